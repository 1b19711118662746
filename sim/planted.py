"""Planted bugs of the staged flows, for proving that the campaign's checks can fail.

Each is a subclass overriding one small method of the real engines, of a flow's component (the
staged flows' halves, core/flows/staged_sender.py and staged_receiver.py, which an engine subclass
composes through its ``staged_class``) or of an allocator, selected by a scenario's ``hooks``
(tests only). What each one breaks, and what should catch it:

- ``ring_keeps_old_head``: an emptied ring keeps its head instead of restarting at 0 in a new
  round, and the watermark is a tail moved only by frees (the upstream ring): after "free
  [0, 60) of 100, assign 70" the writer waits on (round, 60) forever (fault_free, liveness).
- ``drop_early_staging_req``: a StagingReq for a room decode has not opened yet is dropped
  instead of held: the chunk waits for the resend (fault-free runs must never resend).
- ``shared_staging_buffer``: every prefill worker gathers into worker 0's buffer (bytes).
- ``free_staging_before_scatter``: decode frees a chunk's staging space when the scatter starts,
  not when it ends: another chunk's write lands in it before the scatter read it (bytes).
- ``leak_failed_room_staging``: a failed room's staging space is never reclaimed (tables_empty,
  and the ring wedges).

The campaign's blind spots, each caught only with its dimension of the draw space:

- ``silent_truncation``: when the two servers disagree on a room's length, prefill clamps its
  chunks to decode's allocation and decode takes a short delivery as complete: the room ends
  Success with a truncated or padded cache (length; bytes when decode allocated more).
- ``last_note_completes``: decode takes a sender's last chunk note as proof that every chunk
  landed, though earlier chunks may still be in flight (bytes, or a Failed after Success).
- ``late_info_revives_room``: prefill forgets its tombstone when a TransferInfo arrives late
  (a resend or a duplicate after the room was released): the room is created again, times out
  and reports Failed for a room that was Success everywhere (success_stable).
- ``silent_write_failure``: a prefill rank whose write failed fails its room without telling
  decode (no RoomFailed; vLLM's missing PUSH_FAIL): decode waits for its deadline
  (failure_notice).
- ``prefix_front_trim``: on a prefix hit, prefill writes the tokens decode lacks at the front of
  its pages instead of at their own slots (vLLM tracker gap C3: silent corruption upstream); the
  bytes check at decode's Success catches it.
- ``push_lease_never_expires``: prefill's lease registry neither expires leases nor checks their
  deadline before a write: writes go on after decode stopped renewing (lease).
- ``pull_free_early``: a pull room's prefill forgets what it offered as soon as it offered it, so
  it reaches Success and its pages are freed before decode's READ of them ran (ownership: the
  READ's source pages are free or another room's when it lands).

- ``last_layer_write_only``: a layer-wise prefill rank waits only for each chunk's last layer
  write (the last layer's completion taken as the chunk's, and so the room's): an earlier
  layer's write that fails goes unnoticed, and a failed room's fence (Stopped) leaves while
  earlier layers are still in flight, so decode frees pages they then land in (ownership).
  Pinned by tests/scenarios/planted-last-layer-write-only.toml (every room aborted while its
  early layers fly) and campaign seed 292 (48 and 58 too).
- ``layers_after_failure``: a layer-wise prefill rank whose room failed (decode's failure notice,
  its own deadline, a lost peer) still posts the layers its engine goes on reporting for the
  chunk in its forward: a write posted after its Stopped lands in pages decode freed on that
  Stopped (ownership). Caught in the in-memory harness (tests/test_layerwise_fence.py); the
  campaign's forwards end before a failed room's queued writes drain, so its Stopped comes after
  the last layer and no campaign seed of 0-3999 catches it.

The planner (``offset_from_own_length_planner`` below, given to every prefill rank):

- ``chunk_offset_own_length``: a chunk's destination offset computed from its own length, not
  the running total, so chunk N lands on top of chunk N-1 (bytes).

Several servers a side (sim/instances.py; realised in sim/world.py ``_room_links``, not an engine):

- ``links_cache_by_decode``: the scheduler caches who talks to whom per decode server instead of
  per (prefill, decode) server pair, so a room routed to another prefill server than the first
  one that met its decode server gets that first server's ranks as its senders: decode sends its
  TransferInfo to a prefill server that never opened the room (isolation; the room then fails,
  fault_free). With one prefill server it is harmless, so only multi-instance runs can catch it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from kvferry.core import messages as m
from kvferry.core.commands import PostWrite
from kvferry.core.flows import Flow
from kvferry.core.flows.layerwise import LayerwiseSender
from kvferry.core.flows.regions import worker_region
from kvferry.core.flows.staged_receiver import StagedReceiver
from kvferry.core.flows.staged_sender import StagedSender
from kvferry.core.machine import step
from kvferry.core.planner import plan_rank_pair
from kvferry.core.proto_common import RoomError
from kvferry.core.receiver import ReceiverEngine
from kvferry.core.resources import StagingRing, Watermark
from kvferry.core.resources.leases import LeaseIn, LeaseRegistry, LeaseState
from kvferry.core.sender import SENDER_TABLE, SenderEngine, SIn, SState

__all__ = ["offset_from_own_length_planner", "receiver_class", "sender_class"]


class _StaleTailRing(StagingRing):
    """The upstream ring: the watermark is a tail pointer updated only when an allocation is
    freed, and an emptied ring keeps its old head (no new round)."""

    def __init__(self, capacity: int, align: int = 1) -> None:
        super().__init__(capacity, align)
        self._tail = Watermark(0, 0)

    def _restart(self) -> None:
        pass

    def free(self, alloc_id: int) -> None:
        super().free(alloc_id)
        self._tail = super().watermark()

    def watermark(self) -> Watermark:
        return self._tail


class _StaleHeadStaged(StagedReceiver):
    def _new_ring(self, capacity: int) -> StagingRing:
        ring = super()._new_ring(capacity)
        return _StaleTailRing(ring.capacity, ring.align)


class _DropEarlyStaged(StagedReceiver):
    def on_staging_req(self, req: m.StagingReq) -> None:
        r = self.ctx.room(req.room)
        if r is None or r.tid != req.transfer_id:
            self.counters["planted_dropped_staging_req"] += 1
            return
        super().on_staging_req(req)


class _EarlyFreeStaged(StagedReceiver):
    def _start_scatter(self, r: Any, ch: Any) -> None:
        super()._start_scatter(r, ch)
        self._free_alloc(ch)
        self._space_freed()

    def _free_alloc(self, ch: Any) -> None:
        res = self.ring if ch.alloc.__class__.__name__ == "RingSlot" else self.pinned
        if res is not None and ch.alloc_id in res.live:
            super()._free_alloc(ch)


class _LeakyStaged(StagedReceiver):
    def reclaim(self, r: Any) -> None:
        pass


class _SharedBufferStaged(StagedSender):
    def _buffer_region(self, buffer: tuple[Any, ...]) -> int:
        return worker_region(0) if buffer[0] == "slot" else super()._buffer_region(buffer)


def _receiver_with(staged: type[StagedReceiver]) -> type[ReceiverEngine]:
    """The real decode engine composing a planted staged half."""
    return type(f"Planted{staged.__name__}Receiver", (ReceiverEngine,), {"staged_class": staged})


def _sender_with(staged: type[StagedSender]) -> type[SenderEngine]:
    """The real prefill engine composing a planted staged half."""
    return type(f"Planted{staged.__name__}Sender", (SenderEngine,), {"staged_class": staged})


class _TruncatingSender(SenderEngine):
    # The truncation lives in _chunk_bounds: the transition table calls SenderEngine's own chunk
    # handler, so an override of _h_on_chunk here would never run.
    def _chunk_bounds(self, r: Any, c: Any) -> tuple[int, int]:
        if c.token_end > r.num_tokens:
            c = _with_end(c, r.num_tokens)
        if not (c.is_last and c.token_end < r.num_tokens):
            return super()._chunk_bounds(r, c)
        full, r.num_tokens = r.num_tokens, c.token_end  # the short last chunk passes as the end
        try:
            return super()._chunk_bounds(r, c)
        finally:
            r.num_tokens = full


def _with_end(c: Any, end: int) -> Any:
    import msgspec

    return msgspec.structs.replace(c, token_end=end)


class _TruncatingReceiver(ReceiverEngine):
    def _record_chunk(self, r: Any, prog: Any, note: m.ChunkNote) -> bool:
        try:
            return super()._record_chunk(r, prog, note)
        except RoomError as exc:
            if "delivered" not in str(exc):
                raise
            prog.done = True  # a short delivery taken as the whole room
            return True


class _LastNoteReceiver(ReceiverEngine):
    def _record_chunk(self, r: Any, prog: Any, note: m.ChunkNote) -> bool:
        news = super()._record_chunk(r, prog, note)
        if note.is_last:
            prog.done = True
        return news


class _ForgetfulSender(SenderEngine):
    def _on_info(self, msg: m.TransferInfo) -> None:
        if self.tombstones.get(msg.room, msg.transfer_id) is not None and msg.room not in self.rooms:
            self.tombstones._by_key.pop((msg.room, msg.transfer_id), None)
        super()._on_info(msg)


_RECEIVERS = {
    "ring_keeps_old_head": _receiver_with(_StaleHeadStaged),
    "drop_early_staging_req": _receiver_with(_DropEarlyStaged),
    "free_staging_before_scatter": _receiver_with(_EarlyFreeStaged),
    "leak_failed_room_staging": _receiver_with(_LeakyStaged),
    "silent_truncation": _TruncatingReceiver,
    "last_note_completes": _LastNoteReceiver,
}


class _PullFreeEarlySender(SenderEngine):
    def _run_flow(self, r: Any, c: Any, flow: Any) -> str:
        outcome = super()._run_flow(r, c, flow)
        if flow is not Flow.PULL:
            return outcome
        self.pull.owed.pop(r.key, None)  # the pages count as free while decode still READs them
        return "done" if self._quiet(r) else "running"


class _LastLayerOnlySender(SenderEngine):
    def _untrack_early_layers(self, r: Any, outcome: str) -> str:
        last = self.pool.model.num_layers
        for cmd in self._out:  # the step's commands so far (held by the table engine)
            early = type(cmd) is PostWrite and 0 < m.decode_layer_note(cmd.notif).layer_end < last
            if early and cmd.write_id in r.inflight:
                r.inflight.discard(cmd.write_id)
                self.writes.pop(cmd.write_id, None)  # its completion is an unknown write
        return "done" if outcome == "running" and self._quiet(r) else outcome

    def _run_flow(self, r: Any, c: Any, flow: Any) -> str:
        return self._untrack_early_layers(r, super()._run_flow(r, c, flow))

    def _h_on_layers(self, r: Any, inp: Any, ev: Any) -> str:
        return self._untrack_early_layers(r, super()._h_on_layers(r, inp, ev))


# The table holds the base class's handlers themselves, so an override is only called through
# its own rows: the live rows' layer reports (which post the early layers during the forward)
# take the planted handler, or only a chunk whose layers all wait for its run would be planted.
_BASE_LAYERS = SenderEngine._h_on_layers
_LastLayerOnlySender.TABLE = {
    st: {
        inp: step(_LastLayerOnlySender._h_on_layers, **tr.next) if tr.handler is _BASE_LAYERS else tr
        for inp, tr in row.items()
    }
    for st, row in SENDER_TABLE.items()
}


class _LayersAfterFailureSender(SenderEngine):
    def _h_post_failed_layers(self, r: Any, inp: Any, payload: Any) -> str:
        if r.flow is Flow.LAYERWISE:
            LayerwiseSender().on_layers(self.flows.ctx, r, payload)  # posted as if the room lived
        return "stay"


# The table's Failed row takes layer reports as a live room's does.
_LayersAfterFailureSender.TABLE = {
    **SENDER_TABLE,
    SState.FAILED: {
        **SENDER_TABLE[SState.FAILED],
        SIn.LAYERS: step(_LayersAfterFailureSender._h_post_failed_layers, stay=SState.FAILED),
    },
}


class _SilentWriteFailureSender(SenderEngine):
    def _tell_failure(self, r: Any, failure: Any, tell: Any) -> None:
        if not failure.reason.startswith("write failed"):
            super()._tell_failure(r, failure, tell)


class _FrontTrimSender(SenderEngine):
    # Any flow's chunk run (only direct and push rooms run with a prefix hit; pull reads no dests).
    def _run_flow(self, r: Any, c: Any, flow: Any) -> str:
        if not r.token_start:
            return super()._run_flow(r, c, flow)
        saved = dict(r.decode.dests)
        for p, pages in saved.items():
            shift = max(1, r.token_start // self.peers[p].pool.page_size)
            r.decode.dests[p] = np.roll(pages, shift)  # token token_start lands near slot 0
        try:
            return super()._run_flow(r, c, flow)
        finally:
            r.decode.dests = saved


class _NeverExpiringLeases(LeaseRegistry):
    """Expiry is never noticed: no tick expires a lease and ``post`` ignores the deadline."""

    def tick(self, now: int) -> list[Any]:
        for lease in list(self.leases.values()):
            if lease.state is LeaseState.WAITING and lease.watchdog <= now:
                self._step(lease, LeaseIn.WATCHDOG, now)
        return self._drain()

    def next_deadline(self) -> int | None:
        times = [x.watchdog for x in self.leases.values() if x.state is LeaseState.WAITING]
        return min(times) if times else None

    def post(self, transfer_id: str, request_id: str, now: int) -> Any:
        lease = self._matched(transfer_id, request_id)
        if lease.state is not LeaseState.MATCHED:
            return None
        lease.inflight += 1
        return lease.reg


class _LeaseNeverExpiresSender(SenderEngine):
    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        old = self.leases
        self.leases = _NeverExpiringLeases(old.lease_ns, old.match_ns, tombstone_ns=old.tombstone_ns)


class _GreedySuffixSender(SenderEngine):
    """Request-id matching strips everything after the first dash, not only the retry suffix:
    every request of a run shares one base id, and a finish pairs with any lone registration."""

    push_base_id = staticmethod(lambda request_id: request_id.split("-")[0])


_SENDERS = {
    "silent_truncation": _TruncatingSender,
    "late_info_revives_room": _ForgetfulSender,
    "push_lease_never_expires": _LeaseNeverExpiresSender,
    "prefix_front_trim": _FrontTrimSender,
    "silent_write_failure": _SilentWriteFailureSender,
    "shared_staging_buffer": _sender_with(_SharedBufferStaged),
    "pull_free_early": _PullFreeEarlySender,
    "suffix_strips_too_much": _GreedySuffixSender,
    "last_layer_write_only": _LastLayerOnlySender,
    "layers_after_failure": _LayersAfterFailureSender,
}


def sender_class(hooks: frozenset[str]) -> type[SenderEngine]:
    picked = [cls for hook, cls in _SENDERS.items() if hook in hooks]
    if len(picked) > 1:
        raise ValueError(f"one planted prefill bug at a time, got {sorted(hooks)}")
    return picked[0] if picked else SenderEngine


def receiver_class(hooks: frozenset[str]) -> type[ReceiverEngine]:
    picked = [cls for hook, cls in _RECEIVERS.items() if hook in hooks]
    if len(picked) > 1:
        raise ValueError(f"one planted decode bug at a time, got {sorted(hooks)}")
    return picked[0] if picked else ReceiverEngine


def offset_from_own_length_planner() -> Any:
    """Planted bug: a chunk's destination offset computed from its own length, not the running total.

    Chunk N then lands one chunk-length early, on top of chunk N-1 (the upstream bug). Realised by
    rotating the destination page list, so the real planner places tokens ``n`` tokens too early.
    """

    def planner(src_pool: Any, dst_pool: Any, src_pages: Any, dst_pages: Any, start: int, end: int) -> Any:
        dp = np.asarray(dst_pages, dtype=np.int64)
        if start > 0 and end > start:
            dp = np.roll(dp, max(1, (end - start) // dst_pool.page_size))
        return plan_rank_pair(src_pool, dst_pool, src_pages, dp, start, end)

    return planner
