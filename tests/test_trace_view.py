"""The Perfetto trace a user opens: writes named by room and chunk, each room's life a span per rank,
spans nesting on every track, ids as strings, and the count ``replay`` prints equal to the events
in the file.

One traced ``kvferry replay`` of crash-and-restart (failures, a crash mid-transfer, aux writes) is
read back as JSON; a few hand-made event lists pin the naming rules the run may not exercise.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from kvferry.core import messages as m
from kvferry.sim import chrome
from kvferry.sim import scenario as sc
from kvferry.sim.campaign import run_one
from kvferry.sim.trace import Event
from typer.testing import CliRunner

from kvferry.cli import _register, app

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "crash-and-restart.toml"
JS_SAFE = 2**53 - 1
_register()


def _invoke(args: list[str]) -> str:
    # Wide columns: rich would otherwise wrap the report at 80 characters, paths included.
    res = CliRunner().invoke(app, args, env={"COLUMNS": "1000"})
    assert res.exit_code == 0, res.output
    return res.output


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("trace") / "t.json"
    text = _invoke(["replay", str(SCENARIO), "--trace", str(out)])
    return text, json.loads(out.read_text())["traceEvents"]


def _spans(events: list[dict[str, Any]], cat: str) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == "X" and e["cat"] == cat]


def test_replay_prints_the_number_of_events_in_the_file(traced: tuple[str, list[dict[str, Any]]]) -> None:
    text, events = traced
    found = re.search(r"trace written to .*: ([\d,]+) events", " ".join(text.split()))
    assert found, text
    assert int(found.group(1).replace(",", "")) == len(events)


def test_json_report_counts_the_events_in_the_file(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    report = json.loads(_invoke(["replay", str(SCENARIO), "--trace", str(out), "--json"]))
    assert report["trace_events"] == len(json.loads(out.read_text())["traceEvents"])
    # Tapping the notifications for the trace leaves the run, and so its hash, as it was.
    assert report["digest"] == run_one(sc.load(SCENARIO))[0].digest


def test_writes_are_named_by_room_and_chunk(traced: tuple[str, list[dict[str, Any]]]) -> None:
    _, events = traced
    writes = _spans(events, "xfer_done") + _spans(events, "xfer_err")
    assert writes
    for w in writes:
        assert re.fullmatch(r"write room \d+ (chunk \d+|aux row)( \(staged\))?", w["name"]), w
        assert isinstance(w["args"]["room"], str) and w["args"]["transfer_id"], w
    assert any(w["name"].endswith("aux row") for w in writes)
    assert {w["args"]["result"] for w in writes} == {"DONE", "ERR"}


def test_each_room_is_one_span_per_rank(traced: tuple[str, list[dict[str, Any]]]) -> None:
    _, events = traced
    nodes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    lives: dict[tuple[str, str], int] = defaultdict(int)
    for e in _spans(events, "room"):
        assert e["dur"] >= 0 and e["args"]["final"] in ("Success", "Failed", "unfinished"), e
        lives[(nodes[e["pid"]], e["args"]["room"])] += 1
    assert set(lives.values()) == {1}
    rooms = {room for _, room in lives}
    assert len(rooms) == sc.load(SCENARIO).workload.rooms
    # Every room was opened on both decode ranks of this deployment, so it has a span on each.
    for node in ("decode0", "decode1"):
        assert {room for n, room in lives if n == node} == rooms
    # Statuses are spans now (nested in the room's), not instant dots; only news that came after
    # the terminal status stays a moment.
    assert _spans(events, "room_status")
    statuses = ("Bootstrapping", "WaitingForInput", "Transferring", "Success", "Failed")
    for e in events:
        if e["ph"] == "i" and e["name"].startswith(statuses):
            assert "(after " in e["name"], e


def test_spans_nest_on_every_track(traced: tuple[str, list[dict[str, Any]]]) -> None:
    # A viewer stacks the spans of one track; two that overlap without nesting draw wrong.
    _, events = traced
    tracks: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
            start = round(e["ts"] * 1000)
            tracks[(e["pid"], e["tid"])].append((start, start + round(e["dur"] * 1000)))
    assert {e["ph"] for e in events} <= {"M", "X", "i"}  # no B/E pairs to leave unmatched
    for track, spans in tracks.items():
        stack: list[int] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], (
                f"track {track}: [{start}, {end}) overlaps a span ending {stack[-1]}"
            )
            stack.append(end)


def _walk(v: Any, key: str = "") -> list[tuple[str, Any]]:
    if isinstance(v, dict):
        return [x for k, val in v.items() for x in _walk(val, k)]
    if isinstance(v, list):
        return [x for val in v for x in _walk(val, key)]
    return [(key, v)]


def test_ids_are_strings(traced: tuple[str, list[dict[str, Any]]]) -> None:
    _, events = traced
    values = [kv for e in events for kv in _walk(e.get("args", {}))]
    ids = [v for k, v in values if k in ("room", "key", "xid")]
    assert ids and all(isinstance(v, str) for v in ids)
    assert any(int(v) > JS_SAFE for k, v in values if k == "room")  # 63-bit ids: the point of it
    assert not [v for _, v in values if isinstance(v, int) and abs(v) > JS_SAFE]


# --- naming rules, on hand-made traces --------------------------------------------------------------
def _post(xid: int, t: int = 0, **attrs: Any) -> Event:
    base = {"xid": xid, "src": "prefill0", "dst": "decode0", "descs": 1, "charged": 1, "nbytes": 64}
    return Event(t, "prefill0", "post", tuple((base | attrs).items()))


def _done(xid: int, t: int) -> Event:
    return Event(t, "prefill0", "xfer_done", (("xid", xid), ("reason", ""), ("tag", None), ("posted", 0)))


def _note(room: int, chunk: int, **kw: Any) -> bytes:
    src = m.Endpoint(server="prefill", rank=0)
    return m.encode(
        m.ChunkNote(
            room=room,
            transfer_id="t",
            src=src,
            chunk_index=chunk,
            token_start=0,
            token_end=8,
            is_last=False,
            **kw,
        )
    )


def _names(events: list[Event], notes: dict[int, bytes] | None = None) -> dict[str, str]:
    out = chrome.chrome_events(events, notes)
    return {e["args"]["xid"]: e["name"] for e in out if e["ph"] == "X"}


def test_write_names_come_from_tag_then_notification() -> None:
    big = 2**62 + 1
    events = [
        Event(0, "scheduler", "room_arrive", (("room", big), ("key", 7))),
        _post(1, tag="mine"),
        _post(2, notif=_note(big, 3)),  # a fabric that records the notification
        _post(3),  # notification tapped by NoteTap
        _post(4),  # neither: named by its ends
        _post(5, notif=b"not a note"),
        *(_done(x, 10) for x in range(1, 6)),
    ]
    names = _names(events, notes={3: _note(5, 0, staged=2)})
    assert names == {
        "1": "write mine",
        "2": "write room 7 chunk 3",  # the scheduler's key, as in the summary's room column
        "3": "write room 5 chunk 0 (staged)",  # no room_arrive for it: named by its id
        "4": "write prefill0 -> decode0",
        "5": "write prefill0 -> decode0",
    }


def test_overlapping_and_unfinished_writes() -> None:
    events = [_post(1, t=0), _post(2, t=5), _done(1, 10), _post(3, t=20), _done(3, 30), _post(4, t=40)]
    out = chrome.chrome_events(events)
    tracks = {e["args"]["name"]: e["tid"] for e in out if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = {e["args"]["xid"]: e for e in out if e["ph"] == "X"}
    assert spans["1"]["tid"] == spans["3"]["tid"] == tracks["nic"]
    assert spans["2"]["tid"] == tracks["nic 2"]  # overlaps write 1: a track of its own
    # Writes still in flight when the run ended close at its last event, saying so.
    assert spans["2"]["args"]["result"] == "UNFINISHED" and spans["2"]["dur"] == pytest.approx(0.035)
    assert spans["4"]["dur"] == 0
