"""What both sides share: arguments, the command loop, the end-of-run report."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from kvferry.backends.loopback import plan as sp
from kvferry.backends.loopback.wire import heard, rss_kb, say

IDLE_WAIT_S = 3600.0  # a side waits this long for its next command, then gives up


def arguments(role: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"kvferry.backends.loopback.{role}_side")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--flows", default=",".join(sp.FLOWS))
    ap.add_argument("--abort-rate", type=float, default=0.0)
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--segment-timeout-s", type=float, default=120.0)
    ap.add_argument("--incarnation", type=int, default=0)
    if role == "prefill":
        ap.add_argument("--ports", default="", help="control ports to bind, one per rank (restart)")
    else:
        ap.add_argument("--prefill", nargs="+", required=True)
    args = ap.parse_args()
    args.flows = tuple(f for f in args.flows.split(",") if f)
    return args


def serve(
    run_segment: Callable[[dict[str, Any]], None],
    finish: Callable[[], dict[str, Any]],
    close: Callable[[], list[str]],
) -> None:
    """The command loop: ``run`` a segment, ``finish`` (report the tables), ``exit``."""
    while True:
        cmd = heard(IDLE_WAIT_S)
        if cmd is None or cmd["cmd"] == "eof":
            close()
            sys.exit(3)
        if cmd["cmd"] == "run":
            run_segment(cmd)
            say(event="segment", end=cmd["end"], rss_kb=rss_kb())
        elif cmd["cmd"] == "finish":
            say(event="done", rss_kb=rss_kb(), **finish())
        elif cmd["cmd"] == "exit":
            say(event="closed", stuck=close())
            return


def wait_killed() -> None:
    """After ``inflight``: the parent kills the other side, then says ``killed`` (or dies)."""
    while True:
        cmd = heard(IDLE_WAIT_S)
        if cmd is None or cmd["cmd"] == "eof":
            sys.exit(3)
        if cmd["cmd"] == "killed":
            return


def outcome(handles: list[Any], statuses: list[Any]) -> tuple[list[str], list[str]]:
    """Per rank: the failure reason and exception type ("" for a rank that did not fail)."""
    reasons, errors = [], []
    for h in handles:
        try:
            h.failure_exception()
            reasons.append("")
            errors.append("")
        except Exception as exc:
            reasons.append(str(exc)[:300])
            errors.append(type(exc).__name__)
    return reasons, errors


def wait_until(check: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def empty(leaks: list[dict[str, int]]) -> bool:
    return all(v == 0 for d in leaks for v in d.values())


def tables(ep: Any) -> dict[str, int]:
    """``ep.leaks()`` plus the flows' own tables (the harness's ``assert_clean`` list): staging
    slots, pinned reservations, gathers and scatters, stalled rooms, notes awaiting a watermark,
    held staging requests, push leases. All zero once every room is settled."""
    out = ep.leaks()
    e = ep.engine
    with ep.lock:  # the engine only under its endpoint's lock
        out["staging_in_use"] = e.staging_in_use()
        out["copy_ops"] = len(e.ops)
        if ep.role == "prefill":
            out["stalled"] = len(e.stalled)
            out["unconfirmed_notes"] = sum(len(v) for v in e.unconfirmed.values())
            out["leases"] = len(e.leases.leases)
        else:
            out["held_staging_reqs"] = sum(len(v) for v in e.held.values())
    return out
