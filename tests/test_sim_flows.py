"""The staged flows in the simulator: every flow on a heterogeneous deployment, the staged-flows
scenario, and planted staged-flow bugs caught by campaigns with a seed that replays them."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvferry.sim import scenario as sc
from kvferry.sim.campaign import campaign, first_failing, run_one, save_failure
from msgspec.structs import replace

ROOT = Path(__file__).resolve().parent.parent
HETERO = ROOT / "scenarios" / "heterogeneous-tp.toml"
STAGED = ROOT / "scenarios" / "staged-flows.toml"
WRAPS = ROOT / "tests" / "scenarios" / "ring-wraps.toml"


@pytest.mark.parametrize("flow", ["direct", "ring", "pinned", "mixed"])
def test_heterogeneous_deployment_under_each_flow(flow: str) -> None:
    res, w = run_one(sc.with_flow(sc.load(HETERO), flow))
    assert res.violations == []
    assert res.succeeded == res.rooms
    staged = res.descriptors < 1000  # TP 4 -> 2: direct posts a descriptor per (token, region)
    assert staged is (flow in ("ring", "pinned")), res.descriptors
    for d in range(2):
        eng = w.ranks[f"decode{d}"].engine
        assert eng.staging_in_use() == 0
        assert bool(eng.staged.subscribers["ring"]) is (flow in ("ring", "mixed"))


def test_staged_flows_scenario_moves_every_room_with_waits() -> None:
    res, w = run_one(sc.load(STAGED))
    assert res.violations == [] and res.succeeded == res.rooms == 40
    pre = [w.ranks[f"prefill{p}"].engine.counters for p in range(2)]
    dec = w.ranks["decode0"].engine.counters
    assert sum(c["chunk_deferred"] for c in pre) > 0  # one-chunk space: lanes waited
    assert dec["staging_req_held"] > 0  # decode allocated after prefill asked
    assert dec["pinned_wait"] > 0  # the pinned pool was full at times


def test_replay_refuses_an_unknown_flow() -> None:
    with pytest.raises(sc.ScenarioError, match="--flow"):
        sc.with_flow(sc.load(STAGED), "rnig")


@pytest.mark.parametrize(
    ("hook", "base", "seeds", "invariant"),
    [
        ("ring_keeps_old_head", WRAPS, range(0, 2), "ring_progress"),
        ("drop_early_staging_req", STAGED, [17], "fault_free"),  # seed 17 is a calm seed
        ("shared_staging_buffer", STAGED, range(0, 2), "bytes"),
        ("free_staging_before_scatter", STAGED, range(0, 2), "bytes"),
        ("leak_failed_room_staging", STAGED, range(0, 2), "tables_empty"),
    ],
)
def test_campaign_catches_planted_staging_bug(
    hook: str, base: Path, seeds: range, invariant: str, tmp_path: Path
) -> None:
    first = first_failing(campaign(seeds, base=sc.load(base), hooks=(hook,)))
    assert first is not None, f"planted {hook} went unnoticed"
    assert invariant in first.violated()
    s = sc.load(save_failure(first, tmp_path))
    again, _ = run_one(s)
    assert again.digest == first.digest and again.violated() == first.violated()
    clean, _ = run_one(replace(s, hooks=(), expect_violations=()))
    assert clean.violations == [], clean.violations[:2]
