"""A room decode aborts right after opening it can end Success on both sides: the long chaos run's
``hang`` (room 12053, pull, TP 1->1, ``decode_early``, Success on both sides while the harness
waited for the abort's Failed). Decode's open sends the room's TransferInfo; a decode process
descheduled before its abort call (a loaded host) finds every chunk prefill had handed over already
landed, and the abort of a Success room is a no-op (core/receiver.py: "every byte landed"). The
harness expected Failed: prefill kept polling its Success room until the segment gave up.

Reproduced on loopback without forcing anything: ``kvferry soak --flows pull,direct --rooms 3000
--kill-every 0 --abort-rate 1.0 --prefill-tp 1 --decode-tp 1`` under the shared 2-core host's load
gave 7 ``hang`` violations of that signature, and decode's ``ignored_abort_local`` counter (an
abort that reached a Success room) read 7. Here the race is forced (``KVFERRY_SOAK_RACE``: decode
aborts a ``decode_early`` room once it is Success), so every such room takes that path.
"""

from __future__ import annotations

import time

import pytest
from kvferry.backends.loopback import plan as sp
from kvferry.backends.loopback.prefill_side import PrefillSide
from kvferry.core.kvpoll import KVPoll

from kvferry.tools import soak

pytestmark = pytest.mark.timeout(240)
S, F = int(KVPoll.Success), int(KVPoll.Failed)


def _plan(abort: str) -> sp.SoakRoom:
    return sp.SoakRoom(1, 77, "t-1", 8, (4, 8), "pull", abort, False)


def _judged(abort: str, prefill: list[int], decode: list[int], bad_bytes: int = 0) -> soak.Soak:
    s = soak.Soak(soak.SoakConfig(rooms=1), None)
    s.results["prefill"][1] = {"status": prefill, "reason": [""] * len(prefill)}
    s.results["decode"][1] = {
        "status": decode, "reason": [""] * len(decode), "bad_bytes": bad_bytes, "first_bad": None,
        "aux_ok": True,
    }  # fmt: skip
    s._judge(_plan(abort), None)
    return s


def test_an_abort_that_came_after_the_room_ended_is_judged_a_success_with_its_bytes_checked() -> None:
    s = _judged("decode_early", [S], [S])
    assert s.violation_count == 0 and s.outcomes == {"abort_after_success": 1}
    assert _judged("decode_early", [F], [F]).outcomes == {"aborted": 1}
    # Still violations: corrupted bytes, the two sides disagreeing, and any other abort that ended
    # Success (decode_mid and the prefill aborts come before the last chunk is handed over).
    assert [v["kind"] for v in _judged("decode_early", [S], [S], bad_bytes=3).violations] == ["corrupted"]
    assert [v["kind"] for v in _judged("decode_early", [S], [F]).violations] == ["aborted_not_failed"]
    for abort in ("decode_mid", "prefill_early", "prefill_mid"):
        assert [v["kind"] for v in _judged(abort, [S], [S]).violations] == ["aborted_not_failed"]


def test_prefill_waits_a_heartbeat_timeout_for_the_failure_of_a_room_decode_aborted_early() -> None:
    side = object.__new__(PrefillSide)
    side.args = type("A", (), {"deadline_scale": 1.0})()
    hb_s = sp.timeouts().heartbeat_timeout_ns / 1e9
    st = {"plan": _plan("decode_early")}
    assert side._late_failure_owed(st, [KVPoll.Success])  # the clock starts
    st["all_success_at"] = time.monotonic() - hb_s - 0.1
    assert not side._late_failure_owed(st, [KVPoll.Success])  # the abort came too late: report
    # A rank still not Failed beside a Failed one, or any other abort, owes its failure.
    assert side._late_failure_owed(st, [KVPoll.Success, KVPoll.Failed])
    other = {"plan": _plan("prefill_mid"), "all_success_at": 0.0}
    assert side._late_failure_owed(other, [KVPoll.Success])


@pytest.mark.parametrize("tp", [(1, 1), (1, 2)], ids=["tp1to1", "tp1to2"])
def test_decode_aborting_rooms_that_already_ended_leaves_them_success_on_both_sides(
    tp: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two real processes over NIXL on loopback; every ``decode_early`` room is aborted only once
    it is Success on every decode rank. Before the fix each was a ``hang`` (prefill waiting for a
    Failed that never comes) and the segment ran to its timeout."""
    monkeypatch.setenv("KVFERRY_SOAK_RACE", "abort_after_success")
    c = soak.SoakConfig(
        rooms=48, seed=4, prefill_tp=tp[0], decode_tp=tp[1], flows=("pull", "direct"), abort_rate=0.5,
        kill_every=0, warmup_s=0.0, segment_timeout_s=30.0, deadline_scale=2.0,
    )  # fmt: skip
    r = soak.run_soak(c)
    plans = sp.segment_rooms(c.seed, 0, c.rooms, c.rooms, c.flows, c.abort_rate)
    early = sum(p.abort == "decode_early" for p in plans)
    assert early >= 4 and {p.flow for p in plans if p.abort == "decode_early"} == {"pull", "direct"}
    assert r["ok"], r["violations"][:5]
    assert r["outcomes"]["abort_after_success"] == early
    # Every one of those aborts reached a room that was already Success (the core ignores it).
    assert r["end_state"]["decode_counters"].get("ignored_abort_local", 0) == early * tp[1]
