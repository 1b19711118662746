"""Prefill rank endpoint: the sender engine driven by real threads over NIXL + ZMQ.

Threads (SGLang PR 20680's design, with its progress thread split in two): a control thread (control
messages, deadlines and heartbeats: never waits on the data plane), a data thread (notifications,
write and copy completions) and ``num_queues`` worker threads. A room's chunks all go to queue
``room % num_queues`` (the core's ``shard_of``), so one worker runs them in order; the worker
posts a chunk's writes and waits for them before taking its next chunk.

Ownership: a shard's queue in ``driver.queues`` is consumed by whoever holds that shard's step
lock (its worker, or a ``send`` posting a prepared chunk, below); the driver appends under its
lock, and the stepper peeks the head without it, safe while it is the sole consumer; its wake-up
Event is set by the driver's ``on_enqueue`` and cleared only by the worker.
A worker holds the driver lock only to take its chunk's commands from the engine and to feed
results back; it posts the chunk's writes (NIXL make_prepped_xfer + transfer) without it, so the
N workers post in parallel and a slow post (294,912 descriptors per rank for TP 2->1) stalls
neither the control and data threads, nor API calls, nor rooms of other shards (driver.py's header has
the ordering argument). A worker keeps the write ids of at most ``worker_chunks_in_flight`` chunks
in ``_in_flight[shard]`` and waits for the oldest before it takes another chunk (a ``send`` that
stepped the chunk itself appends there too, under the step lock; deque appends and pops are
atomic); the core needs no pacing for correctness (chunk notes may land in any order), so this is
a throughput knob. Everything else follows base.py.

Chunks planned ahead (``KVSender.plan_ahead``, core/flows/ahead.py): when the core says a queued
chunk's run only posts writes made ready before (``EnqueueChunk.prepared``) and the rank runs the
native engine, ``send`` runs that step itself on the caller's thread (one native post per write,
the GIL released) instead of waking the worker: no thread hand-off between "chunk ready" and the
post. A ring or pinned chunk named ahead whose staging space is granted by its ``send`` is such a
chunk too: its step launches its gathers at once from the caller's thread. A shard's steps stay
one at a time and in queue order: a step takes ``_step_locks[shard]``,
and the caller only steps when the lock is free and the worker keeps fewer chunks in flight than
its cap (else the worker runs it, as ever); the worker then sees the chunk's writes through.

A worker never dies: an exception from a chunk fails that chunk's room through the core (an
AbortRoom, which tells decode with RoomFailed) and is kept on the status board, so
``failure_exception()`` raises it with its original type.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from kvferry.backends.driver import Driver
from kvferry.backends.nixl.memory import MemRegion
from kvferry.backends.runtime.base import EndpointBase, RuntimeConfig, now_ns
from kvferry.backends.runtime.errortap import ErrorTap
from kvferry.backends.runtime.loops import Loop
from kvferry.core.errors import LocalMisuseError
from kvferry.core.events import AbortRoom, ChunkAhead, ChunkReady, LayersReady, ReleaseRoom, SenderOpen
from kvferry.core.flows import Flow
from kvferry.core.geometry import PoolGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.core.messages import Endpoint
from kvferry.core.sender import SenderEngine

# The longest a worker sleeps when its queue is empty, or while it awaits writes the data thread
# reports (each sleep ends as soon as it is woken: a chunk queued, its writes fed).
WORKER_IDLE_S = 0.05


class PrefillEndpoint(EndpointBase):
    """One prefill TP rank. ``buffers``: region_id -> numpy array / torch tensor (DRAM or VRAM)
    holding that region of the KV pool (allocated here as DRAM if omitted); ``aux``: the aux rows."""

    role = "prefill"

    def __init__(
        self,
        server: str,
        pool: PoolGeometry,
        *,
        buffers: Mapping[int, Any] | None = None,
        aux: Any | None = None,
        config: RuntimeConfig | None = None,
        extra_groups: Mapping[str, Sequence[MemRegion]] | None = None,
    ) -> None:
        config = config or RuntimeConfig()
        if config.worker_chunks_in_flight < 1:  # before any thread or registration exists
            raise ValueError(f"worker_chunks_in_flight must be >= 1, got {config.worker_chunks_in_flight}")
        super().__init__(server, pool, buffers=buffers, aux=aux, config=config, extra_groups=extra_groups)
        n = config.num_queues
        st = config.staging
        self.engine = SenderEngine(
            self.endpoint,
            pool,
            timeouts=config.timeouts,
            num_shards=n,
            policy=st.policy(),
            worker_buffer_bytes=st.worker_buffer_bytes,
            pinned_bytes=st.prefill_pinned_bytes,
            registration=self.transport.registration(),  # what a pull flow offers decode
        )
        self._wake = [threading.Event() for _ in range(n)]
        self._in_flight: list[deque[tuple[int, ...]]] = [deque() for _ in range(n)]
        self._step_locks = [threading.Lock() for _ in range(n)]  # one step of a shard at a time
        # Set when a poll fed finished writes while the shard's worker has some in flight: the
        # worker awaiting them sleeps on it (one wake-up per completion, not a poll per 20 us+).
        self._writes_done = [threading.Event() for _ in range(n)]
        # Native engine: a prepared chunk is posted by the thread that handed it over (its feed
        # marks the shard here; thread-local, since the driver's callback runs in that thread).
        self._post_on_send = config.nixl_post_on_send and self.transport.executor == "native"
        self._prepared_shard = threading.local()
        self.driver = Driver(
            self.engine,
            ErrorTap(self.transport, self.board),
            num_shards=n,
            lock=self.lock,
            on_status=self._on_status,
            on_free_pages=self._on_free_pages,
            on_enqueue=lambda shard: self._wake[shard].set(),
            on_prepared=self._mark_prepared if self._post_on_send else None,
            on_writes_done=self._on_writes_done,
        )
        self._loops.extend(self._progress_loops())
        self._worker_loops = []
        for shard in range(n):
            self._worker_loops.append(
                Loop(
                    f"{self.endpoint}-worker{shard}",
                    lambda shard=shard: self._worker_step(shard),
                    self._record_error,
                    idle_max_s=config.idle_max_s,
                )
            )
        self._loops.extend(self._worker_loops)

    def sender(self, room: int, transfer_id: str) -> KVSender:
        self._check_open()
        return KVSender(self, room, transfer_id)

    def _wake_all(self) -> None:
        for ev in (*self._wake, *self._writes_done):
            ev.set()

    def _on_writes_done(self) -> None:
        # Driver callback (lock held): wake every worker with writes in flight (a deque's truth
        # is one atomic read); each re-checks its own. A worker whose ids are not appended yet
        # checks them before it first sleeps.
        for shard, in_flight in enumerate(self._in_flight):
            if in_flight:
                self._writes_done[shard].set()

    def _worker_step(self, shard: int) -> bool:
        queue = self.driver.queues[shard]
        wake = self._wake[shard]
        in_flight = self._in_flight[shard]
        if not queue and in_flight:  # nothing new to post: see the oldest chunk's writes through
            self._await_oldest(shard)
            return True
        if not queue:
            wake.wait(WORKER_IDLE_S)
            wake.clear()
            if not queue:
                return True  # the wait was the idle sleep
        with self._step_locks[shard]:
            if queue:  # a send may have stepped it meanwhile
                self._step(shard)
        while len(in_flight) >= self.config.worker_chunks_in_flight:
            self._await_oldest(shard)
        return True

    def _await_oldest(self, shard: int) -> None:
        # Popped once seen through: while it is awaited it still counts against the cap a send
        # checks before stepping a chunk itself.
        in_flight = self._in_flight[shard]
        self._await(shard, in_flight[0])
        in_flight.popleft()

    def _step(self, shard: int) -> None:
        """Run the head chunk of ``shard`` (caller holds its step lock: the head cannot change)."""
        head: ChunkReady = self.driver.queues[shard][0]
        try:
            ids = self.driver.worker_step(shard, now_ns())
        except Exception as exc:
            # The chunk was taken off the queue (or the engine broke on it): fail its room only.
            # Recorded first: whoever sees the room fail may look for the error at once.
            self._record_error(exc)
            self.board.fail(head.room, head.transfer_id, exc)
            self.driver.feed(
                AbortRoom(
                    room=head.room,
                    transfer_id=head.transfer_id,
                    reason=f"worker: {type(exc).__name__}: {exc}",
                ),
                now_ns(),
            )
            return
        if ids:
            self._in_flight[shard].append(ids)

    def _mark_prepared(self, shard: int) -> None:
        # Driver callback (lock held): the chunk just queued only posts prepared writes.
        self._prepared_shard.value = shard

    def _step_on_send(self) -> None:
        """After a send: step the prepared chunk it queued here, if its shard is free (else the
        worker runs it); the worker is woken either way, to see its writes through."""
        shard = getattr(self._prepared_shard, "value", None)
        if shard is None:
            return
        self._prepared_shard.value = None
        lock = self._step_locks[shard]
        if not lock.acquire(blocking=False):
            return  # the worker is stepping this shard: it takes the chunk next
        try:
            room = len(self._in_flight[shard]) < self.config.worker_chunks_in_flight
            if self.driver.queues[shard] and room:
                self._step(shard)
        finally:
            lock.release()
        self._wake[shard].set()

    def _await(self, shard: int, ids: tuple[int, ...]) -> None:
        """SGLang PR 20680's pacing: the worker's next chunk waits for this chunk's writes. The
        data thread polls every write in flight (at the in-flight pace while a room is live; a
        native engine wakes it on each completion) and sets ``_writes_done`` when it fed some:
        the worker sleeps on that, and polls its writes itself only when a sleep ends without
        it (a data thread held up elsewhere)."""
        stop = self._worker_loops[shard].stop_event
        done = self._writes_done[shard]
        while True:
            done.clear()  # before the check: a completion fed after it sets it again
            if not self.driver.writes_pending(ids) or stop.is_set():
                return
            if not done.wait(WORKER_IDLE_S):
                self.driver.poll_writes(now_ns(), ids)


class KVSender:
    """One room on one prefill rank, shaped like SGLang's KVSender (init, send, poll,
    failure_exception, abort, clear)."""

    def __init__(self, endpoint: PrefillEndpoint, room: int, transfer_id: str) -> None:
        self.ep = endpoint
        self.room = room
        self.transfer_id = transfer_id
        self._chunks = 0
        endpoint.board.track(room, transfer_id)
        self._cleared = False

    def init(self, aux_index: int, *, flow: str | None = None, receivers: Sequence[Endpoint] = ()) -> None:
        """The scheduler has this room (its aux row is ``aux_index``). ``flow`` forces this room's
        transfer flow ("direct", "ring", "pinned", "layerwise", ...); ``receivers``: the decode
        ranks this rank sends to (``core.topology.receiver_endpoints``), if known, so staging
        space is asked for before decode's TransferInfo arrives."""
        self._usable()
        self.ep._check_open()
        if flow is not None:
            Flow.parse(flow)  # a typo is the caller's mistake, raised here
        self.ep.driver.feed(
            SenderOpen(
                room=self.room,
                transfer_id=self.transfer_id,
                aux_index=aux_index,
                receivers=tuple(receivers),
                flow=flow,
            ),
            now_ns(),
        )

    def send(self, src_pages: Any, token_end: int, is_last: bool) -> None:
        """A chunk is computed: tokens up to ``token_end`` are in ``src_pages`` (the room's page
        ids from token 0). Returns at once; a worker posts the writes. A "layerwise" room calls
        it when the chunk's forward starts, then ``layers_ready`` as its layers finish."""
        chunk = self._next_chunk(ChunkReady, src_pages, token_end, is_last)
        ep = self.ep
        ep.driver.feed(chunk, now_ns())  # a chunk refused as our own mistake keeps its index
        self._chunks += 1
        if ep._post_on_send:
            ep._step_on_send()

    def plan_ahead(self, src_pages: Any, token_end: int, is_last: bool) -> None:
        """The pages and token range the next ``send`` will carry, known before the chunk is
        computed (the scheduler allocated them). A direct room then plans the chunk's writes and
        has them made ready once decode's TransferInfo is in, so that ``send`` only posts them
        (core/flows/ahead.py). Optional; a ``send`` that differs is planned as ever. A ring or
        pinned room asks decode for the chunk's staging space now; a ``send`` that finds it
        granted launches the chunk's gathers from the caller's thread (native engine), and one
        with another token range fails the room (decode holds space for the range named)."""
        ev = self._next_chunk(ChunkAhead, src_pages, token_end, is_last)
        self.ep.driver.feed(ev, now_ns())

    def _next_chunk(self, kind: Any, src_pages: Any, token_end: int, is_last: bool) -> Any:
        """The event (ChunkReady or ChunkAhead) for the room's next chunk, once the room and the
        endpoint are still usable."""
        self._usable()
        self.ep._check_open()
        return kind(
            room=self.room,
            transfer_id=self.transfer_id,
            chunk_index=self._chunks,
            token_end=int(token_end),
            src_pages=np.asarray(src_pages, dtype=np.int64),
            is_last=bool(is_last),
        )

    def layers_ready(self, first_layer: int, end_layer: int, chunk_index: int | None = None) -> None:
        """Layers ``[first_layer, end_layer)`` of a chunk are computed (the "layerwise" flow:
        core/flows/layerwise.py): their KV leaves at once. ``chunk_index``: the chunk the last
        ``send`` handed over, unless given. Every layer of a chunk is reported before the next
        chunk's ``send``. A room on another flow ignores it (its ``send`` means computed)."""
        self._usable()
        self.ep._check_open()
        if chunk_index is None:
            if not self._chunks:
                raise LocalMisuseError(f"room {self.room}: layers reported before the chunk's send")
            chunk_index = self._chunks - 1
        ev = LayersReady(
            room=self.room,
            transfer_id=self.transfer_id,
            chunk_index=int(chunk_index),
            first_layer=int(first_layer),
            end_layer=int(end_layer),
        )
        self.ep.driver.feed(ev, now_ns())

    def write_aux(self, aux_index: int, row: bytes) -> None:
        """Fill the room's aux row (first 8 bytes: the room id, the landing check)."""
        self._usable()
        self.ep.transport.write_aux_row(aux_index, row)

    def poll(self) -> KVPoll:
        return self.ep.poll(self.room, self.transfer_id)

    def wait(self, timeout_s: float) -> KVPoll | None:
        return self.ep.board.wait_for(self.room, self.transfer_id, {KVPoll.Success, KVPoll.Failed}, timeout_s)

    def failure_exception(self) -> None:
        self.ep.failure_exception(self.room, self.transfer_id)

    def abort(self, reason: str = "aborted by the scheduler") -> None:
        self._usable()
        self.ep.driver.feed(AbortRoom(room=self.room, transfer_id=self.transfer_id, reason=reason), now_ns())

    def _usable(self) -> None:
        if self._cleared:
            raise LocalMisuseError(f"room {self.room}: this handle was cleared")

    def clear(self) -> None:
        """Done with the room: the core drops it once terminal (a failed one once no write is in
        flight); the status board forgets it now."""
        self.ep.driver.feed(ReleaseRoom(room=self.room, transfer_id=self.transfer_id), now_ns())
        self.ep.board.drop(self.room, self.transfer_id)
        self._cleared = True
