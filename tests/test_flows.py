"""The staged flows (ring, pinned) end to end over the in-memory harness, plus the flow policy.

Bytes are checked against the source pattern at every decode Success (harness), every staged
write must land inside a live allocation of its own room, and at the end every staging buffer,
ring and pinned pool is empty again.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest
from kvferry.core import messages as m
from kvferry.core.events import ControlIn, SenderOpen
from kvferry.core.flows import Flow, FlowError, FlowPolicy
from kvferry.core.flows.regions import PINNED_REGION, RING_REGION
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.core.topology import receiver_endpoints, sender_specs

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H

TINY4 = ModelGeometry("tiny4", num_layers=2, num_kv_heads=4, head_dim=4)
PAIRS = [(TINY4, 1, 1), (TINY4, 2, 1), (TINY4, 1, 2), (TINY4, 4, 2), (TINY4, 2, 4), (H.TINY_MLA, 2, 1)]


def world(model: ModelGeometry, p: int, d: int, flow: str | None, space: int, **kw: object) -> H.World:
    return H.World(
        model,
        p,
        d,
        flow=flow,
        ring_bytes=space,
        pinned_bytes=space,
        worker_buffer_bytes=space,
        prefill_pinned_bytes=space,
        seed=p * 10 + d,
        **kw,
    )


def run_rooms(w: H.World, n: int, tokens: int, cuts: list[int], room0: int = 100) -> list[H.Request]:
    reqs = [w.open_room(room0 + i, f"t{i}", tokens, cuts) for i in range(n)]
    assert all(r is not None for r in reqs)
    w.flush()
    for _ in range(len(cuts)):
        for req in reqs:
            for p in range(w.P):
                w.chunk_ready(req, p)  # type: ignore[arg-type]
        w.flush()
    w.heal_and_settle()
    return reqs  # type: ignore[return-value]


def assert_clean(w: H.World) -> None:
    assert w.violations == [] and w.internal_errors() == []
    for r in w.prefill:
        assert (
            r.engine.staging_in_use() == 0 and not r.engine.staged.stalled and not r.engine.staged.unconfirmed
        )
    for r in w.decode:
        assert r.engine.staging_in_use() == 0 and r.engine.staged.ops == {} and r.engine.staged.held == {}
    for r in w.ranks:
        assert r.engine.rooms == {} and r.driver.copies == {}


@pytest.mark.parametrize("flow", ["ring", "pinned"])
@pytest.mark.parametrize(("model", "p", "d"), PAIRS)
def test_staged_flow_moves_every_byte(flow: str, model: ModelGeometry, p: int, d: int) -> None:
    # Space for about one chunk: chunks of several rooms must wait for each other's scatter.
    w = world(model, p, d, flow, space=512, num_shards=2)
    reqs = run_rooms(w, 5, 10, [3, 6, 9, 10])
    for req in reqs:
        assert w.server_view[("decode", req.room, req.tid)] is KVPoll.Success
        assert w.server_view[("prefill", req.room, req.tid)] is KVPoll.Success
        assert all((req.room, req.tid, i) in w.success_checked for i in range(d))
    assert_clean(w)
    if model is TINY4 and p * d > 1:
        assert sum(r.engine.counters["chunk_deferred"] for r in w.prefill) > 0  # the space was tight


def test_default_policy_picks_ring_for_unequal_tp_and_direct_for_equal() -> None:
    for p, d, want in ((2, 1, Flow.RING), (1, 1, Flow.DIRECT)):
        w = world(TINY4, p, d, None, space=4096)
        req = w.open_room(7, "t", 4, [4])
        w.flush()
        assert w.prefill[0].engine.rooms[7].flow is want
        assert req is not None
        for i in range(p):
            w.chunk_ready(req, i)
        w.heal_and_settle()
        assert w.server_view[("decode", 7, "t")] is KVPoll.Success
        assert_clean(w)


def test_policy_rules() -> None:
    pools = [
        PoolGeometry(TINY4, 2, 0, 4, 8),
        PoolGeometry(TINY4, 1, 0, 4, 8),
        PoolGeometry(TINY4, 2, 0, 4, 8),
    ]
    pol = FlowPolicy()
    assert pol.choose(pools[0], pools[2], 0, 0) is Flow.DIRECT  # same heads
    assert pol.choose(pools[0], pools[1], 100, 100) is Flow.RING
    assert pol.choose(pools[0], pools[1], 0, 100) is Flow.PINNED
    assert pol.choose(pools[0], pools[1], 0, 0) is Flow.DIRECT
    assert pol.choose(pools[0], pools[1], 100, 100, override="pinned") is Flow.PINNED
    assert FlowPolicy(override=Flow.DIRECT).choose(pools[0], pools[1], 100, 0) is Flow.DIRECT
    assert pol.choose(pools[0], pools[1], 100, 100, override="pull") is Flow.PULL
    assert pol.choose(pools[0], pools[1], 1, 1, override="push") is Flow.PUSH
    with pytest.raises(FlowError, match="unknown flow"):
        Flow.parse("rnig")


def test_rooms_with_different_flows_share_a_rank() -> None:
    w = world(TINY4, 2, 1, "mixed", space=1024)
    reqs = run_rooms(w, 6, 8, [5, 8])
    flows = {w.room_flow(r.room) for r in reqs}
    assert flows == {"direct", "ring", "pinned", "pull", "push"}
    assert all(w.server_view[("decode", r.room, r.tid)] is KVPoll.Success for r in reqs)
    assert_clean(w)


@pytest.mark.parametrize("flow", ["ring", "pinned"])
def test_chunk_larger_than_decode_space_fails_the_room_with_the_size(flow: str) -> None:
    w = H.World(
        TINY4,
        2,
        1,
        flow=flow,
        ring_bytes=128,
        pinned_bytes=128,
        worker_buffer_bytes=4096,
        prefill_pinned_bytes=4096,
    )
    (req,) = run_rooms(w, 1, 10, [10])
    assert w.server_view[("decode", req.room, req.tid)] is KVPoll.Failed
    assert any("needs" in r and "bytes of decode" in r for r in w.failure_reasons), w.failure_reasons
    assert_clean(w)


def test_fallback_direct_moves_a_chunk_too_large_for_the_ring() -> None:
    w = world(TINY4, 2, 1, "ring", space=128, fallback_direct=True)
    (req,) = run_rooms(w, 1, 10, [1, 10])  # chunk 0 fits the ring, chunk 1 does not
    assert w.server_view[("decode", req.room, req.tid)] is KVPoll.Success
    assert sum(r.engine.counters["chunk_fallback_direct"] for r in w.prefill) == 2
    assert_clean(w)


def test_staging_request_before_decode_opens_is_held_then_answered() -> None:
    w = world(TINY4, 2, 1, "ring", space=4096)
    run_rooms(w, 1, 4, [4], room0=1)  # decode registers with both prefill ranks
    req = w.open_room(2, "late", 8, [4, 8], decode_late=True)
    assert req is not None
    for p in range(2):
        w.chunk_ready(req, p)
    w.flush()
    assert w.decode[0].engine.counters["staging_req_held"] == 2
    assert w.decode[0].engine.staged.held
    w.open_decode(req)
    for p in range(2):
        w.chunk_ready(req, p)
    w.heal_and_settle()
    assert w.server_view[("decode", 2, "late")] is KVPoll.Success
    assert_clean(w)


def test_held_requests_expire_at_the_bootstrap_deadline() -> None:
    w = world(TINY4, 2, 1, "ring", space=4096)
    run_rooms(w, 1, 4, [4], room0=1)
    req = w.open_room(2, "never", 8, [8], decode_late=True)
    assert req is not None
    w.chunk_ready(req, 0)
    w.flush()
    assert w.decode[0].engine.staged.held
    w.advance(w.timeouts.bootstrap_ns + 1)
    assert w.decode[0].engine.staged.held == {}
    assert w.decode[0].engine.counters["staging_req_expired"] >= 1


@pytest.mark.parametrize("flow", ["ring", "pinned"])
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_abort_with_a_chunk_in_staging_reclaims_space_after_the_fence(flow: str, side: str) -> None:
    w = world(TINY4, 2, 1, flow, space=1024)
    req = w.open_room(5, "t", 8, [4, 8])
    assert req is not None
    w.flush()
    for p in range(2):
        w.chunk_ready(req, p)
    # Run the workers and the gathers and land the writes, but do not let decode scatter yet.
    for p in range(2):
        for s in range(len(w.prefill[p].driver.queues)):
            while w.run_worker(p, s):
                pass
    while w.fabric.copies:
        w.fabric.run_copy(0)
        w.pump()
    while w.fabric.writes:
        w.fabric.complete(0)
    while w.fabric.pending:
        w.deliver(0)
    eng = w.decode[0].engine
    assert eng.staging_in_use() == 1
    # What the checkers ask of every staged write: inside a live allocation of its own room.
    region = RING_REGION if flow == "ring" else PINNED_REGION
    (a,) = (eng.staged.ring if flow == "ring" else eng.staged.pinned).live.values()
    assert eng.staging_holds((5, "t"), region, a.offset, a.end)
    assert not eng.staging_holds((6, "t"), region, a.offset, a.end)  # another room's write
    assert not eng.staging_holds((5, "t"), region, a.offset, a.end + 1)  # runs past the allocation
    w.abort(req, side, 0)
    w.heal_and_settle()
    assert w.server_view[("decode", 5, "t")] is KVPoll.Failed
    assert_clean(w)
    # The ring restarts and serves the next room.
    (nxt,) = run_rooms(w, 1, 8, [4, 8], room0=6)
    assert w.server_view[("decode", nxt.room, nxt.tid)] is KVPoll.Success


def test_topology_feeds_both_sides() -> None:
    specs = sender_specs(TINY4, 4, 2, 1)
    assert [s.endpoint for s in specs] == [m.Endpoint("prefill", 2), m.Endpoint("prefill", 3)]
    assert [(s.head_start, s.num_heads, s.send_aux) for s in specs] == [(2, 1, True), (3, 1, False)]
    assert receiver_endpoints(TINY4, 1, 2, 0) == (m.Endpoint("decode", 0), m.Endpoint("decode", 1))
    mla = sender_specs(H.TINY_MLA, 2, 1, 0)
    assert [s.dummy for s in mla] == [False, True] and receiver_endpoints(H.TINY_MLA, 2, 1, 1) == ()


def test_a_ring_that_never_drains_fails_the_waiting_room_with_the_reason() -> None:
    # Decode's scatters never run: the ring stays full, the next chunk can never be written.
    w = world(TINY4, 2, 1, "ring", space=512)
    req = w.open_room(3, "t", 8, [4, 8])
    assert req is not None
    w.flush()
    for p in range(2):
        w.chunk_ready(req, p)
        w.chunk_ready(req, p)
    decode = w.decode[0].endpoint
    for _ in range(40):
        w.fabric.copies = [c for c in w.fabric.copies if c.owner == decode] + [
            c for c in w.fabric.copies if c.owner != decode
        ]
        while any(c.owner != decode for c in w.fabric.copies):
            i = next(i for i, c in enumerate(w.fabric.copies) if c.owner != decode)
            w.fabric.run_copy(i)
            w.pump()
        while w.fabric.pending or w.fabric.writes:
            while w.fabric.pending:
                w.deliver(0)
            while w.fabric.writes:
                w.fabric.complete(0)
                w.pump()
        for p in range(2):
            for s in range(len(w.prefill[p].driver.queues)):
                while w.run_worker(p, s):
                    pass
        w.advance(H.TEST_TIMEOUTS.heartbeat_interval_ns)
    assert any("ring space of decode#0 not drained" in r for r in w.failure_reasons), w.failure_reasons
    assert w.violations == []


def test_too_many_early_requests_are_refused_with_a_reason_not_dropped() -> None:
    from kvferry.core.flows.staged_receiver import MAX_HELD_STAGING

    w = world(TINY4, 1, 1, "ring", space=4096)
    eng = w.decode[0].engine
    src = w.prefill[0].endpoint
    out = []
    for i in range(MAX_HELD_STAGING + 1):
        req = m.StagingReq(
            src=src, room=1000 + i, transfer_id="x", flow="ring", chunk_index=0, token_start=0, token_end=4
        )
        out += eng.handle(ControlIn(data=m.encode(req)), 0)
    assert sum(len(v) for v in eng.staged.held.values()) == MAX_HELD_STAGING
    refusals = [c.msg for c in out if type(c.msg) is m.StagingRsp]
    assert len(refusals) == 1 and not refusals[0].ok and "unopened rooms" in refusals[0].reason
    assert eng.counters["staging_req_overflow"] == 1


@pytest.mark.parametrize("flow", ["pinned", "direct", "pull", "push"])
def test_the_open_names_the_flow_even_when_decode_info_arrived_first(flow: str) -> None:
    # Found by `kvferry soak`: decode opened the room and its TransferInfo reached prefill before
    # the local open, so the rank chose the policy's flow (ring for 2 -> 1) and ignored the
    # open's; ranks whose open came first used the named flow, and decode saw writers disagree.
    w = world(TINY4, 2, 1, None, space=4096)
    held: list[tuple[object, int]] = []
    feeds = [r.driver.feed for r in w.prefill]
    for r in w.prefill:  # hold back every SenderOpen until decode's TransferInfo was delivered
        r.driver.feed = lambda ev, now, f=r.driver.feed: (
            held.append((f, ev)) if isinstance(ev, SenderOpen) else f(ev, now)
        )
    req = w.open_room(7, "t", 8, [4, 8])
    assert req is not None
    w.flush()
    for r, f in zip(w.prefill, feeds, strict=True):
        r.driver.feed = f
    for f, ev in held:
        f(msgspec.structs.replace(ev, flow=flow), w.fabric.now)
    for _ in range(2):
        for p in range(w.P):
            w.chunk_ready(req, p)
        w.flush()
    w.heal_and_settle()
    assert w.server_view[("decode", 7, "t")] is KVPoll.Success, w.failure_reasons
    staged = w.decode[0].engine.counters
    assert staged.get("scattered_ring", 0) == 0, staged
    assert (staged.get("scattered_pinned", 0) > 0) == (flow == "pinned"), staged
    assert_clean(w)
