"""Push's runs are direct's where a push registration costs no host work (``DeploySpec.runs_as``),
and the capacity search and ``select`` take direct's runs for push there instead of simulating
them again; where it costs some, push runs its own."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.sim.deploy import capacity, hardware
from kvferry.sim.deploy import workload as wl
from kvferry.sim.deploy.capacity import Workload, search, steady_run
from kvferry.sim.deploy.select import LoadPoint, select
from kvferry.sim.deploy.spec import DeploySpec

from tests import executor_jobs as fns

# A calibrated profile whose control path charges a push registration (push_handle_us > 0).
CHARGED = "h200-nixl-ranks"


def test_push_runs_as_direct_only_where_its_registration_costs_nothing() -> None:
    assert DeploySpec(flow="push").runs_as() == "direct"
    assert DeploySpec(flow="push", control_path=CHARGED).runs_as() == "push"
    for flow in ("direct", "ring", "pinned", "pull", "layerwise"):
        assert DeploySpec(flow=flow).runs_as() == flow


@settings(max_examples=10, deadline=None)
@given(
    tp=st.sampled_from([(2, 2), (4, 2), (2, 4), (1, 1)]),
    instances=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    rate=st.sampled_from([2.0, 12.0, 40.0, 120.0]),  # below capacity to overloaded
    seed=st.integers(0, 1000),
    spread=st.sampled_from([0.0, 0.5]),
)
def test_a_push_run_is_the_direct_run_request_for_request(
    tp: tuple[int, int], instances: tuple[int, int], rate: float, seed: int, spread: float
) -> None:
    spec = DeploySpec(
        model="qwen3-8b", prefill_tp=tp[0], decode_tp=tp[1], seed=seed,
        prefill_instances=instances[0], decode_instances=instances[1],
    )  # fmt: skip
    w = Workload(2048, 64, duration_s=4.0, warmup_s=1.0, spread=spread)
    direct = steady_run(spec, rate, w, target=0.9)
    push = steady_run(replace(spec, flow="push"), rate, w, target=0.9)
    assert push.flow == "push" and direct.requests > 0
    assert push.same_run(direct), (spec, rate)


@pytest.fixture
def slow_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every NIC's push registration holds prefill's runtime thread 60 ms: on the critical path (a
    calibrated profile's 0.17 ms hides behind the prompt's compute in these runs)."""
    nic = hardware.nic
    monkeypatch.setattr(hardware, "nic", lambda name: replace(nic(name), push_handle_us=60_000.0))


@pytest.mark.usefixtures("slow_registration")
def test_where_a_registration_costs_host_work_the_runs_differ() -> None:
    """The comparison above can fail: push's requests wait for their registration, and the runs
    are no longer the same."""
    spec = DeploySpec(model="qwen3-8b", prefill_tp=2, decode_tp=2, flow="push")
    assert spec.runs_as() == "push"
    w = Workload(2048, 64, duration_s=4.0, warmup_s=1.0)
    push = steady_run(spec, 12.0, w, target=0.9)
    direct = steady_run(replace(spec, flow="direct"), 12.0, w, target=0.9)
    assert not push.same_run(direct)
    assert push.ttft_ms.p50 > direct.ttft_ms.p50


@pytest.mark.parametrize("rate", [None, 3.0])
@pytest.mark.parametrize("control_path", ["", CHARGED])
def test_the_capacity_search_takes_directs_runs_for_push(
    monkeypatch: pytest.MonkeyPatch, rate: float | None, control_path: str
) -> None:
    """Made-up runs (a threshold per flow, push's as direct's): with the twin, every push
    configuration judged has direct's maximum and verdict, no run of its own but the check's one,
    and direct's results relabelled; without it (a charged registration), push runs its own."""
    ran: list[str] = []

    def runs(job: tuple) -> list[fns.ThresholdRun]:  # type: ignore[type-arg]
        ran.append(job[0].flow)
        return fns.capacity_by_threshold(job)

    monkeypatch.setattr(capacity, "_runs", runs)
    monkeypatch.setattr(capacity, "meets", lambda rs, target: rs[0].met)
    spec = DeploySpec(model="llama-3.1-70b", prefill_tp=8, decode_tp=4, control_path=control_path)
    cap = search(spec, [(8, 4)], lambda s: ["direct", "push"], Workload(8192, 500), rate, max_instances=3)
    by = {(c.flow, c.prefill, c.decode): c for c in cap.candidates}
    judged = [c for c in cap.candidates if c.flow == "push" and (c.met is not None or c.max_rps is not None)]
    assert judged
    for c in judged:
        d = by[("direct", c.prefill, c.decode)]
        if control_path:
            assert c.runs_of == ""
            continue
        assert c.runs_of == "direct" and c.max_rps_runs == 0
        assert (c.met, c.max_rps, c.max_rps_below) == (d.met, d.max_rps, d.max_rps_below)
        assert [r.flow for r in c.results] == ["push"] * len(d.results)
        if rate is None:  # (the made-up runs have no latencies for the table with a rate)
            assert c.as_dict(rate)["runs_of"] == "direct"
    # with the twin, push's one run is the check's (its smallest configuration, beside direct's)
    assert ran.count("push") > 1 if control_path else ran.count("push") == 1
    if not control_path and cap.answer is not None and cap.answer.flow == "direct":
        # said once, as the same simulation, not as a tie broken by staging memory
        assert "push ran as direct here" in cap.reason and "with push (" not in cap.reason, cap.reason


def _points() -> list[LoadPoint]:
    return [
        LoadPoint(f"{r:g} req/s", wl.Arrivals(requests=wl.poisson(r, 24, 1024, 32, 1))) for r in (8.0, 30.0)
    ]


def test_select_takes_directs_runs_for_push_once_its_first_run_is_directs() -> None:
    spec = DeploySpec(model="qwen3-8b", prefill_tp=2, decode_tp=2)
    said: list[str] = []
    got = select(spec, _points(), ["push", "direct"], progress=said.append)  # direct runs first
    assert [r.flow for r in got.results["push"]] == ["push", "push"]
    assert all(p.same_run(d) for p, d in zip(got.results["push"], got.results["direct"], strict=True))
    push = [line for line in said if " push at " in line]
    assert "direct's run" not in push[0] and "direct's run" in push[1], said
    assert got.runs_of == {"push": "direct"} and got.as_dict()["runs_of"] == {"push": "direct"}


@pytest.mark.usefixtures("slow_registration")
def test_select_runs_push_where_its_registration_costs_host_work() -> None:
    spec = DeploySpec(model="qwen3-8b", prefill_tp=2, decode_tp=2)
    said: list[str] = []
    got = select(spec, _points(), ["direct", "push"], progress=said.append)
    assert not got.results["push"][0].same_run(got.results["direct"][0])
    assert not any("direct's run" in s for s in said), said
    assert got.runs_of == {}


def _ring_claims_directs_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted wrong twin: ring said to run as direct (its staged hops make it another run)."""
    runs_as = DeploySpec.runs_as
    monkeypatch.setattr(
        DeploySpec, "runs_as", lambda self: "direct" if self.flow == "ring" else runs_as(self)
    )


def test_a_wrong_twin_is_found_by_the_first_run_and_runs_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    _ring_claims_directs_runs(monkeypatch)
    spec = DeploySpec(model="qwen3-8b", prefill_tp=2, decode_tp=2)
    said: list[str] = []
    got = select(spec, _points(), ["direct", "ring"], progress=said.append)
    assert any("ring's run at 8 req/s is not direct's here" in s for s in said), said
    assert not any("direct's run" in s for s in said), said
    assert not got.results["ring"][1].same_run(got.results["direct"][1]) and got.runs_of == {}
    said.clear()
    w = Workload(1024, 32, duration_s=4.0, warmup_s=1.0)
    cap = search(spec, [(2, 2)], lambda s: ["direct", "ring"], w, None, max_instances=1, progress=said.append)
    assert any("ring at TP2->TP2: its run of 1P x TP2 + 1D x TP2 is not direct's" in s for s in said), said
    ring = next(c for c in cap.candidates if c.flow == "ring")
    assert ring.runs_of == "" and ring.max_rps_runs > 0
