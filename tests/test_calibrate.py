"""Calibration: the fit recovers known parameters from noisy synthetic telemetry, its error is
measured on held-out sizes only, a written profile loads by name and changes the simulated
fabric, and the prediction beside a measurement runs the real simulator."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvferry.sim import scenario as sc
from kvferry.sim.calibrate import fit, inputs
from kvferry.sim.calibrate.inputs import CalibrationError, KernelRow, WriteRow
from kvferry.sim.calibrate.predict import BenchRow, Prediction, by_flow, predict, read_bench
from kvferry.sim.calibrate.rooms import TERMS, fit_rooms
from kvferry.sim.deploy import hardware
from typer.testing import CliRunner

from kvferry.cli import _register, app

ROOT = Path(__file__).resolve().parent.parent
CPU = ROOT / "bench" / "calibration" / "cpu-loopback"
TWO_ROWS = ROOT / "tests" / "data" / "bench-nixl-two-rows.jsonl"
_register()
runner = CliRunner()

# Known fabric: 150 us per post, 2 us per descriptor, 20 GB/s, 5 us one-way latency.
TRUE = {"post": 150.0, "desc": 2.0, "gbps": 20.0, "lat": 5.0}


def synthetic(seed: int, noise: float = 0.03) -> list[WriteRow]:
    """Writes timed by the simulator's own cost model, with multiplicative noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for nbytes in (4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20, 128 << 20, 256 << 20):
        for descs in (1, 72, 2_000, 20_000):
            for _ in range(3):
                post = TRUE["post"] + TRUE["desc"] * descs
                total = post + nbytes / (TRUE["gbps"] * 1e3) + 2 * TRUE["lat"]
                e1, e2 = rng.normal(1.0, noise, 2)
                rows.append(WriteRow(nbytes, descs, total * e1, post * e2, "synthetic"))
    return rows


def test_nnls_is_non_negative_and_optimal() -> None:
    rng = np.random.default_rng(3)
    a = rng.uniform(0, 1, (40, 3))
    b = a @ np.array([2.0, -1.5, 0.5]) + rng.normal(0, 0.01, 40)  # the free optimum is negative
    x = fit.nnls(a, b)
    assert np.all(x >= 0) and x[1] == 0
    # KKT: zero gradient on the support, a gradient >= 0 on the clamped coordinate.
    g = a.T @ (a @ x - b)
    assert np.allclose(g[x > 0], 0, atol=1e-8) and np.all(g[x == 0] >= -1e-8)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fit_recovers_known_parameters_from_noisy_telemetry(seed: int) -> None:
    f = fit.fit_fabric(synthetic(seed))
    assert f.bandwidth_gbps == pytest.approx(TRUE["gbps"], rel=0.05)
    assert f.per_desc_us == pytest.approx(TRUE["desc"], rel=0.05)
    assert f.post_cost_us == pytest.approx(TRUE["post"], rel=0.1)
    assert f.post_cost_us + 2 * f.latency_us == pytest.approx(TRUE["post"] + 2 * TRUE["lat"], rel=0.1)
    assert f.mape_heldout_pct < 6  # 3% noise


def test_split_holds_out_every_third_size_and_needs_three() -> None:
    kept, held = fit.split_sizes([5, 1, 2, 2, 3, 4, 6, 7])
    assert held == [2, 5] and kept == [1, 3, 4, 6, 7]
    with pytest.raises(CalibrationError, match="2 distinct transfer size"):
        fit.split_sizes([1, 1, 2])


def test_heldout_mape_is_computed_on_heldout_sizes_only() -> None:
    rows = synthetic(4, noise=0.0)
    _, held = fit.split_sizes([r.nbytes for r in rows])
    clean = fit.fit_fabric(rows)
    # Double the held-out sizes' times: the fit must not move, and their error is then 50%.
    off = [
        WriteRow(r.nbytes, r.descs, 2 * r.total_us, r.post_us, r.source) if r.nbytes in held else r
        for r in rows
    ]
    moved = fit.fit_fabric(off)
    assert moved.bandwidth_gbps == pytest.approx(clean.bandwidth_gbps)
    assert moved.mape_fit_pct == pytest.approx(clean.mape_fit_pct, abs=1e-6)
    assert moved.mape_heldout_pct == pytest.approx(50.0, abs=0.5)
    assert clean.mape_heldout_pct < 0.5


def test_kernel_fit_recovers_rate_and_launch() -> None:
    rows = [
        KernelRow(n, {"gather_gpu": 30e-6 + n / 1400e9, "scatter_gpu": 30e-6 + n / 1400e9}, None)
        for n in (10**7, 10**8, 10**9)
    ]
    k = fit.fit_kernels(rows)
    assert k.gpu_gbps == pytest.approx(1400, rel=1e-6) and k.pinned_gbps is None
    assert k.launch_us == pytest.approx(30, rel=1e-6)
    with_host = fit.fit_kernels([KernelRow(r.nbytes, r.seconds, 140.0) for r in rows])
    assert with_host.launch_us == 140.0  # the host's cost per call, as the h100 profile takes it


def test_failed_rows_are_dropped_and_unknown_posted_counts_use_the_request(tmp_path: Path) -> None:
    rec = {
        "descs_requested": 9,
        "descs_posted": 3,
        "nbytes": 100,
        "post_us": 5,
        "xfer_us": 7,
        "wall_ns": 9000,
    }
    writes = [
        {**rec, "status": "DONE"},
        {**rec, "status": "ERR", "xfer_us": 0},
        {**rec, "status": "DONE", "descs_posted": -1, "xfer_us": 0},
    ]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"writes": writes}))
    t = inputs.read_telemetry([p])
    assert (t.failed, t.requested_descs, t.wall_timed) == (1, 1, 1)
    assert [(r.descs, r.total_us) for r in t.rows] == [(3, 7.0), (9, 9.0)]


def _cli(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def test_cli_fits_the_checked_in_cpu_telemetry(tmp_path: Path) -> None:
    files = sorted(str(p) for p in CPU.glob("t*.json.*"))
    done = sum(w["status"] == "DONE" for f in files for w in json.loads(Path(f).read_text())["writes"])
    out = tmp_path / "p.toml"
    code, stdout, err = _cli("calibrate", *files, "--name", "t", "--out", str(out), "--json")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["rows_used"] + res["rows_heldout"] == done
    assert set(res["sizes_heldout_bytes"]).isdisjoint(res["sizes_fit_bytes"])
    prof = tomllib.loads(out.read_text())
    assert prof["kind"] == "fabric" and prof["fit"]["rows_used"] == res["rows_used"]
    assert prof["bandwidth_gbps"] == pytest.approx(res["fabric"]["bandwidth_gbps"], rel=1e-5)
    assert prof["fit"]["mape_heldout_pct"] == pytest.approx(res["mape_heldout_pct"], abs=0.01)
    code, stdout, _ = _cli("calibrate", *files, "--name", "t", "--out", str(out))
    assert code == 0 and "held out of the fit" in stdout and "MAPE" in stdout


@pytest.fixture
def fitted_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, fit.FabricFit]]:
    """A 10x slow fitted profile, written by the CLI into a private copy of the profile folder
    (this process only: tests running beside it still see the shipped folder)."""
    for f in hardware.folder().iterdir():
        if f.name.endswith(".toml"):
            (tmp_path / f.name).write_text(f.read_text())
    monkeypatch.setattr(hardware, "folder", lambda: tmp_path)
    rows = [WriteRow(r.nbytes, r.descs, r.total_us * 10, r.post_us * 10, r.source) for r in synthetic(5)]
    writes = [
        {"status": "DONE", "descs_requested": r.descs, "descs_posted": r.descs, "nbytes": r.nbytes}
        | {"post_us": round(r.post_us), "xfer_us": round(r.total_us), "wall_ns": 0}
        for r in rows
    ]
    tel = tmp_path / "slow.telemetry"
    tel.write_text(json.dumps({"writes": writes}))
    name = "test-slow"
    code, stdout, err = _cli("calibrate", str(tel), "--name", name, "--json")
    assert code == 0, err
    assert json.loads(stdout)["profile"] == str(tmp_path / f"{name}.toml")
    yield name, fit.fit_fabric(rows)


def test_written_profile_loads_by_name_and_changes_the_simulated_fabric(fitted_profile: tuple) -> None:
    name, f = fitted_profile
    nic = hardware.nic(name)
    assert nic.bandwidth_gbps == pytest.approx(f.bandwidth_gbps, rel=1e-5)
    assert name in hardware.names("fabric") and name in sc.fabric_profiles()
    spec = hardware.fabric_spec(hardware.gpu("h100"), nic)
    assert spec.nic.bandwidth_bps == int(nic.bandwidth_gbps * 1e9)
    assert spec.nic.per_desc_ns == int(nic.per_desc_us * 1000)
    s = sc.parse({"fabric": {"profile": name}})
    assert s.fabric.nic.bandwidth_bps == int(nic.bandwidth_gbps * 1e9)
    assert s.fabric.nic.per_desc_ns == round(nic.per_desc_us * 1000)
    assert sc.parse(tomllib.loads(sc.dump(s))).fabric == s.fabric  # round trip through a file
    # kvferry select's deployment model takes it as its NIC.
    from kvferry.sim.deploy.spec import DeploySpec

    deploy = DeploySpec(nic=name, prefill_tp=1, decode_tp=1)
    deploy.check()
    assert deploy.scenario_dict(256, 256)["fabric"]["bandwidth_gbps"] == pytest.approx(nic.bandwidth_gbps)
    # The same bench row predicts ~10x slower on the 10x slower fitted fabric.
    (row,) = [r for r in read_bench(TWO_ROWS) if r.flow == "direct"]
    fast = predict(row, "h100-rdma")
    slow = predict(row, name)
    assert slow.predicted_ms > 5 * fast.predicted_ms


def test_bench_predict_puts_the_simulation_beside_each_row() -> None:
    code, stdout, err = _cli("bench", "predict", str(TWO_ROWS), "--profile", "cpu-loopback", "--json")
    assert code == 0, err
    got = [json.loads(line) for line in stdout.splitlines()]
    want = [json.loads(line) for line in TWO_ROWS.read_text().splitlines()]
    assert [(g["flow"], g["measured_gbps"]) for g in got] == [(w["flow"], w["kvferry_gbps"]) for w in want]
    for g, w in zip(got, want, strict=True):
        assert g["ratio"] == pytest.approx(g["measured_gbps"] / g["predicted_gbps"])
        assert g["measured_ms"] == pytest.approx(w["kvferry_s"] * 1e3)  # the bench's own batch time
        assert g["unexplained_ms"] == pytest.approx(g["measured_ms"] - g["predicted_ms"])
        # predicted GB/s is the batch's bytes over the simulated time
        assert g["predicted_gbps"] == pytest.approx(g["room_mb"] * g["inflight"] / g["predicted_ms"])


def test_profile_text_is_valid_toml_whatever_the_source_paths() -> None:
    from kvferry.sim.calibrate import profile

    rows = synthetic(6)
    odd = ['a"b\\c', "x\ny\t\x1b\x7f", "é💥\u202e"]
    text = profile.render("t", fit.fit_fabric(rows), inputs.Telemetry(tuple(rows), 0, 0, 0), odd)
    assert tomllib.loads(text)["fit"]["sources"] == odd
    rooms = fit_rooms(_noisy_rows(0, 0.0), "h100-rdma", {}, simulate=_fake_sim)
    text = profile.render(
        "t", fit.fit_fabric(rows), inputs.Telemetry(tuple(rows), 0, 0, 0), odd, None, "", rooms, [odd[1]]
    )
    parsed = tomllib.loads(text)
    assert parsed["fit"]["room_sources"] == [odd[1]]
    assert parsed["control_latency_us"] == pytest.approx(rooms.control_latency_us, rel=1e-5)


# ---- the per-room control path (sim/calibrate/rooms.py)

# control message, completion delay, copy submit, staging message handled, control message sent,
# a room planned (TransferInfo or PullOffer handled), a notification or DONE handled
TRUE_US = (900.0, 1_700.0, 600.0, 400.0, 300.0, 500.0, 150.0, 250.0)
# Each cost's count on a batch's critical path, per flow and rooms in flight (what the simulator
# finds on the H100 profile: direct 1, 1, 0, 0, 1; ring 3, 1, 2, 2, 4; pull 2, 1, 0, 0, 2; eight
# rooms' copies, staging messages and sends queue on their ranks' threads).
PATH = {
    ("direct", 1): (1, 1, 0, 0, 1, 1, 2, 0),
    ("ring", 1): (3, 1, 2, 2, 4, 1, 2, 0),
    ("pull", 1): (2, 1, 0, 0, 2, 2, 1, 0),
    ("ring", 8): (3, 5, 6, 8, 17, 8, 8, 0),
    ("direct", 8): (1, 5, 0, 0, 8, 8, 10, 0),
    # as a TP 2->1 staged batch of 8: decode's thread grants both prefill ranks' requests
    ("pinned", 8): (3, 4, 6, 17, 37, 16, 12, 0),
    ("direct", 4): (1, 3, 0, 0, 4, 4, 6, 0),
    ("pull", 8): (2, 5, 0, 0, 9, 16, 8, 0),
    # a push room is a direct room that also pays its registration
    ("push", 1): (1, 1, 0, 0, 1, 1, 2, 1),
    ("push", 8): (1, 5, 0, 0, 8, 8, 10, 8),
}


def _costs(f: Any) -> tuple[float, ...]:
    host = (
        f.copy_submit_us,
        f.staging_handle_us,
        f.control_send_us,
        f.room_handle_us,
        f.completion_handle_us,
        f.push_handle_us,
    )
    return (f.control_latency_us, f.completion_delay_us, *host)


def _row(flow: str, tokens: int, measured_ms: float, inflight: int = 1) -> BenchRow:
    mb = tokens * 0.147
    return BenchRow(
        "tp1->1 nhd", "qwen3-8b", 1, 1, tokens, inflight, flow, mb, mb * inflight / measured_ms, 1.0
    )


def _wire_ms(row: BenchRow) -> float:
    return 0.2 + row.tokens * 0.001 * (3 if row.flow == "ring" else 1)


def _fake_sim(row: BenchRow, fab: dict[str, Any]) -> Prediction:
    """The simulator reduced to its linear response: wire time plus the path's counts."""
    n = PATH[row.flow, row.inflight]
    costs = [fab.get(t, 50_000 if t == "control_latency_ns" else 0) for t in TERMS]
    ms = _wire_ms(row) + sum(c * k for c, k in zip(costs, n, strict=True)) / 1e6
    return Prediction(row, row.room_mb * row.inflight / ms, ms)


def _noisy_rows(seed: int, noise: float) -> list[BenchRow]:
    rng = np.random.default_rng(seed)
    rows = []
    for tokens in (128, 256, 512, 1024, 2048, 4096):
        for (flow, inflight), n in PATH.items():
            truth = (
                _wire_ms(_row(flow, tokens, 1.0)) + sum(k * c for k, c in zip(n, TRUE_US, strict=True)) / 1e3
            )
            rows.append(_row(flow, tokens, truth * rng.normal(1.0, noise), inflight))
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_room_fit_recovers_known_costs_under_noise(seed: int) -> None:
    rows = _noisy_rows(seed, 0.01)
    f = fit_rooms(rows, "h100-rdma", {}, simulate=_fake_sim)
    got = _costs(f)
    assert got[0] == pytest.approx(TRUE_US[0], rel=0.1)  # control message
    assert got[5] == pytest.approx(TRUE_US[5], rel=0.1)  # a room's plan
    # A completion's delay and its handling go together (one and two of them on a single room),
    # as a copy's submit and a staging message do on every room but the batches of 8: under 1%
    # noise the fit trades one for the other; each pair's effect is held, each term less well.
    assert got[1] + 2 * got[6] == pytest.approx(TRUE_US[1] + 2 * TRUE_US[6], rel=0.05)
    assert got[1] == pytest.approx(TRUE_US[1], rel=0.15)
    assert got[2] + got[3] == pytest.approx(TRUE_US[2] + TRUE_US[3], rel=0.15)
    assert got[2:6] == pytest.approx(TRUE_US[2:6], rel=0.3)
    assert got[6] == pytest.approx(TRUE_US[6], rel=0.6)
    assert got[7] == pytest.approx(TRUE_US[7], rel=0.2)  # a push registration
    assert [c for c in f.counts] == [pytest.approx(PATH[r.flow, r.inflight]) for r in rows]
    assert f.tokens_heldout == (256, 2048) and f.rows_heldout == 20
    assert f.mape_heldout_pct < 6.0 < f.mape_heldout_without_pct


def test_room_fit_is_not_dragged_by_a_row_the_fabric_misses_for_another_reason() -> None:
    rows = _noisy_rows(3, 0.0)
    rows[0] = _row(rows[0].flow, rows[0].tokens, 40 * rows[0].room_mb / rows[0].measured_gbps)
    f = fit_rooms(rows, "h100-rdma", {}, simulate=_fake_sim)
    assert _costs(f) == pytest.approx(TRUE_US, rel=0.02)


def test_room_fit_with_rows_measured_apart_fits_every_row_and_checks_on_those() -> None:
    rows = _noisy_rows(4, 0.0)
    check = [r for r in _noisy_rows(5, 0.0) if r.tokens in (128, 4096)]
    f = fit_rooms(rows, "h100-rdma", {}, simulate=_fake_sim, check=check)
    assert f.rows_fit == len(rows) and f.rows_heldout == len(check)
    assert f.tokens_fit == (128, 256, 512, 1024, 2048, 4096) and f.tokens_heldout == (128, 4096)
    assert _costs(f) == pytest.approx(TRUE_US, rel=0.02)
    assert f.mape_heldout_pct < 0.5 < f.mape_heldout_without_pct
    # every checked row is simulated with the fit (the predictions cover both sets, in order)
    assert [p.row for p in f.predictions] == [*rows, *check]
    from kvferry.sim.calibrate import profile

    tel = synthetic(6)
    text = profile.render(
        "t", fit.fit_fabric(tel), inputs.Telemetry(tuple(tel), 0, 0, 0), ["a"],
        None, "", f, ["fit.jsonl"], None, 0.0, "fitted", ["check.jsonl"],
    )  # fmt: skip
    parsed = tomllib.loads(text)["fit"]
    assert parsed["room_sources"] == ["fit.jsonl"] and parsed["room_check_sources"] == ["check.jsonl"]
    code, _, err = _cli("calibrate", "x.json", "--name", "t", "--rooms-check", str(TWO_ROWS))
    assert code != 0 and "--rooms-check" in err and "--rooms" in err


def test_room_fit_needs_three_room_sizes() -> None:
    rows = [r for r in _noisy_rows(0, 0.0) if r.tokens in (128, 256)]
    with pytest.raises(CalibrationError, match="fewer than 3 distinct --tokens"):
        fit_rooms(rows, "h100-rdma", {}, simulate=_fake_sim)


def test_each_room_cost_adds_its_amount_to_a_simulated_room() -> None:
    """On the real simulator: a direct TP 1 -> 1 room has one control message (decode's
    TransferInfo) and one completion (the KV write's notification) on its critical path, so each
    microsecond of either adds one microsecond to the room; a staged room waits on two."""
    (direct,) = [r for r in read_bench(TWO_ROWS) if r.flow == "direct"]
    (ring,) = [r for r in read_bench(TWO_ROWS) if r.flow == "ring"]
    quiet = {"control_latency_ns": 0, "control_jitter_ns": 0, "jitter_ns": 0}
    # a staged room's chunk asks for its slot (StagingReq, StagingRsp) while decode's TransferInfo
    # travels: two messages on its path once the peers are connected (the warm-up room)
    for row, n_ctrl in ((direct, 1), (ring, 2)):
        t0 = predict(row, "h100-rdma", quiet).predicted_ms
        t_ctrl = predict(row, "h100-rdma", {**quiet, "control_latency_ns": 2_000_000}).predicted_ms
        t_comp = predict(row, "h100-rdma", {**quiet, "completion_delay_ns": 2_000_000}).predicted_ms
        # (the staged room's third message overlaps its gather by a few microseconds)
        assert t_ctrl - t0 == pytest.approx(2.0 * n_ctrl, abs=0.015 * n_ctrl)
        assert t_comp - t0 == pytest.approx(2.0, abs=0.01)


def test_cli_fits_the_room_costs_into_the_profile(tmp_path: Path) -> None:
    files = sorted(str(p) for p in CPU.glob("t*.json.*"))
    out = tmp_path / "p.toml"
    args = ("calibrate", *files, "--name", "t", "--out", str(out), "--rooms", str(CPU / "bench.jsonl"))
    code, stdout, err = _cli(*args, "--json")
    assert code == 0, err
    res = json.loads(stdout)["rooms"]
    assert res["rows_used"] + res["rows_heldout"] == len(read_bench(CPU / "bench.jsonl"))
    prof = tomllib.loads(out.read_text())
    assert prof["control_latency_us"] == pytest.approx(res["control_latency_us"], rel=1e-5)
    assert prof["completion_delay_us"] == pytest.approx(res["completion_delay_us"], rel=1e-5, abs=1e-9)
    assert prof["fit"]["room_mape_heldout_pct"] == pytest.approx(res["mape_heldout_pct"], abs=0.01)
    # What the profile says is what it does: the held-out MAPE is lower with the room costs.
    assert res["mape_heldout_pct"] < res["mape_heldout_without_pct"]
    # no pull row with unequal TP: no READ cost of its own, and the profile says why
    assert json.loads(stdout)["read"] is None and "read_desc_us" not in prof
    assert "READs cost per_desc_us a descriptor: not fitted (no pull row with unequal TP" in out.read_text()
    # rows measured before the bench ran a process a rank: the fit says so
    n_shared = sum(r.prefill_tp > 1 for r in read_bench(CPU / "bench.jsonl"))
    assert f"note: {n_shared} of 20 rows ran a side's TP ranks in one process" in err


def test_a_profile_with_room_costs_sets_the_fabric_and_bad_values_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hardware, "folder", lambda: tmp_path)
    base = 'kind = "fabric"\nbandwidth_gbps = 10\nlatency_us = 1\npost_cost_us = 2\nper_desc_us = 0.5\n'
    (tmp_path / "rc.toml").write_text(
        base + 'name = "rc"\ncontrol_latency_us = 1500\ncompletion_delay_us = 800\n'
    )
    s = sc.parse({"fabric": {"profile": "rc"}})
    assert s.fabric.control.latency_ns == 1_500_000 and s.fabric.nic.completion_delay_ns == 800_000
    gpu = hardware.GpuProfile("g", 1.0, 1.0, 80.0, 64.0, 1440.0, 51.0, 140.0, 0.5, 0.8, 4000.0, 2000.0, 0.9)
    spec = hardware.fabric_spec(gpu, hardware.nic("rc"))
    assert spec.control.latency_ns == 1_500_000 and spec.nic.completion_delay_ns == 800_000
    for bad in ("-1", "nan", "inf", '"fast"', "true"):
        (tmp_path / "bad.toml").write_text(base + f'name = "bad"\ncontrol_latency_us = {bad}\n')
        with pytest.raises(hardware.ProfileError, match="control_latency_us must be a number >= 0"):
            hardware.nic("bad")
    with pytest.raises(sc.ScenarioError, match="completion_delay_ns"):
        sc.parse({"fabric": {"completion_delay_ns": -5}})


def test_room_fit_recovers_known_costs_from_the_real_simulator_under_noise() -> None:
    """Rows 'measured' on the simulator itself with known per-room costs, 2% noise: the fit, which
    finds each row's counts by simulation, gets the costs back (direct, pull and staged rooms, one
    and eight in flight), the three kinds of host work on a rank's thread included."""
    truth = {
        "control_latency_ns": 800_000,
        "completion_delay_ns": 1_200_000,
        "kernel_submit_ns": 600_000,
        "staging_handle_ns": 300_000,
        "control_send_ns": 200_000,
        "room_handle_ns": 500_000,
        "completion_handle_ns": 100_000,
        "push_handle_ns": 400_000,
    }
    rows = _measured(truth, (("direct", 1), ("pull", 1), ("ring", 1), ("ring", 8), ("direct", 8)), 7)
    f = fit_rooms(rows, "h100-rdma", {})
    ctrl, comp, submit, staging, send, room, handle, push = _costs(f)
    assert ctrl == pytest.approx(800, rel=0.15)
    assert comp == pytest.approx(1_200, rel=0.15)
    # Decode's send of the TransferInfo and prefill's plan of the room lie one after the other on
    # every direct room and queue alike in a batch: their sum is held, each alone is not. On TP
    # 1 -> 1 rows a copy goes with a staging message, and the fit trades both with the other host
    # work under 2% noise (their sum comes out 0.6-0.9 ms of the planted 0.9): what is checked of
    # them is the rows they predict.
    assert send + room == pytest.approx(700, rel=0.15)
    assert 0.5 < (submit + staging) / 900 < 1.15
    assert handle < 300
    assert push == 0  # no push row: nothing to fit it to, and no other row moves with it
    assert f.mape_heldout_pct < 6.0


def _measured(
    truth: dict[str, int], kinds: tuple[tuple[str, int], ...], seed: int, noise: float = 0.02
) -> list[BenchRow]:
    """Rows 'measured' on the real simulator with the costs ``truth``, under ``noise``."""
    rng = np.random.default_rng(seed)
    rows = []
    for tokens in (64, 128, 256, 512, 1024):
        for flow, inflight in kinds:
            probe = _row(flow, tokens, 1.0, inflight)
            ms = predict(probe, "h100-rdma", truth).predicted_ms * rng.normal(1.0, noise)
            rows.append(_row(flow, tokens, ms, inflight))
    return rows


def test_room_fit_recovers_a_push_registrations_cost_beside_the_direct_rooms() -> None:
    """Push rooms are direct rooms that also pay their registration on prefill's thread: with
    direct and push rows of 1 and 8 rooms in flight, the fit finds the push-only cost, and a
    profile fitted without it predicts push as fast as direct."""
    truth = {"control_latency_ns": 800_000, "room_handle_ns": 500_000, "push_handle_ns": 400_000}
    kinds = (("direct", 1), ("direct", 8), ("push", 1), ("push", 8))
    rows = _measured(truth, kinds, 9, noise=0.01)
    f = fit_rooms(rows, "h100-rdma", {})
    push = _costs(f)[7]
    # Within half of it either way: on eight rooms in flight a registration queues on prefill's
    # thread as often as a room's plan does, so under noise the fit trades the two a little.
    assert 200 < push < 600
    assert f.mape_heldout_pct < 5.0
    direct = [r for r in rows if r.flow == "direct"]
    plain = fit_rooms(direct, "h100-rdma", {}, check=[r for r in rows if r.flow == "push"])
    assert _costs(plain)[7] == 0 and plain.mape_heldout_pct > 2 * f.mape_heldout_pct


def test_by_flow_reports_the_spread_of_repeated_rows() -> None:
    # Two runs of one configuration (10 and 12 ms) and one of another, all predicted at 11 ms.
    rows = [_row("direct", 1024, 10.0, 8), _row("direct", 1024, 12.0, 8), _row("direct", 2048, 11.0, 8)]
    preds = [Prediction(r, r.room_mb * r.inflight / 11.0, 11.0) for r in rows]
    (e,) = by_flow(preds)
    assert e.rows == 3
    assert e.spread_pct == pytest.approx(20.0)  # (12 - 10) / 10
    assert e.mape_pct == pytest.approx(100 * (1 / 10 + 1 / 12 + 0) / 3)
    assert e.median_mape_pct == pytest.approx(0.0)  # 11 is both configurations' median
    (single,) = by_flow(preds[2:])
    assert single.spread_pct is None


def test_one_slow_machine_moves_the_median_not_the_error_against_it() -> None:
    # Three runs of one configuration, predicted at 10 ms: two at 10, one machine at 20.
    rows = [_row("ring", 1024, ms, 8) for ms in (10.0, 20.0, 10.0)]
    preds = [Prediction(r, r.room_mb * r.inflight / 10.0, 10.0) for r in rows]
    (e,) = by_flow(preds)
    assert e.median_mape_pct == pytest.approx(0.0)
    assert e.mape_pct == pytest.approx(100 * (0 + 0.5 + 0) / 3)
    assert e.spread_pct == pytest.approx(100.0)


def test_by_flow_groups_per_tp_pair_when_asked() -> None:
    one = _row("ring", 1024, 10.0)
    rows = [
        one,
        replace(one, prefill_tp=2, config="tp2->1 nhd"),
        replace(one, decode_tp=2, config="tp1->2 nhd"),
    ]
    preds = [Prediction(r, r.room_mb / 10.0, 10.0) for r in rows]
    assert [e.tp for e in by_flow(preds)] == ["equal", "unequal"]
    assert [(e.tp, e.rows) for e in by_flow(preds, pairs=True)] == [("1->1", 1), ("1->2", 1), ("2->1", 1)]
    assert [(e.tp, e.rows) for e in by_flow(preds, all_tp=True)] == [("all", 3)]
    with pytest.raises(ValueError, match="two different groupings"):
        by_flow(preds, pairs=True, all_tp=True)


def test_a_group_judged_exactly_right_on_its_medians_counts_as_within(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # One configuration's runs at 10 and 30 ms around a prediction of 20: every row is 50% or
    # 100% off, the median (20) is met exactly: the summary counts the group as within 10%.
    from kvferry.commands.calibrate import _print_by_flow

    rows = [_row("ring", 1024, ms, 8) for ms in (10.0, 30.0)]
    preds = [Prediction(r, r.room_mb * r.inflight / 20.0, 20.0) for r in rows]
    _print_by_flow(preds, frozenset(), False, True)
    assert "0 of 1 groups within 10%, 1 on the medians" in capsys.readouterr().out.splitlines()[-1]
