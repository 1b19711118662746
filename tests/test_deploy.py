"""The deployment model: hardware profiles, rooflines, arrivals, and whole runs whose KV goes
through the real core engines and flows over the simulated fabric."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.core.geometry import PRESETS
from kvferry.sim.deploy import hardware
from kvferry.sim.deploy import workload as wl
from kvferry.sim.deploy.compute import Roofline, weights
from kvferry.sim.deploy.metrics import transfer_split
from kvferry.sim.deploy.run import simulate
from kvferry.sim.deploy.spec import DeployError, DeploySpec

# ---- profiles ---------------------------------------------------------------------------------


def test_shipped_profiles_load() -> None:
    assert set(hardware.names("gpu")) >= {"h100", "h200"}
    assert set(hardware.names("nic")) >= {"nic-100g", "nic-200g", "nic-400g"}
    h100, h200 = hardware.gpu("h100"), hardware.gpu("h200")
    assert h200.hbm_tbps > h100.hbm_tbps and h200.hbm_gb > h100.hbm_gb
    rates = [hardware.nic(n).bandwidth_gbps for n in ("nic-100g", "nic-200g", "nic-400g")]
    assert rates == [12.5, 25.0, 50.0]
    fab = hardware.fabric_spec(h100, hardware.nic("nic-400g"))
    assert fab.nic.bandwidth_bps == 50_000_000_000 and fab.nic.per_desc_ns == 505


@pytest.mark.parametrize("name", ["", "nope", "../h100", "h100\0", "a/b"])
def test_unknown_profile_is_a_clear_error(name: str) -> None:
    with pytest.raises(hardware.ProfileError, match="unknown hardware profile"):
        hardware.gpu(name)


def test_a_nic_is_not_a_gpu() -> None:
    with pytest.raises(hardware.ProfileError, match="not a gpu profile"):
        hardware.gpu("nic-400g")


# ---- compute ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "published_b"),
    [("qwen3-8b", 8.19), ("llama-3.1-70b", 70.6), ("deepseek-v3", 671.0)],
)
def test_weights_match_the_published_parameter_counts(name: str, published_b: float) -> None:
    w = weights(PRESETS[name])
    total = (
        w.dense_layers * (w.attn + w.dense_mlp) + w.moe_layers * (w.attn + w.num_experts * w.expert) + w.embed
    )
    assert abs(total / 1e9 - published_b) / published_b < 0.03


def test_deepseek_activates_about_37b_parameters_per_token() -> None:
    assert 34e9 < weights(PRESETS["deepseek-v3"]).active_per_token() < 40e9


@settings(max_examples=50, deadline=None)
@given(
    model=st.sampled_from(sorted(PRESETS)),
    tokens=st.integers(1, 16384),
    ctx=st.integers(0, 32768),
    batch=st.integers(1, 512),
)
def test_step_times_grow_with_work(model: str, tokens: int, ctx: int, batch: int) -> None:
    r = Roofline(PRESETS[model], hardware.gpu("h100"), 8)
    assert r.prefill_ns(tokens + 1, ctx) >= r.prefill_ns(tokens, ctx) > 0
    assert r.prefill_ns(tokens, ctx + 1) >= r.prefill_ns(tokens, ctx)
    assert r.decode_ns(batch + 1, ctx + batch) >= r.decode_ns(batch, ctx) > 0
    # A faster GPU (more HBM bandwidth) is never slower.
    fast = Roofline(PRESETS[model], hardware.gpu("h200"), 8)
    assert fast.decode_ns(batch, ctx) <= r.decode_ns(batch, ctx)


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    g = hardware.gpu("h100")
    r = Roofline(PRESETS["llama-3.1-70b"], g, 4)
    overhead = int(g.decode_step_overhead_us * 1000)
    weights_time = 2 * weights(PRESETS["llama-3.1-70b"]).read_per_step(1) / (g.hbm_bps * 4) * 1e9
    assert r.decode_ns(1, 100) == pytest.approx(overhead + weights_time, rel=0.01)
    flops_time = 2 * weights(PRESETS["llama-3.1-70b"]).active_per_token() * 8192 / (g.flops * 4) * 1e9
    assert r.prefill_ns(8192, 0) > flops_time


def test_a_model_too_big_for_the_gpu_is_refused() -> None:
    with pytest.raises(DeployError, match="does not fit a h100"):
        DeploySpec(model="deepseek-v3", prefill_tp=8, decode_tp=8).pages("decode")


# ---- arrivals -------------------------------------------------------------------------------------


def test_poisson_is_reproducible_and_has_the_asked_rate() -> None:
    a = wl.poisson(50.0, 2000, 1000, 100, seed=3)
    assert a == wl.poisson(50.0, 2000, 1000, 100, seed=3)
    assert a != wl.poisson(50.0, 2000, 1000, 100, seed=4)
    span_s = a[-1].arrival_ns / 1e9
    assert 2000 / span_s == pytest.approx(50.0, rel=0.1)


def test_trace_files_jsonl_and_csv(tmp_path: Path) -> None:
    j = tmp_path / "t.jsonl"
    j.write_text(
        json.dumps({"arrival_s": 0.5, "input_tokens": 100, "output_tokens": 5, "prefix_hit_tokens": 40})
        + "\n\n"
        + json.dumps({"arrival_s": 0.1, "input_tokens": 7, "output_tokens": 3})
        + "\n"
    )
    reqs = wl.load_trace(j)
    assert [r.arrival_ns for r in reqs] == [100_000_000, 500_000_000]
    assert reqs[1].prefix_hit_tokens == 40 and reqs[0].prefix_hit_tokens == 0
    c = tmp_path / "t.csv"
    c.write_text("arrival_s,input_tokens,output_tokens\n0,10,2\n1.5,20,4\n")
    assert [r.input_tokens for r in wl.load_trace(c)] == [10, 20]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{", "t.jsonl:1: not JSON"),
        ('{"arrival_s": 0, "input_tokens": 5}', "t.jsonl:1: missing output_tokens"),
        ('{"arrival_s": -1, "input_tokens": 5, "output_tokens": 1}', "arrival_s must be >= 0"),
        ('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1, "prefix_hit_tokens": 5}', "below input"),
        ('{"arrival_s": 0, "input_tokens": 2.5, "output_tokens": 1}', "non-negative integer"),
        ("", "no requests"),
    ],
)
def test_bad_traces_name_the_line(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(text)
    with pytest.raises(wl.WorkloadError, match=needle):
        wl.load_trace(p)


# ---- whole runs ------------------------------------------------------------------------------------

SPEC = DeploySpec(model="qwen3-8b", prefill_tp=4, decode_tp=2, chunk_tokens=512)


def _closed(
    c: int, n: int, isl: int = 1000, osl: int = 20
) -> tuple[wl.Arrivals, tuple[wl.DeployRequest, ...]]:
    return wl.closed_loop(c, n, isl, osl, seed=1)


@pytest.mark.parametrize("flow", ["direct", "ring", "pinned"])
def test_every_flow_completes_every_request_with_no_violation(flow: str) -> None:
    r = simulate(replace(SPEC, flow=flow), *_closed(4, 12))
    assert r.violations == [], f"seed {r.seed}"
    assert (r.completed, r.failed, r.unfinished) == (12, 0, 0)
    assert r.ttft_ms.p50 > 0 and r.tpot_ms.p50 > 0 and r.e2e_ms.p50 > r.ttft_ms.p50
    # The split follows one write's timeline from the last chunk to Success: it sums to the
    # transfer time of each request, so their means agree.
    assert sum(r.split_ms.values()) == pytest.approx(r.transfer_ms.mean, rel=1e-6)
    assert (r.extra_memory_bytes["decode_ring"] > 0) == (flow == "ring")
    assert (r.extra_memory_bytes["decode_pinned"] > 0) == (flow == "pinned")


def test_per_token_direct_slices_cost_posting_and_staging_removes_it() -> None:
    # TP 4 -> 2: direct posts one descriptor per token, layer and K|V (SGLang PR 22536's problem).
    direct = simulate(replace(SPEC, flow="direct"), *_closed(4, 12))
    ring = simulate(replace(SPEC, flow="ring"), *_closed(4, 12))
    assert direct.split_ms["posting"] > 10 * ring.split_ms["posting"]
    assert direct.ttft_ms.p50 > 1.5 * ring.ttft_ms.p50  # RDMA verbs: about 0.5 us a descriptor
    # cuda_ipc costs 20x more a descriptor (10 us on our H100): there direct slices are ruinous.
    ipc = simulate(replace(SPEC, flow="direct", nic="nvlink-cuda-ipc"), *_closed(4, 12))
    assert ipc.ttft_ms.p50 > 20 * ring.ttft_ms.p50
    assert abs(direct.tpot_ms.p50 - ring.tpot_ms.p50) / ring.tpot_ms.p50 < 0.2  # TPOT comparable


def test_runs_are_reproducible_from_the_seed() -> None:
    a = simulate(replace(SPEC, flow="ring"), wl.Arrivals(requests=wl.poisson(20.0, 10, 500, 10, seed=2)))
    b = simulate(replace(SPEC, flow="ring"), wl.Arrivals(requests=wl.poisson(20.0, 10, 500, 10, seed=2)))
    assert a.ttft_ms == b.ttft_ms and a.tpot_ms == b.tpot_ms and a.split_ms == b.split_ms


def test_prefix_hits_skip_compute_not_the_transfer() -> None:
    cold = (wl.DeployRequest(0, 4000, 5),)
    warm = (wl.DeployRequest(0, 4000, 5, prefix_hit_tokens=3500),)
    spec = replace(SPEC, flow="ring", chunk_tokens=4096)
    a = simulate(spec, wl.Arrivals(requests=cold))
    b = simulate(spec, wl.Arrivals(requests=warm))
    assert b.ttft_ms.p50 < a.ttft_ms.p50
    assert b.transfer_ms.p50 == pytest.approx(a.transfer_ms.p50, rel=0.05)


def test_more_load_means_more_queueing() -> None:
    light = simulate(replace(SPEC, flow="ring"), *_closed(1, 6))
    heavy = simulate(replace(SPEC, flow="ring"), *_closed(16, 32))
    assert heavy.ttft_ms.p50 > light.ttft_ms.p50


def test_transfer_split_parts_sum_to_the_whole() -> None:
    parts = transfer_split(100, 900, [(1, 150, 400, 700, 710), (1, 120, 130, 300, 301)], picked_ns=120)
    assert parts == {"queue": 20, "staging": 30, "posting": 250, "wire": 300, "scatter": 200}
    unknown = transfer_split(100, 900, [(1, 150, 400, 700, 710)])
    assert unknown is not None and unknown["queue"] == 0 and unknown["staging"] == 50
    assert transfer_split(100, 900, []) is None


def test_more_instances_share_the_load() -> None:
    reqs = wl.poisson(40.0, 40, 1000, 20, seed=5)
    one = simulate(replace(SPEC, flow="ring"), wl.Arrivals(requests=reqs))
    two = simulate(
        replace(SPEC, flow="ring", prefill_instances=2, decode_instances=2), wl.Arrivals(requests=reqs)
    )
    assert two.completed == one.completed == 40 and two.violations == []
    assert two.ttft_ms.p99 <= one.ttft_ms.p99
    assert [two.instances[f"prefill{i}"]["requests"] for i in range(2)] == [20, 20]  # round-robin
    with pytest.raises(DeployError, match="decode_instances must be in"):
        replace(SPEC, prefill_instances=2, decode_instances=0).check()


def test_timing_only_registrations_take_no_memory_but_keep_their_bounds() -> None:
    from kvferry.backends.simfabric.descriptors import DescList
    from kvferry.backends.simfabric.errors import RegionAccessError
    from kvferry.backends.simfabric.transport import AUX_REGION
    from kvferry.sim import scenario as sc
    from kvferry.sim.world import World

    s = sc.load(
        Path(__file__).resolve().parent.parent / "scenarios" / "presets" / "llama-3.1-70b-16k-tp8-tp8.toml"
    )
    w = World(s)
    mem = w.fabric.node("decode0").memory
    sizes = mem.sizes()
    kv = [rid for rid in sizes if rid != AUX_REGION]
    assert sum(sizes[r] for r in kv) > 500 << 20  # hundreds of MB of pool on paper...
    assert all(mem.region(r).strides == (0,) for r in kv)  # ...backed by one byte
    assert mem.region(AUX_REGION).flags.writeable  # aux rows are real: decode reads room ids there
    rid = kv[0]
    bad = DescList(*(np.array([x], dtype=np.int64) for x in (rid, 0, rid, sizes[rid] - 8, 16)))
    with pytest.raises(RegionAccessError, match="falls outside"):
        w.fabric.post("prefill0", "prefill0", "decode0", bad, notif=None)


@settings(max_examples=50, deadline=None)
@given(
    model=st.sampled_from(sorted(PRESETS)),
    parts=st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 8192)), min_size=1, max_size=6),
)
def test_a_batched_prefill_step_costs_less_than_its_parts_alone(
    model: str, parts: list[tuple[int, int]]
) -> None:
    r = Roofline(PRESETS[model], hardware.gpu("h100"), 4)
    alone = [r.prefill_ns(t, ctx) for t, ctx in parts]
    batch = r.prefill_batch_ns(parts)
    assert max(alone) <= batch <= sum(alone)
    if len(parts) > 1:
        assert batch < sum(alone)  # the overhead (and the weights) paid once


def test_simultaneous_requests_share_prefill_steps() -> None:
    # 8 requests of 256 tokens arrive together. With a 2048-token step budget they share steps;
    # with a 256-token budget (the same chunks) each gets a step of its own, one after another.
    reqs = wl.Arrivals(requests=tuple(wl.DeployRequest(0, 256, 2) for _ in range(8)))
    shared = simulate(replace(SPEC, flow="ring", chunk_tokens=2048), reqs)
    alone = simulate(replace(SPEC, flow="ring", chunk_tokens=256), reqs)
    assert shared.completed == alone.completed == 8
    assert shared.ttft_ms.p99 < 0.75 * alone.ttft_ms.p99


# ---- the serving runtime's control path, and bench_serving's lengths ------------------------------


def test_random_lengths_follow_bench_serving_and_are_reproducible() -> None:
    a = wl.random_lengths(4000, 256, 128, 0.0, seed=3)
    assert a == wl.random_lengths(4000, 256, 128, 0.0, seed=3)
    ins = np.array([r.input_tokens for r in a])
    outs = np.array([r.output_tokens for r in a])
    assert ins.min() == 1 and ins.max() == 256 and abs(ins.mean() - 128.5) < 4
    assert outs.min() == 1 and outs.max() == 128 and abs(outs.mean() - 64.5) < 3
    fixed = wl.random_lengths(50, 256, 128, 1.0, seed=3)
    assert {(r.input_tokens, r.output_tokens) for r in fixed} == {(256, 128)}
    with pytest.raises(wl.WorkloadError, match="range_ratio"):
        wl.random_lengths(5, 256, 128, 1.5, seed=3)


def test_a_control_path_adds_its_fitted_costs_to_every_transfer() -> None:
    prof = hardware.fitted("h200x2-nvlink")
    assert prof.control_latency_us and prof.completion_delay_us
    spec = replace(SPEC, prefill_tp=1, decode_tp=1, flow="direct", gpu="h200")
    with_path = replace(spec, control_path="h200x2-nvlink")
    fab = with_path.scenario_dict(256, 256)["fabric"]
    assert fab["control_latency_ns"] == round(prof.control_latency_us * 1000)
    assert fab["completion_delay_ns"] == round(prof.completion_delay_us * 1000)
    assert fab["bandwidth_gbps"] == spec.scenario_dict(256, 256)["fabric"]["bandwidth_gbps"]  # the NIC's wire
    ideal = simulate(spec, *_closed(1, 3, isl=256, osl=4))
    real = simulate(with_path, *_closed(1, 3, isl=256, osl=4))
    # One request at a time: decode's TransferInfo (one control message) reaches prefill while it
    # computes (4 ms of step overhead > the message's 1.5 ms), so only the completion delay (the
    # KV write's notification) lands on the critical path, once per request.
    added = prof.completion_delay_us / 1000
    assert real.transfer_ms.mean - ideal.transfer_ms.mean == pytest.approx(added, abs=0.05)
    assert real.ttft_ms.mean - ideal.ttft_ms.mean == pytest.approx(added, abs=0.05)


def test_a_control_path_must_be_a_fitted_profile_with_room_costs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(DeployError, match="control_path: unknown hardware profile"):
        replace(SPEC, control_path="nope").check()
    with pytest.raises(DeployError, match="not a fabric profile"):
        replace(SPEC, control_path="nic-400g").check()
    for f in hardware.folder().iterdir():
        if f.name.endswith(".toml"):
            (tmp_path / f.name).write_text(f.read_text())
    (tmp_path / "wire-only.toml").write_text(
        'kind = "fabric"\nname = "wire-only"\nbandwidth_gbps = 10\nlatency_us = 1\n'
        "post_cost_us = 2\nper_desc_us = 0.5\n"
    )
    monkeypatch.setattr(hardware, "folder", lambda: tmp_path)
    with pytest.raises(DeployError, match="no per-room control path"):
        replace(SPEC, control_path="wire-only").check()
