"""The push flow: direct writes under registration leases (vLLM PR 35264).

Over the in-memory harness (bytes and page ownership checked at every landing and Success) and
over the simulator (heterogeneous TP, lease expiry under a lossy control plane, the planted
never-expiring lease caught by a seed that replays it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvferry.core import messages as m
from kvferry.core.deadlines import Timeouts
from kvferry.core.geometry import ModelGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.sim import scenario as sc
from kvferry.sim.campaign import run_one, save_failure
from msgspec.structs import replace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H

ROOT = Path(__file__).resolve().parent.parent
HETERO = ROOT / "scenarios" / "heterogeneous-tp.toml"
LOSSY = ROOT / "scenarios" / "lossy-control-plane.toml"
TINY4 = ModelGeometry("tiny4", num_layers=2, num_kv_heads=4, head_dim=4)
PAIRS = [(TINY4, 1, 1), (TINY4, 2, 1), (TINY4, 1, 2), (TINY4, 4, 2), (H.TINY_MLA, 2, 1)]


def _room(w: H.World, room: int, tokens: int, cuts: list[int]) -> H.Request:
    req = w.open_room(room, f"t{room}", tokens, cuts)
    assert req is not None
    w.flush()
    return req


@pytest.mark.parametrize(("model", "p", "d"), PAIRS)
@pytest.mark.parametrize("finish_first", [False, True])
def test_push_moves_every_byte_in_either_order(
    model: ModelGeometry, p: int, d: int, finish_first: bool
) -> None:
    w = H.World(model, p, d, flow="push", seed=p * 10 + d)
    reqs = []
    for i in range(3):
        req = w.open_room(100 + i, f"t{i}", 10, [4, 10], decode_late=finish_first)
        assert req is not None
        reqs.append(req)
    for _ in range(2):  # prefill's forward passes finish; with finish_first decode has not registered
        for req in reqs:
            for i in range(p):
                w.chunk_ready(req, i)
        w.flush()
    if finish_first:
        for req in reqs:
            w.open_decode(req)
    w.heal_and_settle()
    for req in reqs:
        assert w.server_view[("decode", req.room, req.tid)] is KVPoll.Success
        assert w.server_view[("prefill", req.room, req.tid)] is KVPoll.Success
        assert all((req.room, req.tid, i) in w.success_checked for i in range(d))
    assert w.violations == [] and w.internal_errors() == []
    for r in w.prefill:
        assert r.engine.leases.leases == {} and r.engine.leases.held == {} and r.engine.rooms == {}
    # One lease per (room, decode rank) a prefill rank writes to (a dummy rank holds none).
    assert sum(r.engine.leases.counters.get("delivered", 0) for r in w.prefill) >= len(reqs) * d


def test_a_lease_decode_stops_renewing_expires_and_both_sides_hear_it() -> None:
    # Room deadlines far beyond the lease (heartbeat_timeout_ns), so the lease is what ends it.
    t = Timeouts(
        bootstrap_ns=9000,
        waiting_ns=9000,
        transfer_ns=9000,
        heartbeat_interval_ns=50,
        heartbeat_timeout_ns=500,
        fence_ns=2500,
        tombstone_ns=20000,
    )
    w = H.World(TINY4, 1, 1, flow="push", num_shards=1, timeouts=t)
    dec = w.decode[0].engine

    def forgetful_heartbeat(peer: m.Endpoint) -> None:
        # Decode is alive (its heartbeats arrive) but names no room: it lost track of this one.
        dec._send(peer, m.Heartbeat(src=dec.endpoint, rooms=[]))

    dec._heartbeat = forgetful_heartbeat  # type: ignore[method-assign]
    req = _room(w, 5, 8, [4, 8])
    pre = w.prefill[0].engine
    assert pre.leases.leases  # decode's TransferInfo registered the room
    w.chunk_ready(req, 0)  # the first chunk: matched and written under the lease
    w.flush()
    written = w.fabric.writes == [] and len(w.effects)
    assert written
    for _ in range(20):
        w.advance(w.timeouts.heartbeat_interval_ns)
        w.flush()
    assert pre.poll(req.room) is KVPoll.Failed
    assert "push registration expired" in pre.rooms[req.room].failure.reason
    assert dec.poll(req.room) is KVPoll.Failed  # the RoomFailed notice reached decode
    assert "lease expired" in dec.rooms[req.room].failure.reason
    assert pre.counters["peer_lost"] == 0  # not the heartbeat loss: the lease
    w.chunk_ready(req, 0)  # the last chunk is ready too late: nothing more is written
    w.heal_and_settle()
    assert w.violations == [] and len(w.effects) == written
    assert pre.leases.finished[f"{req.tid}@decode0"].value == "expired"


def test_push_on_a_heterogeneous_simulated_deployment() -> None:
    base = sc.load(HETERO)
    res, w = run_one(sc.with_flow(base, "push"))
    direct, _ = run_one(sc.with_flow(base, "direct"))
    assert res.violations == [] and res.succeeded == res.rooms
    assert res.descriptors == direct.descriptors
    delivered = sum(w.ranks[f"prefill{p}"].engine.leases.counters.get("delivered", 0) for p in range(4))
    assert delivered > res.rooms  # one lease per (room, decode rank) a prefill rank writes to


def test_lossy_control_plane_expires_leases_without_a_write_after_expiry() -> None:
    s = sc.with_flow(sc.load(LOSSY), "push")
    s = replace(s, faults=replace(s.faults, ctrl_drop=0.6))
    res, w = run_one(s, seed=0)
    assert res.violations == []
    expired = sum(w.ranks[f"prefill{p}"].engine.counters["push_expired"] for p in range(2))
    assert expired > 0


def test_campaign_catches_a_lease_that_never_expires(tmp_path: Path) -> None:
    s = sc.with_flow(sc.load(LOSSY), "push")
    s = replace(s, faults=replace(s.faults, ctrl_drop=0.6), hooks=("push_lease_never_expires",))
    res, _ = run_one(s, seed=0)
    assert res.violated() == ["lease"]
    again, _ = run_one(sc.load(save_failure(res, tmp_path)))
    assert again.digest == res.digest and again.violated() == ["lease"]
    clean, _ = run_one(replace(s, hooks=()), seed=0)
    assert clean.violations == []


def test_a_computed_chunk_matches_its_registration_before_the_worker_runs_it() -> None:
    """The forward pass finishing (chunk 0 handed over) is the match, not the worker reaching the
    chunk: a registration must not be failed by its watchdog because the worker queue is long."""
    w = H.World(TINY4, 1, 1, flow="push", seed=7)
    req = w.open_room(300, "q", 10, [10])
    assert req is not None
    w.flush()  # decode registered (TransferInfo): the lease waits for prefill
    eng = w.prefill[0].engine
    (lease,) = eng.leases.leases.values()
    assert lease.finish is None
    w.chunk_ready(req, 0)  # handed to the worker queue; no worker step has run yet
    assert w.prefill[0].driver.queues[0] or any(w.prefill[0].driver.queues)
    assert lease.finish is not None  # matched now
    w.heal_and_settle()
    assert w.server_view[("decode", req.room, req.tid)] is KVPoll.Success
    assert w.violations == [] and w.internal_errors() == []


def _by_request_id(s: sc.Scenario) -> sc.Scenario:
    pushed = sc.with_flow(s, "push")
    return replace(pushed, flows=replace(pushed.flows, push_match="request_id"))


def test_registrations_matched_by_request_id_deliver_every_room() -> None:
    res, w = run_one(_by_request_id(sc.load(HETERO)))
    assert res.violations == [] and res.succeeded == res.rooms
    engines = [w.ranks[f"prefill{p}"].engine for p in range(4)]
    assert engines[0].lease_key("t7", "decode1") == "req:t7@decode1-1"  # filed by request id
    assert sum(e.leases.counters.get("delivered", 0) for e in engines) > res.rooms
    assert sum(w.ranks[f"prefill{p}"].engine.counters["push_wrong_pair"] for p in range(4)) == 0


def test_campaign_catches_suffix_matching_that_pairs_the_wrong_requests(tmp_path: Path) -> None:
    s = replace(_by_request_id(sc.load(HETERO)), hooks=("suffix_strips_too_much",))
    res, _ = run_one(s, seed=0)
    assert res.violated() == ["lease"]
    assert any("sharing a base id" in str(v) or "paired with another" in str(v) for v in res.violations)
    again, _ = run_one(sc.load(save_failure(res, tmp_path)))
    assert again.digest == res.digest and again.violated() == ["lease"]
    clean, _ = run_one(replace(s, hooks=()), seed=0)
    assert clean.violations == []
