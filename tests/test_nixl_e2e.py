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
from kvferry.core.kvpoll import KVPoll  # noqa: E402

pytestmark = pytest.mark.timeout(240)
# CPU CI runs DRAM pools; on the GPU machine KVFERRY_E2E_MEM=VRAM runs the same tests with torch
# CUDA pools in both processes (one GPU).
MEM = os.environ.get("KVFERRY_E2E_MEM", "DRAM")


class Child:
    """A helper process speaking JSON lines; stderr (NIXL's logs) goes to a temp file."""

    def __init__(self, script: str, *args: str) -> None:
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the child)
            "w+", prefix=f"{script}-", suffix=".log", delete=False
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "NIXL_LOG_LEVEL": "WARN"}
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
            msg = json.loads(line)
            if msg.get("event") == event:
                return msg

    def tell(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

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


def _start(seed: int, rooms: int, abort_rate: float, hold: bool) -> tuple[Child, Child]:
    common = ["--seed", str(seed), "--rooms", str(rooms), "--abort-rate", str(abort_rate), "--mem", MEM]
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


def test_two_processes_rooms_chunks_tp2_to_1_aborts():
    seed, n = 11, 240
    plans = wl.rooms(seed, n, abort_rate=0.15)
    pre, dec = _start(seed, n, 0.15, hold=False)
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

    assert len(d["rooms"]) == len(p["rooms"]) == n
    aborted = [x for x in plans if x.abort]
    assert len({x.abort for x in aborted}) == 4 and len(aborted) >= 20  # every kind, some of each
    successes = 0
    for plan in plans:
        dr, pr = d["rooms"][str(plan.index)], p["rooms"][str(plan.index)]
        if plan.abort:
            assert dr["status"] == KVPoll.Failed, (plan, dr)
            assert pr["status"] == [KVPoll.Failed] * 2, (plan, pr)
            assert dr["error"] == "KVTransferError" and dr["reason"], dr
        else:
            # No faults besides the planned aborts: every other room must succeed on both sides.
            assert dr["status"] == KVPoll.Success, (plan, dr)
            assert pr["status"] == [KVPoll.Success] * 2, (plan, pr)
            assert dr["bad_bytes"] == 0, dr["first_bad"]
            assert dr["aux_room_ok"]
            successes += 1
    assert successes >= n // 2
    assert _empty(d["leaks"]) and _empty(p["leaks"]), (d["leaks"], p["leaks"])
    assert d["waiting_fence"] == 0
    assert d["errors"] == [] and p["errors"] == []
    # Skipped chunks of failed rooms are expected; any other driver error (a refused post, a
    # transport exception) is not, in a run without faults.
    unexpected = [k for e in d["driver_errors"] + p["driver_errors"] for k in e if k != "chunk_skipped"]
    assert unexpected == [], (d["driver_errors"], p["driver_errors"])
    assert d_closed["stuck"] == [] and p_closed["stuck"] == []
    assert sum(p["telemetry"]) > 0


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_peer_killed_mid_transfer_fails_rooms_on_survivor(victim):
    seed, n = 5, 8
    pre, dec = _start(seed, n, 0.0, hold=True)
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
        # write that was still in flight (not by the 5 s room timeout, not by the harness).
        died = ("lost (no heartbeat)", "write failed", "ended in ERR")
        assert all(any(d in r for d in died) for r in reasons), res
    assert out["after_kill_s"] is not None
    assert closed["stuck"] == []
    if victim == "decode":
        assert _empty(out["leaks"]), out["leaks"]
