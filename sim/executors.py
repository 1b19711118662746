"""Executors: independent simulation runs (campaign seeds, sweep points) on local processes or Ray.

One call, whichever executor: ``ex.map(fn, items, progress=...)`` runs the picklable ``fn`` on
every item and yields ``(item, result)`` pairs as runs finish (not in item order). Items must be
hashable and distinct: they key the accounting (``Ledger``) that yields each item exactly once,
re-sends the items of a lost worker, and drops a late duplicate. A run is a pure function of its
item, so an item gives the same result on any executor; ``fn`` raising is a bug and propagates.

- ``LocalExecutor(jobs)``: ``jobs`` processes on this machine (``jobs=1`` runs inline, no process).
  A worker process that dies breaks the pool; a fresh pool re-runs the items that were in flight.
  Workers ignore Ctrl-C; a map stopped early (Ctrl-C, an error, the caller breaking off) terminates
  them rather than letting them run what was queued, and returns once they are gone.
- ``RayExecutor(address)``: tasks on a Ray cluster (``address`` as ``ray.init`` takes it: ``local``
  starts an instance here, ``auto``, ``HOST:PORT``, ``ray://HOST:PORT``). Ray retries a task whose
  worker died (``max_retries``); past those the items are sent again from here (``max_attempts``).
  Every node must have the same kvferry installed: each task checks its code digest against the
  driver's, so a node running other code fails loudly instead of returning other results.

A sweep uses it the way ``kvferry fuzz`` does (``campaign.run_seeds``)::

    with make_executor(jobs=4, ray_address=None) as executor:  # or RayExecutor("auto")
        for point, result in executor.map(run_point, points, progress=lambda st: bar(st.done)):
            ...  # points: hashable, e.g. (flow, concurrency, seed); run_point: module-level
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import importlib.util
import inspect
import multiprocessing as mp
import re
import signal
import socket
import sys
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T", bound=Hashable)
R = TypeVar("R")


_PLAIN = (type(None), bool, int, float, str, bytes)


def _plain(v: Any) -> bool:
    if isinstance(v, _PLAIN):
        return True
    if isinstance(v, tuple | list | set | frozenset):
        return all(_plain(x) for x in v)
    return isinstance(v, dict) and all(isinstance(k, str) and _plain(x) for k, x in v.items())


def _not_shippable(fn: Callable[..., Any]) -> str:
    """Why ``fn`` cannot go to a worker process by reference (empty if it can): a worker imports
    a module-level function by name, so a lambda, a nested function or a bound method cannot go,
    and a ``functools.partial`` may only carry plain data (its results come back as bytes)."""
    args: tuple[Any, ...] = ()
    if isinstance(fn, functools.partial):
        args = (*fn.args, *fn.keywords.values())
        fn = fn.func
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if not inspect.isfunction(fn) or "<" in name:  # '<lambda>', '<locals>'
        return f"{name} is not a module-level function"
    found: Any = sys.modules.get(fn.__module__)
    for part in name.split("."):
        found = getattr(found, part, None)
    if found is not fn:
        return f"{fn.__module__}.{name} cannot be imported by name"
    bad = [a for a in args if not _plain(a)]
    return f"a partial argument of type {type(bad[0]).__name__} is not plain data" if bad else ""


class ExecutorError(RuntimeError):
    """The executor cannot run: Ray missing or unreachable, a bad address, code differing on a node."""


class WorkerLost(ExecutorError):
    """An item's worker was lost more times than allowed (a run that kills its process, say)."""

    def __init__(self, message: str, items: Sequence[Hashable] = ()) -> None:
        super().__init__(message)
        self.items = list(items)  # the items in flight at every loss: one of them is the cause


@dataclass(slots=True)
class MapStats:
    """What a ``map`` has done so far; ``progress`` callbacks get a copy after every change."""

    total: int
    done: int = 0
    resent: int = 0  # item runs sent again after their worker was lost (not Ray's own retries)
    duplicates: int = 0  # results dropped because their item was already delivered


Progress = Callable[[MapStats], None]


class Ledger(Generic[T]):
    """Which items are owed: each is delivered once, re-sent when lost, and never re-delivered."""

    def __init__(self, items: Iterable[T], max_attempts: int) -> None:
        self.order: list[T] = list(items)
        self.owed: dict[T, int] = {}  # item -> times it was lost so far
        for it in self.order:
            if it in self.owed:
                raise ValueError(f"item {it!r} given twice: items key the results, so they must differ")
            self.owed[it] = 0
        self.stats = MapStats(total=len(self.order))
        self.max_attempts = max_attempts

    def deliver(self, item: T) -> bool:
        """True the first time ``item`` finishes (yield it), False for a duplicate (drop it)."""
        if item not in self.owed:
            self.stats.duplicates += 1
            return False
        del self.owed[item]
        self.stats.done += 1
        return True

    def lost(self, items: Sequence[T]) -> list[T]:
        """The worker(s) running ``items`` died: those to send again (not the ones delivered already).

        A dead process cannot say which of the items it held killed it, so every item in flight is
        charged; past ``max_attempts`` losses the error names all such items of this loss.
        """
        again = [it for it in items if it in self.owed]
        for it in again:
            self.owed[it] += 1
        spent = [it for it in again if self.owed[it] >= self.max_attempts]
        if spent:
            what = f"item {spent[0]!r}" if len(spent) == 1 else f"one of items {spent!r}"
            raise WorkerLost(
                f"{what} lost its worker {self.max_attempts} time(s) (each in flight at every loss): a "
                "run that kills its own process or exhausts memory? run it alone to see",
                spent,
            )
        self.stats.resent += len(again)
        return again

    @property
    def finished(self) -> bool:
        return not self.owed


def _chunks(items: Sequence[T], size: int) -> Iterator[list[T]]:
    for i in range(0, len(items), size):
        yield list(items[i : i + size])


def _run_chunk(fn: Callable[[T], R], chunk: list[T]) -> list[R]:
    return [fn(it) for it in chunk]


class Executor(ABC):
    """Runs ``fn`` over items somewhere; ``describe()`` says where, for reports."""

    kind = ""  # "local" or "ray", for --json

    @abstractmethod
    def map(
        self, fn: Callable[[T], R], items: Iterable[T], progress: Progress | None = None
    ) -> Iterator[tuple[T, R]]: ...

    @abstractmethod
    def describe(self) -> str: ...

    def close(self) -> None:  # noqa: B027 (most executors hold nothing between maps)
        pass

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Workers forked from a clean server process, not from the caller: a caller with threads (a NIXL
# agent's progress threads, ZMQ's, a test runner's) forks children that can deadlock on a lock one
# of those threads held, or crash collecting the caller's garbage (a NIXL agent's destructor run in
# a child). Both were seen under pytest-xdist; the function and items are pickled either way.
_WORKER_CONTEXT = mp.get_context("forkserver")


def _leave_ctrl_c_to_the_parent() -> None:
    """A terminal's Ctrl-C goes to the whole process group: a worker it reached would send back a
    half-run chunk as an error, or print a traceback while idle. The parent stops the workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def new_pool(jobs: int, context: BaseContext = _WORKER_CONTEXT) -> cf.ProcessPoolExecutor:
    """``jobs`` worker processes that ignore Ctrl-C (stop them with ``stop_workers``)."""
    return cf.ProcessPoolExecutor(jobs, mp_context=context, initializer=_leave_ctrl_c_to_the_parent)


def stop_workers(pool: cf.ProcessPoolExecutor, grace_s: float = 2.0) -> None:
    """Shut ``pool`` down now (Ctrl-C, an error, a caller breaking off) and return once its workers
    are gone. ``shutdown(wait=False)`` alone leaves each worker running the chunks already handed to
    it (a Ctrl-C'd ``fuzz --jobs 2`` took up to a minute to exit); so the workers are terminated
    (killed after ``grace_s``), as Python 3.14's ``terminate_workers`` does."""
    # Private attributes: there is no public way before Python 3.14.
    workers = list(pool._processes.values()) if pool._processes else []
    manager = pool._executor_manager_thread
    pool.shutdown(wait=False, cancel_futures=True)
    for w in workers:
        w.terminate()
    for w in workers:
        w.join(grace_s)
        if w.exitcode is None:  # a run that handles SIGTERM itself
            w.kill()
            w.join()
    # The pool's thread sees its workers dead and closes its pipes; left running, it races the
    # interpreter's exit hook, which then writes to a closed pipe (a traceback on Python 3.11).
    if manager is not None:
        manager.join(grace_s)


class LocalExecutor(Executor):
    """``jobs`` worker processes on this machine (today's ``kvferry fuzz --jobs``)."""

    kind = "local"

    def __init__(self, jobs: int = 1, chunksize: int | None = None, max_attempts: int = 4) -> None:
        if jobs < 1:
            raise ValueError(f"jobs must be at least 1, got {jobs}")
        self.jobs, self.chunksize, self.max_attempts = jobs, chunksize, max_attempts
        self.last_stats: MapStats | None = None

    def describe(self) -> str:
        return f"{self.jobs} job(s)"

    def map(
        self, fn: Callable[[T], R], items: Iterable[T], progress: Progress | None = None
    ) -> Iterator[tuple[T, R]]:
        ledger: Ledger[T] = Ledger(items, self.max_attempts)
        self.last_stats = ledger.stats
        if self.jobs == 1:  # inline: no process to lose, and exceptions keep their traceback
            for it in ledger.order:
                r = fn(it)
                ledger.deliver(it)
                if progress:
                    progress(replace(ledger.stats))
                yield it, r
            return
        why = _not_shippable(fn)  # an error inside the pool can hang its shutdown (CPython 3.11)
        if why:
            raise TypeError(f"the function must be picklable to run in worker processes: {why}")
        n = len(ledger.order)
        # Chunks amortise the per-submit cost for cheap runs; kept small so progress stays smooth.
        size = self.chunksize or max(1, min(16, n // (self.jobs * 8) or 1))
        todo: deque[list[T]] = deque(_chunks(ledger.order, size))
        window = self.jobs * 4
        pool = new_pool(self.jobs)
        running: dict[cf.Future[list[R]], list[T]] = {}
        finished = False
        try:
            while todo or running:
                while todo and len(running) < window:
                    chunk = todo.popleft()
                    running[pool.submit(_run_chunk, fn, chunk)] = chunk
                done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
                lost: list[T] = []
                for fut in done:
                    chunk = running.pop(fut)
                    try:
                        results = fut.result()
                    except cf.process.BrokenProcessPool:
                        lost += chunk
                        continue
                    for it, r in zip(chunk, results, strict=True):
                        if ledger.deliver(it):
                            if progress:
                                progress(replace(ledger.stats))
                            yield it, r
                if lost:
                    # A dead process breaks the whole pool: every chunk still in it is lost too.
                    for fut, chunk in running.items():
                        fut.cancel()
                        lost += chunk
                    running.clear()
                    pool.shutdown(wait=True, cancel_futures=True)
                    again = ledger.lost(lost)
                    todo.extendleft(reversed(list(_chunks(again, size))))
                    if progress:
                        progress(replace(ledger.stats))
                    pool = new_pool(self.jobs)
            finished = True
        finally:
            if finished:
                pool.shutdown(wait=True)
            else:  # stopped early (Ctrl-C, an error, the caller breaking off): nothing more runs
                stop_workers(pool)


# ---- Ray -------------------------------------------------------------------------------------------

_ADDRESS = re.compile(r"^(?:ray://)?(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>[0-9]{1,5})$")


def check_ray_address(address: str) -> str:
    """``address`` if ``ray.init`` takes it (``local``, ``auto``, ``[ray://]HOST:PORT``), else ValueError."""
    if address in ("local", "auto"):
        return address
    m = _ADDRESS.match(address)
    if m is None or not 1 <= int(m["port"]) <= 65535:
        raise ValueError(
            f"--ray: {address!r} is not a Ray address; use local (start one here), auto (the cluster "
            "this machine belongs to), HOST:PORT (its head node) or ray://HOST:PORT (Ray Client)"
        )
    return address


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """ray.init waits minutes on an address nobody listens at; a plain connect fails in seconds."""
    m = _ADDRESS.match(address)
    assert m is not None
    host = m["host"].strip("[]")
    try:
        with socket.create_connection((host, int(m["port"])), timeout=timeout_s):
            pass
    except OSError as e:
        raise ExecutorError(f"--ray {address}: no Ray cluster answers there ({e})") from None


@functools.cache
def code_digest() -> str:
    """A hash of kvferry's Python sources: nodes must run the same code to give the same results."""
    h = hashlib.sha256()
    for pkg in ("kvferry", "kvferry.core", "kvferry.sim", "kvferry.backends"):
        spec = importlib.util.find_spec(pkg)
        roots = list(spec.submodule_search_locations or []) if spec else []
        for root in roots:
            for path in sorted(Path(root).rglob("*.py")):
                h.update(f"{pkg}/{path.relative_to(root).as_posix()}\0".encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _ray_chunk(fn: Callable[[T], R], chunk: list[T], digest: str) -> list[R]:
    mine = code_digest()
    if mine != digest:
        raise ExecutorError(
            f"node {socket.gethostname()} runs other kvferry code (digest {mine}, driver {digest}): "
            "install the same kvferry on every node"
        )
    return _run_chunk(fn, chunk)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ExecutorError(
            "--ray needs Ray, which is not installed: pip install 'kvferry[ray]' (or uv sync --extra ray)"
        ) from None
    return ray


class RayExecutor(Executor):
    """Tasks on a Ray cluster; connects on construction (a session already open is reused)."""

    kind = "ray"

    def __init__(
        self,
        address: str = "local",
        *,
        num_cpus: int | None = None,
        max_retries: int = 3,
        max_attempts: int = 3,
        chunksize: int | None = None,
        init_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.address = check_ray_address(address)
        self.ray = ray = _import_ray()
        self.max_retries, self.max_attempts, self.chunksize = max_retries, max_attempts, chunksize
        self.last_stats: MapStats | None = None
        if address not in ("local", "auto"):
            _reachable(address)
        # A session already open in this process (a test's, a notebook's) is used as it is.
        self.owns_session = not ray.is_initialized()
        if self.owns_session:
            kw: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
            if address == "local":
                kw |= {"num_cpus": num_cpus, "include_dashboard": False}
            kw |= init_kwargs or {}
            try:
                ray.init(address=address, **kw)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ExecutorError(f"--ray {address}: cannot connect: {e}") from None
        self._task = ray.remote(max_retries=max_retries, retry_exceptions=False)(_ray_chunk)
        # A lost worker, node or result: the run may not have finished, so it is sent again.
        ex = ray.exceptions
        self._lost = (
            ex.WorkerCrashedError,
            ex.NodeDiedError,
            ex.LocalRayletDiedError,
            ex.OutOfMemoryError,
            ex.ObjectLostError,
        )

    def cpus(self) -> int:
        return max(1, int(self.ray.cluster_resources().get("CPU", 1)))

    def describe(self) -> str:
        where = "a local Ray instance" if self.address == "local" else f"Ray at {self.address}"
        return f"{where} ({self.cpus()} CPUs)"

    def map(
        self, fn: Callable[[T], R], items: Iterable[T], progress: Progress | None = None
    ) -> Iterator[tuple[T, R]]:
        ray = self.ray
        ledger: Ledger[T] = Ledger(items, self.max_attempts)
        self.last_stats = ledger.stats
        digest = code_digest()
        fn_ref = ray.put(fn)  # once, not pickled again with every task
        cpus = self.cpus()
        # One task per item while the driver keeps up (about 1 ms of overhead a task, measured in
        # docs/benchmarks.md, against ~0.1 s a seed); on big clusters items go in chunks so that
        # the driver does not become the bottleneck.
        size = self.chunksize or max(1, cpus // 32)
        todo: deque[list[T]] = deque(_chunks(ledger.order, size))
        # Enough queued to keep every CPU busy between polls, not millions of pending tasks.
        window = 2 * cpus + 2
        running: dict[Any, list[T]] = {}
        try:
            while todo or running:
                while todo and len(running) < window:
                    chunk = todo.popleft()
                    running[self._task.remote(fn_ref, chunk, digest)] = chunk
                ready, _ = ray.wait(list(running), num_returns=1)
                for ref in ready:
                    chunk = running.pop(ref)
                    try:
                        results = ray.get(ref)
                    except self._lost:
                        again = ledger.lost(chunk)
                        if again:
                            todo.appendleft(again)
                            if progress:
                                progress(replace(ledger.stats))
                        continue
                    except ray.exceptions.RayTaskError as e:
                        cause = e.cause if isinstance(e.cause, ExecutorError) else None
                        if cause is not None:
                            raise cause from None
                        raise
                    for it, r in zip(chunk, results, strict=True):
                        if ledger.deliver(it):
                            if progress:
                                progress(replace(ledger.stats))
                            yield it, r
        finally:
            for ref in running:  # the caller stopped early: do not leave the cluster busy
                ray.cancel(ref, force=False)

    def close(self) -> None:
        if self.owns_session and self.ray.is_initialized():
            self.ray.shutdown()


def make_executor(jobs: int = 1, ray_address: str | None = None, **ray_kwargs: Any) -> Executor:
    """The CLI's choice: Ray when an address is given, else ``jobs`` local processes."""
    if ray_address is not None:
        return RayExecutor(ray_address, **ray_kwargs)
    return LocalExecutor(jobs)
