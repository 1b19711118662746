"""Several prefill and decode servers from a scenario file: the schema, routing, faults and aborts
aimed at one server, the isolation check (and the planted bug it catches), and campaigns that
draw multi-instance deployments."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvferry.sim import scenario as sc
from kvferry.sim.campaign import MULTI_INSTANCE_SHARE, fuzz_scenario, run_one
from kvferry.sim.faults import draw_personality
from kvferry.sim.rng import Streams
from kvferry.sim.world import World
from msgspec.structs import replace
from typer.testing import CliRunner

from kvferry.cli import _register, app

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "multi-instance.toml"
CRASH = ROOT / "scenarios" / "instance-crash.toml"
_register()
runner = CliRunner()


def _small(p: int, d: int, rooms: int = 10, **topo: int) -> sc.Scenario:
    """A quick world of ``p`` prefill and ``d`` decode servers (TP 2 -> 1 unless ``topo`` says)."""
    base = sc.load(SCENARIO)
    t = replace(base.topology, prefill_instances=p, decode_instances=d, **topo)
    return replace(base, topology=t, workload=replace(base.workload, rooms=rooms))


def _own_nodes(w: World, req) -> set[str]:  # type: ignore[no-untyped-def]
    return set(w.room_nodes(req, "prefill") + w.room_nodes(req, "decode"))


# ---- the schema -------------------------------------------------------------------------------------


def test_instances_parse_round_trip_and_name_the_nodes() -> None:
    s = sc.load(SCENARIO)
    assert (s.topology.prefill_instances, s.topology.decode_instances) == (2, 4)
    assert sc.parse(tomllib.loads(sc.dump(s))) == s
    decode = tuple(f"decode{i}.0" for i in range(4))
    assert s.node_names() == ("prefill0.0", "prefill0.1", "prefill1.0", "prefill1.1", *decode)
    # Left out: one server a side, with the plain names every older file uses.
    assert sc.parse({}).node_names() == ("prefill0", "prefill1", "decode0")


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"topology": {"prefill_instances": 0}}, "[topology].prefill_instances: must be >= 1, got 0"),
        ({"topology": {"decode_instances": 17}}, "[topology].decode_instances: must be <= 16, got 17"),
        (
            {"topology": {"decode_instances": "4"}},
            "[topology].decode_instances: expected an integer, got '4'",
        ),
        ({"topology": {"prefill_instances": True}}, "[topology].prefill_instances: expected an integer"),
        (
            # With several servers a node is named by server and rank: the old name is refused.
            {
                "topology": {"decode_instances": 2},
                "faults": {"event": [{"kind": "crash", "node": "decode0"}]},
            },
            "[faults].event[0].node: expected one of prefill0, prefill1, decode0.0, decode1.0, got 'decode0'",
        ),
        (
            {
                "topology": {"prefill_instances": 5, "decode_instances": 4},
                "faults": {"event": [{"kind": "link_down", "node": "prefill0.0", "peer": "decode4.0"}]},
            },
            "[faults].event[0].peer: expected a node of the topology (prefill0.0 ... decode3.0: server, "
            "then rank), got 'decode4.0'",
        ),
    ],
)
def test_bad_instance_fields_are_one_line_errors(doc: dict, needle: str) -> None:
    with pytest.raises(sc.ScenarioError) as e:
        sc.parse(doc)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_replay_cli_refuses_a_bad_instance_count_with_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[topology]\ndecode_instances = -1\n")
    r = runner.invoke(app, ["replay", str(bad)])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "[topology].decode_instances: must be >= 1, got -1" in lines[0]
    assert "Traceback" not in r.output


# ---- the shipped scenarios --------------------------------------------------------------------------


def test_shipped_multi_instance_scenario_replays_every_room_success() -> None:
    r = runner.invoke(app, ["replay", str(SCENARIO), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["verdict"] == "pass" and d["violations"] == []
    assert d["rooms"] == d["succeeded"] == 32 and d["failed"] == 0 and d["faults"] == {}
    dep = d["deployment"]
    assert (dep["prefill_instances"], dep["decode_instances"]) == (2, 4)
    per = dep["instances"]
    assert sorted(per) == ["decode0", "decode1", "decode2", "decode3", "prefill0", "prefill1"]
    # Every server took rooms, and each room counts once per side.
    assert all(v["rooms"] > 0 and v["succeeded"] == v["rooms"] for v in per.values()), per
    for side in ("prefill", "decode"):
        assert sum(v["rooms"] for k, v in per.items() if k.startswith(side)) == 32


def test_replay_prints_the_deployment_line() -> None:
    r = runner.invoke(app, ["replay", str(SCENARIO)], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert "deployment: prefill 2 x TP2 -> decode 4 x TP1; rooms succeeded/routed per instance: " in r.output
    assert "every room's traffic on its own servers" in r.output
    one = runner.invoke(app, ["replay", str(ROOT / "scenarios" / "quickstart.toml")], env={"COLUMNS": "300"})
    assert "deployment: prefill TP2 -> decode TP1\n" in one.output


def test_faults_on_one_server_fail_only_its_rooms_and_every_invariant_holds() -> None:
    res, w = run_one(sc.load(CRASH))
    assert res.violations == [] and res.faults["crash"] == 1 and res.faults["link_down"] == 1
    hit = {"decode1.0", "prefill0.1", "decode2.1"}
    aborted = {r.key for r in w.requests if any("scheduler abort" in x for x in r.reason.values())}
    for r in w.requests:
        if r.key not in aborted and not _own_nodes(w, r) & hit:
            assert r.outcome == "success", (r.key, r.reason)
    assert 0 < res.failed < res.rooms


# ---- properties ---------------------------------------------------------------------------------------


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p=st.integers(1, 3),
    d=st.integers(1, 3),
    tps=st.sampled_from(((2, 1), (1, 2), (2, 2))),
    seed=st.integers(0, 1000),
)
def test_fault_free_multi_instance_runs_succeed_on_their_own_servers(
    p: int, d: int, tps: tuple[int, int], seed: int
) -> None:
    s = _small(p, d, rooms=8, prefill_tp=tps[0], decode_tp=tps[1])
    res, w = run_one(s, seed=seed)
    assert res.violations == []
    assert res.succeeded == res.rooms == 8
    for r in w.requests:
        assert set(r.inc) == _own_nodes(w, r)  # opened on its own servers' ranks only
    assert w.routing.dec_load == [0] * d  # every room's decode memory came back to its own server
    # The same seed, the same run, event for event.
    again, _ = run_one(s, seed=seed)
    assert again.digest == res.digest


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), crash=st.integers(0, 1000), link=st.integers(0, 1000))
def test_a_fault_aimed_at_one_server_leaves_rooms_elsewhere_alone(seed: int, crash: int, link: int) -> None:
    s = sc.load(CRASH)
    nodes = s.node_names()
    pre = [n for n in nodes if n.startswith("prefill")]
    dec = [n for n in nodes if n.startswith("decode")]
    events = (
        sc.FaultEvent(at_us=2000 + crash, kind="crash", node=nodes[crash % len(nodes)], duration_us=2000),
        sc.FaultEvent(
            at_us=2000 + link,
            kind="link_down",
            node=pre[link % len(pre)],
            peer=dec[crash % len(dec)],
            duration_us=1500,
        ),
    )
    s = replace(s, seed=seed, faults=sc.Faults(events=events))
    res, w = run_one(s)
    assert res.violations == []
    hit = {e.node for e in events} | {e.peer for e in events}
    for r in w.requests:
        if not _own_nodes(w, r) & hit:
            assert r.outcome == "success", (r.key, r.reason)


def test_aborts_hit_a_rank_of_the_rooms_own_servers() -> None:
    s = _small(2, 3, rooms=24)
    s = replace(s, faults=replace(s.faults, abort=0.6), phases=replace(s.phases, fault_window_us=40_000))
    res, w = run_one(s, keep_trace=True)
    assert res.violations == []
    aborts = [(e.node, e.get("room")) for e in w.trace.events if e.kind == "abort"]
    assert len(aborts) == res.faults["abort"] >= 3
    for node, room in aborts:
        assert node in _own_nodes(w, w.by_room[room])
    assert {node.split(".")[0] for node, _ in aborts} - {"prefill0", "decode0"}, aborts


def test_a_swarm_draws_faults_over_every_servers_nodes() -> None:
    s = replace(_small(2, 2), faults=sc.Faults(swarm=True))
    named: set[str] = set()
    for seed in range(40):
        drawn = draw_personality(replace(s, seed=seed), Streams(seed))
        assert not drawn.faults.swarm
        for e in drawn.faults.events:
            assert e.node in s.node_names() and e.peer in ("", *s.node_names())
            named |= {e.node, e.peer} - {""}
    assert {n.split(".")[0] for n in named} >= {"prefill0", "prefill1", "decode0", "decode1"}


# ---- the isolation check and its planted bug ------------------------------------------------------------


def test_planted_links_cache_by_decode_is_caught_by_isolation_only_with_several_prefill_servers() -> None:
    planted = replace(_small(2, 1, rooms=6), hooks=("links_cache_by_decode",))
    res, _ = run_one(planted)
    assert "isolation" in res.violated()
    first = next(v for v in res.violations if v["invariant"] == "isolation")["detail"]
    assert "though the room runs on prefill instance 1 and decode instance 0" in first
    # The honest world, same inputs: nothing crosses.
    assert run_one(replace(planted, hooks=()))[0].violations == []
    # One prefill server: the cache's key is then harmless, and nothing is reported.
    assert (
        run_one(replace(planted, topology=replace(planted.topology, prefill_instances=1)))[0].violations == []
    )


def test_isolation_can_be_turned_off() -> None:
    planted = replace(_small(2, 1, rooms=6), hooks=("links_cache_by_decode",))
    off = replace(planted, checks=replace(planted.checks, isolation=False))
    assert "isolation" not in run_one(off)[0].violated()


# ---- campaigns ------------------------------------------------------------------------------------------


def _multi(seed: int) -> bool:
    t = fuzz_scenario(seed).topology
    return (t.prefill_instances, t.decode_instances) != (1, 1)


def test_campaign_draws_multi_instance_deployments_for_some_seeds() -> None:
    seeds = [s for s in range(200) if _multi(s)]
    assert 0.5 * MULTI_INSTANCE_SHARE * 200 < len(seeds) < 1.5 * MULTI_INSTANCE_SHARE * 200
    assert [s for s in range(200) if _multi(s)] == seeds  # a function of the seed alone
    # A base scenario's servers are kept as they are.
    assert fuzz_scenario(seeds[0], base=sc.load(SCENARIO)).topology.decode_instances == 4


def test_multi_instance_seeds_hold_every_invariant_under_swarm_faults() -> None:
    seeds = [s for s in range(60) if _multi(s)][:8]
    injected = 0
    for seed in seeds:
        res, _ = run_one(fuzz_scenario(seed))
        assert res.violations == [], (seed, res.violations[:2])
        assert res.succeeded + res.failed == res.rooms
        injected += sum(res.faults.values())
    assert injected > 0


def test_fuzz_cli_catches_the_multi_instance_planted_bug_with_a_replay_line(tmp_path: Path) -> None:
    seeds = [s for s in range(40) if fuzz_scenario(s).topology.prefill_instances > 1][:2]
    arg = ",".join(map(str, seeds))
    r = runner.invoke(
        app, ["fuzz", "--seeds", arg, "--plant", "links_cache_by_decode", "--save-dir", str(tmp_path)]
    )
    assert r.exit_code == 1, r.output
    assert "isolation" in r.output and "replay: kvferry replay" in r.output
    saved = sorted(tmp_path.glob("seed-*.toml"))
    assert saved
    back = sc.load(saved[0])
    assert back.topology.prefill_instances > 1 and "isolation" in back.expect_violations
    rr = runner.invoke(app, ["replay", str(saved[0]), "--json"])
    assert rr.exit_code == 0, rr.output  # the file expects the planted violation
    assert json.loads(rr.stdout.strip().splitlines()[-1])["verdict"] == "pass"
