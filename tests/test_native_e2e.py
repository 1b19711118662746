"""The two-process e2e runs (real NIXL over UCX on DRAM, prefill and decode processes, the threaded
runtime) with both processes on the native executor (backends/native): the same rooms, flows,
aborts and killed peers as tests/test_nixl_e2e.py, and the same checks (every Success room's bytes,
every aborted room Failed on both sides, every table empty, every thread joined).

Each run also proves it ran on the native engine (not a silent fall-back to Python).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_nixl_e2e as e2e  # the e2e helpers, shared rather than copied
import workload as wl  # tests/nixl_procs, on sys.path through test_nixl_e2e

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def native_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_E2E_ENGINE", "native")


def _ran_native(out: dict) -> None:
    assert set(out["d"]["executor"]) == {"native"}, out["d"]["executor"]
    assert set(out["p"]["executor"]) == {"native"}, out["p"]["executor"]


def test_native_rooms_chunks_tp2_to_1_aborts() -> None:
    seed, n = 11, 120
    plans = wl.rooms(seed, n, abort_rate=0.15)
    out = e2e._run_rooms(seed, n, 0.15, (2, 1), "direct")
    _ran_native(out)
    assert e2e._check_rooms(plans, out, (2, 1)) >= n // 2


# Every flow once on the native engine (the Python file covers every TP pair of each).
@pytest.mark.parametrize(
    ("tp", "flow"),
    [((2, 1), "direct"), ((2, 1), "ring"), ((4, 2), "pinned"), ((2, 1), "pull"), ((1, 2), "push")],
    ids=["direct", "ring", "pinned", "pull", "push"],
)
def test_native_flows(tp: tuple[int, int], flow: str) -> None:
    seed, n = 23, 32
    plans = wl.rooms(seed, n, abort_rate=0.2)
    out = e2e._run_rooms(seed, n, 0.2, tp, flow)
    _ran_native(out)
    assert e2e._check_rooms(plans, out, tp) >= n // 2


@pytest.mark.parametrize(("tp", "flow"), [((2, 1), "direct"), ((2, 1), "pull")], ids=["direct", "pull"])
@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_native_peer_killed_mid_transfer(victim: str, tp: tuple[int, int], flow: str) -> None:
    e2e.test_peer_killed_mid_transfer_fails_rooms_on_survivor(victim, tp, flow)


def test_native_endpoints_under_hostile_control_frames() -> None:
    """``kvferry fuzz-live``'s run with every endpoint on the native engine: hostile frames kill no
    thread and touch no room, and the legitimate rooms all succeed."""
    from kvferry.tools.hostile import KINDS, LiveFuzzConfig, run_live_fuzz

    res = run_live_fuzz(LiveFuzzConfig(seed=5, frames=800, rooms=16, max_seconds=60, engine="native"))
    assert res.executor == "native"
    assert res.violations == [] and not res.stopped_early
    assert res.rooms_success == res.rooms_done == 16
    assert set(res.frames_sent) == set(KINDS)


def test_native_short_soak_with_a_kill_of_each_side() -> None:
    """``kvferry soak --engine native``: every flow, aborts by both sides, prefill killed after room
    100 and decode after room 200, each restarted; every room judged, every table empty at the
    end, and every process (restarts included) ran the native engine."""
    import test_soak

    code, r, err = test_soak._soak(
        "--rooms", "300", "--kill-every", "100", "--seed", "11", "--warmup-s", "0", "--engine", "native",
    )  # fmt: skip
    assert code == 0 and r["ok"], (r["violations"], err[-2000:])
    assert r["executors"] == ["native"]
    assert r["rooms_run"] == 300 and r["violation_count"] == 0
    assert [k["victim"] for k in r["kills"]] == ["prefill", "decode"]
    assert all(v.get("success", 0) > 0 for v in r["by_flow"].values())
    assert "--engine native" in r["replay"]


# The staged flows' copies end through the engine's fences: each gather and scatter slowed (a
# GPU-like order on a CPU: copies finish after the writes and notices they race with), every
# copy's end learned from the engine's events, and the bytes still right.
@pytest.mark.parametrize(("tp", "flow"), [((2, 1), "ring"), ((4, 2), "pinned")], ids=["ring", "pinned"])
def test_native_staged_copies_end_through_the_engine_fences(
    monkeypatch: pytest.MonkeyPatch, tp: tuple[int, int], flow: str
) -> None:
    monkeypatch.setenv("KVFERRY_E2E_COPY_DELAY_S", "0.01")
    seed, n = 29, 16
    plans = wl.rooms(seed, n, abort_rate=0.2)
    out = e2e._run_rooms(seed, n, 0.2, tp, flow)
    _ran_native(out)
    assert e2e._check_rooms(plans, out, tp) >= n // 2
    # Every rank's copies (prefill gathers, decode scatters) were reported by its engine.
    assert all(f > 0 for f in out["p"]["fences"]), out["p"]["fences"]
    assert all(f > 0 for f in out["d"]["fences"]), out["d"]["fences"]


@pytest.mark.skipif(e2e.MEM != "DRAM", reason="the copy delay slows host copies only")
def test_planted_fence_reported_before_its_copy_finished_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine reports a watched copy done when it is watched (``fence_early``): with slow
    copies a gather's staging slot is written before it is filled and a scatter's room ends before
    its bytes are in the pool, and the byte checks catch it."""
    monkeypatch.setenv("KVFERRY_NATIVE_PLANT", "fence_early")
    monkeypatch.setenv("KVFERRY_E2E_COPY_DELAY_S", "0.05")
    seed, n = 29, 8
    plans = wl.rooms(seed, n, abort_rate=0.0)
    out = e2e._run_rooms(seed, n, 0.0, (2, 1), "ring")
    _ran_native(out)
    with pytest.raises(AssertionError):
        e2e._check_rooms(plans, out, (2, 1))
