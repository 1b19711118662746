"""The staged flows' decode half (``ring``, ``pinned``): a component the decode room machine
(``core.receiver.ReceiverEngine``) composes as ``staged`` and calls through its flow context.

Ring and pinned share every rule here but the allocator and the staging layout (one module, told
apart by the chunk's ``flow``, as on prefill: core/flows/staged_sender.py). It owns the rank's
staging ring and pinned pool (offered to prefill in the Register), StagingReqs held for rooms not
opened yet, one ``RxChunk`` per staged (room, chunk) (``core.flows.staged_rx``), the scatters in
flight, and the watermarks; each per-room table is registered with the engine. The room machine
hands it StagingReqs and staged notes, asks it whether a room's scatters still run, and tells it
when a failed room is fenced (``reclaim``) or gone (``forget``).

Rules kept here:
- a request for a room this rank has not opened is held (bounded, until the bootstrap deadline),
  never dropped; past the bound it is refused with a reason, which fails the room on prefill;
- a chunk's space is allocated once, on the first writer's request, and shared by every writer at
  its own offset; every writer is answered, with the current watermark (a new subscriber learns
  it at once);
- the scatter starts when every writer's note is in; the space is freed when it ends (nothing can
  write it any more), and the chunk is counted for Success only then;
- a failed room's space is reclaimed only once its writers are fenced and no scatter runs; until
  then its ring space is quarantined: still taken, but no longer holding back the rooms behind it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from kvferry.core import messages as m
from kvferry.core.commands import Scatter
from kvferry.core.events import CopyDone, CopyFailed
from kvferry.core.flows import registry
from kvferry.core.flows.parts import FlowTable, RankFlowPart, ignore, ignore_failed, route_copy
from kvferry.core.flows.policy import Flow, staging_format
from kvferry.core.flows.regions import PINNED_REGION, RING_REGION
from kvferry.core.flows.registry import FlowReceiver
from kvferry.core.flows.staged_rx import RX_TABLE, RxChunk, RxIn, RxState
from kvferry.core.flows.staged_sender import STAGED_RECEIVER
from kvferry.core.flows.staged_tx import decode_alloc_bytes
from kvferry.core.flows.staged_wm import WatermarkPacer
from kvferry.core.identity_enum import IdentityEnum
from kvferry.core.kvpoll import KVPoll
from kvferry.core.machine import RoomError, RoomFailure, fire, step
from kvferry.core.resources import PinnedPool, PinnedRefused, RingRefused, StagingRing, Watermark
from kvferry.core.staging_layout import staged_maps

__all__ = ["MAX_HELD_STAGING", "STAGED_RX_ROOM_TABLE", "STAGING_ALIGN", "StagedReceiver", "StagedRxIn"]

# StagingReqs for rooms this rank has not opened yet (SGLang PR 22536 prefetches them) are held, never
# dropped: at most this many, each until the bootstrap deadline.
MAX_HELD_STAGING = 1024
STAGING_ALIGN = 64


RoomKey = tuple[int, str]


class StagedReceiver(RankFlowPart):
    """The rank's staged flows, decode half; see the module docstring. ``ctx`` is the room
    machine's flow context (``core.receiver.ReceiverFlowContext``)."""

    def __init__(self, ctx: Any, registration: m.Register) -> None:
        self.ctx = ctx
        self.counters = ctx.counters
        self.pool = ctx.pool
        # What this rank offers in its Register, and who hears its watermarks.
        self.ring = self._new_ring(registration.ring_bytes) if registration.ring_bytes else None
        self.pinned = (
            PinnedPool(registration.pinned_bytes, STAGING_ALIGN) if registration.pinned_bytes else None
        )
        self.subscribers: dict[str, set[m.Endpoint]] = {"ring": set(), "pinned": set()}
        self._last_wm: dict[str, Watermark] = {}
        self.pacer = WatermarkPacer(ctx, self._watermark_msg)  # who hears a new watermark when
        self._pinned_next = 0  # grant sequence numbers of pinned reservations (their watermark)
        self._pinned_live: dict[int, int] = {}  # reservation id -> grant number
        self.pinned_queue: deque[tuple[int, str, int]] = deque()  # (room, tid, chunk) waiting for space
        # Ring chunks that no gap clear of failed rooms' quarantined space fits, until one is freed.
        self.ring_queue: deque[tuple[int, str, int]] = deque()
        self.held: dict[RoomKey, list[m.StagingReq]] = {}
        self.ops: dict[int, RoomKey] = {}  # scatter op id -> room key
        # The flow's per-room ledger, apart from the room: its staged chunks, and the scatters in
        # flight (they write the room's pages). Entries only for rooms that staged anything.
        self.staged_chunks: dict[RoomKey, dict[int, RxChunk]] = {}
        self.scattering: dict[RoomKey, set[int]] = {}
        # Peaks over the rank's life (what sizing a ring or a pinned pool needs to know).
        # ring_assigned: bytes handed out and not yet freed, laps ahead of the watermark included,
        # so it can exceed the ring (those chunks wait for the watermark on prefill).
        self.staging_peaks = {
            "ring_assigned": 0,
            "pinned_used": 0,
            "pinned_fragmentation": 0.0,
            "pinned_waiting": 0,
        }
        self._next_op_id = 1
        self._track(ctx.track)

    def _new_ring(self, capacity: int) -> StagingRing:
        return StagingRing(capacity, STAGING_ALIGN)

    def _track(self, track: Any) -> None:
        chunks, scattering, ops = self.staged_chunks, self.scattering, self.ops  # never rebound
        ring_queue, pinned_queue = self.ring_queue, self.pinned_queue
        track("staged_chunks", lambda room: any(k[0] == room for k in chunks), chunks.__len__)
        track("scattering", lambda room: any(k[0] == room for k in scattering), scattering.__len__)
        track("ops", lambda room: any(k[0] == room for k in ops.values()), ops.__len__)
        track("ring_queue", lambda room: any(q[0] == room for q in ring_queue), ring_queue.__len__)
        track("pinned_queue", lambda room: any(q[0] == room for q in pinned_queue), pinned_queue.__len__)
        track(
            "held_staging_reqs",
            lambda room: any(k[0] == room for k in self.held),
            lambda: sum(len(v) for v in self.held.values()),
        )
        for name, res in (("ring", self.ring), ("pinned", self.pinned)):
            if res is not None:
                track(
                    name, lambda room, res=res: any(res.owner_of(i)[0] == room for i in res.live), res.__len__
                )

    def in_use(self) -> int:
        """Live staging allocations (ring and pinned); 0 once every room settled."""
        return sum(len(x) for x in (self.ring, self.pinned) if x is not None)

    # --- requests --------------------------------------------------------------------------------

    def on_staging_req(self, req: m.StagingReq) -> None:
        ctx = self.ctx
        key = (req.room, req.transfer_id)
        r = ctx.room(req.room)
        if r is not None and r.tid == req.transfer_id:
            ctx.flow_input(req.room, req.transfer_id, StagedRxIn.STAGING_REQ, req, sender=req.src)
            return
        if ctx.tombstone(req.room, req.transfer_id) is not None:
            self.counters["tombstoned"] += 1
            return
        # Asked ahead of our open (SGLang PR 22536 prefetches): hold it until the room opens, bounded.
        if sum(len(v) for v in self.held.values()) >= MAX_HELD_STAGING:
            self.counters["staging_req_overflow"] += 1
            ctx.send(
                req.src,
                m.StagingRsp(
                    src=ctx.endpoint,
                    room=req.room,
                    transfer_id=req.transfer_id,
                    chunk_index=req.chunk_index,
                    reg=ctx.reg_id,
                    ok=False,
                    reason=f"more than {MAX_HELD_STAGING} requests for unopened rooms",
                ),
            )
            return
        self.counters["staging_req_held"] += 1
        self.held.setdefault(key, []).append(req)
        if ("held", key) not in ctx.deadlines:
            ctx.deadlines.set(("held", key), ctx.now() + ctx.timeouts.bootstrap_ns)

    def take_held(self, key: RoomKey) -> list[m.StagingReq]:
        """The requests held for a room that just opened (they go to it in order)."""
        held = self.held.pop(key, None)
        if held:
            self.ctx.deadlines.cancel(("held", key))
        return held or []

    def held_expired(self, key: RoomKey) -> None:
        dropped = self.held.pop(key, [])
        self.counters["staging_req_expired"] += len(dropped)

    def opened(self, r: Any) -> None:
        """The requests held for the room go to it now, in order."""
        for req in self.take_held(r.key):
            self.ctx.flow_input(req.room, req.transfer_id, StagedRxIn.STAGING_REQ, req, sender=req.src)

    def on_room_req(self, r: Any, req: m.StagingReq) -> None:
        """A StagingReq for a live room (the STAGING_REQ input of STAGED_RX_ROOM_TABLE)."""
        spec = r.senders[req.src]
        if spec.dummy:
            raise RoomError(f"staging request from dummy sender {req.src}")
        flow = Flow(req.flow)
        if (self.ring if flow is Flow.RING else self.pinned) is None:
            raise RoomError(f"{req.src} asked for {flow.value} space, which this rank does not offer")
        if req.token_end > r.num_tokens:
            raise RoomError(
                f"staging request for chunk {req.chunk_index} up to token {req.token_end}, "
                f"past the {r.num_tokens} allocated"
            )
        stg = self.staged_chunks.get(r.key)
        ch = stg.get(req.chunk_index) if stg is not None else None
        if ch is not None:
            if (ch.token_start, ch.token_end, ch.flow) != (req.token_start, req.token_end, flow):
                raise RoomError(
                    f"writers disagree on chunk {req.chunk_index}: [{ch.token_start}, {ch.token_end}) "
                    f"{ch.flow.value} vs [{req.token_start}, {req.token_end}) {flow.value}"
                )
            if ch.state is RxState.WAITING_SPACE:
                self.counters["staging_req_duplicate"] += 1
            elif req.again:  # the writer asked before: its grant may have been lost
                self.counters["staging_req_duplicate"] += 1
                self._grant(r, ch, (req.src,))
            else:  # the first writer's request granted the chunk to every writer, this one too
                self.counters["staging_req_granted_already"] += 1
            return
        writers = tuple(sorted(p for p in r.data_senders))
        for p in writers:
            if r.senders[p].num_heads <= 0:
                raise RoomError(
                    f"sender {p} has no head range; build SenderSpecs with core.topology.sender_specs"
                )
        ch = RxChunk(req.chunk_index, req.token_start, req.token_end, flow, writers)
        self.staged_chunks.setdefault(r.key, {})[req.chunk_index] = ch
        if not self._allocate(r, ch):
            self.counters[f"{flow.value}_wait"] += 1
            (self.ring_queue if flow is Flow.RING else self.pinned_queue).append((r.room, r.tid, ch.index))
            self._note_peaks()

    def _allocate(self, r: Any, ch: RxChunk) -> bool:
        """Space for one chunk of every writer; False if the pinned pool must be waited for."""
        tokens = ch.token_end - ch.token_start
        need = decode_alloc_bytes(self.pool, tokens)
        hb, regions = self.pool.head_bytes, self.pool.model.num_regions
        offsets: dict[m.Endpoint, int] = {}
        if ch.flow is Flow.RING:
            assert self.ring is not None
            got = self.ring.assign(need, r.key)
            if got is None:
                return False  # no gap clear of quarantined space: wait for a fence to free some
            if isinstance(got, RingRefused):
                raise RoomError(f"chunk {ch.index}: {got.reason}")
            pos = got.offset
            for p in ch.writers:  # SGLang PR 22536: one block per writer, packed in sender order
                offsets[p] = pos
                pos += regions * tokens * r.senders[p].num_heads * hb
            self.subscribers["ring"].update(ch.writers)
        else:
            assert self.pinned is not None
            res = self.pinned.reserve(need, r.key)
            if isinstance(res, PinnedRefused):
                raise RoomError(f"chunk {ch.index}: {res.reason}")
            if res is None:
                return False
            for p in ch.writers:  # SGLang PR 18968: head-major, each writer at its heads
                offsets[p] = (
                    res.offset + (r.senders[p].head_start - self.pool.head_start) * regions * tokens * hb
                )
            got = res
            ch.seq = self._pinned_next
            self._pinned_next += 1
            self._pinned_live[res.res_id] = ch.seq
            self.subscribers["pinned"].update(ch.writers)
        self._note_peaks()
        fire(RX_TABLE, ch, RxIn.ALLOCATED, got, offsets)
        self._grant(r, ch, ch.writers)
        return True

    def staging_holds(self, key: Any, region_id: int, lo: int, hi: int) -> bool:
        """Whether bytes ``[lo, hi)`` of staging region ``region_id`` lie inside one live
        allocation that room ``key`` holds (what a staged write may touch; the checkers ask)."""
        res = self.ring if region_id == RING_REGION else self.pinned if region_id == PINNED_REGION else None
        if res is None:
            return False
        return any(res.owner_of(i) == key and a.offset <= lo and hi <= a.end for i, a in res.live.items())

    def _note_peaks(self) -> None:
        p = self.staging_peaks
        if self.ring is not None:
            p["ring_assigned"] = max(p["ring_assigned"], self.ring.used)
        if self.pinned is not None:
            p["pinned_used"] = max(p["pinned_used"], self.pinned.used)
            p["pinned_fragmentation"] = max(p["pinned_fragmentation"], round(self.pinned.fragmentation, 4))
            p["pinned_waiting"] = max(p["pinned_waiting"], len(self.pinned_queue))

    def _watermark(self, pool: str) -> Watermark:
        """Ring: the oldest live allocation. Pinned: the grant number of the oldest live
        reservation (everything granted before it is scattered), or the next one if none."""
        if pool == "ring":
            return self.ring.watermark() if self.ring is not None else Watermark(0, 0)
        return Watermark(min(self._pinned_live.values(), default=self._pinned_next), 0)

    def _grant(self, r: Any, ch: RxChunk, to: tuple[m.Endpoint, ...]) -> None:
        flow = ch.flow.value  # once (``Enum.value`` is a property): three reads below
        wm = self._watermark(flow)
        a = ch.alloc
        rnd, start, end = (a.round, a.offset, a.end) if ch.flow is Flow.RING else (ch.seq, a.offset, a.end)
        for p in to:
            self.ctx.send(
                p,
                m.StagingRsp(
                    src=self.ctx.endpoint,
                    room=r.room,
                    transfer_id=r.tid,
                    chunk_index=ch.index,
                    reg=self.ctx.reg_id,
                    alloc_id=ch.alloc_id,
                    round=rnd,
                    start=start,
                    end=end,
                    offset=ch.offsets[p],
                    flow=flow,  # type: ignore[arg-type]
                    wm_round=wm.round,
                    wm_offset=wm.offset,
                ),
            )
            self.pacer.sent((p, flow), wm)

    def _watermark_msg(self, pool: str) -> m.Watermark:
        wm = self._watermark(pool)
        ctx = self.ctx
        return m.Watermark(src=ctx.endpoint, reg=ctx.reg_id, round=wm.round, offset=wm.offset, pool=pool)  # type: ignore[arg-type]

    def note_receiver(self, r: Any, note: m.ChunkNote) -> FlowReceiver:
        """The decode half of the flow whose space ``note`` names (its StagingReq said which);
        a note naming no space of the room goes to the staged ledger, which refuses it."""
        ch = self._chunk(r, note.chunk_index)
        return registry.halves(ch.flow).receiver if ch is not None else STAGED_RECEIVER

    def _chunk(self, r: Any, index: int) -> RxChunk | None:
        stg = self.staged_chunks.get(r.key)
        return stg.get(index) if stg is not None else None

    def scatters_running(self, r: Any) -> bool:
        """A scatter of the room is writing its pages (the room machine waits for it)."""
        return r.key in self.scattering

    def writing(self, r: Any) -> bool:
        return self.scatters_running(r)

    def room_failed(self, r: Any) -> None:
        self.quarantine(r)

    def withdrawn(self, r: Any, command: Any) -> None:
        if type(command) is Scatter:
            self.withdrawn_scatter(r, command.op_id)

    def routes(self) -> dict[type, Callable[[Any], None]]:
        return {m.StagingReq: self.on_staging_req, CopyDone: self._on_copy, CopyFailed: self._on_copy}

    def table(self) -> FlowTable:
        return STAGED_RX_ROOM_TABLE

    def _on_copy(self, ev: CopyDone | CopyFailed) -> None:
        """A scatter's completion: it no longer writes the room's pages in whatever state the room is."""
        route_copy(self, ev, self.scatter_finished, StagedRxIn.COPY_DONE, StagedRxIn.COPY_FAILED)

    # --- the room inputs of STAGED_RX_ROOM_TABLE -----------------------------------------------------

    def _h_staging_req(self, r: Any, inp: StagedRxIn, req: m.StagingReq) -> None:
        self.on_room_req(r, req)

    def _h_copy_done(self, r: Any, inp: StagedRxIn, ev: CopyDone) -> str:
        return self.on_copy_done(r, ev)

    def _h_copy_failed(self, r: Any, inp: StagedRxIn, ev: CopyFailed) -> str:
        self.ctx.fail_room(r, RoomFailure(f"scatter failed: {ev.reason}", at_ns=self.ctx.now()))
        return "failed"

    def deadline_kinds(self) -> dict[str, Callable[[Any], None]]:
        return {"held": self.held_expired, "wm": lambda _owed: self.pacer.fire(self._watermark)}

    def forget(self, r: Any) -> None:
        """The room is gone: so is the flow's ledger of it."""
        self.staged_chunks.pop(r.key, None)

    def note(self, r: Any, note: m.ChunkNote) -> bool:
        """A writer's note for space it was granted; False for a resend (counted)."""
        ch = self._chunk(r, note.chunk_index)
        if ch is None or ch.state is RxState.WAITING_SPACE or ch.alloc_id != note.staged:
            raise RoomError(
                f"chunk {note.chunk_index} from {note.src} landed in staging space "
                f"{note.staged} this rank never granted it"
            )
        if (note.token_start, note.token_end) != (ch.token_start, ch.token_end):
            raise RoomError(
                f"chunk {note.chunk_index} from {note.src} covers [{note.token_start}, "
                f"{note.token_end}), its space was for [{ch.token_start}, {ch.token_end})"
            )
        if fire(RX_TABLE, ch, RxIn.NOTE, note) == "duplicate":
            self.counters["duplicate_notification"] += 1
            return False
        if ch.state is RxState.LANDED:
            self._start_scatter(r, ch)
        return True

    def _start_scatter(self, r: Any, ch: RxChunk) -> None:
        fmt = staging_format(ch.flow)
        base = ch.alloc.offset
        ring = ch.flow is Flow.RING
        writers = []
        for p in ch.writers:
            spec = r.senders[p]
            writers.append((spec.head_start, spec.num_heads, ch.offsets[p] if ring else base))
        # Every writer's map over the same pages and tokens: their page lookups made once.
        maps = staged_maps(self.pool, r.dst_pages, writers, ch.token_start, ch.token_end, fmt)
        op = self._next_op_id
        self._next_op_id += 1
        self.ops[op] = r.key
        self.scattering.setdefault(r.key, set()).add(op)
        fire(RX_TABLE, ch, RxIn.START, op)
        region = RING_REGION if ch.flow is Flow.RING else PINNED_REGION
        self.ctx.emit(Scatter(op_id=op, room=r.room, staging_region=region, maps=tuple(maps)))

    def scatter_finished(self, r: Any, op: int) -> None:
        """Every state: the scatter's staging space has no writer left, so it is freed at once."""
        running = self.scattering.get(r.key)
        if running is not None:
            running.discard(op)
            if not running:
                del self.scattering[r.key]
        stg = self.staged_chunks.get(r.key, {})
        ch = next((x for x in stg.values() if x.op_id == op), None)
        if ch is None or ch.state is not RxState.SCATTERING:
            return
        fire(RX_TABLE, ch, RxIn.SCATTERED)
        self.counters[f"scattered_{ch.flow.value}"] += 1
        self._free_alloc(ch)
        self._space_freed()

    def _free_alloc(self, ch: RxChunk) -> None:
        if ch.flow is Flow.RING:
            self.ring.free(ch.alloc.alloc_id)  # type: ignore[union-attr]
        else:
            self.pinned.free(ch.alloc.res_id)  # type: ignore[union-attr]
            self._pinned_live.pop(ch.alloc.res_id, None)

    def on_copy_done(self, r: Any, ev: Any) -> str:
        for ch in self.staged_chunks.get(r.key, {}).values():
            if ch.op_id == ev.op_id:
                for p in ch.writers:
                    self.ctx.record_chunk(r, r.progress[p], ch.notes[p])
        return "done" if self.ctx.complete(r) else "stay"

    def reclaim(self, r: Any) -> None:
        """A failed room's staging space, once its writers are fenced and no scatter runs."""
        freed = 0
        if self.ring is not None:
            freed += len(self.ring.free_owner(r.key))
        if self.pinned is not None:
            ids = self.pinned.free_owner(r.key)
            for i in ids:
                self._pinned_live.pop(i, None)
            freed += len(ids)
        for queue in (self.ring_queue, self.pinned_queue):
            if any(q[0] == r.room and q[1] == r.tid for q in queue):
                kept = [q for q in queue if (q[0], q[1]) != r.key]
                queue.clear()
                queue.extend(kept)
        if freed:
            self._space_freed()

    def quarantine(self, r: Any) -> None:
        """A failed room's ring space stays taken until its writers are fenced, which can outlast
        every room behind it; it stops holding their watermark now (core/resources/ring.py)."""
        if self.ring is not None and self.ring.quarantine(r.key):
            self.counters["ring_quarantined"] += 1
            self._broadcast_watermarks()

    def _broadcast_watermarks(self) -> None:
        for pool in ("ring", "pinned"):
            wm = self._watermark(pool)
            if wm != self._last_wm.get(pool):
                self._last_wm[pool] = wm
                chunks = (ch for chs in self.staged_chunks.values() for ch in chs.values())
                live = (ch for ch in chunks if ch.flow.value == pool)
                self.pacer.moved(pool, wm, self.subscribers[pool], live)

    def _space_freed(self) -> None:
        """Broadcast the ring's new watermark; grant the chunks that waited for space, in order."""
        self._broadcast_watermarks()
        self._grant_waiting(self.ring_queue)
        self._grant_waiting(self.pinned_queue)

    def _grant_waiting(self, queue: deque[tuple[int, str, int]]) -> None:
        """Allocate the chunks that waited for space, in order, until one still does not fit."""
        while queue:
            room, tid, idx = queue[0]
            r = self.ctx.room(room)
            ch = self._chunk(r, idx) if r is not None and r.tid == tid and not self.ctx.is_failed(r) else None
            if ch is None:
                queue.popleft()
                continue
            try:
                if not self._allocate(r, ch):
                    break
            except RoomError as exc:
                self.ctx.fail_room(r, RoomFailure(str(exc), error=exc, at_ns=self.ctx.now()))
            queue.popleft()

    def heartbeat(self, peer: m.Endpoint) -> None:
        """A lost broadcast must not leave a writer waiting: repeat it with each heartbeat."""
        for pool in ("ring", "pinned"):
            if peer in self.subscribers[pool]:
                self.ctx.send(peer, self._watermark_msg(pool))
                self.pacer.sent((peer, pool), self._watermark(pool))

    def peer_lost(self, peer: m.Endpoint, rooms: Any) -> None:
        self.pacer.forget(peer)

    def withdrawn_scatter(self, r: Any, op: int) -> None:
        """A Scatter command the table withdrew (its step failed): it never runs."""
        if self.ops.pop(op, None) is not None:
            self.scatter_finished(r, op)


class StagedRxIn(IdentityEnum):
    """The staged flows' own room inputs on decode."""

    STAGING_REQ = "staging_req"  # a writer asks for staging space for a chunk
    COPY_DONE = "copy_done"  # a scatter finished
    COPY_FAILED = "copy_failed"


_B, _W, _T = KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring
_S, _F = KVPoll.Success, KVPoll.Failed
_REQ, _COPIED, _COPY_FAILED = StagedRxIn.STAGING_REQ, StagedRxIn.COPY_DONE, StagedRxIn.COPY_FAILED
_H = StagedReceiver
_FAIL = step(_H._h_copy_failed, failed=_F)

# The room machine adds these rows to RECEIVER_TABLE (core/flows/parts.py, ``FlowTable``).
STAGED_RX_ROOM_TABLE: FlowTable = {
    _B: {_REQ: step(_H._h_staging_req, stay=_B), _COPY_FAILED: _FAIL},
    _W: {_REQ: step(_H._h_staging_req, stay=_W), _COPY_FAILED: _FAIL},
    _T: {
        _REQ: step(_H._h_staging_req, stay=_T),
        _COPIED: step(_H._h_copy_done, stay=_T, done=_S),
        _COPY_FAILED: _FAIL,
    },
    _S: {_REQ: step(ignore, stay=_S)},
    _F: {
        _REQ: step(ignore_failed, stay=_F),
        _COPIED: step(ignore_failed, stay=_F),
        _COPY_FAILED: step(ignore_failed, stay=_F),
    },
}
