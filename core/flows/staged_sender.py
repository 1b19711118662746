"""The staged flows' prefill half (``ring``, ``pinned``): a component the prefill room machine
(``core.sender.SenderEngine``) composes as ``staged`` and calls through its flow context.

Ring and pinned share every rule but the staging resources (ring: a worker's private slot and
decode's ring; pinned: a reservation in the rank's pinned pool and decode's pinned pool) and the
staging layout (core/staging_layout.py), so both are this one module, told apart by the lane's
``flow``. The lanes (``core.flows.staged_tx``) hold the per-chunk state; each room's lanes, grants
and gathers are its ``StagedLedger`` in ``ledgers`` (by room key, registered with the engine like
every per-room table), never a field of the room. This component also owns the rank's staging
resources: one private staging buffer per worker, split into a slot per decode rank the rank
writes to; the pinned pool shared by the workers; the last watermark heard from each decode rank;
notes awaiting confirmation.

Rules kept here:
- space is asked for as soon as a chunk is known and its decode rank registered (SGLang PR 22536's
  prefetch), resent each heartbeat interval until answered;
- a lane starts (gathers) only when it is accepted by the worker, granted, its ring space is past
  the watermark, and a slot is free; it then never waits, so slots always come back;
- a lane that cannot start is deferred, not dropped and not spun on: it is retried only when a
  grant, a watermark or a freed slot arrives; the room's own deadline bounds the wait, and the
  failure says what it waited for;
- the note of a DONE ring write is resent until the watermark passes its slot: a lost note would
  otherwise pin the ring for every room behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from kvferry.core import messages as m
from kvferry.core.commands import ChunkDeferred, Gather, PostWrite, SendNotif
from kvferry.core.errors import ProtocolError
from kvferry.core.events import CopyDone, CopyFailed
from kvferry.core.flows import registry
from kvferry.core.flows.parts import FlowTable, RankFlowPart, ignore, ignore_failed, route_copy
from kvferry.core.flows.policy import Flow, staging_format
from kvferry.core.flows.regions import PINNED_REGION, RING_REGION, worker_region
from kvferry.core.flows.staged_tx import (
    TX_TABLE,
    StagedLedger,
    TxIn,
    TxLane,
    TxState,
    decode_alloc_bytes,
    lane_heads,
    writer_bytes,
)
from kvferry.core.geometry import PoolGeometry
from kvferry.core.identity_enum import IdentityEnum
from kvferry.core.kvpoll import KVPoll
from kvferry.core.machine import RoomFailure, RoomStateError, fire, step
from kvferry.core.resources import PinnedPool, PinnedRefused, RingSlot, Watermark, writable
from kvferry.core.staging_layout import staged_map
from kvferry.core.worker import shard_of

__all__ = [
    "STAGED_RECEIVER",
    "STAGED_SENDER",
    "STAGED_TX_ROOM_TABLE",
    "StagedChunkSender",
    "StagedNoteReceiver",
    "StagedSender",
    "StagedTxIn",
]

RoomKey = tuple[int, str]


class StagingRoomError(ProtocolError):
    """Raised inside a room handler: the room fails with this reason."""


class StagedSender(RankFlowPart):
    """The rank's staged flows, prefill half; see the module docstring. ``ctx`` is the room
    machine's flow context (``core.sender.SenderFlowContext``): the rank, its decode peers, the
    deadline heap, the room's topology and the few room actions a flow may take."""

    def __init__(self, ctx: Any, worker_buffer_bytes: int, pinned_bytes: int) -> None:
        self.ctx = ctx
        self.counters = ctx.counters
        self.worker_buffer_bytes = worker_buffer_bytes
        # (worker, target index, half) -> (room key, lane key). Each worker's buffer holds one slot
        # per decode rank it writes to, split in two halves: two lanes that fit in a half run at
        # once (gather chunk N+1 while chunk N is written); a bigger lane holds both halves.
        self.slot_owner: dict[tuple[int, int, int], tuple[RoomKey, tuple[int, m.Endpoint]]] = {}
        self.pinned = PinnedPool(pinned_bytes) if pinned_bytes > 0 else None
        self.peer_wm: dict[tuple[m.Endpoint, str], Watermark] = {}  # (decode rank, "ring"|"pinned")
        self.ops: dict[int, RoomKey] = {}  # gather op id -> room key
        self.stalled: set[int] = set()  # rooms with an accepted lane that could not start
        # Notes of DONE staged writes the watermark has not confirmed yet, per (decode rank,
        # pool): (slot position, note, give up at).
        self.unconfirmed: dict[tuple[m.Endpoint, str], list[tuple[Watermark, bytes, int]]] = {}
        # Each staged room's ledger (lanes, grants, gathers), apart from the room.
        self.ledgers: dict[RoomKey, StagedLedger] = {}
        self._next_op_id = 1
        ops, slots, pinned, ledgers = self.ops, self.slot_owner, self.pinned, self.ledgers  # never rebound
        track = ctx.track
        track("ops", lambda room: any(k[0] == room for k in ops.values()), ops.__len__)
        track("stalled", self.stalled.__contains__, self.stalled.__len__)
        track("worker_slots", lambda room: any(k[0][0] == room for k in slots.values()), slots.__len__)
        track("staged_ledgers", lambda room: any(k[0] == room for k in ledgers), ledgers.__len__)
        if pinned is not None:
            track(
                "pinned",
                lambda room: any(pinned.owner_of(i)[0][0] == room for i in pinned.live),
                pinned.__len__,
            )

    # --- what the room machine asks of a room ----------------------------------------------------

    def quiet(self, key: RoomKey) -> bool:
        """No gather or write of the room in flight and every accepted lane landed."""
        led = self.ledgers.get(key)
        return led is None or led.quiet()

    def gathering(self, key: RoomKey) -> bool:
        """A gather of the room runs: it owns a staging buffer, so the room stays."""
        led = self.ledgers.get(key)
        return led is not None and bool(led.ops)

    def fenced(self, key: RoomKey) -> bool:
        return not self.gathering(key)

    def blocked(self, key: RoomKey) -> str:
        """Why the room's first waiting lane waits ("" if none): for its timeout's reason."""
        led = self.ledgers.get(key)
        return led.blocked if led is not None else ""

    def lanes(self, key: RoomKey) -> list[TxLane]:
        """The room's lanes (the simulator's ring-progress check reads them)."""
        led = self.ledgers.get(key)
        return list(led.lanes.values()) if led is not None else []

    def room_failed(self, r: Any) -> None:
        """The room failed: nothing not yet started will start, nothing is asked again."""
        led = self.ledgers.get(r.key)
        if led is not None:
            led.drop_waiting()
        self.stalled.discard(r.room)
        self.ctx.deadlines.cancel(("stg", r.room))

    def forget(self, r: Any) -> None:
        """The room is gone: so is its ledger."""
        self.ctx.deadlines.cancel(("stg", r.room))
        self.ledgers.pop(r.key, None)

    def _ledger(self, r: Any) -> StagedLedger:
        led = self.ledgers.get(r.key)
        if led is None:
            led = self.ledgers[r.key] = StagedLedger()
        return led

    # --- prefetch --------------------------------------------------------------------------------

    def prepare(self, r: Any) -> None:
        """Create the lanes of every known chunk not yet accepted and ask for their space."""
        ctx = self.ctx
        if ctx.is_failed(r):
            return
        led = self._ledger(r)
        targets = ctx.targets(r)
        peers = ctx.peers
        asked = False
        for idx, ts, te in self._known_chunks(r):
            if te <= ts or idx in led.direct_chunks:
                continue  # nothing to stage: it runs direct (notes only, or the fallback)
            for p in targets:
                lane = led.lanes.get((idx, p))
                if lane is None:
                    if p not in peers:
                        continue
                    lane = self._new_lane(r, led, idx, p, ts, te, len(targets))
                    if lane is None:
                        break  # the chunk falls back to direct
                if lane.state is TxState.ASKING and not led.asked.get(lane.key):
                    led.asked[lane.key] = True
                    asked = True
                    ctx.send(p, self._staging_req(r, lane))
                if idx == len(r.ranges) and lane.premap is None:  # named ahead, not handed over
                    self._premap(lane, ctx.named_ahead(r)[idx].src_pages)
        deadlines = ctx.deadlines
        if asked and ("stg", r.room) not in deadlines:
            deadlines.set(("stg", r.room), ctx.now() + ctx.timeouts.heartbeat_interval_ns)

    def _known_chunks(self, r: Any) -> list[tuple[int, int, int]]:
        """(index, token start, token end) of every chunk not yet run: those handed over, and the
        next one if the scheduler named it ahead (core/flows/ahead.py) and its range can be
        right (the checks a handed-over chunk gets; a prefix hit is refused when it runs)."""
        known = [(i, *r.ranges[i]) for i in range(r.next_run, len(r.ranges))]
        ev = self.ctx.named_ahead(r).get(len(r.ranges))
        if ev is None or r.run.last_enqueued or r.token_start:
            return known
        ts, te = r.enqueue_end, int(ev.token_end)
        n = r.num_tokens
        if te <= ts or (n >= 0 and (te > n or (ev.is_last and te != n))):
            self.counters["ahead_staging_not_asked"] += 1
            return known
        known.append((len(r.ranges), ts, te))
        return known

    def _premap(self, lane: TxLane, pages: Any) -> None:
        """Make a named chunk's gather map now (off its send's path): only the staging base is
        left for the start, which picks the slot. Pages that do not cover the chunk: none."""
        pool = self.ctx.pool
        pages = np.asarray(pages, dtype=np.int64)
        if pages.size * pool.page_size < lane.token_end:
            return
        fmt = staging_format(lane.flow)
        smap = staged_map(
            pool, pages, lane.head_start, lane.num_heads, lane.token_start, lane.token_end, fmt, 0
        )
        lane.premap = (pages, smap)

    def prepare_named(self, r: Any) -> None:
        """A chunk was named ahead (outside any room step): ask for its space now. A chunk that
        cannot be staged fails the room here, with the prefetch's own reason."""
        try:
            self.prepare(r)
        except ProtocolError as exc:
            self._fail_outside(r, exc)

    def ready_ahead(self, r: Any, idx: int) -> bool:
        """The chunk just handed over has staging space granted on every decode rank it writes to,
        for its range: its run launches its gathers at once (when slots and the ring allow)."""
        led = self.ledgers.get(r.key)
        targets = self.ctx.targets(r)
        if led is None or not targets or idx in led.direct_chunks or idx >= len(r.ranges):
            return False
        for p in targets:
            lane = led.lanes.get((idx, p))
            if lane is None or lane.state is not TxState.GRANTED:
                return False
            if (lane.token_start, lane.token_end) != r.ranges[idx]:
                return False
        return True

    def _new_lane(
        self, r: Any, led: StagedLedger, idx: int, p: m.Endpoint, ts: int, te: int, n_targets: int
    ) -> TxLane | None:
        pool = self.ctx.pool
        dst = self.ctx.peers[p].pool
        g0, n = lane_heads(pool, dst)
        lane = TxLane(idx, p, ts, te, r.flow, g0, n)
        why = self._too_big(lane, dst, n_targets)
        if why:
            if not self.ctx.policy.fallback_direct:
                raise StagingRoomError(f"chunk {idx}: {why}")
            self.counters["chunk_fallback_direct"] += 1
            led.direct_chunks.add(idx)
            return None
        led.lanes[lane.key] = lane
        for rsp in led.early_grants.pop(lane.key, []):
            fire(TX_TABLE, lane, TxIn.GRANT, rsp)
        return lane

    def _lane_bytes(self, lane: TxLane) -> int:
        dst = self.ctx.peers[lane.target].pool
        if lane.bytes_for is not dst:
            lane.nbytes = writer_bytes(self.ctx.pool, dst, lane.token_end - lane.token_start)
            lane.bytes_for = dst
        return lane.nbytes

    def _slot_bytes(self, n_targets: int) -> int:
        return self.worker_buffer_bytes // max(1, n_targets)

    def _too_big(self, lane: TxLane, dst: PoolGeometry, n_targets: int) -> str:
        need = self._lane_bytes(lane)
        if lane.flow is Flow.RING:
            have, knob = (
                self._slot_bytes(n_targets),
                f"a worker staging slot (buffer / {n_targets} decode ranks)",
            )
        else:
            have, knob = (self.pinned.capacity if self.pinned is not None else 0), "prefill pinned pool"
        if need > have:
            return f"needs {need} bytes of {knob}, which holds {have}"
        reg = self.ctx.peers[lane.target].registration
        cap = reg.ring_bytes if lane.flow is Flow.RING else reg.pinned_bytes
        need = decode_alloc_bytes(dst, lane.token_end - lane.token_start)
        if need > cap:
            return f"needs {need} bytes of decode {lane.target}'s {lane.flow.value} region, which holds {cap}"
        return ""

    def _staging_req(self, r: Any, lane: TxLane, again: bool = False) -> m.StagingReq:
        return m.StagingReq(
            src=self.ctx.endpoint,
            room=r.room,
            transfer_id=r.tid,
            flow=lane.flow.value,  # type: ignore[arg-type]
            chunk_index=lane.index,
            token_start=lane.token_start,
            token_end=lane.token_end,
            again=again,
        )

    def resend_staging(self, room: int) -> None:
        """StagingReq (or its answer) may be lost: ask again each heartbeat interval until every
        lane is answered; decode answers a repeat (``again``) with the same allocation."""
        ctx = self.ctx
        r = ctx.room(room)
        if r is None:
            return
        led = self.ledgers.get(r.key)
        pending = False
        for key, lane in sorted(led.lanes.items()) if led is not None else ():
            if lane.state is TxState.ASKING and led.asked.get(key) and lane.target in ctx.peers:
                pending = True
                # Per flow: a ring answers at once, so a ring resend means a lost message; a full
                # pinned pool answers only when space frees, so pinned resends are routine.
                self.counters[f"staging_req_resent_{lane.flow.value}"] += 1
                ctx.send(lane.target, self._staging_req(r, lane, again=True))
        if pending:
            ctx.deadlines.set(("stg", r.room), ctx.now() + ctx.timeouts.heartbeat_interval_ns)

    # --- grants and watermarks ------------------------------------------------------------------

    def on_staging_rsp(self, r: Any, rsp: m.StagingRsp) -> None:
        ctx = self.ctx
        peer = ctx.peers.get(rsp.src)
        if peer is None or peer.reg_id != rsp.reg:
            self.counters["staging_rsp_stale"] += 1
            return
        if not rsp.ok:
            raise StagingRoomError(f"staging refused by {rsp.src}: {rsp.reason}")
        if rsp.src not in ctx.targets(r) and rsp.src not in r.receivers:
            raise StagingRoomError(f"staging space from {rsp.src}, which is not a decode rank of the room")
        self._heard_wm((rsp.src, rsp.flow), Watermark(rsp.wm_round, rsp.wm_offset))
        self._confirm_notes((rsp.src, rsp.flow))  # decode may send its watermark only with grants
        led = self._ledger(r)
        lane = led.lanes.get((rsp.chunk_index, rsp.src))
        if lane is None:
            if rsp.chunk_index < r.next_run:
                self.counters["staging_rsp_late"] += 1
            else:
                led.early_grants.setdefault((rsp.chunk_index, rsp.src), []).append(rsp)
            return
        if fire(TX_TABLE, lane, TxIn.GRANT, rsp) == "duplicate":
            self.counters["staging_rsp_duplicate"] += 1
            return
        self._start_ready(r)
        self._wake_stalled()

    def on_watermark(self, msg: m.Watermark) -> None:
        peer = self.ctx.peers.get(msg.src)
        if peer is None or peer.reg_id != msg.reg:
            self.counters["watermark_stale"] += 1
            return
        self._heard_wm((msg.src, msg.pool), Watermark(msg.round, msg.offset))
        self._confirm_notes((msg.src, msg.pool))
        self._wake_stalled()

    def _heard_wm(self, peer: tuple[m.Endpoint, str], wm: Watermark) -> None:
        # Watermarks only grow; a reordered older one must not undo a newer one.
        old = self.peer_wm.get(peer)
        if old is None or wm > old:
            self.peer_wm[peer] = wm

    # --- the worker step and the lanes ------------------------------------------------------------

    def accept(self, r: Any, c: Any) -> str:
        """The worker hands over the room's next chunk: check it, then let its lanes go."""
        ctx = self.ctx
        start, end = ctx.chunk_bounds(r, c)
        idx = c.chunk_index
        led = self._ledger(r)
        if end > start and idx not in led.direct_chunks:
            self.prepare(r)  # every decode rank is known and registered by now
        targets = ctx.targets(r)
        lanes = [led.lanes[(idx, p)] for p in targets if (idx, p) in led.lanes]
        if end <= start or idx in led.direct_chunks or not lanes:
            return registry.halves(Flow.DIRECT).sender.run_chunk(ctx, r, c)  # the fallback, or no bytes
        if len(lanes) != len(targets):
            raise StagingRoomError(
                f"chunk {idx}: staging lanes for {len(lanes)} of {len(targets)} decode ranks"
            )
        if (lanes[0].token_start, lanes[0].token_end) != (start, end):
            raise StagingRoomError(
                f"chunk {idx} covers [{start}, {end}) but asked for space for "
                f"[{lanes[0].token_start}, {lanes[0].token_end}) (the range it was named ahead with, "
                "if it was)"
            )
        pages = np.asarray(c.src_pages, dtype=np.int64)
        if pages.size * ctx.pool.page_size < end:
            raise StagingRoomError(f"chunk {idx}: {pages.size} source pages do not cover token {end}")
        led.pages = pages
        for lane in lanes:
            lane.accepted = True
            lane.is_last = c.is_last
        ctx.advance(r, c, end)
        # The gathers leave first: the last chunk's aux row (finish_run) is off their critical
        # path, and decode takes the aux row's note and the data notes in either order.
        self._start_ready(r)
        outcome: str = ctx.finish_run(r, c, start, end, [])
        return outcome

    def _blocker(self, r: Any, lane: TxLane) -> str:
        """Why an accepted lane cannot start now ("" if it can, once a slot is free)."""
        if lane.state is TxState.ASKING:
            return f"waiting for staging space from {lane.target}"
        if lane.flow is Flow.RING:
            g = lane.grant
            assert g is not None
            wm = self.peer_wm.get((lane.target, "ring"))
            slot = RingSlot(
                alloc_id=g.alloc_id, offset=g.start, round=g.round, end=g.end, size=g.end - g.start
            )
            if wm is None or not writable(slot, wm):
                return f"ring space of {lane.target} not drained yet (round {g.round}, [{g.start}, {g.end}))"
            halves = self._free_halves(r, lane)
            if halves is None:
                shard, ti = self._worker_of(r), self._target_index(r, lane.target)
                owner = self.slot_owner.get((shard, ti, 0)) or self.slot_owner[(shard, ti, 1)]
                return f"worker staging slot busy (held by {self._describe_lane(*owner)})"
        return ""

    def _describe_lane(self, room_key: RoomKey, lane_key: tuple[int, m.Endpoint]) -> str:
        """For a blocked room's reason: who holds what it waits for, and in which state."""
        holder = self.ctx.room(room_key[0])
        led = self.ledgers.get(room_key) if holder is not None and holder.tid == room_key[1] else None
        lane = led.lanes.get(lane_key) if led is not None else None
        if lane is None:
            return f"room {room_key[0]} chunk {lane_key[0]} (gone)"
        return f"room {room_key[0]} chunk {lane_key[0]}, {lane.state.name}, {holder.state.value}"

    def _free_halves(self, r: Any, lane: TxLane) -> tuple[int, ...] | None:
        """The halves of the worker's slot for this lane's decode rank that the lane would take:
        one free half if the lane fits in half a slot, else both; None if they are not free."""
        shard, ti = self._worker_of(r), self._target_index(r, lane.target)
        free = [k for k in (0, 1) if (shard, ti, k) not in self.slot_owner]
        if self._lane_bytes(lane) <= self._slot_bytes(len(self.ctx.targets(r))) // 2:
            return (free[0],) if free else None
        return (0, 1) if len(free) == 2 else None

    def _worker_of(self, r: Any) -> int:
        return shard_of(r.room, self.ctx.num_shards)  # the worker whose queue runs the room's chunks

    def _target_index(self, r: Any, target: m.Endpoint) -> int:
        return self.ctx.targets(r).index(target)

    def _buffer_region(self, buffer: tuple[Any, ...]) -> int:
        """Staging region of a lane's buffer: its worker's private one, or the pinned pool."""
        return worker_region(buffer[1]) if buffer[0] == "slot" else PINNED_REGION

    def _start_ready(self, r: Any) -> None:
        """Start every accepted, granted lane of the room whose space and slot are free."""
        if self.ctx.is_failed(r):
            return
        led = self._ledger(r)
        blocked = ""
        for _, lane in sorted(led.lanes.items()):
            if not lane.accepted or lane.state not in (TxState.ASKING, TxState.GRANTED):
                continue
            why = self._blocker(r, lane)
            if not why:
                why = self._start_lane(r, led, lane)
            if why:
                blocked = blocked or f"chunk {lane.index} to {lane.target}: {why}"
                if lane.index not in led.deferred:
                    led.deferred.add(lane.index)
                    self.counters["chunk_deferred"] += 1
                    self.ctx.emit(ChunkDeferred(room=r.room, chunk_index=lane.index, reason=why))
        led.blocked = blocked
        if blocked:
            self.stalled.add(r.room)
        else:
            self.stalled.discard(r.room)

    def _start_lane(self, r: Any, led: StagedLedger, lane: TxLane) -> str:
        """Take a slot and launch the lane's gather; the reason if no slot is free."""
        n = self._lane_bytes(lane)
        pool = self.ctx.pool
        T = lane.token_end - lane.token_start
        hb, regions = pool.head_bytes, pool.model.num_regions
        if lane.flow is Flow.RING:
            targets = self.ctx.targets(r)
            shard = self._worker_of(r)
            ti, slot = self._target_index(r, lane.target), self._slot_bytes(len(targets))
            halves = self._free_halves(r, lane)
            assert halves is not None  # _blocker said a slot is free
            base = ti * slot + halves[0] * (slot // 2)
            buffer: tuple[Any, ...] = ("slot", shard, *halves)
            for k in halves:
                self.slot_owner[(shard, ti, k)] = (r.key, lane.key)
        else:
            assert self.pinned is not None
            res = self.pinned.reserve(n, (r.key, lane.key))
            if isinstance(res, PinnedRefused):
                raise StagingRoomError(f"chunk {lane.index}: {res.reason}")
            if res is None:
                return "prefill pinned pool full"
            buffer = ("pinned", res.res_id)
            # Head-major: the lane's heads sit at their offset in a rank buffer starting at base.
            base = res.offset - (lane.head_start - pool.head_start) * regions * T * hb
        pre, lane.premap = lane.premap, None
        if pre is not None and np.array_equal(pre[0], led.pages):  # made when named: rebase it
            smap = replace(pre[1], staging_base=pre[1].staging_base + base)
            self.counters["staged_map_ahead"] += 1
        else:
            smap = staged_map(
                pool,
                led.pages,
                lane.head_start,
                lane.num_heads,
                lane.token_start,
                lane.token_end,
                staging_format(lane.flow),
                base,
            )
        op = self._next_op_id
        self._next_op_id += 1
        self.ops[op] = r.key
        led.ops.add(op)
        fire(TX_TABLE, lane, TxIn.START, op, buffer, smap.staging_base, smap.nbytes)
        self.ctx.emit(Gather(op_id=op, room=r.room, staging_region=self._buffer_region(buffer), maps=(smap,)))
        return ""

    def on_copy_done(self, r: Any, ev: Any) -> None:
        led = self._ledger(r)
        lane = next((x for x in led.lanes.values() if x.op_id == ev.op_id), None)
        if lane is None:
            raise StagingRoomError(f"gather {ev.op_id} finished for no lane of the room")
        g = lane.grant
        assert g is not None and lane.buffer is not None
        ctx = self.ctx
        note = ctx.chunk_note(r, lane, lane.token_start, lane.token_end, staged=g.alloc_id)
        wid = ctx.new_write(r)
        # Where the watermark must pass for this write to be known scattered: the ring slot, or
        # the pinned grant's sequence number.
        position = Watermark(g.round, g.start) if lane.flow is Flow.RING else Watermark(g.round, 0)
        led.write_lane[wid] = (lane.key, note, position)
        fire(TX_TABLE, lane, TxIn.GATHERED, wid)
        ctx.emit(
            PostWrite(
                write_id=wid,
                peer=lane.target,
                room=r.room,
                src_region=np.array([self._buffer_region(lane.buffer)], dtype=np.int64),
                src_offset=np.array([lane.src_offset], dtype=np.int64),
                dst_region=np.array(
                    [RING_REGION if lane.flow is Flow.RING else PINNED_REGION], dtype=np.int64
                ),
                dst_offset=np.array([g.offset], dtype=np.int64),
                length=np.array([lane.length], dtype=np.int64),
                notif=note,
            )
        )

    def op_finished(self, r: Any, op: int) -> None:
        """Every state: a failed room's gather gives its slot back and posts nothing."""
        led = self.ledgers.get(r.key)
        if led is None:
            return
        led.ops.discard(op)
        if self.ctx.is_failed(r):
            for lane in led.lanes.values():
                if lane.op_id == op and lane.state is TxState.GATHERING:
                    self._release(r, lane)

    def withdrawn_gather(self, r: Any, op: int) -> None:
        """A Gather command the table withdrew (its step failed): it never runs."""
        if self.ops.pop(op, None) is not None:
            self.op_finished(r, op)

    def write_finished(self, r: Any, wid: int, done: bool) -> None:
        led = self.ledgers.get(r.key)
        entry = led.write_lane.pop(wid, None) if led is not None and led.write_lane else None
        if entry is None:
            return
        key, note, position = entry
        lane = led.lanes[key]  # type: ignore[union-attr]
        if done:
            self._await_scatter((lane.target, lane.flow.value), position, note)
        fire(TX_TABLE, lane, TxIn.WRITTEN)
        self._release(r, lane)
        self._start_ready(r)

    def _release(self, r: Any, lane: TxLane) -> None:
        if lane.buffer is None:
            return
        kind, ident, *halves = lane.buffer
        lane.buffer = None
        if kind == "slot":
            ti = self._target_index(r, lane.target)
            for k in halves:
                self.slot_owner.pop((ident, ti, k), None)
        elif self.pinned is not None:
            self.pinned.free(ident)
        self._wake_stalled()

    def _wake_stalled(self) -> None:
        """A grant, a watermark or a freed slot: let stalled rooms try again. Not a spin: only
        on news, and each room at most once per news."""
        ctx = self.ctx
        for room in sorted(self.stalled):
            r = ctx.room(room)
            if r is None or ctx.is_failed(r):
                self.stalled.discard(room)
                continue
            try:
                self._start_ready(r)
            except ProtocolError as exc:
                self._fail_outside(r, exc)

    def _fail_outside(self, r: Any, exc: ProtocolError) -> None:
        """Outside a room handler: fail the room here."""
        ctx = self.ctx
        self.counters["room_exception"] += 1
        ctx.fail_room(r, RoomFailure(f"{type(exc).__name__}: {exc}", error=exc, at_ns=ctx.now()))
        ctx.settle(r)

    # --- lost notes of staged writes --------------------------------------------------------------

    def _await_scatter(self, key: tuple[m.Endpoint, str], position: Watermark, note: bytes) -> None:
        """A staged write is DONE; until decode's watermark passes it, its note may have been
        lost, and a lost note would hold its staging space (and, in a ring, every room behind
        it) until the room's deadline. So the note is resent alone (the bytes are in place) each
        heartbeat interval until confirmed, for at most ``fence_ns``."""
        wm = self.peer_wm.get(key)
        if wm is not None and wm > position:
            return
        ctx = self.ctx
        now, t = ctx.now(), ctx.timeouts
        self.unconfirmed.setdefault(key, []).append((position, note, now + t.fence_ns))
        if ("notes", key) not in ctx.deadlines:
            ctx.deadlines.set(("notes", key), now + t.heartbeat_interval_ns)

    def _confirm_notes(self, key: tuple[m.Endpoint, str]) -> None:
        wm = self.peer_wm.get(key)
        pending = self.unconfirmed.get(key)
        if wm is None or not pending:
            return
        left = [e for e in pending if not wm > e[0]]
        if left:
            self.unconfirmed[key] = left
        else:
            del self.unconfirmed[key]
            self.ctx.deadlines.cancel(("notes", key))

    def resend_notes(self, key: tuple[m.Endpoint, str]) -> None:
        self._confirm_notes(key)
        pending = self.unconfirmed.get(key)
        peer = key[0]
        ctx = self.ctx
        if not pending or peer not in ctx.peers:
            self.unconfirmed.pop(key, None)
            return
        now = ctx.now()
        keep = []
        for position, note, give_up_at in pending:
            if now >= give_up_at:
                self.counters["staged_note_gave_up"] += 1
                continue
            keep.append((position, note, give_up_at))
            self.counters["staged_note_resent"] += 1
            ctx.emit(SendNotif(peer=peer, room=-1, notif=note))
        if keep:
            self.unconfirmed[key] = keep
            ctx.deadlines.set(("notes", key), now + ctx.timeouts.heartbeat_interval_ns)
        else:
            del self.unconfirmed[key]

    def forget_peer(self, peer: m.Endpoint) -> None:
        """A decode rank lost or restarted: its pools start over; old notes mean nothing there."""
        for pool in ("ring", "pinned"):
            self.peer_wm.pop((peer, pool), None)
            self.unconfirmed.pop((peer, pool), None)
            self.ctx.deadlines.cancel(("notes", (peer, pool)))

    def peer_lost(self, peer: m.Endpoint, rooms: Sequence[Any]) -> None:
        self.forget_peer(peer)

    def routes(self) -> dict[type, Callable[[Any], None]]:
        return {
            m.Watermark: self.on_watermark,
            m.StagingRsp: self._on_staging_rsp,
            CopyDone: self._on_copy,
            CopyFailed: self._on_copy,
        }

    def table(self) -> FlowTable:
        return STAGED_TX_ROOM_TABLE

    def deadline_kinds(self) -> dict[str, Callable[[Any], None]]:
        return {"notes": self.resend_notes, "stg": self.resend_staging}

    def withdrawn(self, r: Any, command: Any) -> None:
        if type(command) is Gather:
            self.withdrawn_gather(r, command.op_id)

    def _on_staging_rsp(self, msg: m.StagingRsp) -> None:
        self.ctx.flow_input(msg.room, msg.transfer_id, StagedTxIn.STAGING_RSP, msg)

    def _on_copy(self, ev: CopyDone | CopyFailed) -> None:
        """A gather's completion: its slot is accounted for in whatever state the room is."""
        route_copy(self, ev, self.op_finished, StagedTxIn.COPY_DONE, StagedTxIn.COPY_FAILED)

    # --- the room inputs of STAGED_TX_ROOM_TABLE ----------------------------------------------------

    def _h_staging_rsp(self, r: Any, inp: StagedTxIn, rsp: m.StagingRsp) -> None:
        self.on_staging_rsp(r, rsp)

    def _h_copy_done(self, r: Any, inp: StagedTxIn, ev: CopyDone) -> None:
        self.on_copy_done(r, ev)

    def _h_copy_failed(self, r: Any, inp: StagedTxIn, ev: CopyFailed) -> str:
        self.ctx.fail_room(r, RoomFailure(f"gather failed: {ev.reason}", at_ns=self.ctx.now()))
        return "failed"

    def in_use(self) -> int:
        """Staging slots, pinned reservations and gathers held; 0 once every room settled."""
        return len(self.slot_owner) + (len(self.pinned) if self.pinned is not None else 0) + len(self.ops)


class StagedTxIn(IdentityEnum):
    """The staged flows' own room inputs on prefill."""

    STAGING_RSP = "staging_rsp"  # decode granted (or refused) staging space for a chunk
    COPY_DONE = "copy_done"  # a gather finished
    COPY_FAILED = "copy_failed"


_B, _W, _T = KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring
_S, _F = KVPoll.Success, KVPoll.Failed
_RSP, _COPIED, _COPY_FAILED = StagedTxIn.STAGING_RSP, StagedTxIn.COPY_DONE, StagedTxIn.COPY_FAILED
_H = StagedSender

# The room machine adds these rows to SENDER_TABLE (core/flows/parts.py, ``FlowTable``).
STAGED_TX_ROOM_TABLE: FlowTable = {
    _B: {_RSP: step(_H._h_staging_rsp, stay=_B)},  # asked for ahead of the TransferInfos
    _W: {_RSP: step(_H._h_staging_rsp, stay=_W)},
    _T: {
        _RSP: step(_H._h_staging_rsp, stay=_T),
        _COPIED: step(_H._h_copy_done, stay=_T),
        _COPY_FAILED: step(_H._h_copy_failed, failed=_F),
    },
    _S: {_RSP: step(ignore, stay=_S)},
    _F: {
        _RSP: step(ignore_failed, stay=_F),
        _COPIED: step(ignore_failed, stay=_F),
        _COPY_FAILED: step(ignore_failed, stay=_F),
    },
}


class StagedChunkSender:
    """The staged flows' prefill half of a chunk run (core/flows/registry.py): the worker hands
    the chunk over and moves on; its lanes wait for space (the rank's ``StagedSender``)."""

    __slots__ = ()

    def run_chunk(self, ctx: Any, r: Any, c: Any) -> str:
        if r.token_start:
            raise RoomStateError(f"flow {r.flow.value} cannot skip decode's prefix hit")
        outcome: str = ctx.staged.accept(r, c)
        return outcome

    def prepare(self, ctx: Any, r: Any) -> None:
        """The room learned of chunks or decode ranks: ask for their space ahead of the worker."""
        ctx.staged.prepare(r)

    def named_ahead(self, ctx: Any, r: Any) -> None:
        """The scheduler named the room's next chunk ahead (core/flows/ahead.py): ask its space."""
        ctx.staged.prepare_named(r)

    def ready_ahead(self, ctx: Any, r: Any, c: Any) -> bool:
        """The chunk handed over finds its staging space granted: its run starts gathers at once."""
        ready: bool = ctx.staged.ready_ahead(r, c.chunk_index)
        return ready

    def check_peers(self, flow: Flow, registrations: list[m.Register]) -> None:
        """Every decode rank the room writes to must offer this flow's staging region."""
        for reg in registrations:
            if not (reg.ring_bytes if flow is Flow.RING else reg.pinned_bytes):
                raise StagingRoomError(
                    f"flow {flow.value}: decode rank {reg.src} registered no {flow.value} region"
                )


class StagedNoteReceiver:
    """The staged flows' decode half for a note naming its staging allocation: the rank's
    decode ledger (core/flows/staged_receiver.py, ``ctx.staged``)."""

    __slots__ = ()

    def on_note(self, ctx: Any, r: Any, prog: Any, note: m.ChunkNote) -> bool:
        return ctx.staged.note(r, note)


STAGED_SENDER, STAGED_RECEIVER = StagedChunkSender(), StagedNoteReceiver()
registry.register(Flow.RING, STAGED_SENDER, STAGED_RECEIVER)
registry.register(Flow.PINNED, STAGED_SENDER, STAGED_RECEIVER)
