"""The run summary counts rooms, not ranks, and prints failure reasons whole.

A room that failed on several ranks counts once, under the reason of the rank where its failure
started; reasons group with their numbers and ids replaced, and are never cut.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections import Counter

from kvferry.core.kvpoll import KVPoll
from kvferry.sim import scenario as sc
from kvferry.sim.campaign import run_one
from kvferry.sim.metrics import first_failure, reason_class
from typer.testing import CliRunner

from kvferry.cli import _register, app
from kvferry.commands.sim import DEMO_TOML

_register()
F, S = KVPoll.Failed, KVPoll.Success


def test_reason_class_keeps_the_whole_reason_and_replaces_numbers() -> None:
    reason = (
        "timed out while waiting (chunk 3 to decode#0: ring space of decode#0 not drained yet "
        "(round 12, [0, 4096)))"
    )
    assert reason_class(reason) == (
        "timed out while waiting (chunk N to decode#N: ring space of decode#N not drained yet "
        "(round N, [N, N)))"
    )
    assert reason_class("failed on prefill#1: write failed: transfer error") == (
        "failed on prefill#N: write failed: transfer error"
    )
    assert reason_class("superseded by request t5-0x1f") == "superseded by request tN-N"
    assert reason_class("node crashed") == "node crashed"


def test_first_failure_prefers_a_rank_own_reason_then_the_earliest() -> None:
    # prefill1's write failed; the others only pass that on, even the ones that ended earlier.
    reasons = {
        "decode0": "failed on prefill#1: write failed: transfer error",
        "prefill0": "aborted: failed on another rank",
        "prefill1": "write failed: transfer error",
        "decode1": "prefill#1 stopped sending before its failure notice arrived",
    }
    status = dict.fromkeys(reasons, F)
    ends = {"decode0": 5, "prefill0": 1, "prefill1": 9, "decode1": 2}
    assert first_failure(reasons, status, ends) == ("prefill1", "write failed: transfer error")
    # Two reasons of their own: the earliest; at the same time, rank order, by number.
    reasons = {
        "prefill10": "node crashed",
        "prefill2": "node crashed",
        "decode0": "timed out while transferring",
    }
    assert first_failure(reasons, dict.fromkeys(reasons, F), dict.fromkeys(reasons, 4)) == (
        "decode0",
        "timed out while transferring",
    )
    ends = {"prefill10": 3, "prefill2": 3, "decode0": 4}
    assert first_failure(reasons, dict.fromkeys(reasons, F), ends) == ("prefill2", "node crashed")
    # A reason kept from a rank that is no longer Failed (restarted) does not count.
    assert first_failure({"decode0": "node crashed"}, {"decode0": S}, {}) is None


def _demo() -> sc.Scenario:
    return sc.parse(tomllib.loads(DEMO_TOML), where="demo")


def test_failure_reasons_count_each_failed_room_once() -> None:
    res, w = run_one(_demo(), detail=True)
    assert res.failed > 0
    assert sum(res.failure_reasons.values()) == res.failed
    many = [r for r in w.requests if r.outcome == "failed" and sum(st is F for st in r.status.values()) > 1]
    assert many, "the demo should fail some rooms on more than one rank"
    want = Counter(
        reason_class(r.reasons[r.first_failing]) for r in res.rooms_detail if r.outcome == "failed"
    )
    assert res.failure_reasons == dict(want.most_common())
    assert all(r.first_failing in r.reasons for r in res.rooms_detail if r.outcome == "failed")


def _invoke(args: list[str]) -> str:
    res = CliRunner().invoke(app, args, env={"COLUMNS": "1000"})
    assert res.exit_code == 0, res.output
    return res.output


def test_demo_prints_whole_reasons_per_room() -> None:
    report = json.loads(_invoke(["demo", "--json"]))
    text = _invoke(["demo"])
    assert "per rank" not in text
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("failed rooms by reason"))
    printed: dict[str, int] = {}
    for line in lines[head + 1 :]:
        row = re.fullmatch(r"\s+(\d+)\s\s(.+)", line)
        if not row:
            break
        printed[row.group(2)] = int(row.group(1))
    # Whole reasons, as the JSON has them, and the counts add up to the failed rooms.
    assert printed == dict(list(report["failure_reasons"].items())[:5])
    assert len(report["failure_reasons"]) > 5 or sum(printed.values()) == report["failed"]
    assert f"{report['failed']} failed" in text
