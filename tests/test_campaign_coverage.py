"""Campaign coverage and the liveness class (sim/campaign.py): every run counts its rooms per flow
and outcome, a campaign adds them up per flow, TP pair and fault kind with a row for what it
never drew; the liveness class draws only faults the protocol rides out, where every room must
end Success, and a resend taken out of the protocol (planted here) shows up as a violation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kvferry.core import reliable
from kvferry.sim import campaign as cp

# Liveness seeds whose drawn control drops hit a TransferInfo: without its resend, a room waits
# for it until its deadline (found by running seeds 0-39 with the plant below).
INFO_LOSS_SEEDS = (4, 8, 13, 16)


def test_a_runs_coverage_counts_every_room_once() -> None:
    res, _ = cp.run_one(cp.fuzz_scenario(3))
    cov = res.coverage
    assert sum(sum(c.values()) for c in cov["by_flow"].values()) == res.rooms
    assert cov["outcomes"].get("success", 0) == res.succeeded
    assert cov["outcomes"].get("failed", 0) == res.failed
    assert 0 <= cov["failed_by_deadline"] <= res.failed
    t = res.deployment
    assert cov["tp"] == f"{t['prefill_tp']}->{t['decode_tp']}"


def test_the_tally_has_a_row_for_what_was_never_drawn() -> None:
    tally = cp.CoverageTally()
    res, _ = cp.run_one(cp.fuzz_scenario(3))
    tally.add(res)
    d = tally.as_dict()
    assert set(cp.FLOW_NAMES) <= set(d["by_flow"]) and set(cp.TP_PAIRS) <= set(d["by_tp"])
    assert set(cp.FAULT_KINDS) <= set(d["by_fault"])
    assert sum(r["rooms"] for r in d["by_tp"].values()) == res.rooms
    assert sum(r["rooms"] == 0 for r in d["by_tp"].values()) == len(cp.TP_PAIRS) - 1
    drawn = [k for k, n in res.faults.items() if n] or ["none"]
    assert all(d["by_fault"][k]["rooms"] == res.rooms for k in drawn)


@pytest.mark.parametrize("seed", range(40))
def test_the_liveness_class_draws_only_ridable_faults(seed: int) -> None:
    s = cp.liveness_scenario(cp.fuzz_scenario(seed))
    f = s.faults
    assert not f.swarm and f.xfer_err == f.abort == f.notif_drop == 0.0
    assert all(getattr(f, k) <= hi for k, hi in cp.LIVENESS_RATES.items())
    assert all(e.kind == "slow_link" and e.factor >= cp.LIVENESS_SLOW_FACTOR for e in f.events)
    assert s.workload.length_mismatch == 0.0
    assert s == cp.liveness_scenario(cp.fuzz_scenario(seed))  # a function of the seed


def _info_never_resent(monkeypatch: pytest.MonkeyPatch) -> None:
    fire = reliable.Resends.fire

    def planted(self: reliable.Resends, key: object, now: int) -> list:
        return [] if self.kind == "info" else fire(self, key, now)

    monkeypatch.setattr(reliable.Resends, "fire", planted)


@pytest.mark.parametrize("seed", INFO_LOSS_SEEDS)
def test_a_missing_resend_is_a_liveness_violation(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    s = cp.liveness_scenario(cp.fuzz_scenario(seed))
    res, _ = cp.run_one(s, liveness=True)
    assert res.violations == [] and res.failed == 0
    _info_never_resent(monkeypatch)
    res, _ = cp.run_one(s, liveness=True)
    assert cp.LIVENESS in res.violated()
    assert res.coverage["failed_by_deadline"] > 0  # what a campaign's table would show drifting


def test_fuzz_liveness_json_reports_coverage() -> None:
    r = subprocess.run(
        [sys.executable, "-c", "from kvferry.cli import main; main()", "fuzz", "--seeds", "0-2", "--liveness",
         "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["liveness_class"] is True and out["failed"] == 0
    cov = out["coverage"]
    assert set(cov["by_fault"]) >= {"none", *cp.LIVENESS_KINDS} and "crash" not in cov["by_fault"]
    assert sum(v["rooms"] for v in cov["by_flow"].values()) == out["rooms"]
