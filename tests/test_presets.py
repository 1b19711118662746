"""Realistic by default: deployment-sized scenarios get deadlines from their expected transfer time,
short deadlines are refused with a message saying so, and every preset replays fault-free."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.core.deadlines import MS, Timeouts
from kvferry.sim import scenario as sc
from kvferry.sim.campaign import run_one
from kvferry.sim.expected import SAFETY, estimate, flows_used, worst

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "scenarios" / "presets").glob("*.toml"))

# A slow case's file, as a new user writes it: a preset, one 4096-token room, TP 4 -> 2,
# default timeouts, the direct flow.
ISSUE = {
    "model": {"preset": "qwen3-8b"},
    "topology": {"prefill_tp": 4, "decode_tp": 2},
    "flows": {"flow": "direct"},
    "workload": {"rooms": 1, "tokens_min": 4096, "tokens_max": 4096, "chunk_tokens": 0},
}


def test_presets_cover_the_three_models_from_4k_to_32k() -> None:
    loaded = [sc.load(p) for p in PRESETS]
    assert {s.model.name for s in loaded} == {"qwen3-8b", "llama-3.1-70b", "deepseek-v3"}
    assert min(s.workload.tokens_max for s in loaded) == 4096
    assert max(s.workload.tokens_max for s in loaded) == 32768
    pairs = {(s.topology.prefill_tp, s.topology.decode_tp) for s in loaded}
    assert any(p != d for p, d in pairs) and any(p == d for p, d in pairs)


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_replays_fault_free_with_every_room_success(path: Path) -> None:
    s = sc.load(path)
    assert sc.parse(tomllib.loads(sc.dump(s))) == s
    res, _ = run_one(s, detail=True)
    assert res.violations == [], f"seed {res.seed}: replay with `kvferry replay {path}`"
    assert res.succeeded == res.rooms == s.workload.rooms
    assert all(r.outcome == "success" for r in res.rooms_detail)
    # Each room took no longer than its derived deadlines allow; a room alone on the fabric takes
    # no longer than the estimate the deadlines come from (it is an upper bound).
    est = worst(s).total_ns
    assert max(r.latency_ns for r in res.rooms_detail) <= SAFETY * est * s.workload.rooms
    if s.workload.rooms == 1:
        assert res.rooms_detail[0].latency_ns <= est


def test_the_issue_file_gets_deadlines_longer_than_its_transfer() -> None:
    s = sc.parse(ISSUE)
    est = estimate(s, "direct")
    # ~717 ms of posting per prefill rank: 4096 tokens x 36 layers x K|V descriptors at 2.43 us.
    assert est.descriptors == 4096 * 36 * 2 + 1
    assert 700 * MS < est.post_ns < 730 * MS
    assert s.timeouts.waiting_ns >= SAFETY * est.total_ns
    assert s.timeouts.transfer_ns >= SAFETY * est.total_ns
    # The derived fence and tombstone still satisfy the core's own safety rules.
    assert s.timeouts.fence_ns > s.timeouts.waiting_ns + s.timeouts.transfer_ns + est.total_ns
    assert s.phases.liveness_us * 1000 > s.timeouts.waiting_ns + s.timeouts.transfer_ns


def test_deadlines_the_file_sets_are_kept_and_checked() -> None:
    doc = {**ISSUE, "timeouts": {"transfer_ns": 50_000_000}}
    with pytest.raises(sc.ScenarioError, match=r"transfer_ns 50\.0 ms is shorter than the expected transfer"):
        sc.parse(doc)
    ok = {**ISSUE, "timeouts": {"transfer_ns": 5_000_000_000}}
    s = sc.parse(ok)
    assert s.timeouts.transfer_ns == 5_000_000_000
    assert s.timeouts.waiting_ns > 50_000_000  # the one left out is still derived


def test_small_scenarios_keep_the_default_deadlines() -> None:
    s = sc.load(ROOT / "scenarios" / "quickstart.toml")
    assert s.timeouts == sc.TimeoutSpec()
    assert s.phases == sc.Phases()


def test_a_slower_flow_chosen_later_re_derives_the_deadlines() -> None:
    base = {k: v for k, v in ISSUE.items() if k != "flows"}
    s = sc.parse(base)
    assert flows_used(s) == ("ring",)  # the policy under unequal TP, staging auto-sized
    direct = sc.with_flow(s, "direct")
    assert direct.timeouts.transfer_ns > s.timeouts.transfer_ns
    assert direct.timeouts == sc.parse(ISSUE).timeouts
    short = sc.parse({**base, "timeouts": {"waiting_ns": 100_000_000}})
    with pytest.raises(sc.ScenarioError, match=r"waiting_ns 100\.0 ms is shorter"):
        sc.with_flow(short, "direct")


def test_timeouts_problems_names_a_deadline_shorter_than_the_transfer() -> None:
    t = Timeouts(
        bootstrap_ns=100 * MS,
        waiting_ns=100 * MS,
        transfer_ns=100 * MS,
        fence_ns=1000 * MS,
        tombstone_ns=2000 * MS,
    )
    assert t.problems(1 * MS, 10 * MS) == []
    assert t.problems(1 * MS, 10 * MS, expected_transfer_ns=99 * MS) == []
    probs = t.problems(1 * MS, 10 * MS, expected_transfer_ns=717 * MS, transfer_what="direct flow")
    assert len(probs) == 2
    assert probs[0].startswith("waiting_ns 100.0 ms is shorter than the expected transfer")
    assert "717.0 ms (direct flow)" in probs[1]


@settings(max_examples=40, deadline=None)
@given(
    model=st.sampled_from(["qwen3-8b", "llama-3.1-70b", "deepseek-v3"]),
    tp=st.sampled_from([(1, 1), (2, 4), (4, 2), (8, 8), (8, 1), (1, 8)]),
    tokens=st.integers(1, 32768),
    chunk=st.sampled_from([0, 256, 2048]),
    flow=st.sampled_from(["policy", "direct", "ring", "pinned", "mixed"]),
    layout=st.sampled_from(["sglang_nhd", "vllm_hnd"]),
)
def test_derived_deadlines_are_never_refused_and_cover_the_transfer(
    model: str, tp: tuple[int, int], tokens: int, chunk: int, flow: str, layout: str
) -> None:
    pages = -(-tokens // 16) + 8
    doc = {
        "model": {"preset": model},
        "topology": {
            "prefill_tp": tp[0],
            "decode_tp": tp[1],
            "prefill_pages": pages,
            "decode_pages": pages,
            "decode_layout": layout,
        },
        "flows": {"flow": flow},
        "workload": {"rooms": 2, "tokens_min": 1, "tokens_max": tokens, "chunk_tokens": chunk},
    }
    s = sc.parse(doc)  # derived deadlines pass the core's own checks, or this raises
    est = worst(s).total_ns
    assert s.timeouts.waiting_ns > est and s.timeouts.transfer_ns > est
    assert s.timeouts.waiting_ns >= min(SAFETY * est, sc.TimeoutSpec().waiting_ns)
    assert s.timeouts.fence_ns >= sc.TimeoutSpec().fence_ns  # derivation only ever lengthens
    assert sc.parse(tomllib.loads(sc.dump(s))) == s
