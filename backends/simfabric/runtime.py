"""SimPy processes that run one rank: the driver loop, and on prefill N transfer workers over N queues.

The loop body (feed an event to the engine, execute its commands through the transport) is the
shared driver; here it is scheduled by SimPy: the main loop (a call scheduled on wake-up) sleeps
until the fabric wakes it or the engine's next deadline, whichever is first; worker ``i`` takes
chunks from queue ``i`` in order and, as in SGLang PR 20680, does not take its next chunk before the
writes of the current one finished (``AwaitWrites``).

Crash: the rank is marked dead and every process exits at its next wake-up; nothing is
interrupted. The main loop runs once per wake-up, which the fabric's wake-up callback, a local
event or the deadline timer schedules (at most one pending); arrivals themselves sit in the
fabric's per-node lists, so nothing is carried by the wake-up and nothing can be lost with it
(SimPy's lost-item pitfall).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import simpy
from kvferry.backends.driver import Driver
from kvferry.backends.simfabric.calls import DeadlineTimer, call_after
from kvferry.backends.simfabric.fabric import Fabric
from kvferry.backends.simfabric.transport import SimTransport
from kvferry.core.commands import FreePages, StatusChanged


class RankSink(Protocol):
    """What the runtime reports upward (the simulated scheduler implements it, without deriving
    from this class: a protocol, so a compiled SimRank takes any such object)."""

    def status(self, rank: SimRank, cmd: StatusChanged) -> None: ...
    def free_pages(self, rank: SimRank, cmd: FreePages) -> None: ...
    def after_pump(self, rank: SimRank) -> None: ...


class SimRank:
    """One rank of one server running in the simulated world: the shared Driver on SimPy processes."""

    def __init__(
        self,
        env: simpy.Environment,
        fabric: Fabric,
        transport: SimTransport,
        engine: Any,
        sink: RankSink,
        workers: int = 0,
        record: Callable[..., None] | None = None,
    ) -> None:
        self.env = env
        self.fabric = fabric
        self.transport = transport
        self.engine = engine
        self.sink = sink
        self.node = transport.node
        self.incarnation = transport.incarnation
        self.record = record or (lambda *a, **k: None)
        self.dead = False
        self.workers = workers
        self.driver = Driver(
            engine,
            transport,
            num_shards=max(1, workers),
            # partials, not lambdas: no extra Python frame per status change
            on_status=partial(sink.status, self),
            on_free_pages=partial(sink.free_pages, self),
            on_enqueue=self._wake_worker,
            cache_deadline=True,
        )
        # The driver's next_deadline without its lock (SimPy runs one thing at a time: this
        # Driver has none): asked at every sleep and local event, computed once per engine call.
        self._next_deadline = self.driver.cached_deadline
        self._work = [env.event() for _ in range(workers)]
        self._sleep_until: int | None = None
        self._kicked = False
        self._wake_pending = False  # a wake-up is scheduled and has not run yet
        self._timer = DeadlineTimer(env, self._timer_due)
        self._timer_at: int | None = None  # the deadline it is set to (None: not set)
        self.wakeups = 0  # main-loop runs (bench/sim_bench.py --only counts)
        self._fabric_node = fabric.node(self.node)  # it outlives crashes, and so does its skew
        self._skew_ns = self._fabric_node.skew_ns
        self._fabric_node.waker = self._on_wake  # before any process runs: nothing is missed
        self._resolved = env.event()
        env.process(self._boot())
        for i in range(workers):
            env.process(self._worker(i))

    # --- time and feeding ------------------------------------------------------------------------
    def now(self) -> int:
        """``Fabric.node_clock`` of this rank's node (asked at every event), inlined."""
        t = int(self.env._now) + self._skew_ns  # type: ignore[attr-defined]
        return t if t > 0 else 0

    def feed(self, event: Any) -> None:
        """Hand one local event (open, chunk ready, abort, release) to the engine."""
        if not self.dead:
            t = int(self.env._now) + self._skew_ns  # ``now()`` inline: a frame less per event
            self.driver.feed(event, t if t > 0 else 0)
            self._rearm()

    def _rearm(self) -> None:
        """A local event may have set an earlier deadline than the one the main loop sleeps to."""
        if self._kicked:
            return  # a wake-up is already on its way: it sleeps to the new deadline anyway
        dl = self._next_deadline()
        if dl is not None and (self._sleep_until is None or dl < self._sleep_until):
            self._kicked = True
            self._on_wake(None)

    @property
    def pending(self) -> dict[int, Any]:
        return self.driver.handles

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self.driver.queues)

    def _wake_worker(self, shard: int) -> None:
        if shard < len(self._work) and not self._work[shard].triggered:
            self._work[shard].succeed()

    def _writes_resolved(self) -> None:
        if not self._resolved.callbacks:
            # No worker waits: a SimPy step that resumes nobody (4 a deployment request). A
            # worker that waits later yields this same untriggered event, as it would the new one.
            return
        ev, self._resolved = self._resolved, self.env.event()
        ev.succeed()

    # --- processes ----------------------------------------------------------------------------------
    def _on_wake(self, _item: Any) -> None:
        # Scheduled where the wake-up event's succeed() was (same step, same order); repeats
        # before it runs are folded into it, as re-succeeding a triggered event was skipped.
        if not self._wake_pending:
            self._wake_pending = True
            call_after(self.env, 0, self._woken)

    def _timer_due(self) -> None:
        self._timer_at = None
        self._on_wake(None)

    def _boot(self):  # type: ignore[no-untyped-def]
        """The main loop's first sleep, taken at start-up as a process's first step would be."""
        self._sleep()
        return
        yield  # a generator: SimPy runs it as a process

    def _sleep(self) -> None:
        """Sleep until a wake-up: the fabric's callback (message, notification, finished write),
        a local event that moved a deadline earlier (_rearm), or the deadline timer.

        The main loop is a scheduled call (``_on_wake``), not a SimPy process: it runs at the step
        its wake-up event would have, without a generator resumed per wake-up (one per message).
        """
        dl = self._next_deadline()
        self._sleep_until = dl
        self._kicked = False
        if dl is not None and dl != self._timer_at:
            self._timer_at = dl
            self._timer.set(max(0, dl - self.now()))

    def _woken(self) -> None:
        self._wake_pending = False
        self.wakeups += 1
        if self.dead:
            return
        before = len(self.driver.handles)
        t = int(self.env._now) + self._skew_ns  # ``now()`` inline: a frame less per wake-up
        self.driver.pump(t if t > 0 else 0)
        if len(self.driver.handles) < before:
            self._writes_resolved()
        self.sink.after_pump(self)
        self._sleep()

    def _worker(self, i: int):  # type: ignore[no-untyped-def]
        q = self.driver.queues[i]
        while True:
            while not q:
                self._work[i] = self.env.event()
                yield self._work[i]
                if self.dead:
                    return
            chunk = q[0]
            self.record("chunk_begin", self.node, worker=i, room=chunk.room, chunk=chunk.chunk_index)
            wait = self.driver.worker_step(i, self.now()) or ()
            self._rearm()
            while wait and not self.dead and self.driver.writes_pending(wait):
                yield self._resolved
            if self.dead:
                return
            self.record("chunk_end", self.node, worker=i, room=chunk.room, chunk=chunk.chunk_index)

    def crash(self) -> None:
        """Everything of this incarnation stops; the fabric loses its memory and handles."""
        if self.dead:
            return
        self.dead = True
        self.fabric.crash(self.node)
        for ev in self._work:
            if not ev.triggered:
                ev.succeed()
        self._writes_resolved()
