"""The simulated fabric: bytes, timing model, refusal of bad descriptors, crashes and links."""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.backends.simfabric.descriptors import DescList, gather_index, merge_dense_runs
from kvferry.backends.simfabric.errors import RegionAccessError, UnknownPeerError
from kvferry.backends.simfabric.fabric import Fabric, XferState
from kvferry.backends.simfabric.spec import ControlSpec, FabricSpec, NicSpec
from kvferry.backends.simfabric.transport import SimTransport
from kvferry.backends.transport import Transport
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.messages import Endpoint

NIC = NicSpec(
    bandwidth_bps=1_000_000_000,
    latency_ns=1_000,
    jitter_ns=0,
    post_cost_ns=10_000,
    per_desc_ns=1_000,
    max_inflight=4,
    error_timeout_ns=50_000,
)
SPEC = FabricSpec(nic=NIC, control=ControlSpec(latency_ns=5_000, jitter_ns=0))


def world(spec: FabricSpec = SPEC) -> tuple[simpy.Environment, Fabric]:
    env = simpy.Environment()
    fab = Fabric(env, spec, random.Random(1))
    for n in ("a", "b", "c"):
        fab.add_node(n)
        fab.register(n, 0, 1 << 16)
    return env, fab


def one(src_off: int, dst_off: int, n: int, region: int = 0) -> DescList:
    return DescList.of([region], [src_off], [region], [dst_off], [n])


def test_write_moves_bytes_then_notifies_then_done() -> None:
    env, fab = world()
    fab.node("a").memory.region(0)[:100] = np.arange(100, dtype=np.uint8)
    xid = fab.post("a", "a", "b", one(0, 1000, 100), b"note")
    assert fab.state("a", xid) is XferState.PROC
    env.run()
    assert fab.state("a", xid) is XferState.DONE
    assert (fab.node("b").memory.region(0)[1000:1100] == np.arange(100)).all()
    assert fab.drain_notifs("b") == [("a", b"note")]
    x = fab.xfers[xid]
    # post 10us + 1 desc 1us, 100 B at 1 GB/s = 100 ns, latency 1us; DONE one latency later.
    assert x.landed_ns == 10_000 + 1_000 + 100 + 1_000
    assert x.done_ns == x.landed_ns + 1_000
    fab.release("a", xid)
    assert fab.open_handles() == {}


def test_completion_delay_holds_back_the_notification_and_done_by_exactly_that_much() -> None:
    from dataclasses import replace

    times = {}
    for delay in (0, 7_000):
        env, fab = world(replace(SPEC, nic=replace(NIC, completion_delay_ns=delay)))
        seen: list[int] = []
        xid = fab.post("a", "a", "b", one(0, 1000, 100), b"note")

        def watch(env: simpy.Environment, fab: Fabric, seen: list[int]) -> Iterator[simpy.Event]:
            while not fab.node("b").notifs:
                yield env.timeout(100)
            seen.append(int(env.now))

        env.process(watch(env, fab, seen))
        env.run()
        x = fab.xfers[xid]
        times[delay] = (x.landed_ns, seen[0], x.done_ns)
    (land0, notif0, done0), (land1, notif1, done1) = times[0], times[7_000]
    assert land1 == land0  # the wire is unchanged
    assert notif1 - notif0 == 7_000 and done1 - done0 == 7_000


def test_out_of_region_write_is_refused_and_moves_nothing() -> None:
    env, fab = world()
    with pytest.raises(RegionAccessError):
        fab.post("a", "a", "b", one(0, (1 << 16) - 10, 11), None)
    with pytest.raises(RegionAccessError):
        fab.post("a", "a", "b", one(0, 0, 8, region=7), None)
    with pytest.raises(RegionAccessError):
        fab.post("a", "a", "b", DescList.of([0], [-1], [0], [0], [4]), None)
    env.run()
    assert fab.stats.posts == 0 and not fab.node("b").memory.region(0).any()


def test_concurrent_transfers_share_bandwidth() -> None:
    env, fab = world(
        FabricSpec(
            nic=NicSpec(
                bandwidth_bps=1_000_000_000, latency_ns=0, jitter_ns=0, post_cost_ns=0, per_desc_ns=0
            ),
            control=SPEC.control,
        )
    )
    x1 = fab.post("a", "a", "b", one(0, 0, 10_000), None)
    env.run()
    alone = fab.xfers[x1].landed_ns
    x2 = fab.post("a", "a", "b", one(0, 0, 10_000), None)
    x3 = fab.post("c", "c", "b", one(0, 20_000, 10_000), None)
    start = env.now
    env.run()
    # Both into b: each gets half of b's ingress, so both take twice as long.
    assert fab.xfers[x2].landed_ns - start == 2 * alone
    assert fab.xfers[x3].landed_ns - start == 2 * alone


def test_posting_cost_charges_merged_descriptors_when_prepped() -> None:
    descs = DescList.of([0] * 4, [0, 10, 20, 100], [0] * 4, [0, 10, 20, 500], [10, 10, 10, 10])
    costs = {}
    for prepped in (True, False):
        env, fab = world(FabricSpec(nic=NIC, control=SPEC.control, prepped=prepped))
        xid = fab.post("a", "a", "b", descs, None)
        env.run()
        costs[prepped] = fab.xfers[xid].started_ns
    assert costs[True] == 10_000 + 2 * 1_000  # two dense runs
    assert costs[False] == 10_000 + 4 * 1_000


def test_inflight_limit_queues_posts() -> None:
    env, fab = world()
    ids = [fab.post("a", "a", "b", one(0, 0, 1000), None) for _ in range(6)]
    env.run(until=fab.xfers[ids[0]].started_ns if fab.xfers[ids[0]].started_ns > 0 else 17_000)
    env.run()
    started = sorted(fab.xfers[i].started_ns for i in ids)
    # The 5th and 6th start only when earlier ones finish.
    assert started[4] > started[3]
    assert all(fab.state("a", i) is XferState.DONE for i in ids)


def test_crashed_target_gives_err_and_no_bytes() -> None:
    env, fab = world()
    fab.node("a").memory.region(0)[:10] = 7
    xid = fab.post("a", "a", "b", one(0, 0, 10), b"n")
    fab.crash("b")
    fab.restart("b")
    fab.register("b", 0, 1 << 16)
    env.run()
    assert fab.state("a", xid) is XferState.ERR
    assert not fab.node("b").memory.region(0).any()
    assert fab.drain_notifs("b") == []


def test_link_down_fails_transfer_and_drops_control() -> None:
    env, fab = world()
    fab.set_link("a", "b", up=False)
    xid = fab.post("a", "a", "b", one(0, 0, 10), None)
    fab.send_control("a", "b", b"hello")
    env.run()
    assert fab.state("a", xid) is XferState.ERR
    assert fab.drain_control("b") == []
    fab.set_link("a", "b", up=True)
    fab.send_control("a", "b", b"again")
    env.run()
    assert fab.drain_control("b") == [("a", b"again")]


def test_link_down_drops_a_bare_notification() -> None:
    """A notification with no data (a dummy's "done", a resent staged note) takes the data path:
    over a downed link it is lost like the control message; the link back up carries it again."""
    env, fab = world()
    fab.set_link("a", "b", up=False)
    fab.send_notif("a", "b", b"note")
    env.run()
    assert fab.drain_notifs("b") == [] and fab.stats.notifs_dropped == 1
    fab.set_link("a", "b", up=True)
    fab.send_notif("a", "b", b"again")
    env.run()
    assert fab.drain_notifs("b") == [("a", b"again")]


def test_control_latency() -> None:
    env, fab = world()
    fab.send_control("a", "c", b"x")
    env.run(until=4_999)
    assert fab.drain_control("c") == []
    env.run()
    assert env.now == 5_000 and fab.drain_control("c") == [("a", b"x")]


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=30))
def test_merge_dense_runs_is_minimal_and_byte_identical(parts: list[tuple[int, int, int]]) -> None:
    # Build descriptors that are sometimes contiguous with their predecessor (gap 0).
    sr, so, dr, do, ln = [], [], [], [], []
    s_off = d_off = 0
    for region, gap, n in parts:
        s_off += gap
        d_off += gap if gap % 2 else 0
        sr.append(region), so.append(s_off), dr.append(region), do.append(d_off), ln.append(n)
        s_off += n
        d_off += n
    d = DescList.of(sr, so, dr, do, ln)
    m = merge_dense_runs(d)
    assert m.total_bytes == d.total_bytes
    for a, b in ((d.src_offset, d.length), (m.src_offset, m.length)):
        assert gather_index(a, b).size == d.total_bytes
    # Same bytes pairs, in the same order.
    assert (gather_index(m.src_offset, m.length) == gather_index(d.src_offset, d.length)).all()
    assert (gather_index(m.dst_offset, m.length) == gather_index(d.dst_offset, d.length)).all()
    # Minimal: no two neighbours in the merged list are still joinable.
    for i in range(1, m.count):
        assert not (
            m.src_region[i] == m.src_region[i - 1]
            and m.dst_region[i] == m.dst_region[i - 1]
            and m.src_offset[i] == m.src_offset[i - 1] + m.length[i - 1]
            and m.dst_offset[i] == m.dst_offset[i - 1] + m.length[i - 1]
        )


@settings(max_examples=60)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 1), st.integers(0, 200), st.integers(0, 1), st.integers(0, 200), st.integers(1, 40)
        ),
        min_size=1,
        max_size=30,
    )
)
def test_copy_lands_each_descriptor_in_order_few_or_many(rows: list[tuple[int, int, int, int, int]]) -> None:
    """``_copy`` of a few descriptors (slice copies, in Python) or of many (grouped index copies)
    leaves the bytes that copying each descriptor in turn leaves, overlaps included."""
    _env, fab = world()
    for n in ("a", "b"):
        fab.register(n, 1, 1 << 10)
    for rid in (0, 1):
        src = fab.node("a").memory.region(rid)
        src[:] = np.random.default_rng(rid).integers(0, 256, src.size, dtype=np.uint8)
    d = DescList.of(*zip(*rows, strict=True))
    expect = {rid: fab.node("b").memory.region(rid).copy() for rid in (0, 1)}
    for sr, so, dr, do, n in rows:
        expect[dr][do : do + n] = fab.node("a").memory.region(sr)[so : so + n]
    fab._copy(SimpleNamespace(src="a", dst="b"), d)  # type: ignore[arg-type]
    for rid in (0, 1):
        assert (fab.node("b").memory.region(rid) == expect[rid]).all()


def _pool(rank: int) -> PoolGeometry:
    return PoolGeometry(ModelGeometry("t", 1, 2, 4), 1, rank, 4, 8)


def test_sim_transport_is_a_transport_and_checks_peer_regions() -> None:
    env = simpy.Environment()
    fab = Fabric(env, SPEC, random.Random(0))
    for n in ("prefill0", "decode0"):
        fab.add_node(n)
    pe, de = Endpoint("prefill", 0), Endpoint("decode", 0)
    p = SimTransport(fab, pe, _pool(0))
    d = SimTransport(fab, de, _pool(0))
    assert isinstance(p, Transport)
    for t in (p, d):
        t.register_regions(t.pool.regions, aux_rows=4, aux_row_bytes=16)
    with pytest.raises(UnknownPeerError):
        p.post_write(de, *(np.zeros(1, np.int64) for _ in range(4)), np.ones(1, np.int64), b"")
    p.add_peer(de, d.registration())
    nbytes = p.pool.region_bytes
    with pytest.raises(RegionAccessError):
        p.post_write(
            de, np.array([0]), np.array([0]), np.array([0]), np.array([nbytes - 1]), np.array([2]), b""
        )
    p.aux_row(1)[:8] = np.frombuffer((12345).to_bytes(8, "little"), np.uint8)
    h = p.post_aux_write(de, 1, 3, b"aux")
    env.run()
    assert p.check_xfer(h).value == "DONE"
    p.release_xfer(h)
    assert d.read_aux_room(3) == 12345
    assert d.drain_notifs() == [b"aux"]
    # A restarted peer: metadata loaded earlier is stale, the write fails with ERR.
    fab.crash("decode0")
    fab.restart("decode0")
    d2 = SimTransport(fab, de, _pool(0))
    d2.register_regions(d2.pool.regions, aux_rows=4, aux_row_bytes=16)
    h = p.post_write(de, np.array([0]), np.array([0]), np.array([0]), np.array([0]), np.array([8]), b"x")
    env.run()
    assert p.check_xfer(h).value == "ERR"


def test_sim_transport_read_pulls_bytes_and_notifies_the_peer() -> None:
    env = simpy.Environment()
    fab = Fabric(env, SPEC, random.Random(0))
    for n in ("prefill0", "decode0"):
        fab.add_node(n)
    pe, de = Endpoint("prefill", 0), Endpoint("decode", 0)
    p, d = SimTransport(fab, pe, _pool(0)), SimTransport(fab, de, _pool(0))
    for t in (p, d):
        t.register_regions(t.pool.regions, aux_rows=2, aux_row_bytes=16)
    d.add_peer(pe, p.registration())
    p.region(0)[100:110] = np.arange(1, 11, dtype=np.uint8)
    h = d.post_read(pe, np.array([0]), np.array([100]), np.array([0]), np.array([7]), np.array([10]), b"read")
    env.run()
    assert d.check_xfer(h).value == "DONE"
    assert (d.region(0)[7:17] == np.arange(1, 11)).all()
    assert p.drain_notifs() == [b"read"]
    with pytest.raises(RegionAccessError):
        d.post_read(
            pe, np.array([0]), np.array([p.pool.region_bytes]), np.array([0]), np.array([0]), np.array([1])
        )
