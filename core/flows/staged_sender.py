"""The staged flows inside the prefill room machine (``core.sender.SenderEngine``).

A mixin, so the room machine stays about rooms: it calls ``_prefetch`` when it learns of chunks
or decode ranks, ``_accept_staged`` from the worker step, and hands over the flow's inputs
(StagingRsp, Watermark, a finished gather or write). The lanes (``core.flows.staged_tx``) hold
the per-chunk state; this module owns the rank's staging resources: one private staging buffer
per worker, split into a slot per decode rank the rank writes to; the pinned pool shared by the
workers; the last watermark heard from each decode rank; notes awaiting confirmation.

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

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
from kvferry.core import messages as m
from kvferry.core.commands import ChunkDeferred, Gather, PostWrite, SendNotif
from kvferry.core.deadlines import DeadlineHeap, Timeouts
from kvferry.core.errors import ProtocolError
from kvferry.core.flows import registry
from kvferry.core.flows.policy import Flow, FlowPolicy, staging_format
from kvferry.core.flows.regions import PINNED_REGION, RING_REGION, worker_region
from kvferry.core.flows.staged_tx import (
    TX_TABLE,
    TxIn,
    TxLane,
    TxState,
    decode_alloc_bytes,
    lane_heads,
    writer_bytes,
)
from kvferry.core.geometry import PoolGeometry
from kvferry.core.machine import fire
from kvferry.core.proto_common import RoomFailure, RoomStateError
from kvferry.core.resources import PinnedPool, PinnedRefused, RingSlot, Watermark, writable
from kvferry.core.staging_layout import staged_map
from kvferry.core.worker import shard_of

__all__ = ["StagedSender"]


class StagingRoomError(ProtocolError):
    """Raised inside a room handler: the room fails with this reason."""


class StagedSender:
    """Mixin of ``SenderEngine``; see the module docstring. Uses the engine's ``pool``,
    ``peers``, ``rooms``, ``timeouts``, ``deadlines``, ``counters``, ``endpoint``, ``num_shards``,
    ``_now``, ``_out``, ``_send`` and ``_new_write``."""

    pool: PoolGeometry
    peers: dict[m.Endpoint, Any]
    rooms: dict[int, Any]
    timeouts: Timeouts
    deadlines: DeadlineHeap
    counters: Counter[str]
    endpoint: m.Endpoint
    num_shards: int
    _now: int
    _out: list[Any]
    _is_failed: Callable[[Any], bool]  # the host's (core/machine.py): a flow compares no state
    track: Callable[..., None]  # the host's table registry (core/proto_common.py)
    _started: Callable[[Any], bool]  # the host's: the room left bootstrapping
    _flow_ctx: registry.SenderContext  # what every flow's run shares (core/flows/registry.py)

    def _send(self, peer: m.Endpoint, msg: Any) -> None:
        raise NotImplementedError

    def _new_write(self, r: Any) -> int:
        raise NotImplementedError

    def _maybe_finish(self, r: Any) -> None:
        raise NotImplementedError

    def _init_staging(self, policy: FlowPolicy | None, worker_buffer_bytes: int, pinned_bytes: int) -> None:
        self.policy = policy or FlowPolicy()
        self.worker_buffer_bytes = worker_buffer_bytes
        # (worker, target index, half) -> (room key, lane key). Each worker's buffer holds one slot
        # per decode rank it writes to, split in two halves: two lanes that fit in a half run at
        # once (gather chunk N+1 while chunk N is written); a bigger lane holds both halves.
        self.slot_owner: dict[tuple[int, int, int], tuple[tuple[int, str], tuple[int, m.Endpoint]]] = {}
        self.pinned = PinnedPool(pinned_bytes) if pinned_bytes > 0 else None
        self.peer_wm: dict[tuple[m.Endpoint, str], Watermark] = {}  # (decode rank, "ring"|"pinned")
        self.ops: dict[int, tuple[int, str]] = {}  # gather op id -> room key
        self.stalled: set[int] = set()  # rooms with an accepted lane that could not start
        # Notes of DONE staged writes the watermark has not confirmed yet, per (decode rank,
        # pool): (slot position, note, give up at).
        self.unconfirmed: dict[tuple[m.Endpoint, str], list[tuple[Watermark, bytes, int]]] = {}
        self._next_op_id = 1
        ops, slots, pinned = self.ops, self.slot_owner, self.pinned  # never rebound
        self.track("ops", lambda room: any(k[0] == room for k in ops.values()), ops.__len__)
        self.track("stalled", self.stalled.__contains__, self.stalled.__len__)
        self.track("worker_slots", lambda room: any(k[0][0] == room for k in slots.values()), slots.__len__)
        if pinned is not None:
            self.track(
                "pinned",
                lambda room: any(pinned.owner_of(i)[0][0] == room for i in pinned.live),
                pinned.__len__,
            )

    # --- flow choice and prefetch --------------------------------------------------------------

    def _targets(self, r: Any) -> tuple[m.Endpoint, ...]:
        """Decode ranks this rank writes data to: from the TransferInfos once all are in, before
        that from the topology the scheduler passed at open."""
        if r.expected_infos and len(r.infos) == r.expected_infos:
            return tuple(sorted(p for p, i in r.infos.items() if not i.dummy))
        return r.receivers

    def _choose_flow(self, r: Any) -> None:
        """Pick the room's flow from the policy, once a decode rank it writes to is registered
        (its Register says what it can receive)."""
        if not r.opened:
            # Decode's TransferInfo can arrive before the local open; the open may name the flow
            # (SenderOpen.flow), so nothing is chosen before it (else ranks disagree on a room).
            return
        targets = self._targets(r)
        known = [self.peers[p] for p in targets if p in self.peers]
        if not known:
            if self._started(r) and not targets:
                r.ledger.flow = Flow.DIRECT  # only dummy links: nothing to stage
            return
        reg = known[0].registration
        r.ledger.flow = self.policy.choose(
            self.pool, known[0].pool, reg.ring_bytes, reg.pinned_bytes, r.flow_override
        )
        if r.ledger.flow.staged:
            for peer in known:
                have = (
                    peer.registration.ring_bytes
                    if r.ledger.flow is Flow.RING
                    else peer.registration.pinned_bytes
                )
                if not have:
                    raise StagingRoomError(
                        f"flow {r.ledger.flow.value}: decode rank {peer.registration.src} registered no "
                        f"{r.ledger.flow.value} region"
                    )

    def _prefetch(self, r: Any) -> None:
        """Create the lanes of every known chunk not yet accepted and ask for their space."""
        if r.ledger.flow is None:
            self._choose_flow(r)
        flow = r.ledger.flow
        # ``flow.staged`` without the property call: every chunk and TransferInfo of a room asks.
        if (flow is not Flow.RING and flow is not Flow.PINNED) or self._is_failed(r):
            return
        targets = self._targets(r)
        asked = False
        for idx in range(r.next_run, len(r.ranges)):
            ts, te = r.ranges[idx]
            if te <= ts or idx in r.ledger.direct_chunks:
                continue  # nothing to stage: it runs direct (notes only, or the fallback)
            for p in targets:
                lane = r.ledger.lanes.get((idx, p))
                if lane is None:
                    if p not in self.peers:
                        continue
                    lane = self._new_lane(r, idx, p, ts, te, len(targets))
                    if lane is None:
                        break  # the chunk falls back to direct
                if lane.state is TxState.ASKING and not r.ledger.asked.get(lane.key):
                    r.ledger.asked[lane.key] = True
                    asked = True
                    self._send(p, self._staging_req(r, lane))
        if asked and ("stg", r.room) not in self.deadlines:
            self.deadlines.set(("stg", r.room), self._now + self.timeouts.heartbeat_interval_ns)

    def _new_lane(self, r: Any, idx: int, p: m.Endpoint, ts: int, te: int, n_targets: int) -> TxLane | None:
        assert r.ledger.flow is not None
        dst = self.peers[p].pool
        g0, n = lane_heads(self.pool, dst)
        lane = TxLane(idx, p, ts, te, r.ledger.flow, g0, n)
        why = self._too_big(lane, dst, n_targets)
        if why:
            if not self.policy.fallback_direct:
                raise StagingRoomError(f"chunk {idx}: {why}")
            self.counters["chunk_fallback_direct"] += 1
            r.ledger.direct_chunks.add(idx)
            return None
        r.ledger.lanes[lane.key] = lane
        for rsp in r.ledger.early_grants.pop(lane.key, []):
            fire(TX_TABLE, lane, TxIn.GRANT, rsp)
        return lane

    def _lane_bytes(self, lane: TxLane) -> int:
        return writer_bytes(self.pool, self.peers[lane.target].pool, lane.token_end - lane.token_start)

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
        reg = self.peers[lane.target].registration
        cap = reg.ring_bytes if lane.flow is Flow.RING else reg.pinned_bytes
        need = decode_alloc_bytes(dst, lane.token_end - lane.token_start)
        if need > cap:
            return f"needs {need} bytes of decode {lane.target}'s {lane.flow.value} region, which holds {cap}"
        return ""

    def _staging_req(self, r: Any, lane: TxLane) -> m.StagingReq:
        return m.StagingReq(
            src=self.endpoint,
            room=r.room,
            transfer_id=r.tid,
            flow=lane.flow.value,  # type: ignore[arg-type]
            chunk_index=lane.index,
            token_start=lane.token_start,
            token_end=lane.token_end,
        )

    def _resend_staging(self, r: Any) -> None:
        """StagingReq (or its answer) may be lost: ask again each heartbeat interval until every
        lane is answered; decode answers a repeat with the same allocation."""
        pending = False
        for key, lane in sorted(r.ledger.lanes.items()):
            if lane.state is TxState.ASKING and r.ledger.asked.get(key) and lane.target in self.peers:
                pending = True
                # Per flow: a ring answers at once, so a ring resend means a lost message; a full
                # pinned pool answers only when space frees, so pinned resends are routine.
                self.counters[f"staging_req_resent_{lane.flow.value}"] += 1
                self._send(lane.target, self._staging_req(r, lane))
        if pending:
            self.deadlines.set(("stg", r.room), self._now + self.timeouts.heartbeat_interval_ns)

    # --- grants and watermarks ------------------------------------------------------------------

    def _h_on_staging_rsp(self, r: Any, inp: Any, rsp: m.StagingRsp) -> None:
        peer = self.peers.get(rsp.src)
        if peer is None or peer.reg_id != rsp.reg:
            self.counters["staging_rsp_stale"] += 1
            return
        if not rsp.ok:
            raise StagingRoomError(f"staging refused by {rsp.src}: {rsp.reason}")
        if rsp.src not in self._targets(r) and rsp.src not in r.receivers:
            raise StagingRoomError(f"staging space from {rsp.src}, which is not a decode rank of the room")
        self._heard_wm((rsp.src, rsp.flow), Watermark(rsp.wm_round, rsp.wm_offset))
        lane = r.ledger.lanes.get((rsp.chunk_index, rsp.src))
        if lane is None:
            if rsp.chunk_index < r.next_run:
                self.counters["staging_rsp_late"] += 1
            else:
                r.ledger.early_grants.setdefault((rsp.chunk_index, rsp.src), []).append(rsp)
            return
        if fire(TX_TABLE, lane, TxIn.GRANT, rsp) == "duplicate":
            self.counters["staging_rsp_duplicate"] += 1
            return
        self._start_ready(r)
        self._wake_stalled()

    def _on_watermark(self, msg: m.Watermark) -> None:
        peer = self.peers.get(msg.src)
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

    def _accept_staged(self, r: Any, c: Any) -> str:
        """The worker hands over the room's next chunk: check it, then let its lanes go."""
        ctx = self._flow_ctx
        start, end = ctx.chunk_bounds(r, c)
        idx = c.chunk_index
        if end > start and idx not in r.ledger.direct_chunks:
            self._prefetch(r)  # every decode rank is known and registered by now
        lanes = [r.ledger.lanes[(idx, p)] for p in self._targets(r) if (idx, p) in r.ledger.lanes]
        if end <= start or idx in r.ledger.direct_chunks or not lanes:
            return registry.halves(Flow.DIRECT).sender.run_chunk(ctx, r, c)  # the fallback, or no bytes
        if len(lanes) != len(self._targets(r)):
            raise StagingRoomError(
                f"chunk {idx}: staging lanes for {len(lanes)} of {len(self._targets(r))} decode ranks"
            )
        if (lanes[0].token_start, lanes[0].token_end) != (start, end):
            raise StagingRoomError(
                f"chunk {idx} covers [{start}, {end}) but asked for space for "
                f"[{lanes[0].token_start}, {lanes[0].token_end})"
            )
        pages = np.asarray(c.src_pages, dtype=np.int64)
        if pages.size * self.pool.page_size < end:
            raise StagingRoomError(f"chunk {idx}: {pages.size} source pages do not cover token {end}")
        r.ledger.pages = pages
        for lane in lanes:
            lane.accepted = True
            lane.is_last = c.is_last
        ctx.advance(r, c, end)
        outcome = ctx.finish_run(r, c, start, end, [])
        self._start_ready(r)
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

    def _describe_lane(self, room_key: tuple[int, str], lane_key: tuple[int, m.Endpoint]) -> str:
        """For a blocked room's reason: who holds what it waits for, and in which state."""
        holder = self.rooms.get(room_key[0])
        lane = holder.ledger.lanes.get(lane_key) if holder is not None and holder.tid == room_key[1] else None
        if lane is None:
            return f"room {room_key[0]} chunk {lane_key[0]} (gone)"
        return f"room {room_key[0]} chunk {lane_key[0]}, {lane.state.name}, {holder.state.value}"

    def _free_halves(self, r: Any, lane: TxLane) -> tuple[int, ...] | None:
        """The halves of the worker's slot for this lane's decode rank that the lane would take:
        one free half if the lane fits in half a slot, else both; None if they are not free."""
        shard, ti = self._worker_of(r), self._target_index(r, lane.target)
        free = [k for k in (0, 1) if (shard, ti, k) not in self.slot_owner]
        if self._lane_bytes(lane) <= self._slot_bytes(len(self._targets(r))) // 2:
            return (free[0],) if free else None
        return (0, 1) if len(free) == 2 else None

    def _worker_of(self, r: Any) -> int:
        return shard_of(r.room, self.num_shards)  # the worker whose queue runs the room's chunks

    def _target_index(self, r: Any, target: m.Endpoint) -> int:
        return self._targets(r).index(target)

    def _buffer_region(self, buffer: tuple[Any, ...]) -> int:
        """Staging region of a lane's buffer: its worker's private one, or the pinned pool."""
        return worker_region(buffer[1]) if buffer[0] == "slot" else PINNED_REGION

    def _start_ready(self, r: Any) -> None:
        """Start every accepted, granted lane of the room whose space and slot are free."""
        if self._is_failed(r):
            return
        blocked = ""
        for _, lane in sorted(r.ledger.lanes.items()):
            if not lane.accepted or lane.state not in (TxState.ASKING, TxState.GRANTED):
                continue
            why = self._blocker(r, lane)
            if not why:
                why = self._start_lane(r, lane)
            if why:
                blocked = blocked or f"chunk {lane.index} to {lane.target}: {why}"
                if lane.index not in r.ledger.deferred:
                    r.ledger.deferred.add(lane.index)
                    self.counters["chunk_deferred"] += 1
                    self._out.append(ChunkDeferred(room=r.room, chunk_index=lane.index, reason=why))
        r.ledger.blocked = blocked
        if blocked:
            self.stalled.add(r.room)
        else:
            self.stalled.discard(r.room)

    def _start_lane(self, r: Any, lane: TxLane) -> str:
        """Take a slot and launch the lane's gather; the reason if no slot is free."""
        n = self._lane_bytes(lane)
        T = lane.token_end - lane.token_start
        hb, regions = self.pool.head_bytes, self.pool.model.num_regions
        if lane.flow is Flow.RING:
            targets = self._targets(r)
            shard = self._worker_of(r)
            ti, slot = self._target_index(r, lane.target), self._slot_bytes(len(targets))
            halves = self._free_halves(r, lane)
            assert halves is not None  # _blocker said a slot is free
            base = ti * slot + halves[0] * (slot // 2)
            buffer = ("slot", shard, *halves)
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
            base = res.offset - (lane.head_start - self.pool.head_start) * regions * T * hb
        smap = staged_map(
            self.pool,
            r.ledger.pages,
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
        r.ledger.ops.add(op)
        fire(TX_TABLE, lane, TxIn.START, op, buffer, smap.staging_base, smap.nbytes)
        self._out.append(
            Gather(op_id=op, room=r.room, staging_region=self._buffer_region(buffer), maps=(smap,))
        )
        return ""

    def _h_on_copy_done(self, r: Any, inp: Any, ev: Any) -> None:
        lane = next((x for x in r.ledger.lanes.values() if x.op_id == ev.op_id), None)
        if lane is None:
            raise StagingRoomError(f"gather {ev.op_id} finished for no lane of the room")
        g = lane.grant
        assert g is not None and lane.buffer is not None
        note = self._flow_ctx.chunk_note(r, lane, lane.token_start, lane.token_end, staged=g.alloc_id)
        wid = self._new_write(r)
        # Where the watermark must pass for this write to be known scattered: the ring slot, or
        # the pinned grant's sequence number.
        position = Watermark(g.round, g.start) if lane.flow is Flow.RING else Watermark(g.round, 0)
        r.ledger.write_lane[wid] = (lane.key, note, position)
        fire(TX_TABLE, lane, TxIn.GATHERED, wid)
        self._out.append(
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

    def _op_finished(self, r: Any, op: int) -> None:
        """Every state: a failed room's gather gives its slot back and posts nothing."""
        r.ledger.ops.discard(op)
        if self._is_failed(r):
            for lane in r.ledger.lanes.values():
                if lane.op_id == op and lane.state is TxState.GATHERING:
                    self._release(r, lane)

    def _write_finished(self, r: Any, wid: int, done: bool) -> None:
        entry = r.ledger.write_lane.pop(wid, None)
        if entry is None:
            return
        key, note, position = entry
        lane = r.ledger.lanes[key]
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
        for room in sorted(self.stalled):
            r = self.rooms.get(room)
            if r is None or self._is_failed(r):
                self.stalled.discard(room)
                continue
            try:
                self._start_ready(r)
            except ProtocolError as exc:  # outside a room handler: fail the room here
                self.counters["room_exception"] += 1
                self.fail(r, RoomFailure(f"{type(exc).__name__}: {exc}", error=exc, at_ns=self._now))
                self._maybe_finish(r)

    # --- lost notes of staged writes --------------------------------------------------------------

    def _await_scatter(self, key: tuple[m.Endpoint, str], position: Watermark, note: bytes) -> None:
        """A staged write is DONE; until decode's watermark passes it, its note may have been
        lost, and a lost note would hold its staging space (and, in a ring, every room behind
        it) until the room's deadline. So the note is resent alone (the bytes are in place) each
        heartbeat interval until confirmed, for at most ``fence_ns``."""
        wm = self.peer_wm.get(key)
        if wm is not None and wm > position:
            return
        self.unconfirmed.setdefault(key, []).append((position, note, self._now + self.timeouts.fence_ns))
        if ("notes", key) not in self.deadlines:
            self.deadlines.set(("notes", key), self._now + self.timeouts.heartbeat_interval_ns)

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
            self.deadlines.cancel(("notes", key))

    def _resend_notes(self, key: tuple[m.Endpoint, str]) -> None:
        self._confirm_notes(key)
        pending = self.unconfirmed.get(key)
        peer = key[0]
        if not pending or peer not in self.peers:
            self.unconfirmed.pop(key, None)
            return
        keep = []
        for position, note, give_up_at in pending:
            if self._now >= give_up_at:
                self.counters["staged_note_gave_up"] += 1
                continue
            keep.append((position, note, give_up_at))
            self.counters["staged_note_resent"] += 1
            self._out.append(SendNotif(peer=peer, room=-1, notif=note))
        if keep:
            self.unconfirmed[key] = keep
            self.deadlines.set(("notes", key), self._now + self.timeouts.heartbeat_interval_ns)
        else:
            del self.unconfirmed[key]

    def _forget_staging_peer(self, peer: m.Endpoint) -> None:
        """A decode rank lost or restarted: its pools start over; old notes mean nothing there."""
        for pool in ("ring", "pinned"):
            self.peer_wm.pop((peer, pool), None)
            self.unconfirmed.pop((peer, pool), None)
            self.deadlines.cancel(("notes", (peer, pool)))

    def staging_in_use(self) -> int:
        """Staging slots, pinned reservations and gathers held; 0 once every room settled."""
        return len(self.slot_owner) + (len(self.pinned) if self.pinned is not None else 0) + len(self.ops)


class StagedChunkSender:
    """The staged flows' prefill half of a chunk run (core/flows/registry.py): the worker hands
    the chunk over and moves on; its lanes wait for space (``ctx.accept_staged``)."""

    __slots__ = ()

    def run_chunk(self, ctx: Any, r: Any, c: Any) -> str:
        if r.token_start:
            raise RoomStateError(f"flow {r.ledger.flow.value} cannot skip decode's prefix hit")
        outcome: str = ctx.accept_staged(r, c)
        return outcome


class StagedNoteReceiver:
    """The staged flows' decode half for a note naming its staging allocation: the decode ledger
    (core/flows/staged_receiver.py, still a part of the receiver engine: ``ctx.staged_note``)."""

    __slots__ = ()

    def on_note(self, ctx: Any, r: Any, prog: Any, note: m.ChunkNote) -> None:
        ctx.staged_note(r, note)


STAGED_SENDER, STAGED_RECEIVER = StagedChunkSender(), StagedNoteReceiver()
registry.register(Flow.RING, STAGED_SENDER, STAGED_RECEIVER)
registry.register(Flow.PINNED, STAGED_SENDER, STAGED_RECEIVER)
