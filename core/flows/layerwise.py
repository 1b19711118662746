"""The layer-wise flow, both halves: each layer range's KV leaves the moment the engine reports it
computed, so only the last layer's write remains after the forward pass (vLLM PR 56874's
layer-wise save, LMCache's layer-wise mode).

The engine hands a chunk over when its forward starts (``ChunkReady``: pages and token range
known) and reports layers as they finish (``LayersReady``: layers ``[a, b)`` of chunk N). Prefill
plans the chunk like direct (the planner's descriptors, any TP pair: a region is one layer's K, V
or latent buffer, so a layer's slice of a plan is the descriptors of that layer's regions) and
posts each reported range as one WRITE per decode rank, its note naming the range
(``messages.LayerNote``). A chunk is the room's once every layer of it was posted: only then does
the room advance (``SenderContext.advance``), so the room's last chunk, its aux row and Success
wait for the last layer, never for the last layer's completion alone.

Not composed with the ring or pinned: those stage a whole chunk per writer under one staging
grant (a gather of every layer into one block); a layer's slice would need a grant, a gather and
a scatter per layer, which is a different flow, not a slice of one. Nor with pull (decode READs
offered chunks) or push (leases per chunk): layer-wise is chosen only by override.

Prefill's lane table (one lane per chunk of a room on one prefill rank):

    REPORTED  --LAYERS-->  REPORTED              layers reported before the worker ran the chunk
    REPORTED  --PLAN-->    STREAMING | POSTED    planned; what was reported is posted at once
    STREAMING --LAYERS-->  STREAMING | POSTED    each report posted as it comes
    POSTED    (no input)                         every layer posted: the chunk is the room's

Decode's half counts each layer range of a (sender, chunk) exactly once (a resent note is a
duplicate, an overlapping range a violation); a chunk enters direct's chunk ledger only once all
its layers landed, and the room succeeds as direct's does (every chunk tiled, the aux row).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from kvferry.core import messages as m
from kvferry.core.commands import SendNotif
from kvferry.core.errors import LocalMisuseError
from kvferry.core.events import ChunkReady, LayersReady
from kvferry.core.flows import registry
from kvferry.core.flows.direct import DIRECT, write_command
from kvferry.core.flows.policy import Flow
from kvferry.core.identity_enum import IdentityEnum
from kvferry.core.machine import RoomError, Transition, fire, step
from kvferry.core.worker import ChunkWrite, plan_chunk

__all__ = [
    "LANE_TABLE",
    "LAYERWISE",
    "LayerLane",
    "LayerwiseReceiver",
    "LayerwiseSender",
    "LwIn",
    "LwState",
    "layer_mask",
    "layer_slice",
]


class LwState(IdentityEnum):
    REPORTED = "reported"
    STREAMING = "streaming"
    POSTED = "posted"


class LwIn(IdentityEnum):
    LAYERS = "layers"
    PLAN = "plan"


def layer_mask(first: int, end: int) -> int:
    """Layers ``[first, end)`` as a bit mask."""
    return ((1 << end) - 1) ^ ((1 << first) - 1)


class LayerLane:
    """One chunk of one room on one prefill rank: which layers were reported and posted, and the
    chunk's plan once the worker ran it."""

    __slots__ = ("chunk", "end", "full", "index", "posted", "reported", "start", "state", "writes")

    def __init__(self, index: int, num_layers: int) -> None:
        self.index = index
        self.state = LwState.REPORTED
        self.full = layer_mask(0, num_layers)
        self.reported = 0
        self.posted = 0
        self.chunk: ChunkReady | None = None
        self.start = self.end = 0
        self.writes: list[ChunkWrite] = []

    def _outcome(self) -> str:
        if self.chunk is None:
            return "stay"
        return "complete" if self.reported == self.full else "streaming"

    def _on_layers(self, mask: int) -> str:
        self.reported |= mask
        return self._outcome()

    def _on_plan(self, chunk: ChunkReady, start: int, end: int, writes: list[ChunkWrite]) -> str:
        self.chunk, self.start, self.end, self.writes = chunk, start, end, writes
        if not any(len(w.length) for w in writes):
            self.reported = self.full  # nothing of this chunk moves: no layer to wait for
        return self._outcome()

    def postable(self) -> int:
        """Layers reported, planned and not posted yet."""
        return 0 if self.chunk is None else self.reported & ~self.posted


_R, _S, _P = LwState.REPORTED, LwState.STREAMING, LwState.POSTED
LANE_TABLE: dict[LwState, dict[LwIn, Transition]] = {
    _R: {
        LwIn.LAYERS: step(LayerLane._on_layers, stay=_R),
        LwIn.PLAN: step(LayerLane._on_plan, streaming=_S, complete=_P),
    },
    _S: {LwIn.LAYERS: step(LayerLane._on_layers, streaming=_S, complete=_P)},
    _P: {},
}


def layer_slice(w: ChunkWrite, first: int, end: int, kinds: int) -> ChunkWrite:
    """The descriptors of ``w`` in layers ``[first, end)`` (regions ``layer * kinds + kind``)."""
    region = np.asarray(w.src_region)
    sel = (region >= first * kinds) & (region < end * kinds)
    return ChunkWrite(
        w.peer,
        region[sel],
        np.asarray(w.src_offset)[sel],
        np.asarray(w.dst_region)[sel],
        np.asarray(w.dst_offset)[sel],
        np.asarray(w.length)[sel],
    )


def _runs(mask: int) -> list[tuple[int, int]]:
    """The maximal runs of set bits of ``mask`` as ``[first, end)`` layer ranges."""
    out, layer = [], 0
    while mask:
        if mask & 1:
            first = layer
            while mask & 1:
                mask >>= 1
                layer += 1
            out.append((first, layer))
        else:
            mask >>= 1
            layer += 1
    return out


class LayerwiseSender:
    """Prefill half: the worker's chunk run plans and posts what was reported; each later report
    posts its layers at once. The room's lanes live in the flow's own per-room table
    (``layer_lanes``: room key -> chunk -> lane)."""

    __slots__ = ()

    def run_chunk(self, ctx: Any, r: Any, c: ChunkReady) -> str:
        start, end = ctx.chunk_bounds(r, c)
        writes = plan_chunk(ctx.planner, ctx.pool, c.src_pages, ctx.destinations(r), start, end)
        lane = self._lane(ctx, r, c.chunk_index)
        fire(LANE_TABLE, lane, LwIn.PLAN, c, start, end, writes)
        note = None
        for w in writes:
            if not len(w.length):  # nothing of this chunk for that rank: the chunk's bare note
                note = note or ctx.chunk_note(r, c, start, end)
                ctx.emit(SendNotif(peer=w.peer, room=r.room, notif=note))
        return self._post(ctx, r, lane)

    def on_layers(self, ctx: Any, r: Any, ev: LayersReady) -> str:
        """Record the engine's report; post it if the chunk is planned. A report of layers the
        room has already is counted and skipped; one that breaks the rules is the caller's
        mistake (``LocalMisuseError``: the room is untouched)."""
        num_layers = ctx.pool.model.num_layers
        a, b, idx = ev.first_layer, ev.end_layer, ev.chunk_index
        if not 0 <= a < b <= num_layers:
            raise LocalMisuseError(f"room {r.room}: layers [{a}, {b}) outside the model's {num_layers}")
        if idx < r.next_run:
            ctx.count("duplicate_layers")  # the chunk is posted whole already
            return "stay"
        if idx > r.next_enqueue:
            raise LocalMisuseError(
                f"room {r.room}: layers of chunk {idx} reported before chunk {r.next_enqueue} was handed over"
            )
        lane = self._lane(ctx, r, idx)
        mask = layer_mask(a, b)
        if lane.reported & mask:
            if lane.reported & mask == mask:
                ctx.count("duplicate_layers")
                return "stay"
            raise LocalMisuseError(f"room {r.room}: layers [{a}, {b}) of chunk {idx} overlap a report")
        fire(LANE_TABLE, lane, LwIn.LAYERS, mask)
        if lane.chunk is None:
            return "stay"
        return self._post(ctx, r, lane)

    @staticmethod
    def _lane(ctx: Any, r: Any, idx: int) -> LayerLane:
        table = ctx.room_table("layer_lanes")
        lanes = table.get(r.key)
        if lanes is None:
            lanes = table[r.key] = {}
        lane = lanes.get(idx)
        if lane is None:
            lane = lanes[idx] = LayerLane(idx, ctx.pool.model.num_layers)
        return lane

    def _post(self, ctx: Any, r: Any, lane: LayerLane) -> str:
        """Post every planned, reported, unposted layer range; once all are posted the chunk is
        the room's (it advances and ends like every chunk run: aux row, dummy notes)."""
        c = lane.chunk
        assert c is not None  # only a planned lane posts (the table's STREAMING and POSTED)
        kinds = len(ctx.pool.model.kinds)
        posted: list[int] = []
        for a, b in _runs(lane.postable()):
            note = _encode_layer_note(ctx, r, c, lane.start, lane.end, a, b)
            for w in lane.writes:
                if not len(w.length):
                    continue
                wid = ctx.new_write(r)
                posted.append(wid)
                ctx.emit(write_command(wid, r.room, layer_slice(w, a, b, kinds), note))
            lane.posted |= layer_mask(a, b)
            ctx.count("layer_ranges_posted")
        if lane.state is not LwState.POSTED:
            if posted:
                ctx.count("layers_posted_early")  # ranges that left before the chunk's forward ended
            return "running"
        table = ctx.room_table("layer_lanes")
        lanes = table[r.key]
        del lanes[lane.index]
        if not lanes:
            del table[r.key]
        ctx.advance(r, c, lane.end)
        return ctx.finish_run(r, c, lane.start, lane.end, posted)


def _encode_layer_note(ctx: Any, r: Any, c: ChunkReady, start: int, end: int, a: int, b: int) -> bytes:
    note = m.LayerNote(
        room=r.room,
        transfer_id=r.tid,
        src=ctx.endpoint,
        chunk_index=c.chunk_index,
        token_start=start,
        token_end=end,
        is_last=c.is_last,
        layer_start=a,
        layer_end=b,
    )
    return m.encode(note)


class LayerwiseReceiver:
    """Decode half for layer notes: per (sender, chunk) the layers that landed, each range counted
    once (the flow's per-room table ``layer_notes``: room key -> (sender, chunk) -> [token range,
    layers landed]); a chunk whose every layer landed enters direct's chunk ledger (which tiles
    the room)."""

    __slots__ = ()

    def on_note(self, ctx: Any, r: Any, prog: Any, note: m.LayerNote) -> bool:
        num_layers = ctx.pool.model.num_layers
        idx, rng = note.chunk_index, (note.token_start, note.token_end)
        if note.layer_end > num_layers:
            raise RoomError(f"chunk {idx} from {note.src} names layer {note.layer_end - 1} of {num_layers}")
        seen = prog.chunks.get(idx)
        if seen is not None:
            if seen != rng:
                raise RoomError(f"chunk {idx} from {note.src} arrived twice with ranges {seen} and {rng}")
            ctx.count("duplicate_notification")  # the chunk is whole already
            return False
        table = ctx.room_table("layer_notes")
        lanes = table.get(r.key)
        if lanes is None:
            lanes = table[r.key] = {}
        key = (note.src, idx)
        got = lanes.get(key)
        if got is None:
            got = lanes[key] = [rng, 0]
        elif got[0] != rng:
            raise RoomError(f"layers of chunk {idx} from {note.src} name ranges {got[0]} and {rng}")
        mask = layer_mask(note.layer_start, note.layer_end)
        if got[1] & mask:
            if got[1] & mask != mask:
                raise RoomError(f"layers [{note.layer_start}, {note.layer_end}) of chunk {idx} overlap")
            ctx.count("duplicate_notification")  # a resent note: its layers count once
            return False
        got[1] |= mask
        if got[1] == layer_mask(0, num_layers):
            del lanes[key]
            if not lanes:
                del table[r.key]
            return DIRECT.on_note(ctx, r, prog, note)
        return True


LAYERWISE = LayerwiseReceiver()
registry.register(Flow.LAYERWISE, LayerwiseSender(), LAYERWISE)
