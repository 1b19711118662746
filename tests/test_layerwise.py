"""The layer-wise flow (core/flows/layerwise.py) through the room machines in the in-memory harness,
and its lane table and decode ledger under hypothesis.

The harness's byte check runs at decode's Success: a room that succeeded before a layer landed
fails it. Each test reports layers one at a time and checks decode is not Success before the last
layer of the last chunk was reported.
"""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvferry.core import messages as m
from kvferry.core.commands import PostWrite
from kvferry.core.errors import LocalMisuseError
from kvferry.core.events import ChunkReady, LayersReady
from kvferry.core.flows import Flow
from kvferry.core.flows.layerwise import (
    LANE_TABLE,
    LayerLane,
    LayerwiseReceiver,
    LayerwiseSender,
    LwIn,
    LwState,
    layer_mask,
)
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.core.machine import IllegalStep, RoomError, fire
from kvferry.core.planner import plan_rank_pair
from kvferry.core.worker import Destination

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H

LW = Flow.LAYERWISE.value
MODEL = ModelGeometry("tiny4l", num_layers=4, num_kv_heads=4, head_dim=4)


def _report(w: H.World, req: H.Request, p: int, chunk: int, a: int, b: int) -> None:
    ev = LayersReady(room=req.room, transfer_id=req.tid, chunk_index=chunk, first_layer=a, end_layer=b)
    w.prefill[p].driver.feed(ev, w.fabric.now)


def _decode_status(w: H.World, req: H.Request) -> list[KVPoll | None]:
    return [w.rank_status(rank, req) for rank in w.decode]


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 1), (1, 2), (2, 4)])
def test_layers_stream_and_the_room_succeeds_only_after_the_last(p: int, d: int) -> None:
    w = H.World(MODEL, p, d, flow=LW, seed=p * 10 + d)
    cuts = [3, 7, 10]
    reqs = [w.open_room(100 + i, f"t{i}", 10, cuts) for i in range(2)]
    assert all(req is not None for req in reqs)
    w.flush()
    for chunk in range(len(cuts)):
        for req in reqs:
            assert req is not None
            for rank in range(p):
                w.chunk_ready(req, rank)  # the chunk's forward starts
        w.flush()
        for layer in range(MODEL.num_layers):
            for req in reqs:
                assert req is not None
                for rank in range(p):
                    _report(w, req, rank, chunk, layer, layer + 1)
            w.flush()
            last = chunk == len(cuts) - 1 and layer == MODEL.num_layers - 1
            if not last:
                for req in reqs:
                    assert req is not None
                    assert KVPoll.Success not in _decode_status(w, req)
    w.heal_and_settle()
    assert w.violations == [] and w.internal_errors() == []
    for req in reqs:
        assert req is not None
        assert w.server_view[("decode", req.room, req.tid)] is KVPoll.Success
        assert w.server_view[("prefill", req.room, req.tid)] is KVPoll.Success
        assert all((req.room, req.tid, i) in w.success_checked for i in range(d))
    early = sum(r.engine.counters["layers_posted_early"] for r in w.prefill)
    assert early == len(reqs) * p * len(cuts) * (MODEL.num_layers - 1)  # every layer but the last
    assert all(r.engine.rooms == {} for r in w.ranks)


def test_layers_reported_before_the_room_is_ready_post_when_the_chunk_runs() -> None:
    w = H.World(MODEL, 1, 1, flow=LW, seed=3)
    req = w.open_room(7, "t", 8, [8], decode_late=True)
    assert req is not None
    w.chunk_ready(req, 0)
    _report(w, req, 0, 0, 0, 2)
    _report(w, req, 0, 0, 2, 4)
    w.flush()
    assert w.rank_status(w.prefill[0], req) is KVPoll.Bootstrapping  # decode not open yet
    w.open_decode(req)
    w.heal_and_settle()
    assert w.violations == [] and w.server_view[("decode", 7, "t")] is KVPoll.Success
    assert w.prefill[0].engine.counters["layers_posted_early"] == 0  # all posted at the run


def test_writes_landing_in_reverse_order_still_need_every_layer() -> None:
    w = H.World(MODEL, 1, 1, flow=LW, seed=5)
    req = w.open_room(9, "t", 12, [12])
    assert req is not None
    w.flush()
    w.chunk_ready(req, 0)
    w.flush()
    for layer in range(MODEL.num_layers):
        _report(w, req, 0, 0, layer, layer + 1)
        while w.prefill[0].driver.queues[0] or w.prefill[0].driver.queues[1]:
            w.flush()
    # The last layer's write (and the aux row) land first; the earlier layers still fly.
    while w.fabric.writes:
        w.fabric.complete(len(w.fabric.writes) - 1)
        w.pump()
        while w.fabric.pending:
            w.deliver(0)
        if w.fabric.writes:
            assert _decode_status(w, req) != [KVPoll.Success]
    w.heal_and_settle()
    assert w.violations == [] and w.server_view[("decode", 9, "t")] is KVPoll.Success


def test_a_repeated_report_is_counted_and_a_bad_one_is_the_callers_mistake() -> None:
    w = H.World(MODEL, 1, 1, flow=LW, seed=1)
    req = w.open_room(3, "t", 6, [3, 6])
    assert req is not None
    w.flush()
    w.chunk_ready(req, 0)
    w.flush()
    _report(w, req, 0, 0, 0, 2)
    _report(w, req, 0, 0, 0, 2)
    assert w.prefill[0].engine.counters["duplicate_layers"] == 1
    with pytest.raises(LocalMisuseError, match="overlap"):
        _report(w, req, 0, 0, 1, 3)
    with pytest.raises(LocalMisuseError, match="outside"):
        _report(w, req, 0, 0, 3, 9)
    with pytest.raises(LocalMisuseError, match="before chunk"):
        _report(w, req, 0, 5, 0, 1)
    _report(w, req, 0, 0, 2, 4)
    w.chunk_ready(req, 0)
    w.flush()
    _report(w, req, 0, 1, 0, 4)
    _report(w, req, 0, 0, 0, 4)  # chunk 0 is whole already
    w.heal_and_settle()
    assert w.violations == [] and w.server_view[("decode", 3, "t")] is KVPoll.Success


def test_another_flow_ignores_layer_reports() -> None:
    w = H.World(MODEL, 1, 1, flow="direct", seed=2)
    req = w.open_room(4, "t", 5, [5])
    assert req is not None
    w.flush()
    _report(w, req, 0, 0, 0, 4)
    w.chunk_ready(req, 0)
    w.heal_and_settle()
    assert w.prefill[0].engine.counters["layers_ignored"] == 1
    assert w.server_view[("decode", 4, "t")] is KVPoll.Success


def test_an_abort_mid_stream_fails_both_sides() -> None:
    w = H.World(MODEL, 1, 1, flow=LW, seed=4)
    req = w.open_room(5, "t", 9, [9])
    assert req is not None
    w.flush()
    w.chunk_ready(req, 0)
    w.flush()
    _report(w, req, 0, 0, 0, 1)
    w.flush()
    w.abort(req, "prefill", 0)
    _report(w, req, 0, 0, 1, 4)  # the engine goes on computing: absorbed by Failed
    w.heal_and_settle()
    assert w.violations == []
    assert w.server_view[("decode", 5, "t")] is KVPoll.Failed
    assert w.server_view[("prefill", 5, "t")] is KVPoll.Failed


# --- the lane table and the decode ledger, alone -----------------------------------------------

POOL_SRC = PoolGeometry(MODEL, 1, 0, 4, 16)
POOL_DST = PoolGeometry(MODEL, 1, 0, 2, 32)
PEER = m.Endpoint("decode", 0)


class _Ctx:
    """The SenderContext a prefill half sees, over one room and one decode rank, recording what
    the half emits and when the room advances."""

    endpoint = m.Endpoint("prefill", 0)
    pool = POOL_SRC
    planner = staticmethod(plan_rank_pair)

    def __init__(self) -> None:
        self.out: list[Any] = []
        self.counts: Counter[str] = Counter()
        self.advanced: list[int] = []
        self.finished: list[int] = []
        self.next_id = 1
        self.tables: dict[str, dict[Any, Any]] = {}

    def now(self) -> int:
        return 0

    def count(self, what: str) -> None:
        self.counts[what] += 1

    def room_table(self, name: str) -> dict[Any, Any]:
        return self.tables.setdefault(name, {})

    def chunk_bounds(self, r: Any, c: ChunkReady) -> tuple[int, int]:
        return r.tokens_done, c.token_end

    def destinations(self, r: Any) -> list[Destination]:
        return [Destination(PEER, POOL_DST, np.arange(8, dtype=np.int64), False)]

    def chunk_note(self, r: Any, c: Any, start: int, end: int, **kind: Any) -> bytes:
        return b"note"

    def new_write(self, r: Any) -> int:
        self.next_id += 1
        return self.next_id

    def emit(self, cmd: Any) -> None:
        self.out.append(cmd)

    def advance(self, r: Any, c: ChunkReady, end: int) -> None:
        self.advanced.append(c.chunk_index)
        r.next_run += 1
        r.tokens_done = end

    def finish_run(self, r: Any, c: ChunkReady, start: int, end: int, posted: list[int]) -> str:
        self.finished.append(c.chunk_index)
        return "running"


class _Room:
    def __init__(self) -> None:
        self.room, self.tid = 1, "t"
        self.key = (self.room, self.tid)
        self.next_run = self.tokens_done = 0
        self.next_enqueue = 1


def _partition(draw: Any, n: int) -> list[tuple[int, int]]:
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)))
    edges = [0, *cuts, n]
    ranges = list(itertools.pairwise(edges))
    return draw(st.permutations(ranges))


@st.composite
def _schedules(draw: Any) -> tuple[list[tuple[int, int]], int, list[int]]:
    ranges = _partition(draw, MODEL.num_layers)
    plan_at = draw(st.integers(0, len(ranges)))
    dups = draw(st.lists(st.integers(0, len(ranges) - 1), max_size=3))
    return ranges, plan_at, dups


@settings(max_examples=150, deadline=None)
@given(_schedules(), st.integers(1, 12))
def test_every_layer_is_posted_exactly_once_and_the_chunk_advances_once(sched: Any, tokens: int) -> None:
    ranges, plan_at, dups = sched
    ctx, r, half = _Ctx(), _Room(), LayerwiseSender()
    chunk = ChunkReady(
        room=1, transfer_id="t", chunk_index=0, token_end=tokens, src_pages=np.arange(4), is_last=True
    )
    reports = list(ranges)
    for i in dups:
        reports.insert(min(len(reports), i + 1), ranges[i])  # a repeat after its first report
    events: list[Any] = [*reports]
    events.insert(min(plan_at, len(events)), chunk)
    for ev in events:
        if ev is chunk:
            half.run_chunk(ctx, r, chunk)
        else:
            a, b = ev
            lr = LayersReady(room=1, transfer_id="t", chunk_index=0, first_layer=a, end_layer=b)
            half.on_layers(ctx, r, lr)
    # Every layer's descriptors left exactly once, in one of the reported ranges.
    regions: Counter[int] = Counter()
    for cmd in ctx.out:
        assert type(cmd) is PostWrite
        note = m.decode_layer_note(cmd.notif)
        assert note.layer_end > note.layer_start >= 0 and note.is_last
        assert all(note.layer_start * 2 <= g < note.layer_end * 2 for g in np.asarray(cmd.src_region))
        regions.update(int(g) for g in np.asarray(cmd.src_region))
    full = plan_rank_pair(POOL_SRC, POOL_DST, np.arange(4), np.arange(8, dtype=np.int64), 0, tokens)
    assert regions == Counter(int(g) for g in np.asarray(full.src_region))
    assert ctx.advanced == [0] and ctx.finished == [0] and ctx.tables == {"layer_lanes": {}}
    assert ctx.counts["duplicate_layers"] == len(dups)


def test_the_lane_table_refuses_what_it_does_not_list() -> None:
    lane = LayerLane(0, 4)
    c = ChunkReady(room=1, transfer_id="t", chunk_index=0, token_end=0, src_pages=(), is_last=True)
    assert fire(LANE_TABLE, lane, LwIn.PLAN, c, 0, 0, []) == "complete"
    assert lane.state is LwState.POSTED  # nothing moves: no layer to wait for
    with pytest.raises(IllegalStep):
        fire(LANE_TABLE, lane, LwIn.LAYERS, layer_mask(0, 1))
    with pytest.raises(IllegalStep):
        fire(LANE_TABLE, lane, LwIn.PLAN, c, 0, 0, [])


class _Prog:
    def __init__(self) -> None:
        self.chunks: dict[int, tuple[int, int]] = {}
        self.last_index = -1
        self.done = False


class _RxRoom:
    num_tokens = 40
    token_start = 0
    key = (1, "t")


class _RxCtx(_Ctx):
    pool = POOL_DST

    def count(self, what: str) -> None:
        self.counts[what] += 1


def _note(chunk: int, a: int, b: int, start: int, end: int, last: bool) -> m.LayerNote:
    return m.LayerNote(
        room=1,
        transfer_id="t",
        src=m.Endpoint("prefill", 0),
        chunk_index=chunk,
        token_start=start,
        token_end=end,
        is_last=last,
        layer_start=a,
        layer_end=b,
    )


class DecodeLedger(RuleBasedStateMachine):
    """Layer notes of two chunks arrive in any order, some twice: a chunk enters the ledger only
    once all its layers landed, each range counts once, and the room is done only at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.half, self.ctx, self.prog, self.room = LayerwiseReceiver(), _RxCtx(), _Prog(), _RxRoom()
        self.landed: dict[int, int] = {0: 0, 1: 0}
        self.sent: list[tuple[int, int, int]] = []
        self.dups = 0

    @rule(chunk=st.integers(0, 1), layer=st.integers(0, MODEL.num_layers - 1))
    def land(self, chunk: int, layer: int) -> None:
        start, end = (0, 25) if chunk == 0 else (25, 40)
        note = _note(chunk, layer, layer + 1, start, end, chunk == 1)
        before = self.landed[chunk]
        news = self.half.on_note(self.ctx, self.room, self.prog, note)
        duplicate = bool(before & layer_mask(layer, layer + 1)) or before == layer_mask(0, MODEL.num_layers)
        self.dups += duplicate
        assert news is not duplicate  # the half says whether the note was news, as it counts it
        self.landed[chunk] |= layer_mask(layer, layer + 1)

    @precondition(lambda self: self.landed[0] == 0)
    @rule()
    def overlapping_range_is_a_violation(self) -> None:
        self.half.on_note(self.ctx, self.room, self.prog, _note(0, 0, 2, 0, 25, False))
        with pytest.raises(RoomError, match="overlap"):
            self.half.on_note(self.ctx, self.room, self.prog, _note(0, 1, 3, 0, 25, False))
        self.landed[0] |= layer_mask(0, 2)

    @invariant()
    def chunk_recorded_only_when_every_layer_landed(self) -> None:
        full = layer_mask(0, MODEL.num_layers)
        for chunk, mask in self.landed.items():
            assert (chunk in self.prog.chunks) == (mask == full)
        assert self.prog.done == all(mask == full for mask in self.landed.values())
        assert self.ctx.counts["duplicate_notification"] == self.dups


TestDecodeLedger = DecodeLedger.TestCase
TestDecodeLedger.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


class _LastLayerReceiver(H.ReceiverEngine):
    """A decode half that takes a chunk's last layer note as the whole chunk's (the earlier
    layers' writes may still be in flight)."""

    def _layer_note(self, r: Any, prog: Any, note: m.LayerNote) -> bool:
        news = super()._layer_note(r, prog, note)
        if note.layer_end == self.pool.model.num_layers and note.chunk_index not in prog.chunks:
            self.flows.ctx.room_table("layer_notes").get(r.key, {}).pop((note.src, note.chunk_index), None)
            return self._record_chunk(r, prog, note)
        return news


def test_the_byte_check_catches_a_last_layer_taken_as_the_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the simulator cannot reorder (one NIC's writes land in post order there), the harness
    can: the last layer's write lands first, and a decode that trusts it succeeds on wrong bytes."""
    monkeypatch.setattr(H, "ReceiverEngine", _LastLayerReceiver)
    w = H.World(MODEL, 1, 1, flow=LW, seed=5)
    req = w.open_room(9, "t", 12, [12])
    assert req is not None
    w.flush()
    w.chunk_ready(req, 0)
    w.flush()
    for layer in range(MODEL.num_layers):
        _report(w, req, 0, 0, layer, layer + 1)
    while w.fabric.writes:
        w.fabric.complete(len(w.fabric.writes) - 1)
        w.pump()
        while w.fabric.pending:
            w.deliver(0)
    assert any("bytes differ" in v for v in w.violations), w.violations
