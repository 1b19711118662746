"""The pull flow: decode READs prefill's pages, then lets prefill free them.

Over the in-memory harness (every READ is checked against page ownership on both sides when it
lands, and the bytes at every decode Success) and over the simulator (heterogeneous TP, the
planted early free caught with a seed that replays it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvferry.core import messages as m
from kvferry.core.events import AbortRoom
from kvferry.core.flows import Flow
from kvferry.core.geometry import ModelGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.core.sender import SState
from kvferry.sim import scenario as sc
from kvferry.sim.campaign import campaign, first_failing, run_one, save_failure
from msgspec.structs import replace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H

ROOT = Path(__file__).resolve().parent.parent
HETERO = ROOT / "scenarios" / "heterogeneous-tp.toml"
TINY4 = ModelGeometry("tiny4", num_layers=2, num_kv_heads=4, head_dim=4)
PAIRS = [(TINY4, 1, 1), (TINY4, 2, 1), (TINY4, 1, 2), (TINY4, 4, 2), (TINY4, 2, 4), (H.TINY_MLA, 2, 1)]


def _clean(w: H.World) -> None:
    assert w.violations == [] and w.internal_errors() == []
    for r in w.ranks:
        assert r.engine.rooms == {} and r.driver.handles == {}
    for r in w.decode:
        assert r.engine.pull_rx.reads == {} and r.engine.pull_rx.rooms == {}
    for r in w.prefill:
        assert not r.engine.pull.offers.entries


def _room(w: H.World, room: int, tokens: int, cuts: list[int]) -> H.Request:
    req = w.open_room(room, f"t{room}", tokens, cuts)
    assert req is not None
    w.flush()
    return req


@pytest.mark.parametrize(("model", "p", "d"), PAIRS)
def test_pull_moves_every_byte(model: ModelGeometry, p: int, d: int) -> None:
    w = H.World(model, p, d, flow="pull", seed=p * 10 + d, decode_page_size=4 if d == 2 else None)
    reqs = [_room(w, 100 + i, 10, [3, 6, 9, 10]) for i in range(4)]
    for _ in range(4):
        for req in reqs:
            for i in range(p):
                w.chunk_ready(req, i)
        w.flush()
    w.heal_and_settle()
    for req in reqs:
        assert w.server_view[("decode", req.room, req.tid)] is KVPoll.Success
        assert w.server_view[("prefill", req.room, req.tid)] is KVPoll.Success
        assert all((req.room, req.tid, i) in w.success_checked for i in range(d))  # bytes compared
    assert sum(r.engine.counters["read_notif"] for r in w.prefill) > 0  # decode READ, prefill wrote none
    _clean(w)


def _offered_and_read_posted(w: H.World) -> H.Request:
    """One room, one chunk, pull: the offer reached decode and its READ is posted, not finished
    (prefill's aux-row write is done)."""
    req = _room(w, 7, 8, [8])
    w.chunk_ready(req, 0)
    for _ in range(10):
        while w.fabric.pending:
            w.deliver(0)
        while w.run_worker(0, 0):
            pass
        for i in reversed(range(len(w.fabric.writes))):
            if not w.fabric.writes[i].read:
                w.fabric.complete(i)
        w.pump()
        if any(x.read for x in w.fabric.writes):
            break
    reads = [x for x in w.fabric.writes if x.read]
    assert len(reads) == 1
    return req


def test_prefill_holds_its_pages_until_pulled() -> None:
    w = H.World(TINY4, 1, 1, flow="pull", num_shards=1)
    req = _offered_and_read_posted(w)
    eng = w.prefill[0].engine
    assert eng.rooms[req.room].state is SState.TRANSFERRING  # waits for Pulled, whatever the aux
    w.fabric.complete(next(i for i, x in enumerate(w.fabric.writes) if x.read))
    w.pump()
    w.flush()
    assert w.server_view[("decode", req.room, req.tid)] is KVPoll.Success
    assert eng.poll(req.room) is KVPoll.Success
    w.heal_and_settle()
    _clean(w)


def test_failed_prefill_frees_only_after_decode_stopped_reading() -> None:
    w = H.World(TINY4, 1, 1, flow="pull", num_shards=1)
    req = _offered_and_read_posted(w)
    eng = w.prefill[0].engine
    w.prefill[0].driver.feed(AbortRoom(room=req.room, transfer_id=req.tid, reason="test"), w.fabric.now)
    w.release(req, "prefill", 0)
    assert eng.poll(req.room) is KVPoll.Failed
    assert req.room in eng.rooms  # decode may be reading: the pages are not ours to free yet
    # Decode hears the failure while its READ runs: it keeps its own pages and says nothing yet.
    for _ in range(5):
        while w.fabric.pending:
            w.deliver(0)
    assert req.room in eng.rooms
    dec = w.decode[0].engine
    assert dec.pull_rx.reading(dec.rooms[req.room])
    w.fabric.complete(next(i for i, x in enumerate(w.fabric.writes) if x.read))
    w.pump()
    while w.fabric.pending:
        w.deliver(0)
    assert req.room not in eng.rooms  # ReadsStopped: freed before the fence deadline
    assert eng.counters["pull_fence_expired"] == 0
    w.heal_and_settle()
    _clean(w)


def test_failed_prefill_frees_at_the_fence_if_decode_vanished() -> None:
    w = H.World(TINY4, 1, 1, flow="pull", num_shards=1)
    req = _offered_and_read_posted(w)
    eng = w.prefill[0].engine
    w.fabric.pending.clear()  # decode is cut off: nothing it says arrives any more
    w.prefill[0].driver.feed(AbortRoom(room=req.room, transfer_id=req.tid, reason="test"), w.fabric.now)
    w.release(req, "prefill", 0)
    start = w.fabric.now
    while w.fabric.now - start < w.timeouts.fence_ns - w.timeouts.heartbeat_interval_ns:
        w.fabric.now += w.timeouts.heartbeat_interval_ns
        w.fabric.pending.clear()
        w.pump()
        assert req.room in eng.rooms, w.fabric.now - start  # never before the fence deadline
    w.fabric.now = start + w.timeouts.fence_ns
    w.pump()
    assert req.room not in eng.rooms
    assert eng.counters["pull_fence_expired"] == 1


def test_offer_with_garbage_pages_fails_the_room_as_a_peer_violation() -> None:
    w = H.World(TINY4, 1, 1, flow="pull", num_shards=1)
    req = _room(w, 9, 8, [8])
    dec = w.decode[0].engine
    reg = w.prefill[0].transport.registration()
    bad = m.PullOffer(
        src=reg.src,
        room=req.room,
        transfer_id=req.tid,
        registration=reg,
        chunk_index=0,
        token_start=0,
        token_end=8,
        is_last=True,
        src_pages=[10**6] * 4,
    )
    w.decode[0].transport.inbox.append(m.encode(bad))
    w.pump()
    assert dec.poll(req.room) is KVPoll.Failed
    assert dec.counters["remote_violation"] == 1
    assert "page ids out of range" in dec.rooms[req.room].failure.reason


def test_pull_on_a_heterogeneous_simulated_deployment() -> None:
    base = sc.load(HETERO)
    res, w = run_one(sc.with_flow(base, "pull"))
    direct, _ = run_one(sc.with_flow(base, "direct"))
    assert res.violations == [] and res.succeeded == res.rooms
    assert res.descriptors == pytest.approx(direct.descriptors, rel=0.05)  # the same direct slices
    assert sum(w.ranks[f"prefill{p}"].engine.counters["read_notif"] for p in range(4)) > 0
    assert Flow.PULL.value in sc.FLOW_CHOICES


def test_campaign_catches_pull_freeing_pages_before_the_read(tmp_path: Path) -> None:
    base = sc.with_flow(sc.load(HETERO), "pull")
    first = first_failing(campaign(range(0, 2), base=base, hooks=("pull_free_early",)))
    assert first is not None, "planted pull_free_early went unnoticed"
    assert "ownership" in first.violated()
    s = sc.load(save_failure(first, tmp_path))
    again, _ = run_one(s)
    assert again.digest == first.digest and again.violated() == first.violated()
    clean, _ = run_one(replace(s, hooks=(), expect_violations=()))
    assert clean.violations == [], clean.violations[:2]


def test_campaign_catches_a_write_failure_that_never_tells_decode(tmp_path: Path) -> None:
    # Not pull-specific: every flow's failed write must reach decode at once (tracker gap C2).
    first = first_failing(campaign(range(0, 4), hooks=("silent_write_failure",)))
    assert first is not None, "planted silent_write_failure went unnoticed"
    assert first.violated() == ["failure_notice"]
    s = sc.load(save_failure(first, tmp_path))
    again, _ = run_one(s)
    assert again.digest == first.digest and again.violated() == first.violated()
    clean, _ = run_one(replace(s, hooks=(), expect_violations=()))
    assert clean.violations == [], clean.violations[:2]


@pytest.mark.parametrize("flow", ["direct", "pull"])
def test_prefix_hit_moves_only_the_missing_tokens_to_their_own_slots(flow: str) -> None:
    base = sc.with_flow(sc.load(HETERO), flow)
    hits = replace(base, workload=replace(base.workload, prefix_hit=0.7))
    _, full = run_one(base)
    res, w = run_one(hits)
    assert res.violations == [] and res.succeeded == res.rooms  # bytes compared over [0, tokens)
    assert sum(r.token_start > 0 for r in w.requests) > 5
    assert w.fabric.stats.bytes_landed < full.fabric.stats.bytes_landed


def test_prefix_hits_are_drawn_only_where_the_flow_can_skip_tokens() -> None:
    ring = sc.with_flow(sc.load(HETERO), "ring")
    res, w = run_one(replace(ring, workload=replace(ring.workload, prefix_hit=1.0)))
    assert res.violations == []
    assert all(r.token_start == 0 for r in w.requests)  # the simulator draws hits only where they can run


def test_campaign_catches_a_front_trimmed_prefix_hit(tmp_path: Path) -> None:
    base = sc.with_flow(sc.load(HETERO), "direct")
    base = replace(base, workload=replace(base.workload, prefix_hit=0.5))
    first = first_failing(campaign(range(0, 2), base=base, hooks=("prefix_front_trim",)))
    assert first is not None, "planted prefix_front_trim went unnoticed"
    assert first.violated() == ["bytes"]
    s = sc.load(save_failure(first, tmp_path))
    again, _ = run_one(s)
    assert again.digest == first.digest and again.violated() == first.violated()
    clean, _ = run_one(replace(s, hooks=(), expect_violations=()))
    assert clean.violations == [], clean.violations[:2]


def test_failed_prefill_waits_past_its_fence_for_a_live_decode_still_reading() -> None:
    # Seed 1448 of the first campaign: decode's READs were queued behind others longer than the
    # fence; freeing at the fence gave decode other rooms' bytes. A live decode is asked again.
    w = H.World(TINY4, 1, 1, flow="pull", num_shards=1)
    req = _offered_and_read_posted(w)
    eng = w.prefill[0].engine
    i = next(i for i, x in enumerate(w.fabric.writes) if x.read)
    queued = w.fabric.writes.pop(i)  # still in decode's post queue: no timeout applies yet
    w.prefill[0].driver.feed(AbortRoom(room=req.room, transfer_id=req.tid, reason="test"), w.fabric.now)
    w.release(req, "prefill", 0)
    for _ in range(2 * w.timeouts.fence_ns // w.timeouts.heartbeat_interval_ns):
        w.advance(w.timeouts.heartbeat_interval_ns)
        w.flush()
        assert req.room in eng.rooms  # decode is alive and has not said it stopped reading
    assert eng.counters["pull_fence_extended"] > 0 and eng.counters["pull_fence_expired"] == 0
    queued.posted_at = w.fabric.now
    w.fabric.writes.append(queued)
    w.flush()
    assert req.room not in eng.rooms  # ReadsStopped once the READ finished
    w.heal_and_settle()
    _clean(w)
