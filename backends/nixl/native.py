"""The native executor: NIXL driven by the C engine (backends/native/engine.c) through ctypes.

``NativeNixl`` has the shape of the ``nixl_agent`` methods ``NixlAgent`` calls, so the agent's
tables, bounds checks and ticket discipline stay exactly as they are; what changes is who talks to
NIXL and who polls:
- posting is one native call (the arguments are copied and queued; the engine's thread makes the
  request and posts it, in the order given); a transfer prepared ahead (``prepare``: the engine's
  thread makes NIXL's request then) is posted by naming it, one call that releases the GIL,
- the engine's own thread polls every posted request and the agent's notifications, never touching
  the interpreter, and queues completions and notifications as one batch behind one eventfd,
- ``check_xfer_state``/``get_new_notifs`` only read what the batches said (``drain``), and a data
  thread can sleep on the eventfd (``wait``) instead of polling NIXL on a timer.

The engine decides nothing about rooms: it posts what it is given and reports when each transfer
finished or failed, and which notifications arrived.

Loading. ``load()`` finds the engine library built at install (or ``$KVFERRY_NATIVE_LIB``, e.g. an
AddressSanitizer build) and NIXL's C API inside the nixl wheel that ``import nixl`` picks
(``$KVFERRY_NIXL_CAPI`` overrides). Every C API function the engine uses is looked up at load;
anything missing refuses the load with one line naming the nixl version (``NativeUnavailable``).

Planted bugs (tests only, ``$KVFERRY_NATIVE_PLANT``): ``early_done`` reports a completion when the
transfer is posted, before it finished; ``notif_prev`` delivers each notification with the
previous one's payload (a notification counted for the wrong room); ``ready_lifo`` posts the
request made ahead last instead of the one named (a prepared chunk posted for another);
``fence_early`` reports a watched copy done when it is watched, before it finished. The
differential, e2e and fence tests prove they catch them.

Fences (the staged flows' copies). ``watch_host``/``watch_cuda`` have the engine's thread watch a
copy's end (a host fence the copy thread signals, or a recorded CUDA event) and report it in the
same batches as writes, under a cookie; ``take_fences`` hands the reports over. Every watch is
reported once. A cookie forgotten (``forget_fence``: its copy was released while pending) is still
reported by the engine, and the report is dropped here: a CUDA event given to ``watch_cuda`` is
kept alive until then, so the engine never queries a destroyed event.

Ownership: ``_lock`` guards ``_xfers``, ``_notifs`` and ``_settled`` (any thread may drain); the
engine handle is used by any thread (its C side has its own lock and NIXL's RW sync mode).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
import itertools
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from kvferry.backends import lockcheck
from kvferry.backends.nixl.ucx_env import apply_ucx_defaults

PINNED_NIXL = "1.5.1"
MEM_TYPES = {"DRAM": 0, "VRAM": 1}
OPS = {"READ": 0, "WRITE": 1}
SYNC = {"none": 0, "strict": 1, "rw": 2}
PLANTS = {"": 0, "early_done": 1, "notif_prev": 2, "ready_lifo": 3, "fence_early": 4}
_EV_DONE, _EV_NOTIF, _EV_FENCE = 1, 2, 3
# A fence's failure statuses (engine.c FENCE_*); a CUDA error e is FENCE_CUDA_BASE - e.
FENCE_REASONS = {
    -3: "the native engine stopped before the copy finished",
    -6: "CUDA fence: libcuda.so.1 (cuEventQuery) unavailable",
    -7: "host copy failed",
}
FENCE_CUDA_BASE = -10000
_DONE = struct.Struct("<QiQQ")
_NOTIF = struct.Struct("<II")
_ERRLEN = 512

c_u64p = ctypes.POINTER(ctypes.c_uint64)
c_intp = ctypes.POINTER(ctypes.c_int)


class NativeUnavailable(RuntimeError):
    """The native engine cannot run here; the message is one line saying why."""


def nixl_version() -> str:
    try:
        return importlib.metadata.version("nixl")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def capi_path() -> Path:
    """libnixl_capi.so of the nixl backend package ``import nixl`` loads (nixl_cu12/nixl_cu13)."""
    env = os.environ.get("KVFERRY_NIXL_CAPI")
    if env:
        return Path(env)
    import nixl._api as api  # the meta package maps this to the backend package's module

    pkg = Path(api.__file__).resolve().parent
    return pkg.parent / f".{pkg.name}.mesonpy.libs" / "libnixl_capi.so"


def engine_path() -> Path:
    env = os.environ.get("KVFERRY_NATIVE_LIB")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("kvferry.backends.native._kvf_engine")
    if spec is None or spec.origin is None:
        raise NativeUnavailable("native engine not built (no kvferry.backends.native._kvf_engine)")
    return Path(spec.origin)


def _declare(lib: ctypes.CDLL) -> None:
    vp, sz, u64, i64, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int64, ctypes.c_char_p
    sig: dict[str, tuple[Any, list[Any]]] = {
        "kvf_load": (ctypes.c_int, [cp, cp, sz]),
        "kvf_create": (vp, [cp, ctypes.c_int, ctypes.c_uint, ctypes.c_uint, u64, u64, ctypes.c_int, cp, sz]),
        "kvf_stop": (None, [vp]),
        "kvf_destroy": (None, [vp]),
        "kvf_wake_fd": (ctypes.c_int, [vp]),
        "kvf_wait": (ctypes.c_int, [vp, i64]),
        "kvf_wait_fd": (ctypes.c_int, [vp, ctypes.c_int, i64]),
        "kvf_drain": (sz, [vp, vp, sz, c_intp]),
        "kvf_register": (vp, [vp, ctypes.c_int, sz, c_u64p, c_u64p, c_u64p, cp, sz]),
        "kvf_deregister": (ctypes.c_int, [vp, vp]),
        "kvf_local_md": (ctypes.c_int, [vp, ctypes.POINTER(vp), ctypes.POINTER(sz)]),
        "kvf_free": (None, [vp]),
        "kvf_load_remote": (ctypes.c_int, [vp, cp, sz, ctypes.POINTER(vp)]),
        "kvf_remove_remote": (ctypes.c_int, [vp, cp]),
        "kvf_prep": (vp, [vp, cp, ctypes.c_int, sz, c_u64p, c_u64p, c_u64p, cp, sz]),
        "kvf_release_prep": (ctypes.c_int, [vp, vp]),
        "kvf_gen_notif": (ctypes.c_int, [vp, cp, cp, sz]),
        "kvf_post_prepped": (
            ctypes.c_int,
            [vp, ctypes.c_int, vp, c_intp, sz, vp, c_intp, sz, cp, sz, u64],
        ),
        "kvf_post_descs": (
            ctypes.c_int,
            [vp, ctypes.c_int, cp, *(ctypes.c_int, sz, c_u64p, c_u64p, c_u64p) * 2, cp, sz, u64],
        ),
        "kvf_ready_prepped": (
            ctypes.c_int,
            [vp, ctypes.c_int, vp, c_intp, sz, vp, c_intp, sz, cp, sz, u64],
        ),
        "kvf_ready_descs": (
            ctypes.c_int,
            [vp, ctypes.c_int, cp, *(ctypes.c_int, sz, c_u64p, c_u64p, c_u64p) * 2, cp, sz, u64],
        ),
        "kvf_post_ready": (ctypes.c_int, [vp, u64, u64]),
        "kvf_drop_ready": (ctypes.c_int, [vp, u64]),
        "kvf_counters": (None, [vp, c_u64p]),
        "kvf_pending_addr": (vp, [vp]),
        "kvf_set_hot": (None, [vp, ctypes.c_int]),
        "kvf_fence_new": (vp, []),
        "kvf_fence_signal": (None, [vp, ctypes.c_int]),
        "kvf_fence_put": (None, [vp]),
        "kvf_watch_host": (ctypes.c_int, [vp, vp, u64]),
        "kvf_watch_cuda": (ctypes.c_int, [vp, u64, u64]),
        "kvf_fence_counters": (None, [vp, c_u64p]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


@functools.cache
def quick() -> ctypes.PyDLL:
    """The same library through a handle whose calls keep the GIL: for the short, non-blocking
    calls (drain, counters, hot flag), where dropping and retaking the interpreter would cost more
    than the call (a thread that let go of the GIL waits for it behind busy Python threads)."""
    lib = ctypes.PyDLL(str(engine_path()))
    _declare(lib)
    return lib


@functools.cache
def load() -> ctypes.CDLL:
    """The engine library with NIXL's C API loaded into it, or NativeUnavailable (one line)."""
    version = nixl_version()
    try:
        path = engine_path()
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, AttributeError) as exc:
        raise NativeUnavailable(f"native engine library unusable (nixl {version}): {exc}") from None
    try:
        capi = capi_path()
    except ImportError as exc:
        raise NativeUnavailable(f"nixl {version} not importable: {exc}") from None
    err = ctypes.create_string_buffer(_ERRLEN)
    if lib.kvf_load(str(capi).encode(), err, _ERRLEN) != 0:
        raise NativeUnavailable(
            f"NIXL C API of nixl {version} does not match the engine (built for {PINNED_NIXL}): "
            f"{err.value.decode(errors='replace')}"
        )
    return lib


def fence_reason(status: int) -> str:
    """One line for a failed fence's status."""
    if status <= FENCE_CUDA_BASE:
        return f"CUDA fence: cuEventQuery returned CUDA error {FENCE_CUDA_BASE - status}"
    return FENCE_REASONS.get(status, f"fence failed (status {status})")


def describe() -> str:
    """One line: which executor a ``--engine native`` run gets here, and why."""
    try:
        load()
    except NativeUnavailable as exc:
        return f"python (native unavailable: {exc})"
    return f"native (nixl {nixl_version()}, {capi_path()})"


@dataclass
class _Cols:
    """(addr, len, dev) rows as three C arrays; the object keeps them alive across the call."""

    n: int
    addr: Any
    length: Any
    dev: Any
    keep: tuple[np.ndarray, ...]


def _cols(rows: np.ndarray) -> _Cols:
    # One transposing copy makes the three columns rows of one C array (three copies and three
    # ``ctypes`` views before): a post's descriptors cost one numpy call here, whatever their count.
    cols = np.ascontiguousarray(np.asarray(rows, dtype=np.uint64).reshape(-1, 3).T)
    base, step = cols.ctypes.data, cols.strides[0]
    ptr = [ctypes.cast(base + i * step, c_u64p) for i in range(3)]
    return _Cols(cols.shape[1], *ptr, keep=(cols,))


@dataclass
class _Prepped:
    owner: NativeNixl
    ptr: int

    def release(self) -> None:
        if self.ptr:
            self.owner._lib.kvf_release_prep(self.owner._eng, self.ptr)
            self.ptr = 0


@dataclass
class _Xfer:
    """A transfer: the arguments until posted, then its state as the engine reported it."""

    op: str
    notif: bytes
    prepped: tuple[_Prepped, np.ndarray, _Prepped, np.ndarray] | None = None
    descs: tuple[np.ndarray, str, np.ndarray, str, str] | None = None
    cookie: int = 0
    ready: int = 0  # the engine made its request ahead under this id (prepare); 0: not made
    state: str = "NEW"  # NEW, PROC, DONE, ERR
    status: int = 0  # NIXL's status code of a failure
    post_ns: int = 0
    post_call_ns: int = 0
    done_ns: int = 0


@dataclass
class _Telemetry:
    # The field names of NIXL's telemetry object, which NixlAgent reads.
    startTime: int
    postDuration: int
    xferDuration: int
    descCount: int = -1  # the engine does not see NIXL's merged count


@dataclass
class _Reg:
    ptr: int  # NIXL's registration descriptor list, kept for deregistration


# What ended a wait (NativeNixl.wait, kvf_wait_fd's mask): the engine's events, the other fd.
WOKE_ENGINE, WOKE_FD = 1, 2


class NativeNixl:
    """The nixl_agent-shaped face of one native engine (one NIXL agent, one progress thread)."""

    def __init__(
        self,
        name: str,
        sync: str = "rw",
        ucx_workers: int = 1,
        ucx_threads: int = 0,
        poll_s: float = 0.0,
        idle_max_s: float = 200e-6,
    ) -> None:
        self._lib = load()
        self._quick = quick()
        plant = os.environ.get("KVFERRY_NATIVE_PLANT", "")
        if plant not in PLANTS:
            raise ValueError(f"KVFERRY_NATIVE_PLANT must be one of {sorted(PLANTS)}, not {plant!r}")
        apply_ucx_defaults()
        err = ctypes.create_string_buffer(_ERRLEN)
        eng = self._lib.kvf_create(
            name.encode(),
            SYNC[sync],
            ucx_workers,
            ucx_threads,
            int(poll_s * 1e9),
            int(idle_max_s * 1e9),
            PLANTS[plant],
            err,
            _ERRLEN,
        )
        if not eng:
            raise NativeUnavailable(f"native engine: {err.value.decode(errors='replace')}")
        self._eng: int | None = eng
        self.name = name
        # An OwnedLock and tables that check it in the lock-check debug mode (lockcheck.py).
        self._lock = lockcheck.new_lock()
        self._ids = itertools.count(1)
        guard = functools.partial(lockcheck.guard_table, lock=self._lock)
        self._xfers: dict[int, _Xfer] = guard({}, name="NativeNixl._xfers")  # posted, not yet reported
        self._settled: set[int] = guard(set(), name="NativeNixl._settled")  # reported, not released
        self._notifs: list[tuple[str, bytes]] = guard([], name="NativeNixl._notifs")
        self._watching: set[int] = guard(set(), name="NativeNixl._watching")  # fences not reported
        self._fenced: dict[int, int] = guard({}, name="NativeNixl._fenced")  # reported, not taken
        self._keep: dict[int, Any] = guard({}, name="NativeNixl._keep")  # CUDA events, until reported
        self._buf = ctypes.create_string_buffer(1 << 16)
        self.wake_fd = self._lib.kvf_wake_fd(eng)  # readable when events are queued (select/poll)
        # Queued event bytes, written by the engine: an empty poll is one memory read.
        self._pending = ctypes.c_size_t.from_address(self._lib.kvf_pending_addr(eng))
        self._hot = False
        self.batches = 0  # drains that found events (the core hears a batch per wake-up)

    # ---- memory and peers ------------------------------------------------------------------------
    def register_memory(self, rows: np.ndarray, mem: str) -> _Reg:
        c = _cols(rows)
        err = ctypes.create_string_buffer(_ERRLEN)
        ptr = self._lib.kvf_register(self._eng, MEM_TYPES[mem], c.n, c.addr, c.length, c.dev, err, _ERRLEN)
        if not ptr:
            raise RuntimeError(err.value.decode(errors="replace"))
        return _Reg(ptr)

    def deregister_memory(self, reg: _Reg) -> None:
        if reg.ptr:
            self._lib.kvf_deregister(self._eng, reg.ptr)
            reg.ptr = 0

    def get_agent_metadata(self) -> bytes:
        data, size = ctypes.c_void_p(), ctypes.c_size_t()
        st = self._lib.kvf_local_md(self._eng, ctypes.byref(data), ctypes.byref(size))
        if st != 0:
            raise RuntimeError(f"get_local_md: status {st}")
        try:
            return ctypes.string_at(data.value, size.value)
        finally:
            self._lib.kvf_free(data)

    def add_remote_agent(self, metadata: bytes) -> str:
        name = ctypes.c_void_p()
        st = self._lib.kvf_load_remote(self._eng, metadata, len(metadata), ctypes.byref(name))
        if st != 0:
            raise RuntimeError(f"load_remote_md: status {st}")
        try:
            return ctypes.string_at(name.value).decode()
        finally:
            self._lib.kvf_free(name)

    def remove_remote_agent(self, name: str) -> None:
        self._lib.kvf_remove_remote(self._eng, name.encode())

    def prep_xfer_dlist(self, agent: str, rows: np.ndarray, mem: str) -> _Prepped:
        c = _cols(rows)
        who = b"" if agent == "NIXL_INIT_AGENT" else agent.encode()
        err = ctypes.create_string_buffer(_ERRLEN)
        ptr = self._lib.kvf_prep(self._eng, who, MEM_TYPES[mem], c.n, c.addr, c.length, c.dev, err, _ERRLEN)
        if not ptr:
            raise RuntimeError(err.value.decode(errors="replace"))
        return _Prepped(self, ptr)

    def send_notif(self, peer: str, payload: bytes) -> None:
        st = self._lib.kvf_gen_notif(self._eng, peer.encode(), payload, len(payload))
        if st != 0:
            raise RuntimeError(f"gen_notif to {peer}: status {st}")

    # ---- transfers ---------------------------------------------------------------------------------
    def make_prepped_xfer(
        self, op: str, local: _Prepped, li: np.ndarray, remote: _Prepped, ri: np.ndarray, notif: bytes = b""
    ) -> _Xfer:
        li = np.ascontiguousarray(li, dtype=np.intc)
        ri = np.ascontiguousarray(ri, dtype=np.intc)
        return _Xfer(op, bytes(notif), prepped=(local, li, remote, ri))

    def get_xfer_descs(self, rows: np.ndarray, mem: str) -> tuple[np.ndarray, str]:
        return np.ascontiguousarray(rows, dtype=np.uint64).reshape(-1, 3), mem

    def initialize_xfer(
        self,
        op: str,
        local: tuple[np.ndarray, str],
        remote: tuple[np.ndarray, str],
        peer: str,
        notif: bytes = b"",
    ) -> _Xfer:
        return _Xfer(op, bytes(notif), descs=(local[0], local[1], remote[0], remote[1], peer))

    def prepare(self, x: _Xfer) -> None:
        """Have the engine's thread make the request now (NIXL's make/create, its notification
        set), so that ``transfer`` only posts it. Nothing moves; NIXL's refusal comes at the post.
        Without memory to queue it, the request is made at the post instead, as before."""
        x.ready = next(self._ids)
        if self._submit(x, self._quick.kvf_ready_prepped, self._quick.kvf_ready_descs, x.ready) != 0:
            x.ready = 0

    def transfer(self, x: _Xfer) -> str:
        """Post: one native call. A prepared transfer's call names the request the engine made
        ahead and releases the GIL; any other copies its arguments and queues them for the
        engine's thread (it keeps the GIL: a copy, and a thread that lets the GIL go waits for it
        behind busy Python threads). "PROC" (its end, or NIXL's refusal, comes as an event) or
        "ERR" (no memory to queue it)."""
        x.cookie = next(self._ids)
        with self._lock:
            self._xfers[x.cookie] = x  # before the post: the completion may be drained at once
        x.state = "PROC"
        t0 = time.monotonic_ns()
        if x.ready:
            st = self._lib.kvf_post_ready(self._eng, x.ready, x.cookie)
            x.ready = 0  # the engine's now: posted, or reported failed
        else:
            st = self._submit(x, self._quick.kvf_post_prepped, self._quick.kvf_post_descs, x.cookie)
        x.post_call_ns = time.monotonic_ns() - t0
        if st != 0:
            with self._lock:
                self._xfers.pop(x.cookie, None)
            x.state, x.status = "ERR", int(st)
            return "ERR"
        return "PROC"

    def _submit(self, x: _Xfer, prepped: Any, descs: Any, ident: int) -> int:
        """Hand the transfer's arguments to ``prepped`` or ``descs`` (post or make ahead)."""
        if x.prepped is not None:
            lh, li, rh, ri = x.prepped
            return int(
                prepped(
                    self._eng,
                    OPS[x.op],
                    lh.ptr,
                    li.ctypes.data_as(c_intp),
                    li.size,
                    rh.ptr,
                    ri.ctypes.data_as(c_intp),
                    ri.size,
                    x.notif,
                    len(x.notif),
                    ident,
                )
            )
        assert x.descs is not None
        lrows, lmem, rrows, rmem, peer = x.descs
        lc, rc = _cols(lrows), _cols(rrows)
        return int(
            descs(
                self._eng,
                OPS[x.op],
                peer.encode(),
                MEM_TYPES[lmem],
                lc.n,
                lc.addr,
                lc.length,
                lc.dev,
                MEM_TYPES[rmem],
                rc.n,
                rc.addr,
                rc.length,
                rc.dev,
                x.notif,
                len(x.notif),
                ident,
            )
        )

    def check_xfer_state(self, x: _Xfer) -> str:
        if x.state == "PROC":
            self.drain()
        return "PROC" if x.state == "NEW" else x.state

    def release_xfer_handle(self, x: _Xfer) -> None:
        # The engine gives a request back to NIXL itself once it finished; one still in flight at
        # teardown is given back by kvf_stop. A request made ahead and never posted goes back
        # through the engine's queue (after its make). Else only our bookkeeping goes.
        if x.ready and self._eng is not None:
            self._quick.kvf_drop_ready(self._eng, x.ready)
            x.ready = 0
        with self._lock:
            self._settled.discard(x.cookie)
            self._xfers.pop(x.cookie, None)

    def get_xfer_telemetry(self, x: _Xfer) -> _Telemetry:
        if x.done_ns == 0:
            raise RuntimeError("no telemetry for a transfer that did not finish")
        return _Telemetry(x.post_ns // 1000, x.post_call_ns // 1000, (x.done_ns - x.post_ns) // 1000)

    # ---- events ------------------------------------------------------------------------------------
    def drain(self) -> int:
        """Read every queued event into the transfers' states and the notification list."""
        got = 0
        if self._eng is None or not self._pending.value:
            return got
        more = ctypes.c_int(1)
        while more.value:
            with self._lock:
                if self._eng is None:
                    return got
                n = self._quick.kvf_drain(self._eng, self._buf, len(self._buf), ctypes.byref(more))
                if n == 0 and more.value:  # one event bigger than the buffer: grow it
                    self._buf = ctypes.create_string_buffer(len(self._buf) * 2)
                    continue
                got += self._parse(ctypes.string_at(self._buf, n)) if n else 0
        if got:
            self.batches += 1
        return got

    def _parse(self, buf: bytes) -> int:
        # Caller holds _lock.
        i = count = 0
        while i < len(buf):
            kind = buf[i]
            i += 1
            if kind == _EV_FENCE:
                cookie, status, _, _ = _DONE.unpack_from(buf, i)
                i += _DONE.size
                self._keep.pop(cookie, None)  # the engine is done with it
                if cookie in self._watching:  # else forgotten: its copy was released
                    self._watching.discard(cookie)
                    self._fenced[cookie] = status
            elif kind == _EV_DONE:
                cookie, status, post_ns, done_ns = _DONE.unpack_from(buf, i)
                i += _DONE.size
                x = self._xfers.get(cookie)
                if x is not None:
                    x.state, x.status = ("DONE", 0) if status == 0 else ("ERR", status)
                    x.post_ns, x.done_ns = post_ns, done_ns
                    self._settled.add(cookie)
            else:
                alen, plen = _NOTIF.unpack_from(buf, i)
                i += _NOTIF.size
                agent = bytes(buf[i : i + alen]).decode(errors="replace")
                i += alen
                self._notifs.append((agent, bytes(buf[i : i + plen])))
                i += plen
            count += 1
        return count

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.drain()
        with self._lock:
            got = list(self._notifs)
            self._notifs.clear()
        out: dict[str, list[bytes]] = {}
        for agent, payload in got:
            out.setdefault(agent, []).append(payload)
        return out

    def has_news(self) -> bool:
        """Events queued by the engine or notifications drained and not yet taken (no lock: a
        read of the engine's counter and of the list's truth, each atomic under the GIL)."""
        return bool(self._pending.value or self._notifs or self._fenced)

    def settled(self) -> set[int]:
        """Cookies of transfers reported finished and not yet released."""
        self.drain()
        with self._lock:
            return set(self._settled)

    def wait(self, timeout_s: float, hot: bool | None = None, fd: int = -1) -> int:
        """Sleep until the engine has news or the timeout passed (0); the GIL is free. Returns
        WOKE_ENGINE for events queued or undelivered, WOKE_FD (ored in) for ``fd`` readable.
        ``hot``: the host expects notifications (a room in flight): the engine polls for them at
        its in-flight pace meanwhile, else at its idle pace. ``fd`` (-1: none): a non-blocking
        eventfd that also ends the sleep once readable, and is then reset here: the caller looks
        at what it announces after every wait."""
        with self._lock:
            if self._eng is None:
                return WOKE_ENGINE
            if hot is not None and hot != self._hot:
                self._hot = hot
                self._quick.kvf_set_hot(self._eng, int(hot))
            # Unread events or undelivered notifications end the wait. Settled transfers do not:
            # they were announced already and wait for their own poller (a ticket the driver does
            # not hold, such as a benchmark's raw write, would otherwise keep this from sleeping).
            if self._notifs or self._fenced or self._pending.value:
                return WOKE_ENGINE
        if fd < 0:
            return WOKE_ENGINE if self._lib.kvf_wait(self._eng, int(timeout_s * 1e6)) else 0
        return int(self._lib.kvf_wait_fd(self._eng, fd, int(timeout_s * 1e6)))

    def counters(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * 6)()
        if self._eng is not None:
            self._quick.kvf_counters(self._eng, out)
            self._quick.kvf_fence_counters(self._eng, ctypes.cast(ctypes.addressof(out) + 4 * 8, c_u64p))
        names = ("status_polls", "posts", "completions", "notifications", "fence_polls", "fence_events")
        return dict(zip(names, out, strict=True))

    # ---- fences ------------------------------------------------------------------------------------
    def new_host_fence(self) -> int:
        """A pending host fence (its pointer), held once by the caller: ``signal_host_fence`` it
        once the copy ended, then ``put_host_fence``."""
        ptr = self._quick.kvf_fence_new()
        if not ptr:
            raise MemoryError("native engine: no memory for a host fence")
        return int(ptr)

    def signal_host_fence(self, fence: int, status: int = 0) -> None:
        """The copy behind ``fence`` finished (0) or failed (< 0)."""
        self._quick.kvf_fence_signal(fence, status)

    def put_host_fence(self, fence: int) -> None:
        self._quick.kvf_fence_put(fence)

    def watch_host(self, fence: int) -> int:
        """Have the engine watch host fence ``fence``; returns the cookie it reports under."""
        return self._watch(lambda eng, cookie: self._quick.kvf_watch_host(eng, fence, cookie))

    def watch_cuda(self, event: Any) -> int:
        """Watch a recorded ``torch.cuda.Event`` (kept alive here until the engine reported it);
        returns the cookie. The calling thread has the event's device current (its context is
        the one the engine queries in)."""
        handle = int(event.cuda_event)
        if not handle:
            raise ValueError("watch_cuda: the event was never recorded")
        return self._watch(lambda eng, cookie: self._lib.kvf_watch_cuda(eng, handle, cookie), keep=event)

    def _watch(self, call: Any, keep: Any = None) -> int:
        cookie = next(self._ids)
        with self._lock:
            eng = self._eng
            if eng is None:
                raise RuntimeError("native engine destroyed")
            self._watching.add(cookie)  # before the call: the report may be drained at once
            if keep is not None:
                self._keep[cookie] = keep
        if call(eng, cookie) != 0:
            with self._lock:
                self._watching.discard(cookie)
                self._keep.pop(cookie, None)
            raise MemoryError("native engine: no memory to watch a fence")
        return cookie

    @staticmethod
    def fence_reason(status: int) -> str:
        return fence_reason(status)

    def forget_fence(self, cookie: int) -> None:
        """Its copy was released: a report still to come is dropped (the engine still makes it)."""
        with self._lock:
            self._watching.discard(cookie)
            self._fenced.pop(cookie, None)

    def take_fences(self) -> dict[int, int]:
        """Fences reported since the last call: cookie -> status (0 done, < 0 failed)."""
        self.drain()
        with self._lock:
            got = dict(self._fenced)
            self._fenced.clear()
        return got

    def fences_watched(self) -> int:
        """Watches not yet reported (forgotten ones included while the engine still holds
        their CUDA event) as this side knows them."""
        with self._lock:
            return len(self._watching) + len(self._keep.keys() - self._watching)

    # ---- teardown ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the progress thread (requests still in flight are reported failed)."""
        if self._eng is not None:
            self._lib.kvf_stop(self._eng)
            self.drain()

    def destroy(self) -> None:
        with self._lock:
            eng, self._eng = self._eng, None
        if eng is not None:
            self._lib.kvf_destroy(eng)


def make_native_agent(
    name: str,
    sync: str,
    telemetry: bool,
    ucx_threads: int,
    progress_thread: bool = False,
    ucx_workers: int = 1,
    *,
    poll_s: float = 0.0,
    idle_max_s: float = 200e-6,
) -> NativeNixl:
    """``NixlAgent``'s factory for the native executor (telemetry comes from the engine's clocks;
    NIXL's own progress thread is never used: the engine's thread polls)."""
    del telemetry, progress_thread
    return NativeNixl(
        name, sync, ucx_workers=ucx_workers, ucx_threads=ucx_threads, poll_s=poll_s, idle_max_s=idle_max_s
    )
