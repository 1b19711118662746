"""``kvferry chaos``: prefill and decode on two hosts made of network namespaces, real faults.

The pure parts (the fault schedule, the room split, the coverage table, the options) run
anywhere. The rest needs root and iproute2 (CI runs as root): the namespaces' partition and rate
limit really cut and throttle traffic; a failed set-up, a killed run's leftovers, Ctrl-C and
SIGTERM leave no namespace or process behind; the short run (about 500 rooms, every flow and TP
pair, each fault kind) is clean; the planted bug (decode reuses a failed room's pages before the
fence) is caught by the canaries or the byte check and replayable from its seed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from kvferry.backends.loopback import plan as sp
from kvferry.core.kvpoll import KVPoll

from kvferry.tools.chaos import netns
from kvferry.tools.chaos import run as chaos
from kvferry.tools.chaos.schedule import KINDS, LIVENESS_KINDS, plan
from kvferry.tools.coverage import table
from kvferry.tools.soak import _by_deadline

pytestmark = pytest.mark.timeout(300)
HB_S = sp.timeouts().heartbeat_timeout_ns / 1e9
FENCE_S = sp.timeouts().fence_ns / 1e9
WHY_NOT = netns.why_not_available()
needs_netns = pytest.mark.skipif(bool(WHY_NOT), reason=f"kvferry chaos: {WHY_NOT}")
# Python's own Ctrl-C handler: a test run started as a background job of a script inherits SIGINT
# ignored, and the interrupt tests' Ctrl-C would never reach the command.
CLI = [
    sys.executable,
    "-c",
    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from kvferry.cli import main; main()",
    "chaos",
]


# ---- the pure parts --------------------------------------------------------------------------
def test_the_schedule_is_a_function_of_the_seed() -> None:
    a = plan(5, 40, 0.5, KINDS, HB_S)
    assert a == plan(5, 40, 0.5, KINDS, HB_S)
    assert a != plan(6, 40, 0.5, KINDS, HB_S)
    assert 0 not in a  # both sides settle before the first fault
    assert not any(s + 1 in a for s in a)  # a fault's aftermath segment gets no fault of its own


@pytest.mark.parametrize("seed", range(20))
def test_every_kind_is_drawn_even_when_few_segments_are_faulted(seed: int) -> None:
    faults = plan(seed, 20, 0.05, KINDS, HB_S)
    assert {f.kind for f in faults.values()} == set(KINDS)
    assert not any(s + 1 in faults for s in faults)


def test_durations_straddle_the_heartbeat_timeout() -> None:
    faults = [f for s in range(30) for f in plan(s, 60, 0.8, KINDS, HB_S).values()]
    by = {k: [f for f in faults if f.kind == k] for k in KINDS}
    assert all(f.for_s < HB_S for f in by["partition_short"])  # ridden out
    assert all(HB_S < f.for_s < FENCE_S for f in by["partition_long"])  # rooms fail, notices arrive
    assert all(HB_S < f.for_s < FENCE_S for f in by["stall"])
    assert {f.rate_kbit for f in by["slow_link"]} == {1000, 2000, 4000}
    assert {f.side for f in faults} == {"prefill", "decode"}


def test_the_liveness_class_draws_only_faults_the_protocol_rides_out() -> None:
    faults = [f for s in range(30) for f in plan(s, 40, 0.8, LIVENESS_KINDS, HB_S, liveness=True).values()]
    assert {f.kind for f in faults} == set(LIVENESS_KINDS)
    assert all(f.for_s <= HB_S / 2 for f in faults)
    assert all(f.rate_kbit >= 2000 for f in faults if f.kind == "slow_link")


def test_the_replay_line_carries_a_stretched_deadline() -> None:
    line = chaos.replay_command(chaos.ChaosConfig(rooms=500, deadline_scale=2.0))
    assert line.startswith("kvferry chaos --seed 0 --rooms 500") and line.endswith(" --deadline-scale 2")
    assert "--deadline-scale" not in chaos.replay_command(chaos.ChaosConfig(rooms=500))


def test_rooms_are_split_over_the_pairs_and_segments_once() -> None:
    c = chaos.ChaosConfig(rooms=503, segment_rooms=25)
    rooms = [i for s, e in chaos.segment_starts(c) for i in range(s, e)]
    assert rooms == list(range(503))
    assert [(tp, e - s) for tp, s, e in chaos.pair_ranges(c)] == [((1, 1), 168), ((2, 1), 168), ((1, 2), 167)]


def test_the_coverage_table_shows_rows_that_were_never_drawn() -> None:
    lines = table("fault", {"stall": {"rooms": 3, "failed": 2, "success": 1}, "kill": {"rooms": 0}})
    assert "never drawn" in lines[2] and "never drawn" not in lines[1]
    assert lines[0].split() == ["fault", "rooms", "failed", "success"]


def test_a_failure_counts_as_by_deadline_only_if_every_reason_is_a_deadline() -> None:
    assert _by_deadline(["room 1: timed out while waiting", ""])
    assert not _by_deadline(["room 1: timed out while waiting", "peer prefill#0 lost (no heartbeat)"])
    assert not _by_deadline(["", ""])


class _Rank:
    """A decode rank's receiver as the soak's decode process sees it: polled, never fenced."""

    def __init__(self, status: KVPoll, reason: str = "") -> None:
        self.status, self.reason, self.cleared = status, reason, False

    def poll(self) -> KVPoll:
        return self.status

    def failure_exception(self) -> None:
        if self.status is KVPoll.Failed:
            raise RuntimeError(self.reason)

    def pages_freed(self) -> bool:
        return False

    def clear(self) -> None:
        self.cleared = True


def test_a_rank_failed_while_its_bytes_are_checked_is_settled_not_reported_success(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The stall's disagreement (pull, TP 1->2: decode#0 Success, decode#1 and prefill Failed):
    after a thaw, decode#0's READ completes (Success) and prefill's RoomFailed lands right
    behind it (Failed, as the protocol says: Failed overrides a Success). The decode process
    reported the room from one poll but decided to keep it for settling from a second one: a rank
    Failed by then was cleared, its report said Success, and settling never told the change."""
    from kvferry.backends.loopback import decode_side

    plan_ = sp.room_plan(0, 7, ("pull",), 0.0, False)
    notice = "failed on prefill#0: peer decode#0 lost (no heartbeat)"
    rank0, rank1 = _Rank(KVPoll.Success), _Rank(KVPoll.Failed, notice)

    def bytes_check(*_a: object) -> tuple[int, None]:
        rank0.status, rank0.reason = KVPoll.Failed, notice  # the notice lands meanwhile
        return 0, None

    monkeypatch.setattr(decode_side.pattern, "mismatches", bytes_check)
    side = object.__new__(decode_side.DecodeSide)
    transport = type("T", (), {"region": None, "read_aux_room": staticmethod(lambda _row: plan_.room)})
    side.eps = [type("E", (), {"pool": None, "transport": transport})() for _ in range(2)]
    side.keep, side.settling, side.waiting_fence, side.unfenced = True, {}, {}, []
    live = {7: {"plan": plan_, "pages": [1, 2], "aux": 3, "rvs": [rank0, rank1], "canary_bad": []}}
    assert side._step(live, 7)
    side.settle()
    said = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert said[0]["event"] == "room" and said[0]["status"] == [int(KVPoll.Success), int(KVPoll.Failed)]
    assert not rank0.cleared, "a rank reported Success was cleared before settling"
    assert said[1:] == [
        {
            "event": "room_final",
            "i": 7,
            "status": [int(KVPoll.Failed)],
            "reason": [notice],
            "error": ["RuntimeError"],
        }
    ]


def test_abandoned_transfers_are_summed_over_every_incarnation() -> None:
    """Each process reports its agents' running count with every segment's end; a killed one's
    last report still counts, and its successor starts again from zero."""
    from types import SimpleNamespace

    from kvferry.tools.soak import Soak, SoakConfig

    soak = Soak(SoakConfig(rooms=100, kill_every=0), None)
    first, second = SimpleNamespace(role="decode", abandoned=0), SimpleNamespace(role="decode", abandoned=0)
    for who, n in ((first, 1), (first, 1), (first, 3), (second, 0), (second, 2)):
        soak._count(who, {"event": "segment", "abandoned": n})  # type: ignore[arg-type]
    soak._count(first, {"event": "segment"})  # type: ignore[arg-type]  # an older side: no count
    assert dict(soak.abandoned) == {"decode": 5}


def test_a_disagreement_names_every_ranks_reason() -> None:
    from kvferry.tools.soak import Soak, SoakConfig

    soak = Soak(SoakConfig(rooms=100, kill_every=0), None)
    plan_ = sp.room_plan(0, 3, ("pull",), 0.0, False)
    lost = "peer decode#0 lost (no heartbeat)"
    soak.results["prefill"][3] = {"status": [0], "reason": [lost]}
    soak.results["decode"][3] = {"status": [4, 0], "reason": ["", f"failed on prefill#0: {lost}"]}
    soak._judge(plan_, None, "stall")
    [v] = soak.violations
    assert v["kind"] == "disagree" and v["decode_reasons"] == ["", f"failed on prefill#0: {lost}"]
    assert v["prefill_reasons"] == [lost]


def test_an_rss_baseline_taken_while_the_peer_was_lost_does_not_read_as_growth() -> None:
    """The rss_growth violations of long chaos runs (e.g. TP 2->1, both sides at once):
    a process that loses its peer (a long partition, a stall, the peer killed) releases what it
    held for it and takes it again when the peer is back; the baseline was one sample, taken in
    such a dip (97 MB, below the process's own first sample of 109 MB), and the run's end (173 MB)
    sat in the band every other incarnation of that process held (164-183 MB)."""
    from kvferry.tools.soak import RssTrack

    mb = 1024
    dip = RssTrack(
        "prefill", 2, [(5, 0, 109 * mb), (46, 180, 97 * mb), (52, 210, 165 * mb), (200, 720, 173 * mb)]
    )
    r = dip.summary(warmup_s=45.0, bound_mb=64.0)
    assert r["checked"] and r["baseline_mb"] == 165.0 and r["growth_mb"] == 8.0 and r["ok"]
    # A leak still shows: it outgrows every sample of the baseline window.
    leak = RssTrack("prefill", 0, [(t, t, (100 + t // 10) * mb) for t in range(5, 1200, 5)])
    r = leak.summary(warmup_s=45.0, bound_mb=64.0)
    assert r["checked"] and r["growth_mb"] > 64 and not r["ok"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "3-1"], "--tp: each pair is PREFILL-DECODE"),
        (["--tp", "2"], "--tp: '2' is not PREFILL-DECODE"),
        (["--faults", "meteor"], "--faults: unknown kind"),
        (["--liveness", "--faults", "stall"], "--liveness draws only faults"),
        (["--liveness", "--abort-rate", "0.1"], "--liveness needs --abort-rate 0"),
        (["--segment-rooms", "2"], "--segment-rooms must be in"),
        (["--rooms", "2"], "--rooms must be at least one per TP pair"),
    ],
)
def test_bad_options_are_one_line_errors(args: list[str], message: str) -> None:
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# ---- the hosts --------------------------------------------------------------------------------
def _ours(tag: str) -> list[str]:
    return [n for n in netns.namespaces() if n.startswith(f"{tag}-")]


def _leftovers() -> list[str]:
    """Namespaces of chaos runs whose process is gone (a run still going elsewhere is fine)."""
    return [
        n for n in netns.namespaces()
        if n.startswith(netns.PREFIX) and not os.path.exists(f"/proc/{n[len(netns.PREFIX):].split('-')[0]}")
    ]  # fmt: skip


@needs_netns
def test_a_partition_cuts_the_link_and_a_heal_restores_it() -> None:
    with netns.Network(2, tag=f"{netns.PREFIX}{os.getpid()}") as net:
        srv = subprocess.Popen(
            [*net.exec_prefix(1), sys.executable, "-c",
             f"import socket,time; s=socket.socket(); s.bind(('{net.address(1)}', 5555)); s.listen(); "
             "time.sleep(20)"],
        )  # fmt: skip
        try:

            def reach() -> bool:
                code = f"import socket; socket.create_connection(('{net.address(1)}', 5555), timeout=1.0)"
                r = subprocess.run(
                    [*net.exec_prefix(0), sys.executable, "-c", code], capture_output=True, timeout=30
                )
                return r.returncode == 0

            deadline = time.monotonic() + 15
            while not reach():  # the server's socket is listening within a few seconds
                assert time.monotonic() < deadline
                time.sleep(0.2)
            net.set_link(1, up=False)
            assert not reach()
            net.set_link(1, up=True)
            assert reach()
            net.slow(0, 1000)
            show = ["tc", "-n", net.host(0), "qdisc", "show", "dev", "eth0"]
            out = subprocess.run(show, capture_output=True, text=True, timeout=10).stdout
            assert "tbf" in out and "1Mbit" in out
            net.heal()
            assert net.slowed == set()
        finally:
            srv.kill()
            srv.wait(10)
    assert _ours(net.tag) == []


@needs_netns
def test_a_failed_setup_removes_what_it_made() -> None:
    tag = f"{netns.PREFIX}{os.getpid()}"
    subprocess.run(["ip", "netns", "add", f"{tag}-h1"], check=True, timeout=10)  # in the way
    try:
        with pytest.raises(netns.NetError, match="h1"):
            netns.Network(2, tag=tag).open()
        assert _ours(tag) == [f"{tag}-h1"]
    finally:
        subprocess.run(["ip", "netns", "del", f"{tag}-h1"], check=False, timeout=10)


@needs_netns
def test_namespaces_of_a_run_killed_outright_are_removed_by_the_next() -> None:
    dead = 4_000_000  # above any pid this machine hands out (pid_max 4194304 is not reached)
    while os.path.exists(f"/proc/{dead}"):
        dead += 1
    name = f"{netns.PREFIX}{dead}-b"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        assert name in netns.remove_stale()
        assert name not in netns.namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=10)


def _chaos(*args: str, timeout: float = 240) -> tuple[int, dict, str]:
    return _chaos_ended(_chaos_started(*args), timeout)


def _chaos_started(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, "--json", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _chaos_ended(proc: subprocess.Popen[str], timeout: float = 240) -> tuple[int, dict, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        _chaos_stopped(proc)
    assert "Traceback" not in err, err[-3000:]
    return proc.returncode, json.loads(out), err


def _chaos_stopped(*procs: subprocess.Popen[str]) -> None:
    """A run still going (a timeout, a failed check on the other run) gets SIGTERM: the run
    removes its processes and namespaces itself, as on Ctrl-C."""
    live = [proc for proc in procs if proc.poll() is None]
    for proc in live:
        proc.terminate()
    for proc in live:
        try:
            proc.communicate(timeout=60)  # drained, so a full pipe cannot hold its exit
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


# The runs that must end with no violation at all stretch the rooms' own deadlines (not the
# heartbeat timeout the faults are drawn around): on a loaded 2-core CI host a fault-free room
# could otherwise miss them, and a room held at a kill reach its deadline before the survivor's
# heartbeat timeout. Safety checks are the same. A stretched fence costs time only where a fault
# cut rooms (decode waits for it before its tables are checked): the short run, which tolerates a
# few deadline misses, and the planted-reuse runs keep the plain deadlines.
SLOW_HOST = ("--deadline-scale", "2")


@needs_netns
def test_short_run_every_flow_tp_pair_and_fault_kind() -> None:
    # The soak's own deadlines, not SLOW_HOST's: a pair that a partition, stall or kill cut
    # waits for its failed rooms' fence (17 s, 34 s stretched) before its tables are checked,
    # which made half of this run's time. The tolerance below covers a loaded host.
    code, r, err = _chaos("--rooms", "500", "--seed", "0", "--fault-share", "0.3")
    # Safety is zero-tolerance. Liveness is not, here: on a loaded 2-core CI host a few fault-free
    # rooms can still miss their own deadline; they end Failed on both sides, by a deadline, with
    # nothing leaked. At most 1% of the rooms, and nothing else.
    by_deadline = [
        v
        for v in r["violations"]
        if v["kind"] == "failed" and v.get("reasons") and all("timed out while" in x for x in v["reasons"])
    ]
    others = [v for v in r["violations"] if v not in by_deadline]
    assert not others and len(by_deadline) <= 5, [r["violations"][:5], err[-2000:]]
    assert code == (1 if by_deadline else 0), err[-2000:]
    cov = r["coverage"]
    assert r["rooms_run"] == 500
    assert set(r["abandoned"]) == {"prefill", "decode"}, r["abandoned"]
    assert set(cov["by_flow"]) == set(sp.FLOWS) and "layerwise" in cov["by_flow"], cov["by_flow"]
    assert all(v["rooms"] > 0 for v in cov["by_flow"].values()), cov["by_flow"]
    assert all(v["rooms"] > 0 for v in cov["by_tp"].values()), cov["by_tp"]
    assert set(cov["faults"]) == set(KINDS) and all(n >= 1 for n in cov["faults"].values()), cov["faults"]
    # The faults did something: a kill fails its held rooms on the survivor, a burst aborts rooms.
    # (Whether a stall fails rooms depends on what was still in flight: not asserted.)
    assert cov["by_fault"]["kill"].get("killed", 0) > 0
    assert cov["by_fault"]["abort_burst"].get("aborted", 0) > 0
    for line in ("fault at", "stall: ", "kill: "):
        assert line in err
    assert r["replay"].startswith("kvferry chaos --seed 0 --rooms 500")
    assert "--deadline-scale" not in r["replay"]  # the default is left out (see the next test)
    assert _leftovers() == []


@needs_netns
def test_layerwise_rooms_stream_through_a_kill_and_an_abort_burst() -> None:
    """Layer-wise rooms on two hosts: prefill hands each chunk over and reports its layers over
    the following steps of its loop (plan.layer_ends), held rooms are killed mid-stream, aborts
    come from both sides; bytes, canaries, agreement and tables are checked as for every flow."""
    run = ("--flows", "layerwise", "--rooms", "60", "--tp", "2-1", "--segment-rooms", "15", "--seed", "1")
    code, r, err = _chaos(*run, "--fault-share", "1", "--faults", "kill,abort_burst", *SLOW_HOST)
    assert code == 0 and r["ok"], [r["violations"][:5], err[-2000:]]
    cov = r["coverage"]
    assert set(cov["by_flow"]) == {"layerwise"} and cov["by_flow"]["layerwise"]["rooms"] == 60
    assert cov["by_fault"]["kill"].get("killed", 0) > 0, cov["by_fault"]
    assert cov["by_fault"]["abort_burst"].get("aborted", 0) > 0, cov["by_fault"]
    assert cov["by_flow"]["layerwise"].get("success", 0) > 30, cov["by_flow"]
    # Prefill posted layer ranges and ignored no report. (How many
    # left before their chunk's last layer depends on whether the worker planned the chunk before
    # the reports came: timing, not asserted.)
    counters = r["end_state"]["2->1"]["prefill_counters"]
    assert counters.get("layer_ranges_posted", 0) > 0 and counters.get("layers_ignored", 0) == 0, counters
    burst = next(f for f in r["faults"] if f["kind"] == "abort_burst")
    plans = sp.segment_rooms(1, *burst["rooms"], burst["rooms"][1], ("layerwise",), burst["abort_rate"])
    assert {p.abort.split("_")[0] for p in plans if p.abort} == {"prefill", "decode"}
    assert {p.layer_ends for p in plans} == {(1, 2), (2,)}  # one report per layer, and both at once


def test_a_kill_is_drawn_on_a_side_and_the_fault_line_names_it() -> None:
    kills = [f for s in range(10) for f in plan(s, 40, 0.8, ("kill",), HB_S).values()]
    assert {f.side for f in kills} == {"prefill", "decode"}
    assert all(f.describe().startswith(f"kill: {f.side} killed") for f in kills)


@needs_netns
def test_the_kill_fault_kills_the_side_it_drew() -> None:
    # Seed 1 draws both kills of four segments on decode: the soak's own alternation would have
    # killed prefill first.
    faults = plan(1, 4, 1.0, ("kill",), HB_S)
    assert [f.side for f in faults.values()] == ["decode", "decode"]
    run = ("--rooms", "40", "--tp", "1-1", "--segment-rooms", "10", "--seed", "1", "--faults", "kill")
    code, r, err = _chaos(*run, "--fault-share", "1", *SLOW_HOST)
    assert code == 0 and r["ok"], [r["violations"][:5], err[-2000:]]
    assert [k["victim"] for k in r["kills"]] == ["decode", "decode"], r["kills"]
    assert r["coverage"]["faults_by_side"]["kill"] == {"prefill": 0, "decode": 2}
    assert [f["side"] for f in r["faults"]] == ["decode", "decode"]
    assert err.count("kill: decode killed (SIGKILL)") == 2
    assert r["coverage"]["by_fault"]["kill"].get("killed", 0) > 0  # prefill failed decode's held rooms


@needs_netns
def test_a_released_write_still_lands_after_the_heal() -> None:
    """Why the core does not fence transfers a lost peer cut (tests/test_protocol_cut_transfers.py):
    over UCX/TCP a WRITE posted during a partition, released and its agent removed on both sides,
    lands once the link is back, even into a buffer decode registered again."""
    from kvferry.tools.chaos.released_write import probe

    r = probe(rereg=True)
    assert r["state_at_release"] == "PROC"
    assert r["bytes"] == 64 << 10 and r["landed_after_heal_s"] is not None, r


@needs_netns
def test_a_lost_peers_write_is_reported_ended_only_after_its_bytes_landed() -> None:
    """The writer's side of the fence: prefill's agent drops decode (as on a heartbeat loss) with a
    WRITE queued behind the partition. It keeps the transfer until it ends on its own, so the core
    sees it end (and may answer Stopped) only once the bytes are in, after the heal; an agent that
    releases at the drop reports it failed before the heal while the bytes land after it."""
    from kvferry.tools.chaos.released_write import fenced_probe

    r = fenced_probe()
    assert r["state_after_drop"] == "PROC" and r["draining_after_drop"] == ["decode"], r
    assert r["bytes"] == 64 << 10 and r["ended_state"] == "DONE", r
    assert r["ended_after_heal_s"] > 0, r  # not while the bytes were still queued
    # DONE over TCP waits for the target's acknowledgement, so the bytes were in by then; the
    # slack is decode's watcher thread being scheduled (it polls the buffer every millisecond).
    assert r["landed_after_heal_s"] <= r["ended_after_heal_s"] + 0.5, r
    assert r["left"] == {"inflight": 0, "draining": [], "peers": []}, r


@needs_netns
def test_liveness_class_every_room_succeeds_through_short_partitions_and_slow_links() -> None:
    code, r, _err = _chaos(
        "--liveness", "--rooms", "125", "--tp", "1-1", "--seed", "3", "--fault-share", "0.8", *SLOW_HOST
    )
    assert code == 0 and r["ok"], r["violations"][:5]
    assert r["config"]["abort_rate"] == 0.0 and set(r["config"]["kinds"]) == set(LIVENESS_KINDS)
    by_fault = r["coverage"]["by_fault"]
    assert set(by_fault) == {"none", *LIVENESS_KINDS}
    assert all(set(row) <= {"rooms", "success"} for row in by_fault.values()), by_fault
    assert all(by_fault[k]["rooms"] > 0 for k in LIVENESS_KINDS)


@needs_netns
def test_planted_reuse_before_the_fence_is_caught_with_its_replay_line() -> None:
    # Seed 0 stops prefill twice past the heartbeat timeout: decode fails the rooms in flight,
    # and prefill's writes posted once it resumes land in their pages. The fence keeps them out;
    # the planted bug hands the pages out before it, and the canaries see the writes. Both runs
    # keep the plain deadlines (the control is the planted run less the plant): a stretched fence
    # only made the control wait longer for its failed rooms' pages.
    # Once on a quiet CI box, seed 0's late writes were refused by the stalled-out peer
    # (driver_errors, PostWrite: NixlPeerError) and none landed: that run says nothing of the
    # fence either way, so only then the next seed is tried (seeds 1 and 2 catch it as well).
    for seed in ("0", "1"):
        run = ("--rooms", "100", "--tp", "2-1", "--seed", seed, "--fault-share", "1", "--faults", "stall")
        control, planted = _chaos_started(*run), _chaos_started(*run, "--plant", "reuse_unfenced")
        try:
            code, r, _err = _chaos_ended(control)
            ended = _chaos_ended(planted)
        finally:
            _chaos_stopped(control, planted)
        # Without the plant: no safety violation. A post refused by a peer the stall cut off
        # (driver_errors, PostAuxWrite: NixlPeerError) was seen once on a loaded CI host; it is no
        # late write and no lost room, so it does not count against the control run.
        unsafe = [v for v in r["violations"] if v["kind"] != "driver_errors"]
        assert not unsafe, r["violations"][:5]
        assert r["coverage"]["by_fault"]["stall"].get("failed", 0) > 0
        code, r, err = ended
        assert code == 1 and not r["ok"]
        kinds = {v["kind"] for v in r["violations"]}
        if kinds != {"driver_errors"}:
            break
    assert kinds & {"canary", "corrupted"}, r["violations"][:5]
    assert f"chaos FAILED with seed {seed}; replay: kvferry chaos --seed {seed} --rooms 100 --tp 2-1" in err
    assert "--plant reuse_unfenced" in r["replay"]


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_run_removes_every_namespace_and_process_and_reports(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [*CLI, "--rooms", "2000", "--tp", "1-1", "--faults", "stall", "--fault-share", "1", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tag = f"{netns.PREFIX}{proc.pid}"
    pids: list[int] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 120
        for line in proc.stderr:  # interrupt it while a side is stopped (the hardest cleanup)
            if "stall:" in line or time.monotonic() > deadline:
                break
        for name in _ours(tag):
            out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10)
            pids += [int(p) for p in out.stdout.split()]
        assert len(pids) == 2, pids  # prefill in one host, decode in the other
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 130, err[-2000:]
    assert "every process, fault and namespace it made was removed" in err
    # The stall hits the second segment: the first one's rooms were judged, and are reported.
    r = json.loads(out)
    assert r["interrupted"] and 0 < r["rooms_run"] < 2000, {k: r[k] for k in ("interrupted", "rooms_run")}
    assert sum(r["outcomes"].values()) == r["rooms_run"]
    assert f"interrupted after {r['rooms_run']} rooms" in err
    assert _ours(tag) == []
    time.sleep(1.0)  # reparented to init and reaped
    assert [p for p in pids if os.path.exists(f"/proc/{p}")] == []
