"""A READ's own cost a descriptor (NicSpec.read_desc_ns): charged where the fabric posts a READ,
carried through scenarios and profiles, fitted by `kvferry calibrate` from pull rows
(sim/calibrate/readpost.py); 0 (every profile before it) leaves every run as it was."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.backends.simfabric.descriptors import DescList
from kvferry.backends.simfabric.fabric import Fabric
from kvferry.backends.simfabric.spec import FabricSpec
from kvferry.sim import scenario as sc
from kvferry.sim.calibrate.inputs import CalibrationError
from kvferry.sim.calibrate.posting import read_flow_telemetry
from kvferry.sim.calibrate.predict import BenchRow, Prediction, predict
from kvferry.sim.calibrate.readpost import KEY, fit_read_desc, read_rows
from kvferry.sim.deploy import hardware
from kvferry.sim.scenario_read import profile_fabric

from tests.test_flow_costs import NIC, QUIET, SPEC  # the same small fabric


def _spaced(n: int, length: int = 8) -> DescList:
    """``n`` descriptors no merge can join (every other slot)."""
    off = np.arange(n, dtype=np.int64) * 2 * length
    return DescList.of([0] * n, off, [0] * n, off, [length] * n)


def _posted(spec: FabricSpec, n: int, read: bool) -> int:
    """When a lone post of ``n`` descriptors between a and b leaves posting (a READ: b pulls)."""
    env = simpy.Environment()
    fab = Fabric(env, spec, random.Random(1))
    for name in ("a", "b"):
        fab.add_node(name)
        fab.register(name, 0, 1 << 22)
    xid = fab.post("b" if read else "a", "a", "b", _spaced(n), None)
    env.run()
    return fab.xfers[xid].started_ns


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 300),
    per_desc=st.integers(0, 20_000),
    read_desc=st.integers(0, 20_000),
    shared=st.sampled_from([0, 3_000, 9_000]),
)
def test_a_read_posts_at_its_own_cost_and_a_write_at_per_desc(
    n: int, per_desc: int, read_desc: int, shared: int
) -> None:
    spec = replace(
        SPEC, nic=replace(NIC, per_desc_ns=per_desc, read_desc_ns=read_desc, shared_desc_ns=shared)
    )
    read_cost = read_desc or per_desc  # 0: a READ costs what a WRITE does
    # a lone poster pays max(its own cost, its device's) a descriptor, as for a WRITE
    assert _posted(spec, n, read=True) == 10_000 + n * max(read_cost, shared)
    assert _posted(spec, n, read=False) == 10_000 + n * max(per_desc, shared)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), per_desc=st.integers(0, 20_000), read=st.booleans())
def test_read_desc_0_posts_exactly_as_before(n: int, per_desc: int, read: bool) -> None:
    """0 and the WRITE's own cost are the same fabric: what every profile without the field gets."""
    base = replace(SPEC, nic=replace(NIC, per_desc_ns=per_desc))
    same = replace(SPEC, nic=replace(NIC, per_desc_ns=per_desc, read_desc_ns=per_desc))
    assert _posted(base, n, read) == _posted(same, n, read) == 10_000 + n * per_desc


def test_a_tp2_pull_room_is_longer_by_its_reads_extra_cost_and_a_direct_room_not_at_all() -> None:
    """TP 2 -> 1 pull on the real simulator: decode READs 36 layers x K,V x 64 tokens = 4,608
    descriptors from each prefill rank, one READ after the other on its one NIC: 9,216 at 3 us more."""
    row = BenchRow("tp2->1 nhd", "qwen3-8b", 2, 1, 64, 1, "pull", 64 * 0.147, 1.0, 1.0)
    t0 = predict(row, "h100-rdma", {**QUIET, "per_desc_ns": 6_000}).predicted_ms
    t1 = predict(row, "h100-rdma", {**QUIET, "per_desc_ns": 6_000, KEY: 9_000}).predicted_ms
    assert t1 - t0 == pytest.approx(2 * 36 * 2 * 64 * 3_000 / 1e6, rel=0.02)
    direct = replace(row, flow="direct")
    assert predict(direct, "h100-rdma", {**QUIET, "per_desc_ns": 6_000, KEY: 9_000}).predicted_ms == (
        predict(direct, "h100-rdma", {**QUIET, "per_desc_ns": 6_000}).predicted_ms
    )


def test_a_shipped_profile_without_the_field_behaves_exactly_as_before() -> None:
    """Every fitted profile before this field reads READs at 0 (per_desc), and a pull room on one
    simulates to the nanosecond as with READs at per_desc given explicitly."""
    assert hardware.fitted("h200-nixl-same").read_desc_us is None
    nic = profile_fabric("h200-nixl-same").nic
    assert nic.read_desc_ns == 0
    row = BenchRow("tp2->1 nhd", "qwen3-8b", 2, 1, 64, 1, "pull", 64 * 0.147, 1.0, 1.0)
    plain = predict(row, "h200-nixl-same")
    assert plain.predicted_ms == predict(row, "h200-nixl-same", {KEY: nic.per_desc_ns}).predicted_ms
    assert plain.predicted_ms == predict(row, "h200-nixl-same", {KEY: 0}).predicted_ms


def test_the_field_goes_through_a_scenario_a_dump_and_a_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = sc.parse({"fabric": {KEY: 4_500}})
    assert s.fabric.nic.read_desc_ns == 4_500
    assert "read_desc_ns = 4500" in sc.dump(s)
    with pytest.raises(sc.ScenarioError, match=KEY):
        sc.parse({"fabric": {KEY: -1}})
    base = 'kind = "fabric"\nbandwidth_gbps = 10\nlatency_us = 1\npost_cost_us = 2\nper_desc_us = 0.5\n'
    (tmp_path / "tr.toml").write_text(base + 'name = "tr"\nread_desc_us = 5.4\n')
    (tmp_path / "bad.toml").write_text(base + 'name = "bad"\nread_desc_us = -1\n')
    monkeypatch.setattr(hardware, "folder", lambda: tmp_path)
    assert sc.parse({"fabric": {"profile": "tr"}}).fabric.nic.read_desc_ns == 5_400
    assert sc.parse({"fabric": {"profile": "tr", KEY: 0}}).fabric.nic.read_desc_ns == 0  # the key wins
    gpu = hardware.GpuProfile("g", 1.0, 1.0, 80.0, 64.0, 1440.0, 51.0, 140.0, 0.5, 0.8, 4000.0, 2000.0, 0.9)
    assert hardware.fabric_spec(gpu, hardware.nic("tr")).nic.read_desc_ns == 5_400  # a deployment's too
    with pytest.raises(hardware.ProfileError, match="read_desc_us must be a number >= 0"):
        hardware.nic("bad")


# ---- the fit


def _pull(p: int, d: int, tokens: int, ms: float) -> BenchRow:
    mb = tokens * 0.147
    return BenchRow(f"tp{p}->{d} nhd", "qwen3-8b", p, d, tokens, 1, "pull", mb, mb / ms, 1.0)


@settings(max_examples=20, deadline=None)
@given(
    planted=st.integers(2_000, 20_000),
    write=st.integers(3_000, 9_000),
    noise=st.lists(st.floats(-0.01, 0.01), min_size=3, max_size=3),
)
def test_the_fit_recovers_a_planted_read_cost(planted: int, write: int, noise: list[float]) -> None:
    """Rows whose ms is 1 + descriptors x READ cost (1% noise): the fit finds the READ cost."""

    def descs(r: BenchRow) -> int:
        return 2 * 36 * 2 * r.tokens  # a head slice a descriptor: every token, layer, K and V

    def run(r: BenchRow, fab: dict[str, int]) -> Prediction:
        ms = 1.0 + descs(r) * (fab.get(KEY) or fab["per_desc_ns"]) / 1e6
        return Prediction(r, r.room_mb / ms, ms)

    rows = [_pull(2, 1, t, 1.0) for t in (1024, 2048, 4096)]
    rows = [
        _pull(2, 1, r.tokens, run(r, {KEY: planted}).predicted_ms * (1 + e))
        for r, e in zip(rows, noise, strict=True)
    ]
    # same-TP pull and other flows are not the fit's: their READs (or writes) are few
    rows += [_pull(1, 1, 2048, 3.0), replace(_pull(2, 1, 2048, 3.0), flow="direct")]
    got = fit_read_desc(rows, {"per_desc_ns": write}, run)
    assert got is not None and got.rows == 3
    assert got.read_desc_us * 1000 == pytest.approx(planted, rel=0.03)
    assert got.mape_pct <= got.mape_before_pct


def test_the_fit_recovers_a_planted_read_cost_on_the_simulator() -> None:
    fab = {**QUIET, "per_desc_ns": 6_000}
    rows = []
    for tokens in (32, 64):
        shape = _pull(2, 1, tokens, 1.0)
        ms = predict(shape, "h100-rdma", {**fab, KEY: 4_000}).predicted_ms
        rows.append(_pull(2, 1, tokens, ms))
    got = fit_read_desc(rows, fab, lambda r, f: predict(r, "h100-rdma", f))
    assert got is not None and got.read_desc_us == pytest.approx(4.0, rel=0.03)
    assert got.mape_pct < 1 < got.mape_before_pct


def test_no_pull_row_with_unequal_tp_fits_nothing() -> None:
    rows = [_pull(1, 1, 2048, 3.0), replace(_pull(2, 1, 2048, 3.0), flow="direct")]
    assert read_rows(rows) == []
    assert fit_read_desc(rows, {"per_desc_ns": 6_000}, lambda r, f: Prediction(r, 1.0, 1.0)) is None


def test_a_pull_rooms_telemetry_without_reads_is_refused(tmp_path: Path) -> None:
    """Telemetry of a pull room taken before the bench recorded decode's READs: nothing in it."""
    path = tmp_path / "pull.json"
    path.write_text(json.dumps({"config": {"flow": "pull", "prefill_tp": 2}, "writes": []}))
    with pytest.raises(CalibrationError, match="without READs"):
        read_flow_telemetry([path])


def _read(start: float, descs: int, us: float) -> dict[str, object]:
    return {"op": "READ", "status": "DONE", "descs_posted": -1, "descs_requested": descs,
            "nbytes": 1 << 20, "start_us": start, "post_us": 1, "xfer_us": us}  # fmt: skip


@settings(max_examples=20, deadline=None)
@given(planted=st.floats(1.0, 15.0), shared=st.sampled_from([0.0, 2.0, 4.0]))
def test_the_posting_fit_reads_a_planted_read_cost_from_pull_telemetry(
    tmp_path_factory: pytest.TempPathFactory, planted: float, shared: float
) -> None:
    """Decode (TP 1) READs from two prefill ranks, one after the other: each READ's own time is
    post_cost + descriptors x max(read, 1 x shared); the fit recovers the READ cost."""
    from kvferry.sim.calibrate.posting import fit_flows

    post = 50.0
    reads, t = [], 0.0
    for descs in (147_456, 147_456, 294_912, 294_912):
        us = post + descs * max(planted, shared)
        reads.append(_read(t, descs, us))
        t += us
    path = tmp_path_factory.mktemp("tel") / "pull.json"
    cfg = {"flow": "pull", "prefill_tp": 2, "decode_tp": 1}
    path.write_text(json.dumps({"config": cfg, "writes": [], "reads": reads}))
    got = fit_flows([path], post)
    assert got.posting is None and got.host_gbps is None and got.read_rows == 4
    if planted >= shared:  # below the shared device's cost a READ cannot tell its own apart
        assert got.read_desc_us == pytest.approx(planted, rel=0.01)
        assert got.overrides()[KEY] == round(got.read_desc_us * 1000)
    assert read_flow_telemetry([path]) == ([], [])  # the READs never enter the WRITE fit's rows
