"""Two real processes on 127.0.0.1: a prefill server (2 ranks) and a decode server (1 rank),
real NIXL over UCX on DRAM, the threaded runtime, ports chosen at runtime.

Proves: a few hundred rooms with chunked prefill, TP 2 -> 1 and different page sizes; every
Success room's bytes equal what prefill computed; every aborted room (by either side, early or
mid-transfer) ends Failed on both sides; every table is empty at the end; worker threads join.
A peer killed mid-transfer ends the survivor's rooms Failed (heartbeat deadline of the core).
The processes are always killed in ``finally``; every wait on them is bounded.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent / "nixl_procs"
sys.path.insert(0, str(HERE))
import workload as wl  # noqa: E402
from kvferry.backends.loopback.plan import LATE_ABORTS  # noqa: E402
from kvferry.core import topology  # noqa: E402
from kvferry.core.kvpoll import KVPoll  # noqa: E402

pytestmark = pytest.mark.timeout(240)
# CPU CI runs DRAM pools; on the GPU machine KVFERRY_E2E_MEM=VRAM runs the same tests with torch
# CUDA pools in both processes (one GPU, or the GPUs named by KVFERRY_E2E_PREFILL_GPUS and
# KVFERRY_E2E_DECODE_GPUS).
MEM = os.environ.get("KVFERRY_E2E_MEM", "DRAM")


class Child:
    """A helper process speaking JSON lines; stderr (NIXL's logs) goes to a temp file."""

    def __init__(self, script: str, *args: str) -> None:
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the child)
            "w+", prefix=f"{script}-", suffix=".log", delete=False
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "NIXL_LOG_LEVEL": "WARN"}
        # Placement on a multi-GPU host: KVFERRY_E2E_PREFILL_GPUS=0 KVFERRY_E2E_DECODE_GPUS=1 puts
        # each side's ranks on its own GPUs (a rank uses the first GPU it sees).
        gpus = os.environ.get(f"KVFERRY_E2E_{script.removesuffix('_proc').upper()}_GPUS", "")
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / f"{script}.py"), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def expect(self, event: str, timeout_s: float = 60.0) -> dict[str, Any]:
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"no {event!r} within {timeout_s}s; log: {self.tail()}") from None
            if line is None:
                raise AssertionError(
                    f"process exited (rc={self.proc.poll()}) before {event!r}: {self.tail()}"
                )
            if not line.startswith("{"):
                continue  # UCX prints its own errors (a killed peer's refused socket) to stdout
            msg = json.loads(line)
            if msg.get("event") == event:
                return msg

    def tell(self, word: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(word + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            # Say why the child is gone (its exit status and its log), not only that the pipe broke.
            raise AssertionError(
                f"process exited (rc={self.proc.wait(10)}) before {word!r}: {self.tail()}"
            ) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def close(self) -> None:
        self.kill()
        self.log.close()
        os.unlink(self.log.name)


def _start(
    seed: int, rooms: int, abort_rate: float, hold: bool, tp: tuple[int, int] = (2, 1), flow: str = "policy"
) -> tuple[Child, Child]:
    common = ["--seed", str(seed), "--rooms", str(rooms), "--abort-rate", str(abort_rate), "--mem", MEM]
    common += ["--prefill-tp", str(tp[0]), "--decode-tp", str(tp[1]), "--flow", flow]
    if hold:
        common.append("--hold")
    pre = Child("prefill_proc", *common)
    try:
        addresses = pre.expect("ready")["addresses"]
        dec = Child("decode_proc", *common, "--prefill", *addresses)
    except BaseException:
        pre.close()
        raise
    return pre, dec


def _empty(leaks: list[dict[str, int]]) -> bool:
    return all(v == 0 for d in leaks for v in d.values())


def _run_rooms(seed: int, n: int, abort_rate: float, tp: tuple[int, int], flow: str) -> dict[str, Any]:
    pre, dec = _start(seed, n, abort_rate, hold=False, tp=tp, flow=flow)
    try:
        dec.expect("ready")
        pre.tell("go")
        dec.tell("go")
        d = dec.expect("done", 150)
        p = pre.expect("done", 60)
        dec.tell("exit")
        pre.tell("exit")
        d_closed, p_closed = dec.expect("closed"), pre.expect("closed")
    finally:
        dec.close()
        pre.close()
    return {"d": d, "p": p, "stuck": d_closed["stuck"] + p_closed["stuck"]}


def _check_rooms(plans: list[wl.RoomPlan], out: dict[str, Any], tp: tuple[int, int]) -> int:
    """Every aborted room Failed as a whole on both sides, every other room Success with its
    bytes right, every table (the staging ring and pools included) empty; returns the Success
    count. A rank of an aborted room may be Success: its decode rank finished before the
    scheduler's abort reached it (a local abort after Success is a no-op, core/receiver.py).
    Then its peers agree and its bytes are right. A room decode aborts as soon as it opens it may
    have ended before the abort on every rank: then all are Success with the right bytes."""
    d, p = out["d"], out["p"]
    n = len(plans)
    assert len(d["rooms"]) == len(p["rooms"]) == n
    # First what the threads saw (it explains a failed room better than the room does):
    assert d["errors"] == [] and p["errors"] == []
    assert all(not c["engine_ops"] and not c["driver"] for c in p["copies"]), p["copies"]
    # Skipped chunks of failed rooms and chunks waiting for staging space are expected; any other
    # driver error (a refused post, a transport exception) is not, in a run without faults.
    expected = {"chunk_skipped", "chunk_deferred"}
    unexpected = [k for e in d["driver_errors"] + p["driver_errors"] for k in e if k not in expected]
    assert unexpected == [], (d["driver_errors"], p["driver_errors"])
    successes = 0
    for plan in plans:
        dr, pr = d["rooms"][str(plan.index)], p["rooms"][str(plan.index)]
        ended_first = plan.abort in LATE_ABORTS and all(
            st == KVPoll.Success for st in [*dr["status"], *pr["status"]]
        )
        if ended_first:
            # An abort that can reach a room already Success (backends/loopback/plan.py says
            # which and why), where it is a no-op: judged as the soak judges it, by its bytes.
            assert dr["bad_bytes"] == 0 and dr["aux_room_ok"], (plan, dr)
        elif plan.abort:
            assert KVPoll.Failed in dr["status"] and KVPoll.Failed in pr["status"], (plan, dr, pr)
            for rank, status in enumerate(pr["status"]):
                if status == KVPoll.Success:  # only if every decode rank it feeds finished too
                    to = topology.receiver_endpoints(wl.MODEL, tp[0], tp[1], rank)
                    assert all(dr["status"][e.rank] == KVPoll.Success for e in to), (plan, dr, pr)
            failed = [i for i, st in enumerate(dr["status"]) if st == KVPoll.Failed]
            assert {dr["error"][i] for i in failed} == {"KVTransferError"}, dr
            assert all(dr["reason"][i] for i in failed), dr
            assert dr["bad_bytes"] == 0, dr["first_bad"]  # the ranks that did finish
        else:
            # No faults besides the planned aborts: every other room must succeed on both sides.
            assert dr["status"] == [KVPoll.Success] * tp[1], (plan, dr)
            assert pr["status"] == [KVPoll.Success] * tp[0], (plan, pr)
            assert dr["bad_bytes"] == 0, dr["first_bad"]
            assert dr["aux_room_ok"]
            successes += 1
    assert _empty(d["leaks"]) and _empty(p["leaks"]), (d["leaks"], p["leaks"])
    assert d["waiting_fence"] == 0
    assert out["stuck"] == []
    assert sum(p["telemetry"]) > 0
    return successes


def test_two_processes_rooms_chunks_tp2_to_1_aborts():
    seed, n = 11, 240
    plans = wl.rooms(seed, n, abort_rate=0.15)
    out = _run_rooms(seed, n, 0.15, (2, 1), "direct")
    aborted = [x for x in plans if x.abort]
    assert len({x.abort for x in aborted}) == 4 and len(aborted) >= 20  # every kind, some of each
    assert _check_rooms(plans, out, (2, 1)) >= n // 2


# Every staged flow, and the policy's choice, on the TP pairs of the issue: fewer rooms each (the
# 240-room run above covers volume), every abort kind, ring wrapping (a small ring), chunking.
@pytest.mark.parametrize("flow", ["ring", "pinned", "direct", "pull", "push"])
@pytest.mark.parametrize("tp", [(2, 1), (1, 2), (4, 2), (2, 2)], ids=["tp2to1", "tp1to2", "tp4to2", "tp2to2"])
def test_two_processes_flows_tp_pairs(tp, flow):
    seed, n = 23, 48
    plans = wl.rooms(seed, n, abort_rate=0.2)
    out = _run_rooms(seed, n, 0.2, tp, flow)
    assert _check_rooms(plans, out, tp) >= n // 2
    scattered = {f: sum(c.get(f"scattered_{f}", 0) for c in out["d"]["counters"]) for f in ("ring", "pinned")}
    pre = {k: sum(c.get(k, 0) for c in out["p"]["counters"]) for c in out["p"]["counters"] for k in c}
    if flow in ("direct", "pull", "push"):
        assert scattered == {"ring": 0, "pinned": 0}, scattered
    else:  # the flow really staged: decode scattered chunks of that flow and no other
        assert scattered[flow] > 0 and sum(scattered.values()) == scattered[flow], scattered
    if flow == "pull":  # decode really READ: prefill saw its READs' notifications
        assert pre.get("read_notif", 0) > 0, pre
    if flow == "push":  # prefill's writes went under leases, and never without one
        assert pre.get("lease_delivered", 0) > 0, pre
        assert pre.get("push_untracked_write", 0) == 0, pre
        # Both orders: decode registered first, and (its late rooms) prefill computed first.
        assert pre.get("lease_matched_registration_first", 0) > 0, pre
        assert pre.get("push_computed_before_registration", 0) > 0, pre


@pytest.mark.parametrize(
    ("tp", "flow"),
    [
        ((2, 1), "direct"),
        ((2, 1), "ring"),
        ((4, 2), "pinned"),
        ((2, 1), "pull"),
        ((1, 2), "push"),
        ((2, 1), "layerwise"),  # a held room: its first chunk's first layer only, then the kill
    ],
    ids=["direct", "ring", "pinned", "pull", "push", "layerwise"],
)
@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_peer_killed_mid_transfer_fails_rooms_on_survivor(victim, tp, flow):
    seed, n = 5, 8
    pre, dec = _start(seed, n, 0.0, hold=True, tp=tp, flow=flow)
    try:
        dec.expect("ready")
        pre.tell("go")
        dec.tell("go")
        survivor, dead = (dec, pre) if victim == "prefill" else (pre, dec)
        # Both sides past the first chunk: every room is Transferring on decode.
        dec.expect("inflight", 60)
        pre.expect("inflight", 60)
        dead.kill()
        survivor.tell("killed")
        out = survivor.expect("done", 60)
        survivor.tell("exit")
        closed = survivor.expect("closed")
    finally:
        dec.close()
        pre.close()

    assert len(out["rooms"]) == n
    for res in out["rooms"].values():
        statuses = res["status"] if isinstance(res["status"], list) else [res["status"]]
        assert all(s == KVPoll.Failed for s in statuses), res
        reasons = res["reason"] if isinstance(res["reason"], list) else [res["reason"]]
        # The core noticed the death itself: by the heartbeat deadline, or by the NIXL error of a
        # write (or, under pull, decode's READ) that was still in flight (not by the 5 s room
        # timeout, not by the harness).
        # A staged write posted after the death is refused by NIXL itself (the original error).
        # Under push, decode's death also shows as its registration's lease running out.
        died = (
            "lost (no heartbeat)",
            "write failed",
            "read failed",
            "ended in ERR",
            "REMOTE_DISCONNECT",
            "lease expired",
        )
        assert all(any(d in r for d in died) for r in reasons), res
    assert out["after_kill_s"] is not None
    assert closed["stuck"] == []
    if victim == "decode" and flow != "pull":
        # (Under pull, prefill keeps a dead decode's pages until the fence deadline, 20 s, never
        # earlier: decode's READs might still be landing. The simulator checks that rule.)
        assert _empty(out["leaks"]), out["leaks"]
