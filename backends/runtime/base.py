"""What prefill and decode endpoints share: config, transport, driver, status board, shutdown.

Threads and ownership (the rule for every table reachable from an endpoint):
- The core engine, the driver's queues, in-flight handle table and ``posting`` count: only under
  ``self.lock`` (the driver takes it on every call; ``on_status``/``on_free_pages`` run with it
  held). The one thing done without it is a worker posting its chunk's writes: the engine has
  already counted them in flight, and the handles are published under the lock once posted.
- The status board: its own lock (board.py), so polling never waits for a worker.
- The transport: thread-safe (NIXL agent with its RW lock and sync mode RW, which makes concurrent
  posts from the workers safe, see nixl/agent.py; the control plane's IO thread owns the sockets).
- ``errors``: a list appended under ``_err_lock``.
Shutdown stops every loop, joins every thread (bounded), then closes the transport (NIXL teardown
in its order, then the control plane's IO thread).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
from kvferry.backends import lockcheck
from kvferry.backends.driver import Driver
from kvferry.backends.nixl.memory import MemRegion
from kvferry.backends.nixl.transport import NixlTransport
from kvferry.backends.runtime.board import StatusBoard
from kvferry.backends.runtime.errors import EndpointClosedError, KVTransferError
from kvferry.backends.runtime.loops import Loop
from kvferry.backends.runtime.security import control_auth
from kvferry.backends.runtime.staging import StagingConfig, allocate_staging, pool_device
from kvferry.backends.zmqctl import ControlPlane
from kvferry.core.commands import FreePages, StatusChanged
from kvferry.core.deadlines import Timeouts
from kvferry.core.geometry import PoolGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.core.messages import Endpoint

MAX_LATE_WRITE_S = 7 * 86400.0  # a week: anything longer is a typo, not a bound


class RuntimeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``num_queues``: prefill transfer queues, one worker thread each (rooms sharded by id).
    ``idle_max_s``: the longest the data thread and waiting workers sleep when the rank has no
    room in flight; ``active_idle_max_s``: the same while some room is in flight (it bounds how
    late a write completion or a notification is noticed: NIXL offers no descriptor to wait on,
    so both are polled). The control thread waits on its socket and needs neither."""

    num_queues: int = 4
    # Chunks whose writes a worker keeps in flight before it waits for the oldest (1: SGLang PR 20680's
    # pacing, a chunk's writes finish before the next chunk is planned). More lets a worker plan
    # and post the next room while the NIC or copy engine still moves the last one.
    worker_chunks_in_flight: int = 1
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    idle_max_s: float = 1e-3
    active_idle_max_s: float = 200e-6
    join_timeout_s: float = 10.0
    aux_rows: int = 1024
    aux_row_bytes: int = 64
    host: str = "127.0.0.1"
    port: int = 0  # 0: chosen at runtime
    nixl_sync: str = "rw"  # several threads share the agent
    # NIXL's progress thread spins (~70% of a core per agent); our progress threads poll instead.
    nixl_progress_thread: bool = False
    # UCX workers per agent. With one, NIXL serialises concurrent posts to a peer inside its post
    # call: a small room's post waits for a big post of another shard (bench/nixl_hol_probe.py).
    # 4 workers did not change that on the CPU machine (docs/benchmarks.md); left at 1.
    nixl_ucx_workers: int = 1
    # How planner descriptors reach NIXL: "prepped" (index runs into lists prepared once, which
    # NIXL merges back), "oneshot" (each run as one descriptor, lists built per post), or "auto"
    # (one-shot when runs are long: backends/nixl/transport.py ONESHOT_INDICES_PER_RUN).
    nixl_direct_post: str = "auto"
    # Who executes the core's NIXL commands: "python" (the reference executor: our threads call
    # NIXL's Python API and poll it) or "native" (backends/native: one C thread per endpoint posts
    # and polls without the interpreter, and wakes the data thread through an eventfd). "native"
    # falls back to "python" with one log line when the engine or NIXL's C API is unavailable.
    nixl_engine: str = "python"
    # The native engine's pace (microseconds) while a transfer is in flight or a room this rank
    # receives is: 0 polls back to back (its thread yields the core between polls and never holds
    # the interpreter, so it costs a core, not the host's Python threads). Idle, it backs off to
    # active_idle_max_s.
    nixl_engine_poll_us: float = 0.0
    # Native engine: a chunk planned ahead (KVSender.plan_ahead) is posted by the thread that
    # calls send(), not handed to a worker (backends/runtime/prefill.py). False: always the worker.
    nixl_post_on_send: bool = True
    # Progress threads per endpoint besides the workers (``progress_threads``): 2, a control loop
    # and a data loop; 1, one loop that sleeps on the control plane's inbox and the native engine's
    # wake-up at once (native-engine ranks only: their data half never waits on UCX); 0, auto:
    # two. On an H200 one thread gave direct rooms 3-10% more of the raw write; a co-located
    # scheduler kept 0.74-0.77 of its step rate against 0.77-0.88 with two (`kvferry bench
    # interference`, docs/benchmarks.md "One progress thread or two"): no clear winner, so the
    # design with the longer record stays the default.
    # $KVFERRY_PROGRESS_THREADS (1 or 2) replaces auto, so one run can compare both designs.
    progress_threads: int = 0
    # Staging memory of the ring and pinned flows (backends/runtime/staging.py).
    staging: StagingConfig = msgspec.field(default_factory=StagingConfig)
    # Control-plane authentication (backends/runtime/security.py, docs/security.md): one or two
    # keys (signing key first; "hex:..." or text of >= 16 bytes), else the key file, else
    # $KVFERRY_CONTROL_KEY / $KVFERRY_CONTROL_KEY_FILE. Without any, the endpoint refuses to start
    # unless control_insecure is set. Keys given here appear in the config's repr: prefer a file.
    control_keys: tuple[str, ...] = ()
    control_key_file: str = ""
    control_insecure: bool = False
    control_max_age_s: float = 300.0  # frames sent longer ago (sender's clock) are rejected
    # Prometheus metrics (backends/runtime/metrics.py, extra ``metrics``); metrics_port >= 0 also
    # serves them over HTTP on ``host`` (0: a free port, EndpointMetrics.port).
    metrics: bool = False
    metrics_port: int = -1
    # Writes a lost peer may still deliver (docs/two-machines.md, section 8). Over RDMA a failed
    # queue pair delivers nothing more; over UCX's TCP transport a write the connection holds lands
    # after a partition heals. ``write_quarantine_s`` (decode): how long past the fence deadline a
    # failed room's pages wait for every writer's Stopped (ReceiverEngine.quarantine_ns).
    # ``lost_peer_drain_s`` (both sides): how long the NIXL agent keeps a lost peer's transfers
    # until they end before it releases them unfenced (NixlAgent.drain_s). None derives them from
    # ``timeouts``: see ``write_quarantine`` and ``lost_peer_drain``.
    write_quarantine_s: float | None = None
    lost_peer_drain_s: float | None = None

    def __post_init__(self) -> None:
        if self.progress_threads not in (0, 1, 2):
            raise ValueError(f"progress_threads must be 0 (auto), 1 or 2, got {self.progress_threads}")
        if self.progress_threads == 1 and self.nixl_engine != "native":
            raise ValueError("progress_threads=1 needs nixl_engine='native' (the python data half can block)")
        for name, low in (("write_quarantine_s", 0.0), ("lost_peer_drain_s", 1e-3)):
            value = getattr(self, name)
            if value is not None and not (low <= value <= MAX_LATE_WRITE_S):  # NaN fails too
                raise ValueError(f"{name} must be None or in [{low:g}, {MAX_LATE_WRITE_S:g}] s, got {value}")

    def write_quarantine(self) -> float:
        """Seconds past the fence a failed room's pages wait for its writers. Default: one fence
        deadline more, so a writer cut off for longer than the fence still has as long again to
        say Stopped, while one that never comes back costs its pages twice the fence. Over TCP
        give TCP's own bound on a silent connection (tcp_retries2 = 15: about 924 s)."""
        if self.write_quarantine_s is not None:
            return self.write_quarantine_s
        return self.timeouts.fence_ns / 1e9

    def lost_peer_drain(self) -> float:
        """Seconds a lost peer's transfers are kept. Default: the fence plus the quarantine, the
        longest decode holds a failed room's pages for a writer; a transfer released sooner could
        let its writer say Stopped while its bytes are still on their way."""
        if self.lost_peer_drain_s is not None:
            return self.lost_peer_drain_s
        return self.timeouts.fence_ns / 1e9 + self.write_quarantine()


CONTROL_WAIT_S = 2e-3
PROGRESS_ENV = "KVFERRY_PROGRESS_THREADS"


def progress_threads(config: RuntimeConfig, executor: str) -> int:
    """How many progress threads an endpoint runs (RuntimeConfig.progress_threads). A rank that
    asked for the native engine and fell back to python gets two: its data half may block."""
    want = config.progress_threads
    if not want:
        env = os.environ.get(PROGRESS_ENV, "")
        if env not in ("", "1", "2"):
            raise ValueError(f"${PROGRESS_ENV} must be 1 or 2, not {env!r}")
        want = int(env) if env else 2
    return 1 if want == 1 and executor == "native" else 2


def now_ns() -> int:
    return time.monotonic_ns()


class EndpointBase:
    role = ""

    def __init__(
        self,
        server: str,
        pool: PoolGeometry,
        *,
        buffers: Mapping[int, Any] | None,
        aux: Any | None,
        config: RuntimeConfig,
        extra_groups: Mapping[str, Sequence[MemRegion]] | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.endpoint = Endpoint(server=server, rank=pool.tp_rank)
        control = ControlPlane(
            str(self.endpoint), host=config.host, port=config.port, auth=control_auth(config)
        )
        self.transport = NixlTransport(
            self.endpoint,
            pool,
            role=self.role,
            buffers=buffers,
            aux=aux,
            sync=config.nixl_sync,
            control=control,
            extra_groups=extra_groups,
            progress_thread=config.nixl_progress_thread,
            ucx_workers=config.nixl_ucx_workers,
            direct_post=config.nixl_direct_post,
            engine=config.nixl_engine,
            engine_poll_s=config.nixl_engine_poll_us / 1e6,
            engine_idle_max_s=config.active_idle_max_s,
        )
        self.transport.agent.drain_s = config.lost_peer_drain()
        try:
            self.transport.register_regions(pool.regions, config.aux_rows, config.aux_row_bytes)
            st = config.staging
            device = pool_device(buffers or {})
            self.staging_buffers = allocate_staging(self.role, st, config.num_queues, device)
            offered = (st.ring_bytes, st.pinned_bytes) if self.role == "decode" else (0, 0)
            self.transport.register_staging(self.staging_buffers, *offered)
        except BaseException:
            self.transport.close()  # no thread or registration outlives a refused endpoint
            raise
        self.lock = lockcheck.new_lock()  # an OwnedLock in the lock-check debug mode
        self.board = StatusBoard()
        self.errors: list[BaseException] = []
        self._err_lock = threading.Lock()
        self._loops: list[Loop] = []
        self._started = False
        self._closed = False
        self.engine: Any = None
        self.driver: Driver
        # Called (room, transfer_id) when a failed room's pages are fenced; runs with the driver
        # lock held, so it must be quick and must not call back into the endpoint.
        self.on_free_pages: Callable[[int, str], None] | None = None
        self.metrics: Any = None  # EndpointMetrics when config.metrics
        self._control_fd = -1  # the control plane's inbox wake-up, for the one progress thread

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The control-plane address peers reach this rank at (port chosen at runtime)."""
        return self.transport.control_address

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        lockcheck.guard(self)  # debug mode only: the engine asserts its lock from here on
        if self.config.metrics:
            from kvferry.backends.runtime import metrics  # the optional extra, only when asked

            self.metrics = metrics.attach(self)
        for loop in self._loops:
            loop.start()

    def close(self) -> list[str]:
        """Stop and join every thread, then tear the transport down. Returns the names of threads
        that did not stop in time (empty on a clean shutdown)."""
        if self._closed:
            return []
        self._closed = True
        for loop in self._loops:
            loop.stop()
        self._wake_all()
        self.transport.control.nudge()  # the one progress thread may sleep on the inbox's fd
        stuck = [lp.name for lp in self._loops if not lp.join(self.config.join_timeout_s)]
        self.transport.close()
        if self.metrics is not None:
            self.metrics.close()
        return stuck

    def __enter__(self) -> EndpointBase:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake_all(self) -> None:
        pass

    def _check_open(self) -> None:
        if self._closed or not self._started:
            raise EndpointClosedError(f"{self.endpoint} is {'closed' if self._closed else 'not started'}")

    # ---- driver callbacks (driver lock held) ---------------------------------------------------
    def _on_status(self, cmd: StatusChanged) -> None:
        error = None
        if cmd.status is KVPoll.Failed:
            failure = self.engine.failure(cmd.room)
            error = failure.error if failure is not None else None
        self.board.update(cmd.room, cmd.transfer_id, cmd.status, cmd.reason, error)
        if self.metrics is not None:
            self.metrics.on_status(cmd.room, cmd.transfer_id, cmd.status, cmd.reason)

    def _on_free_pages(self, cmd: FreePages) -> None:
        self.board.freed(cmd.room, cmd.transfer_id)
        if self.on_free_pages is not None:
            self.on_free_pages(cmd.room, cmd.transfer_id)

    def _sync(self, room: int, tid: str) -> None:
        """Bring the board up to the engine's view: a room can change state before its handle
        exists (a TransferInfo, or an Abort, may arrive before the local open)."""
        with self.lock:
            live = self.engine.rooms.get(room)
            if live is None or live.tid != tid:
                return
            status = self.engine.poll(room)
            failure = self.engine.failure(room)
        reason, error = (failure.reason, failure.error) if failure is not None else ("", None)
        self.board.update(room, tid, status, reason, error)

    def _record_error(self, exc: BaseException) -> None:
        with self._err_lock:
            self.errors.append(exc)

    def _progress_loops(self) -> list[Loop]:
        """The threads that drive the engine besides the workers. On the python executor two: the
        control loop (control messages, deadlines, heartbeats: never blocked by the data plane,
        so a busy rank still proves it is alive) and the data loop (notifications, write and copy
        completions, which may wait on a UCX worker another thread's big post holds). On a
        native-engine rank the engine's C thread posts and polls NIXL, so nothing here waits on
        UCX and one thread does both (``_progress_step``): one interpreter thread fewer taking
        turns on the GIL with the workers and the serving engine."""
        idle = self.config.idle_max_s
        native = self.transport.executor == "native"
        if progress_threads(self.config, self.transport.executor) == 1:
            self._control_fd = self.transport.control_fd()
            return [
                Loop(
                    f"{self.endpoint}-progress",
                    self._progress_step,
                    self._record_error,
                    idle_max_s=idle,
                    idle_cap=self._data_idle_cap,
                    wait=self._wait_progress,
                )
            ]
        return [
            Loop(
                f"{self.endpoint}-control",
                self._control_step,
                self._record_error,
                idle_min_s=0.0,
                idle_max_s=0.0,
            ),
            Loop(
                f"{self.endpoint}-data",
                lambda: self.driver.pump_data(now_ns()) > 0,
                self._record_error,
                idle_max_s=idle,
                idle_cap=self._data_idle_cap,
                wait=self._wait_native if native else None,
            ),
        ]

    def _wait_native(self, timeout_s: float) -> None:
        """The data thread's idle sleep on a native-engine rank: on the engine's wake-up, with the
        engine polling fast while this rank has a room in flight (the board's count)."""
        self.transport.wait_events(timeout_s, hot=self.board.in_flight() > 0)

    def _progress_step(self) -> bool:
        """One pass of a native-engine rank's one progress thread: the controls that wait and the
        due deadlines, then the engine's events (notifications, write and copy completions)."""
        n = self.driver.pump_control(now_ns(), self.transport.recv_control(0))
        return n + self.driver.pump_data(now_ns()) > 0

    def _wait_progress(self, idle_s: float) -> None:
        """The one progress thread's sleep: on the control plane's inbox and the engine's wake-up
        at once, so a control message or an engine event ends it at once. It is bounded by the
        data loop's idle cap and, when that is longer than ``CONTROL_WAIT_S``, by the next
        deadline: a deadline fires at most ``CONTROL_WAIT_S`` late, the control loop's bound
        (heartbeats and liveness fire on time), and the short sleeps (all of them by default:
        idle_max_s is 1 ms) skip the engine's deadline query and its lock. A message put in the
        inbox after the step took it has written the inbox fd, so the sleep ends at once
        (kvf_wait_fd resets that fd when it wakes on it; the next step takes the inbox)."""
        if idle_s > CONTROL_WAIT_S:
            dl = self.driver.next_deadline()
            if dl is not None:
                idle_s = min(idle_s, max(0.0, (dl - now_ns()) / 1e9))
        if idle_s > 0:
            self.transport.wait_events(idle_s, hot=self.board.in_flight() > 0, fd=self._control_fd)

    def _data_idle_cap(self) -> float:
        """Poll fast while a room of this rank is in flight (the board's count, under its own
        lock: no engine lock on the idle path); an idle rank sleeps up to ``idle_max_s``. A failed
        room's writes that are still landing are polled at the slow pace: nobody waits on them.
        On a native-engine rank the engine's wake-up ends the sleep on every completion,
        notification and copy fence (the engine watches the copies' ends), so the thread sleeps
        until the engine has news (at most ``idle_max_s``); only copies the engine does not watch
        would need the fast pace."""
        if not self.board.in_flight():
            return self.config.idle_max_s
        if self.transport.executor == "native" and (not self.driver.copies or self.transport.copies_fenced):
            return self.config.idle_max_s
        return self.config.active_idle_max_s

    def _control_step(self) -> bool:
        """Wait on the control plane until a message comes or the next deadline is due (at most
        ``CONTROL_WAIT_S``): no polling, so a message is handled as soon as it arrives and an idle
        rank costs no wake-ups. The cap bounds how late a deadline set by another thread fires."""
        now = now_ns()
        dl = self.driver.next_deadline()
        wait = CONTROL_WAIT_S if dl is None else min(CONTROL_WAIT_S, max(0.0, (dl - now) / 1e9))
        controls = self.transport.recv_control(wait) if wait > 0 else []
        return self.driver.pump_control(now_ns(), controls) > 0

    # ---- what a room handle needs --------------------------------------------------------------
    def poll(self, room: int, tid: str) -> KVPoll:
        view = self.board.get(room, tid)
        if view is None:
            raise KVTransferError(room, "not tracked here (cleared, or never created)")
        return view.status

    def failure_exception(self, room: int, tid: str) -> None:
        """Raise the room's failure: the original exception when there was one, else
        KVTransferError with the core's reason. Returns quietly if the room has not failed."""
        view = self.board.get(room, tid)
        if view is None or view.status is not KVPoll.Failed:
            return
        if view.error is not None:
            raise view.error
        raise KVTransferError(room, view.reason or "failed")

    def leaks(self) -> dict[str, int]:
        """Sizes of every per-room or per-transfer table; all zero once every room was cleared
        and fenced. Tombstones are excluded: they expire by design."""
        with self.lock:
            # Every per-room table the engine registered (core/proto_common.RoomEngine.track).
            out = {f"engine.{name}": n for name, n in self.engine.table_sizes().items()}
            out["driver.handles"] = len(self.driver.handles)
            out["driver.posting"] = self.driver.posting
            out["driver.queues"] = sum(len(q) for q in self.driver.queues)
        out["nixl.inflight"] = self.transport.agent.inflight()
        out["nixl.prepared"] = self.transport.agent.prepared()  # made ready, never posted
        out["board"] = len(self.board)
        return out
