"""The flows' own costs in the simulated fabric, each by an amount computable by hand: a
descriptor's cost on a GPU that every posting process shares, the host wire of pinned-to-pinned
writes, a control thread that handles one message at a time; and their fits
(sim/calibrate/posting.py) recovering planted values."""

from __future__ import annotations

import json
import random
import tomllib
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np
import pytest
import simpy
from kvferry.backends.simfabric.descriptors import DescList
from kvferry.backends.simfabric.fabric import Fabric
from kvferry.backends.simfabric.spec import ControlSpec, FabricSpec, NicSpec
from kvferry.core.flows.regions import PINNED_REGION
from kvferry.core.messages import PullOffer, StagingReq, StagingRsp, TransferInfo, Watermark
from kvferry.sim import scenario as sc
from kvferry.sim.calibrate.inputs import CalibrationError
from kvferry.sim.calibrate.posting import fit_host_wire, fit_posting, read_flow_telemetry
from kvferry.sim.calibrate.predict import BenchRow, predict
from kvferry.sim.deploy import hardware
from typer.testing import CliRunner

from kvferry.cli import _register, app

NIC = NicSpec(
    bandwidth_bps=1_000_000_000,
    latency_ns=1_000,
    jitter_ns=0,
    post_cost_ns=10_000,
    per_desc_ns=6_000,
    max_inflight=4,
    error_timeout_ns=50_000,
)
SPEC = FabricSpec(nic=NIC, control=ControlSpec(latency_ns=5_000, jitter_ns=0), prepped=False)
QUIET = {"control_jitter_ns": 0, "jitter_ns": 0, "control_latency_ns": 0}
FLOWS = Path(__file__).resolve().parent.parent / "bench" / "calibration" / "h100-nixl" / "flows"


def world(spec: FabricSpec = SPEC, hosts: dict[str, str] | None = None) -> tuple[simpy.Environment, Fabric]:
    env = simpy.Environment()
    fab = Fabric(env, spec, random.Random(1))
    for n in ("a", "b", "c"):
        fab.add_node(n, host=(hosts or {}).get(n, ""))
        fab.register(n, 0, 1 << 20)
        fab.register(n, PINNED_REGION, 1 << 22)
    return env, fab


def spaced(n: int, region: int = 0, length: int = 8) -> DescList:
    """``n`` descriptors that no merge can join (every other slot)."""
    off = np.arange(n, dtype=np.int64) * 2 * length
    return DescList.of([region] * n, off, [region] * n, off, [length] * n)


# ---- a descriptor's cost on the GPU every posting process shares


def test_shared_descriptor_cost_is_off_by_default_and_one_poster_pays_the_larger_cost() -> None:
    n = 100
    for shared, per_desc in ((0, 6_000), (5_000, 6_000), (9_000, 9_000)):
        env, fab = world(replace(SPEC, nic=replace(NIC, shared_desc_ns=shared)))
        xid = fab.post("a", "a", "b", spaced(n), None)
        env.run()
        # post cost + n * max(per_desc, 1 * shared_desc): a lone poster is held by the slower of the two
        assert fab.xfers[xid].started_ns == 10_000 + n * per_desc


def test_two_processes_posting_at_once_each_pay_twice_the_shared_cost() -> None:
    n = 100
    env, fab = world(replace(SPEC, nic=replace(NIC, shared_desc_ns=5_000), one_gpu=True))
    first = fab.post("a", "a", "b", spaced(n), None)
    second = fab.post("c", "c", "b", spaced(n), None)
    env.run()
    # the first began alone: 10 us + 100 * max(6, 5) us; the second began beside it:
    # 10 us + 100 * max(6, 2 * 5) us
    assert fab.xfers[first].started_ns == 10_000 + 600_000
    assert fab.xfers[second].started_ns == 10_000 + 1_000_000
    # without the shared device both post in parallel, each in 10 us + 100 * 6 us; so do two
    # processes with the cost set but a GPU each (a deployment's ranks), on one host or not
    for spec, hosts in (
        (SPEC, None),
        (replace(SPEC, nic=replace(NIC, shared_desc_ns=5_000)), None),
        (replace(SPEC, nic=replace(NIC, shared_desc_ns=5_000)), {"a": "srv", "c": "srv"}),
    ):
        env, fab = world(spec, hosts)
        xids = [fab.post(n_, n_, "b", spaced(n), None) for n_ in ("a", "c")]
        env.run()
        assert [fab.xfers[x].started_ns for x in xids] == [610_000, 610_000]


def test_a_different_tp_room_is_longer_by_the_shared_cost_of_its_second_poster() -> None:
    """TP 2 -> 1 on the real simulator: each prefill rank posts 36 layers x K,V x 64 tokens =
    4,608 descriptors at once; the second to begin pays 2 x 5 us each instead of its own 6 us,
    so the room ends about 4,608 x 4 us = 18.4 ms later (less the few microseconds by which the
    second rank begins after the first)."""
    row = BenchRow("tp2->1 nhd", "qwen3-8b", 2, 1, 64, 1, "direct", 64 * 0.147, 1.0, 1.0)
    t0 = predict(row, "h100-rdma", {**QUIET, "per_desc_ns": 6_000}).predicted_ms
    t1 = predict(row, "h100-rdma", {**QUIET, "per_desc_ns": 6_000, "shared_desc_ns": 5_000}).predicted_ms
    assert t1 - t0 == pytest.approx(36 * 2 * 64 * 4_000 / 1e6, rel=0.02)
    # the same room with a GPU for each rank (a deployment's placement): nothing shared, and each
    # rank's own 6 us is above the 5 us of its device
    apart = replace(row, one_gpu=False)
    t2 = predict(apart, "h100-rdma", {**QUIET, "per_desc_ns": 6_000, "shared_desc_ns": 5_000}).predicted_ms
    assert t2 == t0


def test_bench_rows_say_from_their_gpus_whether_every_rank_shared_one_gpu(tmp_path: Path) -> None:
    from kvferry.sim.calibrate.predict import read_bench

    base = {"config": "tp2->1 nhd", "model": "qwen3-8b", "tp": "2->1", "tokens": 64, "inflight": 1,
            "flow": "direct", "room_mb": 9.4, "kvferry_gbps": 1.0, "raw_gbps": 2.0}  # fmt: skip
    rows = [base, {**base, "gpus": "0->0"}, {**base, "gpus": "1->1"}, {**base, "gpus": "0->1"},
            {**base, "gpus": "0,1->2"}]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r.one_gpu for r in read_bench(path)] == [True, True, True, False, False]
    path.write_text(json.dumps({**base, "gpus": "0"}) + "\n")
    with pytest.raises(CalibrationError, match="row 1: gpus: expected 'PREFILL->DECODE', got '0'"):
        read_bench(path)


def test_a_worlds_ranks_share_their_servers_host_unless_every_rank_is_on_one_gpu() -> None:
    from kvferry.sim.world import World

    data = {"topology": {"prefill_tp": 2, "decode_tp": 1, "prefill_instances": 2, "decode_instances": 2}}
    w = World(sc.parse(data))
    hosts = {name: node.host for name, node in w.fabric.nodes.items()}
    assert len(hosts) == 6 and len(set(hosts.values())) == 4
    for name, ep in w.fleet.endpoint.items():
        assert hosts[name] == ep.server
    bench = World(sc.parse({**data, "fabric": {"one_gpu": True}}))
    assert {node.host for node in bench.fabric.nodes.values()} == {"host0"}


# ---- the host wire


def test_a_host_to_host_write_moves_at_the_host_wire_shared_by_its_initiator() -> None:
    nbytes = 1_000_000
    host = replace(SPEC, nic=replace(NIC, host_bandwidth_bps=250_000_000))

    def wire_ns(spec: FabricSpec, posts: list[tuple[str, int]]) -> list[int]:
        env, fab = world(spec)
        xids = [fab.post(ini, ini, "b", DescList.of([r], [0], [r], [0], [nbytes]), None) for ini, r in posts]
        env.run()
        return [fab.xfers[x].landed_ns - fab.xfers[x].started_ns - NIC.latency_ns for x in xids]

    # 1 MB at the NIC's 1 GB/s: 1 ms; between pinned buffers at the host wire's 0.25 GB/s: 4 ms
    assert wire_ns(SPEC, [("a", PINNED_REGION)]) == [1_000_000]
    assert wire_ns(host, [("a", PINNED_REGION)]) == [4_000_000]
    assert wire_ns(host, [("a", 0)]) == [1_000_000]  # device memory keeps the NIC's wire
    # Two host writes of one initiator share its wire. Its posts end 16 us apart (10 us + 1
    # descriptor at 6 us), so the first moves 4,000 B alone, both then move at 0.125 GB/s until
    # the first ends at 8.000 ms, and the second's last 4,000 B go alone: 7.984 ms of wire each.
    assert wire_ns(host, [("a", PINNED_REGION), ("a", PINNED_REGION)]) == [7_984_000, 7_984_000]
    # two initiators' host writes do not share (their posts end together: 4 ms each)
    assert wire_ns(host, [("a", PINNED_REGION), ("c", PINNED_REGION)]) == [4_000_000, 4_000_000]


def test_host_writes_of_several_initiators_share_the_hosts_wire_when_it_is_set() -> None:
    nbytes = 1_000_000
    own = replace(NIC, host_bandwidth_bps=250_000_000)
    shared = replace(SPEC, nic=replace(own, host_shared_bandwidth_bps=300_000_000))

    def two_host_writes(spec: FabricSpec, hosts: dict[str, str] | None = None) -> list[int]:
        env, fab = world(spec, hosts)
        pinned = DescList.of([PINNED_REGION], [0], [PINNED_REGION], [0], [nbytes])
        xids = [fab.post(n, n, "b", pinned, None) for n in "ac"]
        env.run()
        return [fab.xfers[x].landed_ns - fab.xfers[x].started_ns - NIC.latency_ns for x in xids]

    # posts end together; two host writes active on the one host: 0.3 / 2 = 0.15 GB/s each (under
    # each initiator's own 0.25), so 1 MB takes 6.667 ms each (4 ms each without the shared wire):
    # every node on one GPU of one host (the bench), or two nodes placed on one host
    for spec, hosts in ((replace(shared, one_gpu=True), None), (shared, {"a": "srv", "c": "srv"})):
        assert two_host_writes(spec, hosts) == [pytest.approx(1e6 / 0.15, abs=2)] * 2
    # on two hosts (by default a node is a host of its own) each keeps its own wire
    assert two_host_writes(shared, {"a": "srv0", "c": "srv1"}) == [4_000_000, 4_000_000]
    assert two_host_writes(shared) == [4_000_000, 4_000_000]
    # one alone keeps its own wire (0.25 < 0.3): 4 ms; device memory (c into a) is not host memory
    env, fab = world(shared)
    one = fab.post("a", "a", "b", DescList.of([PINNED_REGION], [0], [PINNED_REGION], [0], [nbytes]), None)
    dev = fab.post("c", "c", "a", DescList.of([0], [0], [0], [0], [nbytes]), None)
    env.run()
    assert fab.xfers[one].landed_ns - fab.xfers[one].started_ns - NIC.latency_ns == 4_000_000
    assert fab.xfers[dev].landed_ns - fab.xfers[dev].started_ns - NIC.latency_ns == 1_000_000


def test_a_tp2_pinned_room_is_longer_by_its_bytes_over_the_shared_host_wire() -> None:
    row = BenchRow("tp2->1 nhd", "qwen3-8b", 2, 1, 256, 1, "pinned", 256 * 0.147456, 1.0, 1.0)
    fab = {**QUIET, "host_bandwidth_gbps": 4.0}
    t0 = predict(row, "h100-rdma", fab).predicted_ms
    t1 = predict(row, "h100-rdma", {**fab, "host_shared_bandwidth_gbps": 6.0}).predicted_ms
    # each prefill rank writes half the room host to host at once: 4 GB/s each alone, 3 shared
    half = row.room_mb * 1e6 / 2
    assert t1 - t0 == pytest.approx(half * (1 / 3e9 - 1 / 4e9) * 1e3, rel=0.02)
    one = BenchRow("tp1->1 nhd", "qwen3-8b", 1, 1, 256, 1, "pinned", 256 * 0.147456, 1.0, 1.0)
    assert predict(one, "h100-rdma", {**fab, "host_shared_bandwidth_gbps": 6.0}).predicted_ms == (
        predict(one, "h100-rdma", fab).predicted_ms
    )


def test_a_pinned_room_is_longer_by_its_bytes_over_the_host_wire() -> None:
    row = BenchRow("tp1->1 nhd", "qwen3-8b", 1, 1, 256, 1, "pinned", 256 * 0.147456, 1.0, 1.0)
    t0 = predict(row, "h100-rdma", QUIET).predicted_ms
    t1 = predict(row, "h100-rdma", {**QUIET, "host_bandwidth_gbps": 5.0}).predicted_ms
    # the room's one write: its bytes at 5 GB/s instead of h100-rdma's 50 GB/s NIC
    assert t1 - t0 == pytest.approx(row.room_mb * 1e6 * (1 / 5e9 - 1 / 50e9) * 1e3, rel=1e-4)


# ---- a control thread that handles one message at a time


def test_messages_arriving_together_wait_for_each_other_by_the_handling_cost() -> None:
    for handle, want in ((0, [5_000, 5_000, 5_000]), (2_000, [7_000, 9_000, 11_000])):
        env, fab = world(replace(SPEC, control=ControlSpec(latency_ns=5_000, jitter_ns=0, handle_ns=handle)))
        seen: list[int] = []
        fab.nodes["b"].waker = lambda _item, env=env, seen=seen: seen.append(int(env.now))
        for i in range(3):
            fab.send_control("a" if i != 1 else "c", "b", b"m%d" % i)
        env.run()
        assert seen == want
        assert [p for _, p in fab.drain_control("b")] == [b"m0", b"m1", b"m2"]


def test_a_message_for_a_receiver_that_crashed_while_it_queued_is_dropped() -> None:
    env, fab = world(replace(SPEC, control=ControlSpec(latency_ns=5_000, jitter_ns=0, handle_ns=2_000)))
    fab.send_control("a", "b", b"x")
    env.run(until=6_000)  # arrived at 5 us, handed over at 7 us
    fab.crash("b")
    fab.restart("b")
    env.run()
    assert fab.drain_control("b") == [] and fab.stats.control_dropped == 1


# ---- host work on a rank's one runtime thread: staging messages, sends, copy submits


def _tagged(tag: str) -> bytes:
    return msgspec.msgpack.encode({"t": tag})  # the fabric reads a message's tag alone


def test_a_staging_message_holds_its_receiver_by_the_staging_cost_and_others_do_not() -> None:
    control = ControlSpec(latency_ns=5_000, jitter_ns=0, staging_handle_ns=3_000)
    env, fab = world(replace(SPEC, control=control))
    seen: list[int] = []
    fab.nodes["b"].waker = lambda _item: seen.append(int(env.now))
    tags = [m.__struct_config__.tag for m in (StagingReq, StagingRsp, Watermark, TransferInfo)]
    for tag in tags:
        fab.send_control("a", "b", _tagged(tag))
    fab.send_control("c", "b", b"\xc1 not msgpack")  # a garbled message: no staging work
    env.run()
    # all arrive at 5 us; the three staging messages are handled one after another (8, 11, 14 us),
    # the TransferInfo and the garbled one queue behind them without a cost of their own
    assert seen == [8_000, 11_000, 14_000, 14_000, 14_000]
    assert len(fab.drain_control("b")) == 5


def test_a_senders_messages_leave_one_after_another_by_the_send_cost() -> None:
    env, fab = world(replace(SPEC, control=ControlSpec(latency_ns=5_000, jitter_ns=0, send_ns=2_000)))
    seen: list[tuple[int, bytes]] = []
    fab.nodes["b"].waker = lambda _item: seen.append((int(env.now), fab.drain_control("b")[0][1]))
    for payload in (b"m0", b"m1"):
        fab.send_control("a", "b", payload)
    fab.send_control("c", "b", b"m2")  # another sender's thread: no wait for a's
    env.run()
    assert seen == [(7_000, b"m0"), (7_000, b"m2"), (9_000, b"m1")]


def test_a_ring_room_is_longer_by_its_copies_and_staging_messages_on_the_runtime_thread() -> None:
    """TP 1 -> 1 ring on the real simulator: the gather (prefill) and the scatter (decode) each hold
    their rank's thread by the submit cost; decode's grant of the StagingReq and prefill's handling
    of the StagingRsp each by the staging cost (the Watermark comes after the room). Every one is
    on the room's critical path."""
    row = BenchRow("tp1->1 nhd", "qwen3-8b", 1, 1, 256, 1, "ring", 256 * 0.147456, 1.0, 1.0)
    t0 = predict(row, "h100-rdma", QUIET).predicted_ms
    t_sub = predict(row, "h100-rdma", {**QUIET, "kernel_submit_ns": 1_000_000}).predicted_ms
    t_stg = predict(row, "h100-rdma", {**QUIET, "staging_handle_ns": 1_000_000}).predicted_ms
    # (the scatter's submit overlaps the tail of the write's completion by about 10 us)
    assert t_sub - t0 == pytest.approx(2.0, abs=0.02)
    assert t_stg - t0 == pytest.approx(2.0, abs=0.02)
    direct = replace(row, flow="direct")
    d0 = predict(direct, "h100-rdma", QUIET).predicted_ms
    # a direct room has no copy and no staging message; decode's TransferInfo is its one send
    assert predict(direct, "h100-rdma", {**QUIET, "kernel_submit_ns": 1_000_000}).predicted_ms == d0
    assert predict(direct, "h100-rdma", {**QUIET, "staging_handle_ns": 1_000_000}).predicted_ms == d0
    d_send = predict(direct, "h100-rdma", {**QUIET, "control_send_ns": 1_000_000}).predicted_ms
    assert d_send - d0 == pytest.approx(1.0, abs=0.01)


def test_a_room_message_holds_its_receiver_by_the_room_cost_and_others_do_not() -> None:
    """A TransferInfo or PullOffer is the room's plan on its receiver (NicSpec.room_handle_ns): two
    arriving together are planned one after another; other messages queue behind, at no cost."""
    env, fab = world(replace(SPEC, nic=replace(NIC, room_handle_ns=3_000)))
    seen: list[int] = []
    fab.nodes["b"].waker = lambda _item: seen.append(int(env.now))
    for tag in (TransferInfo.__struct_config__.tag, PullOffer.__struct_config__.tag, "hb"):
        fab.send_control("a", "b", _tagged(tag))
    fab.send_control("c", "a", _tagged(TransferInfo.__struct_config__.tag))  # a's thread: no wait
    env.run()
    assert seen == [8_000, 11_000, 11_000]
    assert len(fab.drain_control("b")) == 3 and len(fab.drain_control("a")) == 1


def test_a_push_rooms_transfer_info_holds_its_receiver_by_the_push_cost_too() -> None:
    """NicSpec.push_handle_ns: a TransferInfo of a room the world says runs push costs its
    receiver the registration on top of the plan; another room's TransferInfo, a PullOffer of
    the push room and garbage cost only what they did."""
    env, fab = world(replace(SPEC, nic=replace(NIC, room_handle_ns=3_000, push_handle_ns=2_000)))
    fab.push_room = lambda room: room == 7
    seen: list[int] = []
    fab.nodes["b"].waker = lambda _item: seen.append(int(env.now))
    info = TransferInfo.__struct_config__.tag
    fab.send_control("a", "b", msgspec.msgpack.encode({"t": info, "room": 7}))
    fab.send_control("a", "b", msgspec.msgpack.encode({"t": info, "room": 8}))
    fab.send_control("a", "b", msgspec.msgpack.encode({"t": PullOffer.__struct_config__.tag, "room": 7}))
    fab.send_control("a", "b", b"\xc1garbage")
    env.run()
    # 5 us of latency, then 3 + 2 us (push), 3 us, 3 us, and the garbage at no cost, one after another
    assert seen == [10_000, 13_000, 16_000, 16_000]
    assert len(fab.drain_control("b")) == 4


def test_a_push_room_is_longer_by_its_registration_and_a_direct_room_is_not() -> None:
    """On the real simulator, TP 1 -> 1: the push room's one TransferInfo is on its critical path;
    the direct flow never pays it."""
    row = BenchRow("tp1->1 nhd", "qwen3-8b", 1, 1, 64, 1, "push", 64 * 0.147456, 1.0, 1.0)
    p0 = predict(row, "h100-rdma", QUIET).predicted_ms
    p_reg = predict(row, "h100-rdma", {**QUIET, "push_handle_ns": 1_000_000}).predicted_ms
    assert p_reg - p0 == pytest.approx(1.0, abs=0.01)
    direct = replace(row, flow="direct")
    d0 = predict(direct, "h100-rdma", QUIET).predicted_ms
    assert predict(direct, "h100-rdma", {**QUIET, "push_handle_ns": 1_000_000}).predicted_ms == d0


def test_notifications_and_dones_hold_their_ranks_thread_by_the_completion_cost() -> None:
    env, fab = world(replace(SPEC, nic=replace(NIC, completion_handle_ns=4_000)))
    seen: list[tuple[int, object]] = []
    fab.nodes["b"].waker = lambda item: seen.append((int(env.now), item))
    fab.nodes["a"].waker = lambda item: seen.append((int(env.now), item))
    x0 = fab.post("a", "a", "b", spaced(1), b"n0")
    x1 = fab.post("a", "a", "b", spaced(1), b"n1")
    env.run()
    # each post: 10 + 6 us, the second after the first; 8 bytes at 1 GB/s and 1 us: landed at
    # 17 and 33 us (+8 ns), DONE one latency later; b's notification and a's DONE each wait 4 us
    # more (two ranks' threads: they do not wait for each other)
    assert seen == [
        (21_008, ("notif", "a")),
        (22_008, ("xfer", x0)),
        (37_008, ("notif", "a")),
        (38_008, ("xfer", x1)),
    ]
    assert [p for _src, p in fab.drain_notifs("b")] == [b"n0", b"n1"]


def test_a_direct_room_is_longer_by_its_plan_and_its_completions_on_the_runtime_thread() -> None:
    """TP 1 -> 1 direct on the real simulator: prefill plans the room once (decode's TransferInfo);
    the KV write's DONE (prefill, before the aux row's write) and the aux row's notification
    (decode) are each handled on the room's critical path."""
    row = BenchRow("tp1->1 nhd", "qwen3-8b", 1, 1, 64, 1, "direct", 64 * 0.147456, 1.0, 1.0)
    d0 = predict(row, "h100-rdma", QUIET).predicted_ms
    d_room = predict(row, "h100-rdma", {**QUIET, "room_handle_ns": 1_000_000}).predicted_ms
    d_comp = predict(row, "h100-rdma", {**QUIET, "completion_handle_ns": 1_000_000}).predicted_ms
    assert d_room - d0 == pytest.approx(1.0, abs=0.01)
    assert d_comp - d0 == pytest.approx(2.0, abs=0.05)
    # eight rooms in flight: their plans queue on prefill's one thread, so the batch takes at least
    # eight plans (side by side, it would take one more than its 4.2 ms without them)
    batch = replace(row, inflight=8)
    assert predict(batch, "h100-rdma", {**QUIET, "room_handle_ns": 1_000_000}).predicted_ms > 8.0


def test_a_profile_sets_the_runtime_thread_costs_and_refuses_bad_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hardware, "folder", lambda: tmp_path)
    base = 'kind = "fabric"\nbandwidth_gbps = 10\nlatency_us = 1\npost_cost_us = 2\nper_desc_us = 0.5\n'
    costs = "staging_handle_us = 300\ncopy_submit_us = 400\ncontrol_send_us = 50\n"
    costs += "room_handle_us = 700\ncompletion_handle_us = 90\npush_handle_us = 150\n"
    (tmp_path / "th.toml").write_text(base + 'name = "th"\n' + costs)
    s = sc.parse({"fabric": {"profile": "th"}})
    got = (s.fabric.control.staging_handle_ns, s.fabric.kernel.submit_ns, s.fabric.control.send_ns)
    assert got == (300_000, 400_000, 50_000)
    assert (s.fabric.nic.room_handle_ns, s.fabric.nic.completion_handle_ns) == (700_000, 90_000)
    assert s.fabric.nic.push_handle_ns == 150_000
    # a deployment's ranks pay them too (per-rank host work, not the shared GPU)
    gpu = hardware.GpuProfile("g", 1.0, 1.0, 80.0, 64.0, 1440.0, 51.0, 140.0, 0.5, 0.8, 4000.0, 2000.0, 0.9)
    spec = hardware.fabric_spec(gpu, hardware.nic("th"))
    assert (spec.control.staging_handle_ns, spec.kernel.submit_ns, spec.control.send_ns) == got
    assert (spec.nic.room_handle_ns, spec.nic.completion_handle_ns) == (700_000, 90_000)
    assert spec.nic.push_handle_ns == 150_000
    # absent, they are 0 (off): the shipped NIC profiles do not set them
    plain = hardware.fabric_spec(gpu, hardware.nic("th").__class__("p", 10.0, 1.0, 2.0, 0.5))
    assert (plain.control.staging_handle_ns, plain.kernel.submit_ns, plain.control.send_ns) == (0, 0, 0)
    assert (plain.nic.room_handle_ns, plain.nic.completion_handle_ns, plain.nic.push_handle_ns) == (0, 0, 0)
    for key in (
        "staging_handle_us",
        "copy_submit_us",
        "control_send_us",
        "room_handle_us",
        "completion_handle_us",
        "push_handle_us",
    ):
        for bad in ("-1", "nan", '"slow"', "true"):
            (tmp_path / "bad.toml").write_text(base + f'name = "bad"\n{key} = {bad}\n')
            with pytest.raises(hardware.ProfileError, match=f"{key} must be a number >= 0"):
                hardware.nic("bad")
    for key in (
        "staging_handle_ns",
        "kernel_submit_ns",
        "control_send_ns",
        "room_handle_ns",
        "completion_handle_ns",
        "push_handle_ns",
    ):
        with pytest.raises(sc.ScenarioError, match=key):
            sc.parse({"fabric": {key: -5}})


# ---- the fits recover planted costs


def _telemetry(path: Path, flow: str, writes: list[dict[str, float]]) -> Path:
    path.write_text(json.dumps({"config": {"flow": flow}, "writes": writes}))
    return path


def _write(start: float, descs: int, post_us: float, nbytes: int = 1 << 20) -> dict[str, float]:
    return {
        "status": "DONE",
        "descs_requested": descs,
        "descs_posted": descs,
        "nbytes": nbytes,
        "start_us": start,
        "post_us": post_us,
        "xfer_us": post_us,
        "wall_ns": post_us * 1000,
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_posting_fit_recovers_planted_costs_from_writes_alone_and_in_pairs(tmp_path: Path, seed: int) -> None:
    per_desc, shared, post = 6.2, 4.8, 58.0
    rng = np.random.default_rng(seed)
    files = []
    for i, n in enumerate((100_000, 200_000, 400_000)):
        alone = [_write(t0, n, (post + n * max(per_desc, shared)) * rng.normal(1, 0.03)) for t0 in (0.0, 5e6)]
        pair = [_write(1e7 + k, n, (post + n * 2 * shared) * rng.normal(1, 0.03)) for k in (0.0, 3.0)]
        files.append(_telemetry(tmp_path / f"a{i}.json", "direct", alone))
        files.append(_telemetry(tmp_path / f"p{i}.json", "direct", pair))
    posts, host = read_flow_telemetry(files)
    assert sorted({r.concurrent for r in posts}) == [1, 2] and not host
    assert sum(r.concurrent == 2 for r in posts) == 6
    f = fit_posting(posts, post)
    assert (f.per_desc_us, f.shared_desc_us) == pytest.approx((per_desc, shared), rel=0.04)


def test_posting_fit_reads_the_native_engines_telemetry(tmp_path: Path) -> None:
    """The native engine's post returns at once (NIXL gives no posted count: -1) and its
    descriptors' cost lands in the transfer; one prefill process works its writes one after
    another, so with TP 1->2 the second write's own time starts when the first ended."""
    per_desc, shared, post, n = 6.0, 4.8, 60.0, 150_000

    def native(start: float, took_us: float) -> dict[str, float]:
        return {**_write(start, n, 140.0), "descs_posted": -1, "xfer_us": took_us}

    one = post + n * per_desc
    t12 = tmp_path / "12.json"
    t12.write_text(
        json.dumps(
            {
                "config": {"flow": "direct", "prefill_tp": 1, "decode_tp": 2},
                # both posted at 0 and 10 us; the second waits for the first, done at twice its time
                "writes": [native(0.0, one), native(10.0, 2 * one - 10.0)],
            }
        )
    )
    both = post + n * 2 * shared
    t21 = tmp_path / "21.json"
    t21.write_text(
        json.dumps(
            {
                "config": {"flow": "direct", "prefill_tp": 2, "decode_tp": 1},
                "writes": [native(0.0, both), native(5.0, both)],
            }
        )
    )
    posts, host = read_flow_telemetry([t12, t21])
    assert [(r.descs, r.concurrent) for r in posts] == [(n, 1), (n, 1), (n, 2), (n, 2)] and not host
    assert [r.post_us for r in posts] == pytest.approx([one, one, both, both])
    f = fit_posting(posts, post)
    assert (f.per_desc_us, f.shared_desc_us) == pytest.approx((per_desc, shared), rel=0.01)


def test_posting_fit_refuses_writes_of_one_concurrency_and_ignores_small_ones(tmp_path: Path) -> None:
    files = [_telemetry(tmp_path / "a.json", "direct", [_write(0.0, 100_000, 6e5), _write(1e6, 72, 400.0)])]
    posts, _ = read_flow_telemetry(files)
    assert [r.descs for r in posts] == [100_000]  # 72 descriptors: the post's fixed cost dominates
    with pytest.raises(CalibrationError, match="same concurrency"):
        fit_posting(posts, 58.0)


def test_native_engine_writes_are_read_by_their_transfer_and_requested_count(tmp_path: Path) -> None:
    """The native engine's telemetry: no posted count (-1), a post that returns at once, the walk of
    the descriptors in xfer_us. Read as the Python executor's rows would be, so both fit alike."""
    native = {**_write(0.0, 147_456, 147.0), "descs_posted": -1, "xfer_us": 1_365_145.0}
    python = _write(5e6, 147_456, 1_487_015.0)
    posts, _ = read_flow_telemetry([_telemetry(tmp_path / "d.json", "direct", [native, python])])
    assert [(r.descs, r.post_us) for r in posts] == [(147_456, 1_365_145.0), (147_456, 1_487_015.0)]
    # One prefill process (TP 1->2) hands both ranks' writes over at once; its agent walks them
    # one after another, so the second's own walk starts where the first's ends, and alone.
    handed = ((0.0, 8e5), (10.0, 1.6e6))  # (start, xfer_us)
    one = [{**_write(t0, 147_456, 150.0), "descs_posted": -1, "xfer_us": us} for t0, us in handed]
    path = tmp_path / "o.json"
    path.write_text(json.dumps({"config": {"flow": "direct", "prefill_tp": 1}, "writes": one}))
    posts, _ = read_flow_telemetry([path])
    assert [(r.post_us, r.concurrent) for r in posts] == [(8e5, 1), (8e5 + 10.0, 1)]
    pinned = {**_write(0.0, 4, 30.0, 1 << 30), "descs_posted": -1, "xfer_us": 2.0e5}
    _, host = read_flow_telemetry([_telemetry(tmp_path / "p.json", "pinned", [pinned])])
    assert [(h.nbytes, h.xfer_us) for h in host] == [(1 << 30, 2.0e5)]


def test_host_wire_fit_recovers_a_planted_bandwidth(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    writes = [
        _write(i * 1e6, 1, n / 4.8e3 * rng.normal(1, 0.03), n) for i, n in enumerate((3e8, 3e8, 1.2e9, 1.2e9))
    ]
    _, host = read_flow_telemetry([_telemetry(tmp_path / "p.json", "pinned", writes)])
    gbps, mape = fit_host_wire(host)
    assert gbps == pytest.approx(4.8, rel=0.04) and mape < 6


# ---- the profile and the commands


def test_calibrate_writes_the_flow_costs_and_a_scenario_on_the_profile_charges_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _register()
    cal = FLOWS.parent
    out = tmp_path / "t.toml"
    args = ["calibrate", *map(str, sorted(cal.glob("h100.*.json"))), "--name", "t", "--out", str(out)]
    args += ["--transport", "cuda_ipc", "--control-handle-us", "165"]
    for f in sorted(FLOWS.glob("h100.*.json")):
        args += ["--flow-telemetry", str(f)]
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    flows = json.loads(res.stdout)["flows"]
    prof = tomllib.loads(out.read_text())
    assert prof["transport"] == "cuda_ipc"
    assert prof["per_desc_us"] == pytest.approx(flows["per_desc_us"], rel=1e-5)
    assert prof["shared_desc_us"] == pytest.approx(flows["shared_desc_us"], rel=1e-5)
    assert prof["host_bandwidth_gbps"] == pytest.approx(flows["host_bandwidth_gbps"], rel=1e-5)
    # the telemetry's own story: one process 5.5-8.8 us a descriptor, two at once 8.3-10.7 us each
    assert 5.5 < flows["per_desc_us"] < 8.8 and 8.3 < 2 * flows["shared_desc_us"] < 10.7
    assert 4.5 < flows["host_bandwidth_gbps"] < 5.5
    monkeypatch.setattr(hardware, "folder", lambda: tmp_path)
    s = sc.parse({"fabric": {"profile": "t"}})
    assert s.fabric.nic.shared_desc_ns == round(prof["shared_desc_us"] * 1000)
    assert s.fabric.nic.host_bandwidth_bps == int(prof["host_bandwidth_gbps"] * 1e9)
    assert s.fabric.control.handle_ns == 165_000


def test_bench_predict_prints_each_flows_error_fit_and_held_out_apart() -> None:
    _register()
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "predict",
            str(FLOWS / "bench-flows.jsonl"),
            "--profile",
            "h100-nixl",
            "--held-out-tokens",
            "8192",
        ],
    )
    assert res.exit_code == 0, res.output
    lines = res.stdout.split("per flow:")[1].splitlines()
    assert any(line.split()[:5] == ["ring", "1", "unequal", "held", "out"] for line in lines)
    assert any(line.split()[:4] == ["ring", "8", "unequal", "fit"] for line in lines)
    bad = CliRunner().invoke(
        app, ["bench", "predict", str(FLOWS / "bench-flows.jsonl"), "--held-out-tokens", "x"]
    )
    assert bad.exit_code == 2 and "--held-out-tokens" in bad.output


def test_flow_telemetry_of_one_kind_fits_only_its_cost_and_of_neither_is_refused(tmp_path: Path) -> None:
    _register()
    main = [str(p) for p in sorted(FLOWS.parent.glob("h100.*.json"))]
    out = tmp_path / "t.toml"
    pinned = [a for f in sorted(FLOWS.glob("h100.11.pinned.*.json")) for a in ("--flow-telemetry", str(f))]
    res = CliRunner().invoke(app, ["calibrate", *main, "--name", "t", "--out", str(out), *pinned, "--json"])
    assert res.exit_code == 0, res.output
    prof = tomllib.loads(out.read_text())
    assert "shared_desc_us" not in prof and prof["host_bandwidth_gbps"] > 0
    assert prof["per_desc_us"] == pytest.approx(json.loads(res.stdout)["fabric"]["per_desc_us"], rel=1e-5)
    same_tp = ["--flow-telemetry", main[0]]  # 72-descriptor writes: neither kind
    res = CliRunner().invoke(app, ["calibrate", *main, "--name", "t", "--out", str(out), *same_tp])
    assert res.exit_code == 2 and "neither descriptor-bound writes" in res.output


def test_the_shared_host_wire_is_fitted_back_from_rows_simulated_with_it() -> None:
    from kvferry.sim.calibrate.hostshare import fit_host_share

    fab = {**QUIET, "host_bandwidth_gbps": 4.0}
    rows = []
    for tokens in (64, 128):
        shape = BenchRow("tp2->1 nhd", "qwen3-8b", 2, 1, tokens, 1, "pinned", tokens * 0.147456, 1.0, 1.0)
        ms = predict(shape, "h100-rdma", {**fab, "host_shared_bandwidth_gbps": 6.0}).predicted_ms
        rows.append(replace(shape, measured_gbps=shape.room_mb / ms))
    same_tp = replace(rows[0], prefill_tp=1, config="tp1->1 nhd")  # one host writer: not a row of this fit
    got = fit_host_share([*rows, same_tp], fab, lambda r, f: predict(r, "h100-rdma", f))
    assert got is not None and got.rows == 2
    assert got.gbps == pytest.approx(6.0, rel=0.03) and got.mape_pct < 1 < got.mape_before_pct
    # rows no slower than each writer's own wire gives: nothing to fit
    fast = [replace(r, measured_gbps=r.measured_gbps * 2) for r in rows]
    assert fit_host_share(fast, fab, lambda r, f: predict(r, "h100-rdma", f)) is None


def test_a_profiles_shared_host_wire_reaches_the_scenarios_fabric(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = hardware.folder().joinpath("h100-nixl.toml").read_text()
    off = sc.parse({"fabric": {"profile": "h100-nixl"}})  # a profile without it: off
    assert off.fabric.nic.host_shared_bandwidth_bps == 0
    (tmp_path / "t.toml").write_text(
        shipped.replace('name = "h100-nixl"', 'name = "t"').replace(
            "\n[fit]\n", "\nhost_shared_bandwidth_gbps = 6.5\n[fit]\n"
        )
    )
    monkeypatch.setattr(hardware, "folder", lambda: tmp_path)
    assert sc.parse({"fabric": {"profile": "t"}}).fabric.nic.host_shared_bandwidth_bps == 6_500_000_000
    given = sc.parse({"fabric": {"profile": "t", "host_shared_bandwidth_gbps": 0}})
    assert given.fabric.nic.host_shared_bandwidth_bps == 0  # a scenario's key wins over its profile's


def test_bench_rows_say_whether_a_sides_ranks_shared_one_process(tmp_path: Path) -> None:
    """Rows from before `process_per_rank` ran a side's ranks in one process, unlike the
    simulator: predict says how many of its different-TP rows did."""
    from kvferry.sim.calibrate.predict import layout_note, read_bench

    base = {"config": "tp2->1 nhd", "model": "qwen3-8b", "tp": "2->1", "tokens": 64, "inflight": 1,
            "flow": "ring", "room_mb": 9.4, "kvferry_gbps": 1.0, "raw_gbps": 2.0}  # fmt: skip
    same_tp = {**base, "tp": "1->1"}
    rows = [base, {**base, "process_per_rank": False}, {**base, "process_per_rank": True}, same_tp]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    read = read_bench(path)
    assert [r.ranks_share_process for r in read] == [True, True, False, False]
    note = layout_note(read)
    assert note is not None and note.startswith("note: 2 of 4 rows ran a side's TP ranks in one process")
    assert layout_note(read[2:]) is None
    path.write_text(json.dumps({**base, "process_per_rank": "yes"}) + "\n")
    with pytest.raises(CalibrationError, match="row 1: process_per_rank: expected true or false, got 'yes'"):
        read_bench(path)
