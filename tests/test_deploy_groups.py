"""One TP group stands for every rank: a deployment run on one of the identical TP groups of each
instance pair (the default) gives the same timings, request by request, as every rank run
(``every_rank``), once the fabric's per-transfer jitter (the only draw that differs in number)
is off. With jitter on, one group draws one jitter a hop where every rank waited for the latest
of several (a few microseconds earlier a hop, at most the jitter's 2 us a transfer and 10 us a
control message), so a request may join a neighbouring decode step; the cases below agree."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.core.geometry import ModelGeometry
from kvferry.sim import scenario as sc
from kvferry.sim.deploy import workload as wl
from kvferry.sim.deploy.run import build_scenario, run_world, simulate
from kvferry.sim.deploy.select import applicable_flows
from kvferry.sim.deploy.spec import DeploySpec
from kvferry.sim.deploy.world import DeployWorld

# (model, prefill TP, decode TP) with sharded heads on both sides (more than one group; with one
# group both runs build the same scenario), and one of one group for the baseline.
SHAPES = [
    ("qwen3-8b", 4, 2),
    ("qwen3-8b", 2, 4),
    ("qwen3-8b", 2, 2),
    ("llama-3.1-70b", 8, 4),
    ("qwen3-8b", 1, 2),
]


def test_groups_are_the_shared_divisor_of_sharded_heads() -> None:
    def groups(model: str, ptp: int, dtp: int) -> int:
        return DeploySpec(model=model, prefill_tp=ptp, decode_tp=dtp).rank_groups()

    assert groups("llama-3.1-70b", 8, 4) == 4
    assert groups("qwen3-8b", 4, 2) == 2
    assert groups("qwen3-8b", 2, 4) == 2
    assert groups("qwen3-8b", 1, 4) == 1
    assert groups("deepseek-v3", 4, 4) == 1  # MLA: every rank holds the whole latent
    assert groups("qwen3.5-397b-a17b", 4, 2) == 1  # 2 heads over 4 ranks: replicated


def _scenario(spec: DeploySpec, reqs: tuple[wl.DeployRequest, ...], plant: bool = False) -> sc.Scenario:
    longest = max(r.input_tokens for r in reqs)
    d: dict[str, Any] = spec.scenario_dict(longest, min(spec.chunk_tokens, longest))
    d["fabric"]["jitter_ns"] = 0
    d["fabric"]["control_jitter_ns"] = 0
    if plant:  # a wrong reduction: the group's ranks hold every head (twice the bytes or more)
        g = ModelGeometry.preset(spec.model)
        d["model"]["num_kv_heads"] = g.num_kv_heads
    return sc.parse(d, where="test")


def _tracks(spec: DeploySpec, reqs: tuple[wl.DeployRequest, ...], plant: bool = False) -> list[tuple]:
    arrivals = wl.Arrivals(requests=reqs)
    w = DeployWorld(spec, _scenario(spec, reqs, plant), arrivals, ())
    run_world(w, arrivals)
    assert not w.violations, w.violations[:3]
    return [
        (t.arrival_ns, t.first_token_ns, t.done_ns, t.kv_done_ns, tuple(t.chunk_ready_ns), t.failed)
        for _key, t in sorted(w.tracks.items())
    ]


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    flow_pick=st.integers(0, 7),
    serial=st.booleans(),
    allocator=st.sampled_from(["sglang", "lowest-first"]),
    p=st.integers(1, 2),
    d=st.integers(1, 2),
    rate=st.floats(2.0, 40.0),
    seed=st.integers(0, 10_000),
)
def test_one_group_runs_as_every_rank_request_by_request(
    shape: tuple[str, int, int],
    flow_pick: int,
    serial: bool,
    allocator: str,
    p: int,
    d: int,
    rate: float,
    seed: int,
) -> None:
    model, ptp, dtp = shape
    base = DeploySpec(
        model=model,
        prefill_tp=ptp,
        decode_tp=dtp,
        chunk_tokens=512,
        seed=seed,
        page_allocator=allocator,
        pull_orchestration="serial" if serial else "overlapped",
    )
    flows = applicable_flows(base)
    spec = replace(base, flow=flows[flow_pick % len(flows)], prefill_instances=p, decode_instances=d)
    reqs = tuple(wl.poisson(rate, 12, 1500, 8, seed=seed, spread=0.5))
    every = _tracks(replace(spec, every_rank=True), reqs)
    one = _tracks(spec, reqs)
    assert one == every, f"{spec}: replay with seed={seed}"


def test_a_wrong_reduction_is_caught() -> None:
    """The comparison can fail: a group whose ranks hold every head moves more bytes, later."""
    spec = DeploySpec(model="llama-3.1-70b", prefill_tp=8, decode_tp=4, flow="direct", chunk_tokens=512)
    reqs = tuple(wl.poisson(4.0, 6, 2048, 4, seed=1))
    assert _tracks(spec, reqs, plant=True) != _tracks(replace(spec, every_rank=True), reqs)


@pytest.mark.parametrize("flow", ["ring", "pull"])
def test_with_jitter_these_runs_agree_within_a_twentieth_of_a_millisecond(flow: str) -> None:
    spec = DeploySpec(model="llama-3.1-70b", prefill_tp=8, decode_tp=4, flow=flow, chunk_tokens=2048)
    reqs = wl.poisson(3.0, 24, 4096, 16, seed=2)
    every = simulate(replace(spec, every_rank=True), wl.Arrivals(requests=reqs))
    one = simulate(spec, wl.Arrivals(requests=reqs))
    assert one.completed == every.completed == 24
    for a, b in ((one.ttft_ms, every.ttft_ms), (one.tpot_ms, every.tpot_ms)):
        assert (a.p50, a.p99) == pytest.approx((b.p50, b.p99), abs=0.05)


def test_the_scenario_holds_one_group() -> None:
    spec = DeploySpec(model="llama-3.1-70b", prefill_tp=8, decode_tp=4)
    s = build_scenario(spec, (wl.DeployRequest(0, 1024, 4),))
    assert (s.topology.prefill_tp, s.topology.decode_tp, s.model.num_kv_heads) == (2, 1, 2)
    s = build_scenario(replace(spec, every_rank=True), (wl.DeployRequest(0, 1024, 4),))
    assert (s.topology.prefill_tp, s.topology.decode_tp, s.model.num_kv_heads) == (8, 4, 8)
