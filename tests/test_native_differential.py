"""Differential test of the two executors of the core's commands: the same command sequences, run by
a real Driver over real NIXL (UCX, CPU DRAM, two processes) once on the Python executor and once on
the native engine, must give the same event sequences (WriteDone / WriteFailed / NotificationIn /
AuxChecked, per step) and the same bytes.

The sequence covers prepared and one-shot writes with notifications, an aux-row write and its
check, a bare notification, a READ (pull) with its notification, a descriptor outside its region
(refused before NIXL), writes prepared ahead and posted later (prepared lists and one-shot
descriptors, an aux row; one refused at its preparation, one never prepared, one dropped, one whose peer was
dropped before its post), a write after the peer was dropped, and a 16 MiB write whose completion is
posted while the target process is stopped (SIGSTOP): UCX's TCP transport cannot finish it before
the target resumes, so no completion may be reported until then, and its bytes must be there once
it is ("landed").

Planted engine bugs (``KVFERRY_NATIVE_PLANT``) prove the comparison can fail: a completion reported
before the transfer finished (the landed check fails), and each notification delivered with the
previous one's payload (a notification counted for the wrong room), and a post of a prepared
write that posts the one prepared last instead (a prepared chunk posted for another).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_nixl_e2e import Child  # the helper-process wrapper the e2e tests use

pytestmark = pytest.mark.timeout(180)
PAGE_BYTES = 16 * 2048  # one page of diff_proc's pool (16 tokens of 8 heads x 128 x bf16)


def _run(
    child: Child, cmds: list[dict[str, Any]], notifs: int = 0, timeout_s: float = 20.0
) -> list[list[Any]]:
    child.tell(json.dumps({"do": "run", "cmds": cmds, "notifs": notifs, "timeout_s": timeout_s}))
    return sorted(child.expect("events", 60)["events"])  # order within a step is UCX's, not ours


def _digest(child: Child, region: int) -> str:
    child.tell(json.dumps({"do": "digest", "region": region}))
    return child.expect("digest", 30)["sha"]


def _hex(s: str) -> str:
    return s.encode().hex()


def trace(monkeypatch: pytest.MonkeyPatch, engine: str, plant: str = "") -> list[Any]:
    """Run the sequence on ``engine`` (both processes); the steps' event lists, in step order."""
    monkeypatch.setenv("KVFERRY_E2E_ENGINE", engine)
    monkeypatch.setenv("KVFERRY_NATIVE_PLANT", plant)
    # TCP only: the target's own process must copy the bytes in (and answer UCX's flush), so a
    # stopped target cannot complete a write. Shared-memory transports (cma) write into a stopped
    # process, and which one UCX picks varies by host: a correct engine then reports step 9's
    # completion early on one machine and not on another.
    monkeypatch.setenv("UCX_TLS", "tcp")
    pre = Child("diff_proc", "--role", "prefill")
    dec = Child("diff_proc", "--role", "decode")
    try:
        p_ready, d_ready = pre.expect("ready"), dec.expect("ready")
        assert p_ready["executor"] == d_ready["executor"] == engine
        region = p_ready["region_bytes"]
        pre.tell(json.dumps({"do": "peer", "registration": d_ready["registration"]}))
        dec.tell(json.dumps({"do": "peer", "registration": p_ready["registration"]}))
        pre.expect("ok")
        dec.expect("ok")
        steps: list[Any] = [_run(pre, [{"kind": "add_peer"}]), _run(dec, [{"kind": "add_peer"}])]
        pre.tell(json.dumps({"do": "aux_row", "index": 1, "room": 77}))
        pre.expect("ok")
        pg = PAGE_BYTES
        writes = [
            {  # one run of two pages, then three runs across both regions
                "kind": "write",
                "id": 1,
                "src_region": [0],
                "src_offset": [0],
                "dst_region": [1],
                "dst_offset": [pg],
                "length": [2 * pg],
                "notif": _hex("room1-chunk0"),
            },
            {
                "kind": "write",
                "id": 2,
                "src_region": [0, 1, 1],
                "src_offset": [4 * pg, 0, 9 * pg],
                "dst_region": [1, 0, 1],
                "dst_offset": [8 * pg, 3 * pg, 20 * pg],
                "length": [pg, 3 * pg, 2048],
                "notif": _hex("room1-chunk1"),
            },
            {"kind": "aux", "id": 3, "src": 1, "dst": 2, "notif": _hex("room1-aux")},
            {"kind": "notif", "notif": _hex("room2-empty")},
        ]
        steps.append(_run(pre, writes))
        prepared = [  # made ready now, posted in a later step (the decode side is the same)
            {  # page runs: indices into the prepared lists
                "prep": 1,
                "src_region": [0, 1],
                "src_offset": [10 * pg, 30 * pg],
                "dst_region": [0, 1],
                "dst_offset": [60 * pg, 70 * pg],
                "length": [2 * pg, pg],
                "notif": _hex("room4-prep0"),
            },
            {  # one long run: one-shot descriptors (the "auto" choice)
                "prep": 2,
                "src_region": [1],
                "src_offset": [100 * pg],
                "dst_region": [0],
                "dst_offset": [200 * pg],
                "length": [40 * pg],
                "notif": _hex("room4-prep1"),
            },
            {  # past the end of the peer's region: refused when prepared, failed when posted
                "prep": 3,
                "src_region": [0],
                "src_offset": [0],
                "dst_region": [1],
                "dst_offset": [region - pg],
                "length": [2 * pg],
            },
        ]
        steps.append(_run(dec, [], notifs=4))
        steps.append(_run(dec, [{"kind": "check_aux", "room": 1, "index": 2}]))
        read = {
            "kind": "read",
            "id": 10,
            "src_region": [1],
            "src_offset": [5 * pg],
            "dst_region": [0],
            "dst_offset": [40 * pg],
            "length": [2 * pg],
            "notif": _hex("room3-read"),
        }
        steps.append(_run(dec, [read]))
        steps.append(_run(pre, [], notifs=1))
        outside = {
            "kind": "write",
            "id": 20,
            "src_region": [0],
            "src_offset": [0],
            "dst_region": [0],
            "dst_offset": [region - pg],
            "length": [2 * pg],
        }
        steps.append(_run(pre, [outside]))
        steps.append(["bytes", _digest(dec, 0), _digest(dec, 1)])
        # The whole of region 0, no notification: its completion must mean its bytes are there.
        want = _digest(pre, 0)
        whole = {
            "kind": "write",
            "id": 30,
            "src_region": [0],
            "src_offset": [0],
            "dst_region": [0],
            "dst_offset": [0],
            "length": [region],
        }
        # The target is stopped while it is posted: the write cannot finish before it resumes
        # (UCX's TCP transport needs the target's progress), so no completion may be reported.
        os.kill(dec.proc.pid, signal.SIGSTOP)
        try:
            steps.append(_run(pre, [whole], timeout_s=1.0))
        finally:
            os.kill(dec.proc.pid, signal.SIGCONT)
        steps.append(_run(pre, []))
        steps.append(["landed", _digest(dec, 0) == want])
        steps.append(_run(pre, [{**p, "kind": "prepare"} for p in prepared]))
        posts = [{"kind": "post_prepared", "prep": p["prep"], "id": 50 + i} for i, p in enumerate(prepared)]
        steps.append(_run(pre, [*posts, {"kind": "post_prepared", "prep": 99, "id": 53}]))
        steps.append(_run(dec, [], notifs=2))
        steps.append(["bytes", _digest(dec, 0), _digest(dec, 1)])
        a, b = ({**writes[0], "kind": "prepare", "prep": 5 + i, "notif": _hex(f"room5-{i}")} for i in (0, 1))
        post_a = {"kind": "post_prepared", "prep": 5, "id": 54}
        aux = {"kind": "prepare_aux", "prep": 8, "src": 1, "dst": 3, "notif": _hex("room5-aux")}
        post_aux = {"kind": "post_prepared", "prep": 8, "id": 57}
        steps.append(_run(pre, [a, b, aux, post_a, post_aux, {"kind": "drop_prepared", "prep": 6}]))
        steps.append(_run(dec, [], notifs=2))
        steps.append(_run(dec, [{"kind": "check_aux", "room": 1, "index": 3}]))
        steps.append(_run(pre, [{"kind": "post_prepared", "prep": 6, "id": 55}]))
        steps.append(_run(pre, [{**writes[0], "kind": "prepare", "prep": 7}]))
        dropped = {"kind": "post_prepared", "prep": 7, "id": 56}
        steps.append(_run(pre, [{"kind": "drop_peer"}, {**writes[0], "id": 40}, dropped]))
        pre.tell("exit")
        dec.tell("exit")
        pre.expect("closed")
        dec.expect("closed")
        return steps
    finally:
        pre.close()
        dec.close()


@pytest.fixture(scope="module")
def reference() -> list[Any]:
    with pytest.MonkeyPatch.context() as mp:
        return trace(mp, "python")


def test_reference_sequence_is_what_the_contract_says(reference: list[Any]) -> None:
    """The Python executor's events, spelled out: the baseline the native engine must match."""
    notes = sorted(["notif", _hex(s)] for s in ("room1-chunk0", "room1-chunk1", "room1-aux", "room2-empty"))
    assert reference[2] == [["done", 1], ["done", 2], ["done", 3]]
    assert reference[3] == notes
    assert reference[4] == [["aux", 77]]
    assert reference[5] == [["done", 10]]
    assert reference[6] == [["notif", _hex("room3-read")]]
    assert reference[7] == [["failed", 20]]
    assert reference[9] == []  # the target stopped: no completion yet
    assert reference[10] == [["done", 30]]
    assert reference[11] == ["landed", True]
    assert reference[12] == []  # prepared: nothing moves, nothing answers
    assert reference[13] == [["done", 50], ["done", 51], ["failed", 52], ["failed", 53]]
    assert reference[14] == sorted(["notif", _hex(s)] for s in ("room4-prep0", "room4-prep1"))
    assert reference[15][1:] != reference[8][1:]  # the prepared writes changed the target's bytes
    assert reference[16] == [["done", 54], ["done", 57]]
    assert reference[17] == sorted(["notif", _hex(s)] for s in ("room5-0", "room5-aux"))
    assert reference[18] == [["aux", 77]]  # the prepared aux row's write landed
    assert reference[19] == [["failed", 55]]  # dropped before its post
    assert reference[20] == []
    assert reference[21] == [["failed", 40], ["failed", 56]]  # its peer dropped before its post


def test_native_engine_gives_the_same_events(reference: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    assert trace(monkeypatch, "native") == reference


@pytest.mark.parametrize(
    ("plant", "step"),
    [("early_done", 9), ("notif_prev", 3), ("ready_lifo", 17)],
    ids=["completion-before-landing", "notification-for-wrong-room", "prepared-posted-for-another"],
)
def test_planted_engine_bug_is_caught(
    reference: list[Any], monkeypatch: pytest.MonkeyPatch, plant: str, step: int
) -> None:
    planted = trace(monkeypatch, "native", plant)
    assert planted[step] != reference[step], planted
