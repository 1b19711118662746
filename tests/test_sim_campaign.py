"""CI's bounded fault campaign, and the fuzz/replay/demo commands end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvferry.sim.campaign import campaign, parse_seeds
from typer.testing import CliRunner

from kvferry.cli import _register, app

ROOT = Path(__file__).resolve().parent.parent
_register()
runner = CliRunner()


@pytest.mark.parametrize("block", range(4))
def test_bounded_campaign_finds_no_violation(block: int) -> None:
    """300 seeds of swarm faults over drawn deployments (4 blocks so xdist can spread them)."""
    failing = []
    for res in campaign(range(block * 75, (block + 1) * 75)):
        assert res.succeeded + res.failed == res.rooms
        if res.violations:
            failing.append((res.seed, res.violations[0]))
    assert failing == [], "\n".join(
        f"seed {seed}: {violation} -- replay: uv run kvferry fuzz --seeds {seed} --save-dir fuzz-failures"
        for seed, violation in failing
    )


def test_parse_seeds() -> None:
    assert parse_seeds("0-3,7,2") == [0, 1, 2, 3, 7]
    for bad in ("", "a-b", "5-2", "-1"):
        with pytest.raises(ValueError):
            parse_seeds(bad)


def test_fuzz_cli_json_clean_run() -> None:
    r = runner.invoke(app, ["fuzz", "--seeds", "0-5", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["seeds"] == 6 and d["violations"] == {} and d["rooms"] > 0
    assert isinstance(d["agreement_exempt_rooms"], int)


def test_fuzz_cli_reports_planted_bug_with_replay_line_and_file(tmp_path: Path) -> None:
    r = runner.invoke(
        app, ["fuzz", "--seeds", "0-3", "--plant", "free_pages_early", "--save-dir", str(tmp_path)]
    )
    assert r.exit_code == 1
    assert "ownership" in r.output and "replay: kvferry replay" in r.output
    files = sorted(tmp_path.glob("seed-*.toml"))
    assert files
    rr = runner.invoke(app, ["replay", str(files[0]), "--json"])
    assert rr.exit_code == 0, rr.output  # the file expects the planted violation
    d = json.loads(rr.stdout.strip().splitlines()[-1])
    assert d["verdict"] == "pass" and "ownership" in d["expected_violations"]


def test_replay_cli_writes_trace_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    r = runner.invoke(app, ["replay", str(ROOT / "scenarios" / "quickstart.toml"), "--trace", str(out)])
    assert r.exit_code == 0, r.output
    assert "invariants: all held" in r.output and "room latency" in r.output
    assert json.loads(out.read_text())["traceEvents"]


def test_replay_cli_bad_file_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[faults]\nctrl_drop = 2\n")
    r = runner.invoke(app, ["replay", str(bad)])
    assert r.exit_code == 2
    assert "[faults].ctrl_drop" in r.output


def test_demo_cli() -> None:
    r = runner.invoke(app, ["demo", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["rooms"] == 36 and d["verdict"] == "pass" and d["succeeded"] > 0
    assert sum(d["faults"].values()) >= 5


def test_fuzz_cli_with_a_base_scenario() -> None:
    r = runner.invoke(
        app, ["fuzz", "--seeds", "0-2", "--scenario", str(ROOT / "scenarios" / "quickstart.toml"), "--json"]
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["rooms"] == 3 * 24 and d["violations"] == {}
