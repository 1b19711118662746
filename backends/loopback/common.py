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
    ap.add_argument("--engine", default="python", choices=("python", "native"))
    ap.add_argument("--deadline-scale", type=float, default=1.0)
    # The address every rank binds its control socket to (a network namespace's own address under
    # ``kvferry chaos``); NIXL's UCX picks its interface from UCX_NET_DEVICES in the environment.
    ap.add_argument("--host", default="127.0.0.1")
    # How long a lost peer's transfer may stay in flight before the agent releases it unfenced
    # (RuntimeConfig.lost_peer_drain_s; 0: the runtime's default, fence + quarantine): over TCP,
    # as long as decode's quarantine.
    ap.add_argument("--drain-s", type=float, default=0.0)
    if role == "prefill":
        ap.add_argument("--ports", default="", help="control ports to bind, one per rank (restart)")
    else:
        ap.add_argument("--prefill", nargs="+", required=True)
        # How long past the fence a failed room's pages wait for a writer's Stopped (over TCP a
        # write held through a partition lands after the heal): RuntimeConfig.write_quarantine_s.
        # 0 here (frees at the fence, as over RDMA): the loopback soak's writers die with their
        # process, and kvferry chaos gives TCP's bound.
        ap.add_argument("--quarantine-s", type=float, default=0.0)
    args = ap.parse_args()
    args.flows = tuple(f for f in args.flows.split(",") if f)
    return args


def serve(
    run_segment: Callable[[dict[str, Any]], None],
    finish: Callable[[], dict[str, Any]],
    close: Callable[[], list[str]],
    settle: Callable[[], None] = lambda: None,
    release: Callable[[], None] = lambda: None,
    counts: Callable[[], dict[str, int]] = dict,
) -> None:
    """The command loop: ``run`` a segment, ``settle`` (report its kept rooms that changed) and
    ``release`` them, ``finish`` (report the tables), ``exit``. ``counts``: running totals of
    the process, sent with every segment's end and the final report (a killed process's last
    segment still counts)."""
    while True:
        cmd = heard(IDLE_WAIT_S)
        if cmd is None or cmd["cmd"] == "eof":
            close()
            sys.exit(3)
        if cmd["cmd"] == "run":
            run_segment(cmd)
            say(event="segment", end=cmd["end"], rss_kb=rss_kb(), **counts())
        elif cmd["cmd"] == "settle":
            settle()
            say(event="settled")
        elif cmd["cmd"] == "release":
            release()
            say(event="released")
        elif cmd["cmd"] == "finish":
            say(event="done", rss_kb=rss_kb(), **counts(), **finish())
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
        out["copy_ops"] = len(e.staged.ops)
        if ep.role == "prefill":
            out["stalled"] = len(e.staged.stalled)
            out["unconfirmed_notes"] = sum(len(v) for v in e.staged.unconfirmed.values())
            out["leases"] = len(e.leases.leases)
        else:
            out["held_staging_reqs"] = sum(len(v) for v in e.staged.held.values())
    return out


class SideLoop:
    """The segment loop both sides run: open rooms up to the window, step the live ones, and when
    the segment holds rooms for a kill, announce them once every one is Transferring and wait for
    the parent's word. A side names its room handles (``HANDLES``) and implements ``_open`` and
    ``_step``; ``_reclaim`` runs first each round (decode frees fenced pages there)."""

    HANDLES = ""  # the key of a live room's handles: "rvs" (decode) or "senders" (prefill)
    args: Any
    eps: list[Any]  # the side's endpoints, one per rank
    # After a fault, a rank's Success can still turn Failed (the peer failed the room and its
    # notice arrives after a heal or a thaw, resent for up to the fence deadline). A segment run
    # with ``keep`` keeps the handles of reported rooms with a Success rank: ``settle`` reports
    # the ones that changed since (as often as the parent asks), ``release`` clears them.
    keep = False
    settling: dict[int, tuple[list[Any], list[int]]]

    def _release(self, idx: int, handles: list[Any], statuses: list[Any]) -> list[Any]:
        """Handles to clear now; a room with a Success rank is kept to settle when ``keep``."""
        from kvferry.core.kvpoll import KVPoll

        if self.keep and KVPoll.Success in statuses:
            self.settling[idx] = (handles, [int(x) for x in statuses])
            return []
        return handles

    def settle(self) -> None:
        """Report every kept room whose status changed since it was last reported."""
        from kvferry.backends.loopback.wire import say

        for idx, (handles, said) in sorted(self.settling.items()):
            now = [int(h.poll()) for h in handles]
            if now != said:
                reasons, errors = outcome(handles, now)
                say(event="room_final", i=idx, status=now, reason=reasons, error=errors)
                self.settling[idx] = (handles, now)

    def release(self) -> None:
        for handles, _said in self.settling.values():
            for h in handles:
                h.clear()
        self.settling = {}
        self.keep = False

    def counts(self) -> dict[str, int]:
        """``abandoned``: transfers of lost peers the agents released still in flight, past their
        drain bound (backends/nixl/agent.py): their bytes may land after any fence."""
        return {"abandoned": sum(ep.transport.agent.abandoned for ep in self.eps)}

    def _open(self, pending: list[Any], live: dict[int, dict[str, Any]]) -> bool:
        raise NotImplementedError

    def _step(self, live: dict[int, dict[str, Any]], idx: int) -> bool:
        raise NotImplementedError

    def _reclaim(self) -> None:
        return None

    def run_segment(self, cmd: dict[str, Any]) -> None:
        from kvferry.backends.loopback import plan as sp
        from kvferry.backends.loopback.wire import say
        from kvferry.core.kvpoll import KVPoll

        a = self.args
        self.keep = bool(cmd.get("keep"))
        self.settling = getattr(self, "settling", {})
        rate = cmd.get("abort_rate", a.abort_rate)  # a segment may carry its own (a burst of aborts)
        plans = sp.segment_rooms(a.seed, cmd["start"], cmd["end"], cmd["hold_from"], a.flows, rate)
        pending = list(reversed(plans))
        live: dict[int, dict[str, Any]] = {}
        holding = cmd["hold_from"] < cmd["end"]
        end = time.monotonic() + a.segment_timeout_s
        while (pending or live) and time.monotonic() < end:
            self._reclaim()
            busy = self._open(pending, live)
            for idx in list(live):
                busy |= self._step(live, idx)
            if (
                holding
                and not pending
                and live
                and all(st["plan"].hold for st in live.values())
                and all(h.poll() is KVPoll.Transferring for st in live.values() for h in st[self.HANDLES])
            ):
                say(event="inflight", rooms=len(live))
                wait_killed()
                holding = False
                end = time.monotonic() + a.segment_timeout_s
            if not busy:
                time.sleep(0.001)
        for idx, st in live.items():  # a hang: the parent reports it
            say(event="room", i=idx, status=[int(h.poll()) for h in st[self.HANDLES]], reason=["still live"])
