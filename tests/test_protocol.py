"""Protocol end to end over the in-memory harness: topologies, chunking, abort fence, sharding,
failures; and proof that the harness's checks catch the bugs they are meant to catch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvferry.core import messages as m
from kvferry.core.commands import FreePages
from kvferry.core.errors import PlanError
from kvferry.core.events import AbortRoom
from kvferry.core.geometry import Layout
from kvferry.core.kvpoll import KVPoll
from kvferry.core.planner import plan_rank_pair

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H

TOPOLOGIES = [
    (H.TINY, 1, 1, None),
    (H.TINY, 2, 1, None),
    (H.TINY, 1, 2, None),
    (H.TINY, 2, 2, None),
    (H.TINY, 4, 1, None),
    (H.TINY, 1, 4, None),
    (H.TINY, 4, 2, None),
    (H.TINY_MLA, 2, 1, None),
    (H.TINY_MLA, 1, 2, None),
    (H.TINY, 2, 1, 4),
    (H.TINY, 1, 2, 1),
]
ROOMS = [(5, 7, [3, 7]), (6, 4, [4]), (9, 10, [2, 2, 10]), (11, 0, [0])]


def run_rooms(w: H.World, rooms: list[tuple[int, int, list[int]]] = ROOMS) -> list[H.Request]:
    reqs = [w.open_room(room, f"t{room}", n, cuts) for room, n, cuts in rooms]
    w.pump()
    for req in reqs:
        assert req is not None
        for p in range(w.P):
            while w.chunk_ready(req, p):
                pass
    w.heal_and_settle()
    return reqs  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("src_layout", "dst_layout", "p", "d"),
    [(Layout.SGLANG_NHD, Layout.VLLM_HND, 2, 1), (Layout.VLLM_HND, Layout.VLLM_NHD, 1, 2)],
)
def test_layouts_move_every_byte(src_layout: Layout, dst_layout: Layout, p: int, d: int) -> None:
    w = H.World(H.TINY, p, d, prefill_layout=src_layout, decode_layout=dst_layout, page_size=4, seed=9)
    reqs = run_rooms(w)
    assert w.violations == [] and w.internal_errors() == []
    assert all({(r.room, r.tid, i) for i in range(d)} <= w.success_checked for r in reqs)


def final(w: H.World, side: str, req: H.Request) -> list[KVPoll | None]:
    ranks = w.prefill if side == "prefill" else w.decode
    return [w.history.get((side, r.index, req.room, req.tid)) for r in ranks]


@pytest.mark.parametrize(("model", "p", "d", "dps"), TOPOLOGIES, ids=lambda x: getattr(x, "name", str(x)))
def test_every_topology_moves_every_byte(model: Any, p: int, d: int, dps: int | None) -> None:
    w = H.World(model, p, d, decode_page_size=dps, seed=p * 10 + d)
    reqs = run_rooms(w)
    assert w.violations == [] and w.internal_errors() == []
    for req in reqs:
        assert final(w, "decode", req) == [KVPoll.Success] * d
        assert final(w, "prefill", req) == [KVPoll.Success] * p
        assert {(req.room, req.tid, i) for i in range(d)} <= w.success_checked
    # Each (room, sender, receiver, chunk) landed exactly once; dummies wrote nothing.
    assert max(w.effects.values()) == 1
    writers = {src for (_, src, _, _, _) in w.effects}
    if model.is_mla and p > d:
        assert len(writers) == d
    for rank in w.ranks:
        assert rank.engine.rooms == {} and rank.engine.rooms_by_peer == {}
    w.advance(w.ranks[0].engine.tombstones.longest + 1)  # expiries fall on a grid past the ttl
    for rank in w.ranks:
        assert len(rank.engine.tombstones) == 0


def test_harness_catches_chunk_written_at_previous_offset() -> None:
    """The classic bug (chunk offset from its own length) must show up as a byte mismatch."""
    w = H.World(H.TINY, 2, 1, seed=1)
    for r in w.prefill:
        r.engine.planner = lambda s, d, sp, dp, a, b: plan_rank_pair(s, d, sp, dp, 0, b - a)
    run_rooms(w, [(5, 10, [2, 6, 10])])
    assert any("bytes differ" in v for v in w.violations)


def test_harness_catches_pages_freed_before_the_fence() -> None:
    """A decode side that frees pages on abort without waiting for Stopped gets caught."""
    w = H.World(H.TINY, 1, 1, seed=2)
    req = w.open_room(5, "t5", 8, [8])
    w.flush()
    w.chunk_ready(req, 0)
    w.run_worker(0, 5 % 2)
    assert w.fabric.writes
    w.decode[0].driver.feed(AbortRoom(room=5, transfer_id="t5"), w.fabric.now)
    w._free_decode(req, 0)  # what a buggy decode would do: free now
    w.fabric.complete(0)
    assert any("does not own" in v for v in w.violations)


def test_abort_with_writes_in_flight_frees_pages_only_after_stopped() -> None:
    w = H.World(H.TINY, 2, 1, seed=3)
    req = w.open_room(5, "t5", 8, [4, 8])
    w.flush()
    for p in range(2):
        w.chunk_ready(req, p)
        w.run_worker(p, 5 % 2)
    assert len(w.fabric.writes) == 2
    w.abort(req, "decode", 0)
    freed: list[Any] = []
    w.decode[0].driver.on_free_pages = lambda c, cb=w.decode[0].driver.on_free_pages: (freed.append(c), cb(c))
    while w.fabric.pending:  # the Aborts reach both prefill ranks; writes still in flight
        w.deliver(0)
    assert freed == [] and w.decode[0].engine.pages_in_use(5)
    assert w.prefill[0].engine.state(5).value == "failed"
    w.fabric.complete(0)
    w.pump()
    while w.fabric.pending:
        w.deliver(0)
    assert freed == []  # one sender still has a write in flight
    w.fabric.complete(0)
    w.pump()
    while w.fabric.pending:
        w.deliver(0)
    assert [type(c) for c in freed] == [FreePages] and freed[0].reason == "every sender stopped"
    assert w.violations == []


def test_lost_transfer_info_is_resent_until_acknowledged() -> None:
    w = H.World(H.TINY, 1, 1, seed=4)
    req = w.open_room(5, "t5", 4, [4])
    infos = [i for i, x in enumerate(w.fabric.pending) if type(m.decode_control(x.data)) is m.TransferInfo]
    w.fabric.pending.pop(infos[0])
    w.chunk_ready(req, 0)
    w.heal_and_settle()
    assert final(w, "decode", req) == [KVPoll.Success] and final(w, "prefill", req) == [KVPoll.Success]
    assert w.decode[0].engine.counters["info_resent"] >= 1
    assert all(not r.engine.rooms for r in w.ranks) and w.violations == []


def test_transfer_info_never_arriving_fails_both_sides_within_deadlines() -> None:
    w = H.World(H.TINY, 1, 1, seed=4)
    req = w.open_room(5, "t5", 4, [4])
    w.chunk_ready(req, 0)
    t_end = H.TEST_TIMEOUTS.bootstrap_ns + H.TEST_TIMEOUTS.waiting_ns + H.TEST_TIMEOUTS.fence_ns
    while w.fabric.now <= t_end and w.live_rooms_anywhere():
        # The network loses every copy of the TransferInfo, resends included.
        w.fabric.pending = [
            x for x in w.fabric.pending if x.note or type(m.decode_control(x.data)) is not m.TransferInfo
        ]
        w.pump()
        w.release_terminal()
        w.advance(H.TEST_TIMEOUTS.heartbeat_interval_ns)
    w.heal_and_settle()
    assert final(w, "decode", req) == [KVPoll.Failed] and final(w, "prefill", req) == [KVPoll.Failed]
    assert all(not r.engine.rooms for r in w.ranks) and w.violations == []
    assert w.fabric.now <= t_end + 4 * H.TEST_TIMEOUTS.heartbeat_interval_ns


def test_one_rooms_exception_does_not_stop_the_worker_or_other_rooms() -> None:
    w = H.World(H.TINY, 1, 1, num_shards=1, seed=5)
    boom = PlanError("bad pages for room 6")

    def planner(s: Any, d: Any, sp: Any, dp: Any, a: int, b: int) -> Any:
        if np.array_equal(sp, w.live[6].src_pages):
            raise boom
        return plan_rank_pair(s, d, sp, dp, a, b)

    w.prefill[0].engine.planner = planner
    reqs = [w.open_room(room, f"t{room}", 4, [2, 4]) for room in (5, 6, 7)]
    w.flush()
    for req in reqs:
        while w.chunk_ready(req, 0):  # all on the single worker queue, interleaved
            pass
    while w.run_worker(0, 0):
        pass
    failure = w.prefill[0].engine.failure(6)
    assert failure.error is boom and failure.error_type == "PlanError"
    assert w.prefill[0].driver.errors["chunk_skipped"] == 1  # room 6's second chunk
    w.heal_and_settle()
    assert [final(w, "decode", r)[0] for r in reqs] == [KVPoll.Success, KVPoll.Failed, KVPoll.Success]
    assert w.violations == []


def test_refused_post_fails_only_that_room() -> None:
    w = H.World(H.TINY, 1, 1, seed=6)
    t = w.prefill[0].transport
    real = t.post_write

    def post(peer: Any, sr: Any, so: Any, dr: Any, do: Any, ln: Any, notif: bytes) -> Any:
        if m.decode_note(notif).room == 6:
            raise H.FabricError("descriptor outside a region")
        return real(peer, sr, so, dr, do, ln, notif)

    t.post_write = post  # type: ignore[method-assign]
    reqs = run_rooms(w, [(5, 4, [4]), (6, 4, [4])])
    assert [final(w, "decode", r)[0] for r in reqs] == [KVPoll.Success, KVPoll.Failed]
    assert w.prefill[0].driver.errors["PostWrite: FabricError"] == 1


def test_sharding_keeps_a_rooms_chunks_on_one_queue_in_order() -> None:
    w = H.World(H.TINY, 1, 1, num_shards=3, seed=7)
    reqs = [w.open_room(room, f"t{room}", 6, [2, 4, 6]) for room in (3, 4, 5, 6)]
    w.flush()
    for req in reqs:
        while w.chunk_ready(req, 0):
            pass
    queues = w.prefill[0].driver.queues
    for shard, q in enumerate(queues):
        assert all(c.room % 3 == shard for c in q)
        for room in {c.room for c in q}:
            assert [c.chunk_index for c in q if c.room == room] == [0, 1, 2]
    w.heal_and_settle()
    assert all(final(w, "decode", r) == [KVPoll.Success] for r in reqs) and w.violations == []
