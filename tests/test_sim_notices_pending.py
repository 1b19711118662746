"""The world's final checks wait while a prefill rank still resends a failure notice."""

from __future__ import annotations

from pathlib import Path

from kvferry.sim import scenario as sc
from kvferry.sim.world import World
from msgspec.structs import replace

ROOT = Path(__file__).resolve().parents[1]


def _aborting_world() -> World:
    """Quickstart's deployment with every room aborted by the scheduler on a random rank."""
    s = sc.load(ROOT / "scenarios" / "quickstart.toml")
    s = replace(
        s,
        workload=replace(s.workload, rooms=8),
        faults=replace(s.faults, abort=1.0),
        phases=replace(s.phases, fault_window_us=200_000),
    )
    return World(s, seed=3)


def test_pending_while_a_prefill_engine_owes_a_notice_and_not_once_answered() -> None:
    w = _aborting_world()
    prefill = [r for n, r in w.ranks.items() if w.fleet.side_of[n] == "prefill"]
    seen_pending = False
    while w.env.peek() < w.progress.deadline_ns:
        w.env.step()
        owing = [r for r in prefill if r.engine.notices]
        assert w._notices_pending() == bool(owing)
        if owing:
            seen_pending = True
            # A dead rank's notices die with it: nothing to wait for.
            for r in owing:
                r.dead = True
            assert not w._notices_pending()
            for r in owing:
                r.dead = False
    assert seen_pending, "no prefill rank ever owed a failure notice: the scenario tests nothing"
    w.run()
    assert not w._notices_pending()
    assert not w.violations
