"""``kvferry fuzz-live`` (kvferry/tools/hostile.py): hostile control frames at live endpoints
over real NIXL (DRAM) while legitimate rooms run; and the checker's own ability to fail."""

from __future__ import annotations

import pytest

from kvferry.tools.hostile import KINDS, LiveFuzzConfig, run_live_fuzz

pytestmark = pytest.mark.timeout(120)


def test_hostile_frames_kill_no_thread_and_touch_no_room() -> None:
    res = run_live_fuzz(LiveFuzzConfig(seed=3, frames=1500, rooms=24, max_seconds=60))
    assert res.violations == [] and not res.stopped_early
    assert res.rooms_success == res.rooms_done == 24
    assert set(res.frames_sent) == set(KINDS)
    r = res.rejected
    # Each layer turned away its share: the plane (untagged, bad tags, replays, stale, wrong
    # identity) and the engines (schema violations and messages about rooms they do not hold).
    for reason in (
        "auth.untagged",
        "auth.replayed",
        "auth.identity_mismatch",
        "auth.stale",
        "engine.wire_error",
    ):
        assert r.get(reason, 0) > 0, (reason, r)
    assert r.get("auth.old_incarnation", 0) > 0, r


def test_a_stray_write_outside_every_room_is_reported() -> None:
    res = run_live_fuzz(LiveFuzzConfig(seed=4, frames=100, rooms=4, max_seconds=60, plant_stray_write=True))
    assert any("no room owns it" in v for v in res.violations), res.violations
    assert not res.ok
