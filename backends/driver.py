"""The loop body shared by the SimPy and the threaded runtimes. It decides nothing.

A ``Driver`` wraps one engine (``SenderEngine`` or ``ReceiverEngine``) and one ``Transport``:

- ``pump(now)``: feed what the transport observed (control messages, notifications, finished
  writes) and, if a deadline is due, a ``Tick``. Call it whenever the transport may have news or
  ``next_deadline()`` is reached.
- ``feed(event, now)``: hand a local event (open, chunk ready, abort, release) to the engine.
- ``worker_step(shard, now)`` (prefill): run the next queued chunk of worker queue ``shard``;
  returns the write ids the worker should wait for before its next chunk (SGLang PR 20680's pacing).
  ``writes_pending(ids)`` tells when they finished; ``poll_writes(now)`` makes progress on them.

Every command is executed here, in order, and what it causes (a refused post becomes
``WriteFailed``, ``CheckAux`` becomes ``AuxChecked``) is fed back before the call returns; a
decode-side ``PostRead`` (pull flow) is tracked and answered like a write.
A transport error never escapes: it is counted in ``errors`` and, where a write is concerned,
turned into a failed write so that only that room fails.

Threads: pass ``lock=threading.Lock()``. The lock guards the engine, ``queues``, ``handles``,
``errors``, ``posting`` and the follow-up queue: every entry point takes it, so the
single-threaded engine is never entered twice. SimPy passes nothing (the driver then takes an
RLock nobody contends). Waiting (``time.sleep(0)`` between polls, or ``yield env.timeout(...)``)
belongs to the runtime, not here.
The callbacks (``on_status``, ``on_free_pages``, ``on_enqueue``, ``on_prepared``,
``on_writes_done``) run with the lock held: they must record and return, not call back into the
driver (with a plain Lock that would deadlock).

Data-plane calls of a worker step run *outside* the lock: ``worker_step`` takes the lock
to pop the chunk and get its commands from the engine, releases it to execute each run of
``PostWrite``/``PostAuxWrite``/``SendNotif`` (a TP 2->1 post is ~300k descriptors; N workers must
post in parallel, and a slow post must not stall the progress thread or other rooms), then takes
it again to publish the handles and feed back what failed (a refused post -> ``WriteFailed``).
Other commands of the step run under the lock, in list order, between those runs; follow-ups
are fed after the whole list, as before. So:
- a room's commands run in the engine's order: only its shard's worker runs its chunks, one at a
  time; a chunk's data carries its own notification, so no later message of the chunk can
  overtake its bytes;
- a write being posted is in flight for the engine from the moment the engine emitted it (its id is
  in the engine's tables) until ``WriteDone``/``WriteFailed`` is fed: an abort that lands while
  the post runs fails the room but cannot fence its pages before the post returned and the handle
  finished; a handle enters ``handles`` only after its post returned, so pollers never touch a
  handle that is still being posted;
- the transport must accept concurrent data-plane calls (NixlTransport does: NIXL sync mode RW).
The same holds for observing: ``pump`` and ``poll_writes`` ask the transport (control messages,
notifications, write states) without the lock and feed the answers under it. With one UCX worker
per agent, a poll or notification drain waits while another thread's big post holds the worker;
holding the engine lock through that wait would stall every room again.
The SimPy runtime runs the same steps in the same order (no other thread can act in between).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from kvferry.backends.transport import Transport, XferState
from kvferry.core import messages as m
from kvferry.core.commands import (
    AddPeer,
    AwaitWrites,
    CheckAux,
    ChunkDeferred,
    ChunkSkipped,
    DropPeer,
    DropPrepared,
    EnqueueChunk,
    FreePages,
    Gather,
    PostAuxWrite,
    PostPrepared,
    PostRead,
    PostWrite,
    PrepareAuxWrite,
    PrepareWrite,
    Scatter,
    SendControl,
    SendNotif,
    StatusChanged,
)
from kvferry.core.events import (
    AuxChecked,
    ControlIn,
    CopyDone,
    CopyFailed,
    NotificationIn,
    PeerUnusable,
    Tick,
    WriteDone,
    WriteFailed,
)

# The members as plain module names: under Python 3.11 every ``XferState.PROC`` read goes through
# EnumType.__getattr__'s slow attribute hook (about ten times a global's cost), twice per write.
_PROC, _DONE, _ERR = XferState.PROC, XferState.DONE, XferState.ERR

__all__ = ["Driver"]


class Driver:
    def __init__(
        self,
        engine: Any,
        transport: Transport,
        *,
        num_shards: int = 1,
        lock: contextlib.AbstractContextManager[Any] | None = None,
        on_status: Callable[[StatusChanged], None] | None = None,
        on_free_pages: Callable[[FreePages], None] | None = None,
        on_enqueue: Callable[[int], None] | None = None,
        on_prepared: Callable[[int], None] | None = None,
        on_writes_done: Callable[[], None] | None = None,
        cache_deadline: bool = False,
    ) -> None:
        self.engine = engine
        self.transport = transport
        # No lock given (SimPy, one thread): an uncontended reentrant C lock, which costs about
        # half of nullcontext's two Python-level calls per ``with`` (dozens per simulated room).
        self.lock = lock if lock is not None else threading.RLock()
        self.queues: list[deque[Any]] = [deque() for _ in range(num_shards)]
        self.handles: dict[int, Any] = {}  # write id -> transport handle, in post order
        self.copies: dict[int, Any] = {}  # gather/scatter op id -> transport handle
        # prep id -> what PrepareWrite made: the transport's prepared transfer, the command itself
        # (a transport that cannot prepare: posted as a PostWrite), or the exception that refused it.
        self.prepared: dict[int, Any] = {}
        self.errors: Counter[str] = Counter()
        self.on_status = on_status
        self.on_free_pages = on_free_pages
        self.on_enqueue = on_enqueue
        self.on_prepared = on_prepared  # a queued chunk whose run only posts prepared writes
        # After a poll fed finished writes: a worker awaiting its chunk's writes sleeps until
        # then instead of polling them itself (backends/runtime/prefill.py).
        self.on_writes_done = on_writes_done
        self._followups: deque[Any] = deque()
        self.posting = 0  # writes of worker steps not yet posted and published to ``handles``
        # Engine calls so far. The engine's next deadline changes only with one, so the simulated
        # runtime asks it once per call (``cached_deadline``), not at every wake-up; the threaded
        # runtime asks the engine itself (``next_deadline``).
        self.engine_calls = 0
        self._deadline: tuple[int, int | None] = (-1, None)  # (engine_calls, next_deadline)
        # The simulated runtime (one thread) also asks the cache at every pump's tick check, and
        # takes no lock for it: ``cache_deadline`` is for a driver only one thread enters.
        self._cache_deadline = cache_deadline
        # Called with ("in", event) for each event fed, ("step", chunk) when a worker takes a
        # chunk, ("run", command) before each command and ("posted", command) when a post
        # returned: runtime.tracing.DriverTrace (kvferry bench nixl --trace).
        self.trace: Callable[[str, Any], None] | None = None

    # --- entry points ----------------------------------------------------------------------------

    def feed(self, event: Any, now: int) -> tuple[int, ...]:
        with self.lock:
            return self._feed(event, now)

    def pump(self, now: int) -> int:
        """Feed every observation the transport has, then a Tick if a deadline is due.
        Returns how many observations were fed (0: nothing happened). The transport is asked
        without the lock (its calls may wait on the data plane, see the module header), each
        batch of answers is fed under it, in the same order as ever."""
        n = self._feed_controls(now)
        n += self.pump_data(now)
        return n + self._tick_if_due(now)

    def pump_control(self, now: int, controls: list[bytes] | None = None) -> int:
        """The control half of ``pump``: control messages and due deadlines (heartbeats among
        them). It never waits on the data plane, so a thread running only this keeps a rank's
        heartbeats and liveness checks going while a big post holds the UCX worker.
        ``controls``: messages the caller already received (it waited on the control plane)."""
        return self._feed_controls(now, controls) + self._tick_if_due(now)

    def pump_data(self, now: int) -> int:
        """The data half of ``pump``: notifications, finished writes and copies. May wait while
        another thread's post holds the data plane."""
        notifs = self.transport.drain_notifs()
        n = 0
        if notifs:  # most polls find none: no lock round trip for nothing
            with self.lock:
                for data in notifs:
                    self._feed(NotificationIn(data=data), now)
                    n += 1
        return n + self.poll_writes(now, None)

    def _feed_controls(self, now: int, controls: list[bytes] | None = None) -> int:
        if controls is None:
            controls = self.transport.recv_control()
        if not controls:
            return 0
        with self.lock:
            for data in controls:
                self._feed(ControlIn(data=data), now)
        return len(controls)

    def _tick_if_due(self, now: int) -> int:
        if self._cache_deadline:
            # The simulated runtime (one thread, every wake-up): its uncontended lock and a
            # frame less; the cached deadline, which only an engine call changes.
            calls, dl = self._deadline
            if calls != self.engine_calls:
                dl = self.cached_deadline()
            if dl is not None and dl <= now:
                self._feed(Tick(), now)
                return 1
            return 0
        with self.lock:
            dl = self.engine.next_deadline()
            if dl is not None and dl <= now:
                self._feed(Tick(), now)
                return 1
        return 0

    def poll_writes(self, now: int, ids: tuple[int, ...] | None = None) -> int:
        """Check posted writes (all, or ``ids``); feed the finished ones. Returns how many finished.
        The checks run without the lock; a write two threads both saw finish is fed once."""
        t = self.transport
        # A transport that knows which of its handles left PROC (the simulated fabric, the native
        # engine) spares a check of every write in flight on every poll, and a worker awaiting
        # its chunk's writes a check of each of them per wake-up; the order (post order, or the
        # order of ``ids``) is the same.
        settled = t.settled_handles()
        if settled is not None and not settled:  # no write left PROC
            return self._poll_copies(now) if ids is None and self.copies else 0
        with self.lock:
            asked = self.handles if ids is None else ids
            if settled is not None:
                todo = [(w, h) for w in asked if (h := self.handles.get(w)) is not None and h in settled]
            else:
                todo = [(w, self.handles[w]) for w in asked if w in self.handles]
        checked: list[tuple[int, Any, XferState, Exception | None]] = []
        for wid, h in todo:
            try:
                checked.append((wid, h, t.check_xfer(h), None))
            except Exception as exc:
                checked.append((wid, h, _ERR, exc))
        copies = self._poll_copies(now) if ids is None else 0
        n = 0
        with self.lock:
            for _, _, _, err in checked:  # not ``exc``: the except clause above deletes that name
                if err is not None:
                    self.errors[f"check_xfer: {type(err).__name__}"] += 1
            for wid, h, st, _ in checked:
                if st is _PROC or self.handles.get(wid) is not h:
                    continue  # still in flight, or another thread fed it already
                del self.handles[wid]
                try:
                    t.release_xfer(h)
                except Exception as exc:
                    self.errors[f"release_xfer: {type(exc).__name__}"] += 1
                ev = WriteDone(write_id=wid) if st is _DONE else WriteFailed(write_id=wid)
                self._feed(ev, now)
                n += 1
            if n and self.on_writes_done is not None:
                self.on_writes_done()
        return n + copies

    def _poll_copies(self, now: int) -> int:
        """Gathers and scatters that finished: fed as CopyDone/CopyFailed (checked without the lock)."""
        if not self.copies:
            # Nothing posted (a dict's truth is one atomic read): a copy another thread posts
            # meanwhile is checked on the next poll, as if it had been posted just after this one.
            return 0
        t = self.transport
        # A transport that learns copy ends from events (the native engine's fences) names the
        # finished ones: no check of every copy in flight on every poll.
        settled = t.settled_copies()
        if settled is not None and not settled:
            return 0
        with self.lock:
            todo = [(op, h) for op, h in self.copies.items() if settled is None or h in settled]
        if not todo:
            return 0
        states = []
        for op, h in todo:
            try:
                states.append((op, h, t.check_copy(h), ""))
            except Exception as exc:
                states.append((op, h, _ERR, f"{type(exc).__name__}: {exc}"))
        n = 0
        with self.lock:
            for op, h, st, why in states:
                if st is _PROC or self.copies.get(op) is not h:
                    continue
                del self.copies[op]
                try:
                    t.release_copy(h)
                except Exception as exc:
                    self.errors[f"release_copy: {type(exc).__name__}"] += 1
                ev = CopyDone(op_id=op) if st is _DONE else CopyFailed(op_id=op, reason=why or "copy failed")
                self._feed(ev, now)
                n += 1
        return n

    def writes_pending(self, ids: tuple[int, ...]) -> bool:
        with self.lock:
            return not self.handles.keys().isdisjoint(ids)  # C-level: no generator per ask

    def worker_step(self, shard: int, now: int) -> tuple[int, ...] | None:
        """Run one queued chunk of ``shard``; None if the queue is empty, else the ids to await.
        The chunk's data-plane calls run without the lock (see the module header)."""
        with self.lock:
            q = self.queues[shard]
            if not q:
                return None
            chunk = q.popleft()
            if self.trace is not None:
                self.trace("step", chunk)
            self.engine_calls += 1
            cmds = self.engine.run_chunk(chunk, now)
        wait: tuple[int, ...] = ()
        pending: list[Any] = []  # follow-ups, fed after the whole list (the order _execute keeps)
        i, n = 0, len(cmds)
        while i < n:
            j = i
            slow = type(cmds[i]) in _DATA_PLANE
            while j < n and (type(cmds[j]) in _DATA_PLANE) == slow:
                j += 1
            if slow:
                self._post_unlocked(cmds[i:j], pending, now)
            else:
                with self.lock:
                    for cmd in cmds[i:j]:
                        w = self._run(cmd)
                        wait = w if w is not None else wait
                    pending.extend(self._followups)
                    self._followups.clear()
            i = j
        with self.lock:
            self._followups.extend(pending)
            self._drain(now)
        return wait

    def _post_unlocked(self, cmds: list[Any], pending: list[Any], now: int) -> None:
        ids = [c.write_id for c in cmds if type(c) is not SendNotif]
        with self.lock:
            self.posting += len(ids)
            taken = {c.prep_id: self.prepared.pop(c.prep_id, None) for c in cmds if type(c) is PostPrepared}
        done: list[tuple[Any, Any, Exception | None]] = []
        try:
            for cmd in cmds:
                try:
                    done.append((cmd, self._call_data_plane(cmd, taken), None))
                except Exception as exc:
                    done.append((cmd, None, exc))
        finally:
            with self.lock:
                self.posting -= len(ids)
                for cmd, handle, err in done:  # not ``exc``: the except clause above deletes that name
                    k = type(cmd)
                    if err is not None:
                        self._on_failure(cmd, err, pending)
                    elif k is not SendNotif:
                        self.handles[cmd.write_id] = handle
                if len(done) < len(cmds):
                    # A BaseException is on its way out of this step: fail what was never posted
                    # and feed it now, since the step will not get to the end.
                    for cmd in cmds[len(done) :]:
                        self._on_failure(cmd, RuntimeError("worker interrupted before the post"), pending)
                    self._followups.extend(pending)
                    pending.clear()
                    self._drain(now)

    def _call_data_plane(self, cmd: Any, taken: dict[int, Any] | None = None) -> Any:
        if self.trace is None:
            return self._post(cmd, taken)
        self.trace("run", cmd)
        handle = self._post(cmd, taken)
        self.trace("posted", cmd)
        return handle

    def _post(self, cmd: Any, taken: dict[int, Any] | None) -> Any:
        """Post one data-plane command. ``taken``: the prepared entries a worker step popped under
        the lock (None: the lock is held here, pop now)."""
        t: Any = self.transport  # post_prepared: not in the Transport protocol
        if type(cmd) is PostPrepared:
            entry = self.prepared.pop(cmd.prep_id, None) if taken is None else taken.get(cmd.prep_id)
            if entry is None:
                raise KeyError(f"write {cmd.prep_id} was never prepared, or was dropped or posted")
            if isinstance(entry, Exception):
                raise entry
            if type(entry) is PrepareWrite:  # prepared as "remember": today's PostWrite
                return t.post_write(*_write_args(entry))
            if type(entry) is PrepareAuxWrite:
                return t.post_aux_write(*_aux_args(entry))
            return t.post_prepared(entry)
        if type(cmd) is PostWrite:
            return t.post_write(*_write_args(cmd))
        if type(cmd) is PostAuxWrite:
            return t.post_aux_write(*_aux_args(cmd))
        t.send_notif(cmd.peer, cmd.notif)
        return None

    def next_deadline(self) -> int | None:
        # The threaded runtime asks the engine itself: with the cache its prefill ranks lost
        # heartbeats under load (a due Tick never fed: pinned e2e rooms failed by "no heartbeat"
        # in one run of three on two loaded cores, none in 11 with the engine asked), and
        # where the count misses an engine change is not found. The simulated runtime, one
        # thread, keeps ``cached_deadline``.
        with self.lock:
            return self.engine.next_deadline()

    # --- internals (lock held) ---------------------------------------------------------------------

    def cached_deadline(self) -> int | None:
        """``next_deadline`` with the lock held (or no lock, as in SimPy): the engine is asked
        only if it was called since the last answer."""
        calls, dl = self._deadline
        if calls != self.engine_calls:
            dl = self.engine.next_deadline()
            self._deadline = (self.engine_calls, dl)
        return dl

    def _feed(self, event: Any, now: int) -> tuple[int, ...]:
        if self.trace is not None:
            self.trace("in", event)
        self.engine_calls += 1
        return self._execute(self.engine.handle(event, now), now)

    def _execute(self, cmds: list[Any], now: int) -> tuple[int, ...]:
        wait: tuple[int, ...] = ()
        for cmd in cmds:
            w = self._run(cmd)
            wait = w if w is not None else wait
        if self._followups:  # rare (a refused command, an aux check): no call for nothing
            self._drain(now)
        return wait

    def _drain(self, now: int) -> None:
        while self._followups:
            self.engine_calls += 1
            self._execute(self.engine.handle(self._followups.popleft(), now), now)

    def _run(self, cmd: Any) -> tuple[int, ...] | None:
        """Execute one command (lock held); a failure is counted and queued as a follow-up."""
        k = type(cmd)
        t: Any = self.transport  # post_read, release_prepared: not in the Transport protocol
        if self.trace is not None and k not in _DATA_PLANE:  # _call_data_plane traces its own
            self.trace("run", cmd)
        try:
            # StatusChanged first: the most frequent command (several per room and rank).
            if k is StatusChanged:
                if self.on_status is not None:
                    self.on_status(cmd)
            elif k is SendControl:
                t.send_control(cmd.peer, m.encode(cmd.msg))
            elif k in _DATA_PLANE:
                handle = self._call_data_plane(cmd)
                if k is not SendNotif:
                    self.handles[cmd.write_id] = handle
            elif k is PostRead:
                # Decode's pull READ: tracked and reported like a write (WriteDone/WriteFailed).
                self.handles[cmd.read_id] = t.post_read(
                    cmd.peer,
                    cmd.src_region,
                    cmd.src_offset,
                    cmd.dst_region,
                    cmd.dst_offset,
                    cmd.length,
                    cmd.notif,
                )
                if self.trace is not None:
                    self.trace("posted", cmd)
            elif k is EnqueueChunk:
                self.queues[cmd.shard % len(self.queues)].append(cmd.chunk)
                if self.on_enqueue is not None:
                    self.on_enqueue(cmd.shard % len(self.queues))
                if cmd.prepared and self.on_prepared is not None:
                    self.on_prepared(cmd.shard % len(self.queues))
            elif k is Gather or k is Scatter:
                kind = "gather" if k is Gather else "scatter"
                self.copies[cmd.op_id] = t.post_copy(kind, cmd.staging_region, cmd.maps)
                if self.trace is not None:
                    self.trace("posted", cmd)
            elif k is PrepareWrite:
                prepare = getattr(t, "prepare_write", None)
                self.prepared[cmd.prep_id] = cmd if prepare is None else prepare(*_write_args(cmd))
            elif k is PrepareAuxWrite:
                prepare = getattr(t, "prepare_aux_write", None)
                self.prepared[cmd.prep_id] = cmd if prepare is None else prepare(*_aux_args(cmd))
            elif k is DropPrepared:
                entry = self.prepared.pop(cmd.prep_id, None)
                remembered = type(entry) is PrepareWrite or type(entry) is PrepareAuxWrite
                if entry is not None and not remembered and not isinstance(entry, Exception):
                    t.release_prepared(entry)
            elif k is AwaitWrites:
                return cmd.write_ids
            elif k is ChunkDeferred:
                self.errors["chunk_deferred"] += 1
            elif k is CheckAux:
                found = t.read_aux_room(cmd.aux_index)
                self._followups.append(
                    AuxChecked(room=cmd.room, transfer_id=cmd.transfer_id, found_room=found)
                )
            elif k is AddPeer:
                t.add_peer(cmd.peer, cmd.registration)
            elif k is DropPeer:
                t.drop_peer(cmd.peer)
            elif k is FreePages:
                if self.on_free_pages is not None:
                    self.on_free_pages(cmd)
            elif k is ChunkSkipped:
                self.errors["chunk_skipped"] += 1
            else:
                self.errors[f"unknown command {k.__name__}"] += 1
        except Exception as exc:
            self._on_failure(cmd, exc, self._followups)
        return None

    def _on_failure(self, cmd: Any, exc: Exception, followups: Any) -> None:
        k = type(cmd)
        self.errors[f"{k.__name__}: {type(exc).__name__}"] += 1
        if k is PostWrite or k is PostAuxWrite or k is PostPrepared:
            # Refused before anything moved: only this room fails, as a failed write.
            followups.append(WriteFailed(write_id=cmd.write_id, reason=f"post refused: {exc}"))
        elif k is PrepareWrite or k is PrepareAuxWrite:
            self.prepared[cmd.prep_id] = exc  # its post is refused with this reason
        elif k is PostRead:
            followups.append(WriteFailed(write_id=cmd.read_id, reason=f"read refused: {exc}"))
        elif k is CheckAux:
            followups.append(AuxChecked(room=cmd.room, transfer_id=cmd.transfer_id, found_room=-1))
        elif k is Gather or k is Scatter:
            followups.append(CopyFailed(op_id=cmd.op_id, reason=f"copy refused: {type(exc).__name__}: {exc}"))
        elif k is AddPeer:
            # The engine believes the peer is loaded: tell it, or its rooms fail only at their
            # first write, with "no registered peer" instead of this reason.
            followups.append(PeerUnusable(peer=cmd.peer, reason=f"{type(exc).__name__}: {exc}"))


def _write_args(cmd: PostWrite | PrepareWrite) -> tuple[Any, ...]:
    """A write's arguments to ``post_write``/``prepare_write``, in their order."""
    return (cmd.peer, cmd.src_region, cmd.src_offset, cmd.dst_region, cmd.dst_offset, cmd.length, cmd.notif)


def _aux_args(cmd: PostAuxWrite | PrepareAuxWrite) -> tuple[Any, ...]:
    """An aux write's arguments to ``post_aux_write``/``prepare_aux_write``, in their order."""
    return (cmd.peer, cmd.src_aux_index, cmd.dst_aux_index, cmd.notif)


# Executed outside the driver lock by a worker step (they touch only the transport).
_DATA_PLANE = (PostWrite, PostPrepared, PostAuxWrite, SendNotif)
