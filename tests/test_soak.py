"""``kvferry soak`` (backends/loopback): a short soak through the real entry point, two real
processes over NIXL on loopback, with a kill and restart of each side; the checker's self-test
(planted corruption must be reported, exit 1); the pure parts (segments, room plans, options)."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvferry.backends.loopback import plan as sp

from kvferry.tools import soak

pytestmark = pytest.mark.timeout(240)


def _soak(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    r = subprocess.run(
        [sys.executable, "-c", "from kvferry.cli import main; main()", "soak", "--json", *args],
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, **(env or {})},
    )
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout), r.stderr


@pytest.mark.parametrize("tp", [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_short_soak_with_a_kill_of_each_side(tp: tuple[int, int]) -> None:
    # 300 rooms: prefill killed after room 100, decode after room 200, each restarted.
    code, r, err = _soak(
        "--rooms", "300", "--kill-every", "100", "--seed", "7", "--warmup-s", "0",
        "--prefill-tp", str(tp[0]), "--decode-tp", str(tp[1]),
    )  # fmt: skip
    assert code == 0 and r["ok"], (r["violations"], err[-2000:])
    assert r["rooms_run"] == 300 and r["violation_count"] == 0
    o = r["outcomes"]
    # abort_after_success: decode's early abort reached a room that had already ended (a loaded
    # host; tests/test_soak_late_abort.py), which then is a Success on both sides.
    assert o["success"] + o["aborted"] + o["abort_after_success"] + o["killed"] == 300
    assert o["killed"] == 8 and o["aborted"] > 0 and o["success"] > 200
    assert [k["victim"] for k in r["kills"]] == ["prefill", "decode"]
    assert set(r["by_flow"]) == set(sp.FLOWS)
    assert all(v.get("success", 0) > 0 for v in r["by_flow"].values())
    e = r["end_state"]
    assert not any(e["prefill_leaks"]) and not any(e["decode_leaks"]) and e["stuck_threads"] == []
    assert any(x["checked"] for x in r["rss"])  # at least one process's RSS was compared
    assert "rooms/s" in err  # the progress line


def test_planted_corruption_is_reported_with_the_seed() -> None:
    code, r, err = _soak(
        "--rooms", "60", "--kill-every", "0", "--seed", "3", env={"KVFERRY_SOAK_PLANT": "corrupt"}
    )
    assert code == 1 and not r["ok"]
    # The plant flips a whole region, free pages too: their canaries report it as well.
    assert {v["kind"] for v in r["violations"]} == {"corrupted", "canary"}
    assert "with seed 3; replay: kvferry soak --seed 3 --rooms 60" in err


def test_max_seconds_stops_at_the_next_segment_and_reports() -> None:
    code, r, _ = _soak("--rooms", "100000", "--kill-every", "0", "--max-seconds", "4", "--seed", "4")
    assert code == 0 and r["ok"] and r["stopped_by_time"]
    # Whole segments only (the limit is checked between them), far fewer than asked for.
    assert r["rooms_run"] % soak.SEGMENT_ROOMS == 0 and r["rooms_run"] < 5000
    assert not any(r["end_state"]["prefill_leaks"]) and not any(r["end_state"]["decode_leaks"])


def test_sigterm_ends_the_run_with_the_summary_of_the_rooms_judged() -> None:
    # A long run stopped from outside (SIGTERM: a background job of a script ignores SIGINT)
    # still says what it judged; without --json, the human summary marks it interrupted.
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kvferry.cli import main; main()", "soak", "--rooms", "100000",
         "--kill-every", "0", "--seed", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "KVFERRY_PROGRESS_EVERY_S": "1"},
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 120
        for line in proc.stderr:  # the first segment's rooms judged
            m = re.search(r"judged: (\d+) ok", line)
            if (m and int(m.group(1)) > 0) or time.monotonic() > deadline:
                break
        sides = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(sides) == 2, sides  # prefill and decode
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    m = re.search(r"rooms: (\d+) of 100000 .*INTERRUPTED", out)
    assert m and int(m.group(1)) >= soak.SEGMENT_ROOMS, out
    assert "verdict so far: no violation" in out, out
    assert f"soak: interrupted after {m.group(1)} rooms" in err
    assert [p for p in sides if os.path.exists(f"/proc/{p}")] == []  # both sides killed and reaped


def test_rss_is_compared_from_the_first_sample_after_warm_up() -> None:
    t = soak.RssTrack("prefill", 0, [(1.0, 200, 100 << 10), (50.0, 5000, 120 << 10), (90.0, 9000, 190 << 10)])
    r = t.summary(warmup_s=45.0, bound_mb=64.0)
    assert r["checked"] and r["baseline_mb"] == 120.0 and r["growth_mb"] == 70.0 and not r["ok"]
    assert t.summary(warmup_s=45.0, bound_mb=80.0)["ok"]
    young = soak.RssTrack("decode", 1, [(1.0, 200, 100 << 10), (20.0, 2000, 400 << 10)])
    assert not young.summary(warmup_s=45.0, bound_mb=64.0)["checked"]  # lived shorter than warm-up


def test_segments_put_a_kill_at_every_multiple_of_kill_every() -> None:
    c = soak.SoakConfig(rooms=1050, kill_every=500)
    segs = soak.segments(c)
    assert segs[0][0] == 0 and segs[-1][1] == 1050
    assert all(a < b for a, b, _ in segs) and all(
        b == a2 for (_, b, _), (a2, _, _) in itertools.pairwise(segs)
    )
    assert [b for _, b, k in segs if k] == [500, 1000]
    assert max(b - a for a, b, _ in segs) <= soak.SEGMENT_ROOMS
    assert not any(k for *_, k in soak.segments(soak.SoakConfig(rooms=1050, kill_every=0)))


def test_room_plans_depend_only_on_seed_and_index() -> None:
    a = sp.room_plan(5, 123, sp.FLOWS, 0.3, hold=False)
    assert a == sp.room_plan(5, 123, sp.FLOWS, 0.3, hold=False)
    assert a.room != sp.room_plan(6, 123, sp.FLOWS, 0.3, hold=False).room
    plans = [sp.room_plan(1, i, sp.FLOWS, 0.2, hold=False) for i in range(400)]
    assert {p.flow for p in plans} == set(sp.FLOWS) and {p.abort for p in plans} == {None, *sp.ABORTS}
    for p in plans:
        assert p.cuts[-1] == p.tokens and list(p.cuts) == sorted(set(p.cuts))
        assert len(p.cuts) >= 2 or p.abort not in ("decode_mid", "prefill_mid")
    held = sp.room_plan(1, 9, sp.FLOWS, 1.0, hold=True)
    assert held.abort is None and len(held.cuts) >= 2  # a held room waits after its first chunk


def test_a_layerwise_forward_is_drawn_after_every_older_choice() -> None:
    """Each room's layer reports (``layer_ends``) are drawn last, so every other choice of a room
    is what it was before they existed (a replay of an older run's seed gets the same rooms)."""
    five = ("direct", "ring", "pinned", "pull", "push")
    old = sp.room_plan(32, 12053, five, 0.7, hold=False)  # a room of a long run, as it was drawn then
    assert (old.room, old.tokens, old.cuts, old.flow, old.abort) == (
        346050020602441867, 11, (11,), "pull", "decode_early",
    )  # fmt: skip
    plans = [sp.room_plan(2, i, ("layerwise",), 0.0, hold=False) for i in range(200)]
    layers = sp.MODEL.num_layers
    assert {p.layer_ends for p in plans} == {(1, 2), (2,)}
    assert all(list(p.layer_ends) == sorted(set(p.layer_ends)) and p.layer_ends[-1] == layers for p in plans)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rooms": 0}, "--rooms"),
        ({"prefill_tp": 3}, "--prefill-tp"),
        ({"flows": ("ring", "rnig")}, "unknown flow"),
        ({"flows": ()}, "--flows"),
        ({"abort_rate": float("nan")}, "--abort-rate"),
        ({"kill_every": 5}, "--kill-every"),
        ({"hold": 0}, "--hold"),
        ({"max_seconds": float("inf")}, "--max-seconds"),
        ({"rss_bound_mb": -1.0}, "--rss-bound-mb"),
    ],
)
def test_bad_configs_name_the_option(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        soak.check_config(soak.SoakConfig(**change))
