"""The campaign's blind spots : decode allocations shorter or longer than what prefill
sends, several chunks of a room in flight (notes out of order), and a released Success room that
must stay Success. Each is in the campaign's draw space, checked, and proven checkable by a
planted bug (sim/planted.py) that a campaign catches with a seed that replays it."""

from __future__ import annotations

import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from kvferry.core.kvpoll import KVPoll
from kvferry.core.receiver import ReceiverEngine
from kvferry.sim import scenario as sc
from kvferry.sim.campaign import campaign, first_failing, fuzz_scenario, run_one, save_failure
from msgspec.structs import replace

ROOT = Path(__file__).resolve().parent.parent
QUICK = ROOT / "scenarios" / "quickstart.toml"


def _quick(**workload: Any) -> sc.Scenario:
    s = sc.parse(tomllib.loads(QUICK.read_text()))
    return replace(s, workload=replace(s.workload, **workload))


@pytest.mark.parametrize(("tokens", "decode_tokens"), [(100, 60), (100, 140), (64, 63), (64, 65), (1, 2)])
def test_a_length_mismatch_fails_the_room_on_both_sides(tokens: int, decode_tokens: int) -> None:
    rooms = (
        sc.RoomSpec(tokens=tokens, arrival_us=0, decode_tokens=decode_tokens),
        sc.RoomSpec(tokens=tokens, arrival_us=10),  # the same room with agreeing lengths
    )
    s = _quick(rooms=2, explicit=rooms)
    res, w = run_one(s)
    assert res.violations == [], res.violations[:3]
    bad, good = w.requests
    assert bad.mismatched and not good.mismatched
    assert bad.outcome == "failed" and good.outcome == "success"
    assert all(st is KVPoll.Failed for st in bad.status.values()), bad.status
    assert all(st is KVPoll.Success for st in good.status.values()), good.status


def test_the_campaign_draws_mismatched_rooms_and_they_all_fail() -> None:
    mismatched = failed = 0
    for seed in range(6):
        s = fuzz_scenario(seed)
        if not s.workload.length_mismatch:
            continue
        res, w = run_one(s)
        assert res.violations == [], (seed, res.violations[:3])
        for r in w.requests:
            if r.opened and r.mismatched:
                mismatched += 1
                failed += r.outcome == "failed"
    assert mismatched > 3 and failed == mismatched


def test_the_campaign_draws_bursts_with_chunks_landing_out_of_order(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: Counter[str] = Counter()
    record = ReceiverEngine._record_chunk

    def spy(self: ReceiverEngine, r: Any, prog: Any, note: Any) -> bool:
        if prog.chunks and note.chunk_index < max(prog.chunks):
            seen["out_of_order"] += 1
        if note.is_last and len(prog.chunks) < note.chunk_index:
            seen["last_before_earlier"] += 1
        return record(self, r, prog, note)

    monkeypatch.setattr(ReceiverEngine, "_record_chunk", spy)
    bursts = [s for s in map(fuzz_scenario, range(40)) if s.workload.compute_ns_per_token == 0]
    assert bursts and any(s.fabric.nic.jitter_ns > 2_000 for s in bursts)
    for s in bursts[:3]:
        res, _ = run_one(replace(s, faults=replace(s.faults, swarm=False)))  # calm: no fault reorders
        assert res.violations == [], res.violations[:3]
    assert seen["out_of_order"] > 0 and seen["last_before_earlier"] > 0, seen


@pytest.mark.parametrize(
    ("hook", "seeds", "invariant"),
    [
        ("silent_truncation", range(0, 3), "length"),
        # Seeds 3 and 4 draw several decode servers since campaigns draw instances (4 is then
        # caught by tables_empty only: a chunk's staging left behind); 5 is caught by bytes.
        ("last_note_completes", range(5, 8), "bytes"),
        ("late_info_revives_room", [1006], "success_stable"),
        ("suffix_strips_too_much", [18], "lease"),  # push matched by request id, first caught at 18
    ],
)
def test_campaign_catches_planted_blind_spot_bug(
    hook: str, seeds: Any, invariant: str, tmp_path: Path
) -> None:
    first = first_failing(campaign(seeds, hooks=(hook,)))
    assert first is not None, f"planted {hook} went unnoticed"
    assert invariant in first.violated(), first.violations[:3]
    s = sc.load(save_failure(first, tmp_path))
    again, _ = run_one(s)
    assert again.digest == first.digest and again.violated() == first.violated()
    clean, _ = run_one(replace(s, hooks=(), expect_violations=()))
    assert clean.violations == [], clean.violations[:2]


def test_without_success_stable_the_revived_room_passes_every_other_check() -> None:
    s = sc.load(ROOT / "tests" / "scenarios" / "planted-late-info-revives-room.toml")
    assert s.expect_violations == ("success_stable",)
    res, _ = run_one(replace(s, checks=replace(s.checks, success_stable=False), expect_violations=()))
    assert res.violations == [], res.violations[:3]  # the blind spot the invariant closes


def test_a_decode_length_that_does_not_fit_the_pool_is_refused() -> None:
    raw = tomllib.loads(QUICK.read_text())
    raw["workload"] = {"room": [{"tokens": 10, "arrival_us": 0, "decode_tokens": 10**9}]}
    with pytest.raises(sc.ScenarioError, match="does not fit the decode pool"):
        sc.parse(raw)


def test_a_senders_note_stands_for_its_lost_info_ack() -> None:
    """The fix for what success_stable found (tests/scenarios/restarted-prefill-stale-transfer-
    info-*.toml): decode stops resending a TransferInfo once that sender's note arrived, so a
    prefill rank that restarts later never learns of the finished room from a stale copy."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    import harness as H
    from kvferry.core import messages as m

    w = H.World(H.TINY, 1, 1, seed=4)
    deliver = w.fabric.deliver

    def lose_info_acks(i: int) -> m.Endpoint:
        x = w.fabric.pending[i]
        if not x.note and type(m.decode_control(x.data)) is m.InfoAck:
            w.fabric.pending.pop(i)  # every InfoAck is lost
            return x.dst
        return deliver(i)

    w.fabric.deliver = lose_info_acks
    req = w.open_room(5, "t5", 4, [4])
    w.chunk_ready(req, 0)
    w.flush()
    dec = w.decode[0].engine
    assert dec.poll(req.room) is KVPoll.Success
    assert not dec._infos.entries, "decode still owes a TransferInfo to a sender that already wrote"
    resent = dec.counters["info_resent"]
    for _ in range(5):
        w.advance(H.TEST_TIMEOUTS.heartbeat_interval_ns)
        w.flush()
    assert dec.counters["info_resent"] == resent
