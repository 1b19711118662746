"""The soak parent: a prefill process and a decode process on loopback over real NIXL, rooms run
segment by segment; every ``kill_every`` rooms one side (prefill first, then decode, alternating)
is killed with SIGKILL while its segment's last rooms are in flight, and restarted.

Checks, per room: a Success room is Success on every rank of both sides and its bytes (and aux
row) equal what prefill computed; an aborted room is Failed on every rank of both sides; a room in
flight when its peer was killed is Failed on every rank of the survivor; every room reaches a
terminal state within the segment's deadline. At the end: every table (engine, driver, NIXL,
staging copies, status board) is empty on both sides, no thread failed or stuck, and the resident
memory of each process grew by at most ``rss_bound_mb`` from its first sample after warm-up to its
last. All random choices derive from ``seed``; a failure prints a replay command.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvferry.backends.loopback import plan as sp
from kvferry.backends.loopback.wire import rss_kb
from kvferry.core.kvpoll import KVPoll

SEGMENT_ROOMS = 200  # rooms between two barriers (and at most between two time checks)
DRIVER_ERRORS_OK = {"chunk_skipped", "chunk_deferred"}  # expected in any run (e2e tests' rule)
START_TIMEOUT_S = 90.0
# How a survivor's rooms may fail when its peer dies (tests/test_nixl_e2e.py's list, and a pull
# room's READ of the dead peer failing).
DEATH_MARKS = (
    "lost (no heartbeat)", "write failed", "read failed", "ended in ERR", "REMOTE_DISCONNECT",
    "lease expired",
)  # fmt: skip
FAILED, SUCCESS = int(KVPoll.Failed), int(KVPoll.Success)


@dataclass(frozen=True)
class SoakConfig:
    rooms: int = 2000
    seed: int = 0
    prefill_tp: int = 2
    decode_tp: int = 1
    flows: tuple[str, ...] = sp.FLOWS
    abort_rate: float = 0.1
    kill_every: int = 500  # 0: no kills
    hold: int = 4  # rooms in flight at each kill
    max_seconds: float = 3600.0
    rss_bound_mb: float = 64.0
    warmup_s: float = 45.0  # tombstones (40 s) and allocator arenas fill up first
    segment_timeout_s: float = 120.0
    engine: str = "python"  # RuntimeConfig.nixl_engine of both sides: python or native
    deadline_scale: float = 1.0  # rooms' own deadlines stretched (plan.timeouts) on a loaded host


def check_config(c: SoakConfig) -> None:
    """Raise ValueError naming the option for a value the soak cannot run."""
    if not 1 <= c.rooms <= 10**8:
        raise ValueError(f"--rooms must be in [1, 100000000], got {c.rooms}")
    for name, tp in (("--prefill-tp", c.prefill_tp), ("--decode-tp", c.decode_tp)):
        if tp not in (1, 2, 4):
            raise ValueError(f"{name} must be 1, 2 or 4 (the soak model has 4 KV heads), got {tp}")
    bad = [f for f in c.flows if f not in sp.FLOWS]
    if bad or not c.flows:
        raise ValueError(f"--flows: unknown flow(s) {bad}; known: {list(sp.FLOWS)}")
    if not 0.0 <= c.abort_rate <= 1.0:
        raise ValueError(f"--abort-rate must be a probability in [0, 1], got {c.abort_rate}")
    if c.kill_every != 0 and not 2 * sp.WINDOW <= c.kill_every <= 10**8:
        raise ValueError(
            f"--kill-every must be 0 (no kills) or in [{2 * sp.WINDOW}, 100000000], got {c.kill_every}"
        )
    if not 1 <= c.hold <= sp.WINDOW:
        raise ValueError(f"--hold must be in [1, {sp.WINDOW}], got {c.hold}")
    if not 1.0 <= c.max_seconds <= 7 * 86400:
        raise ValueError(f"--max-seconds must be in [1, 604800], got {c.max_seconds}")
    if not 0.0 < c.rss_bound_mb <= 1e6:
        raise ValueError(f"--rss-bound-mb must be in (0, 1000000], got {c.rss_bound_mb}")
    if not 0.0 <= c.warmup_s <= 86400:
        raise ValueError(f"--warmup-s must be in [0, 86400], got {c.warmup_s}")
    if c.engine not in ("python", "native"):
        raise ValueError(f"--engine must be python or native, got {c.engine!r}")
    if not 1.0 <= c.deadline_scale <= sp.MAX_DEADLINE_SCALE:
        top = f"{sp.MAX_DEADLINE_SCALE:g}"
        raise ValueError(f"--deadline-scale must be in [1, {top}], got {c.deadline_scale}")


def replay_command(c: SoakConfig) -> str:
    return (
        f"kvferry soak --seed {c.seed} --rooms {c.rooms} --prefill-tp {c.prefill_tp} "
        f"--decode-tp {c.decode_tp} --flows {','.join(c.flows)} --abort-rate {c.abort_rate} "
        f"--kill-every {c.kill_every} --hold {c.hold}"
        + (f" --engine {c.engine}" if c.engine != "python" else "")
    )


def segments(c: SoakConfig) -> list[tuple[int, int, bool]]:
    """(start, end, kill after it): boundaries every SEGMENT_ROOMS and every kill_every rooms."""
    cuts = set(range(0, c.rooms, SEGMENT_ROOMS)) | {c.rooms}
    kills = set(range(c.kill_every, c.rooms, c.kill_every)) if c.kill_every else set()
    bounds = sorted(cuts | kills)
    return [(a, b, b in kills) for a, b in itertools.pairwise(bounds)]


class SideDied(RuntimeError):
    pass


class Side:
    """One side's process: JSON lines on stdout into the shared queue, stderr (NIXL and UCX logs)
    to a temporary file kept for the report when something went wrong."""

    def __init__(
        self,
        role: str,
        incarnation: int,
        args: list[str],
        events: queue.Queue,
        env: dict,
        prefix: tuple[str, ...] = (),
    ) -> None:
        self.role, self.incarnation = role, incarnation
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the process)
            "w+", prefix=f"kvferry-soak-{role}{incarnation}-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            # ``prefix`` runs the side elsewhere (``ip netns exec NS``, which execs: the pid is the side's)
            [*prefix, sys.executable, "-m", f"kvferry.backends.loopback.{role}_side", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.started = time.monotonic()
        self.seen: dict[str, dict[str, Any]] = {}
        self.dead = False
        self.ran = False  # it finished a segment: its RSS is sampled from then on
        self.abandoned = 0  # its agents' abandoned transfers, as it last reported them
        threading.Thread(target=self._read, args=(events,), daemon=True).start()

    def _read(self, events: queue.Queue) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):  # UCX prints its own errors (a killed peer's socket) to stdout
                events.put((self, json.loads(line)))
        events.put((self, None))

    def tell(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-2000:]

    def close(self) -> None:
        self.kill()
        self.log.close()
        os.unlink(self.log.name)


BASELINE_WINDOW_S = 30.0  # longer than a peer's loss and return (heartbeat timeout, re-register)


@dataclass
class RssTrack:
    side: str
    incarnation: int
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (s since start, rooms, KiB)

    def summary(self, warmup_s: float, bound_mb: float) -> dict[str, Any]:
        s = self.samples
        # The baseline: the highest sample in the first BASELINE_WINDOW_S after warm-up (samples
        # that follow at least one segment, the last one left to compare). Not a single sample:
        # a process that lost its peer (a partition, a stall, the peer killed) has released what
        # it held for it (remote agent, prepared lists, UCX endpoints: 20-70 MB here) and takes
        # it again when the peer is back, so one sample taken in such a dip reads as growth.
        post = [x for x in s[1:-1] if x[0] >= warmup_s]
        window = [x for x in post if x[0] < post[0][0] + BASELINE_WINDOW_S] if post else []
        base = max(window, key=lambda x: x[2]) if window else None
        last = s[-1] if s else None
        out: dict[str, Any] = {
            "side": self.side,
            "incarnation": self.incarnation,
            "samples": len(s),
            "first_mb": round(s[0][2] / 1024, 1) if s else None,
            "last_mb": round(last[2] / 1024, 1) if last else None,
            "checked": base is not None and last is not None and last is not base,
        }
        if out["checked"]:
            out["baseline_mb"] = round(base[2] / 1024, 1)
            out["baseline_rooms"] = base[1]
            out["last_rooms"] = last[1]
            out["growth_mb"] = round((last[2] - base[2]) / 1024, 1)
            out["ok"] = out["growth_mb"] <= bound_mb
        return out


class Soak:
    # A room held in flight at a kill must fail on the survivor by the peer's death (heartbeat loss,
    # a refused write, a lease), not by its own deadline. Chaos relaxes this (see PairRun).
    kill_deadline_is_violation = True

    def __init__(self, c: SoakConfig, progress: Callable[[str], None] | None) -> None:
        self.c = c
        self.progress = progress or (lambda _line: None)
        self.events: queue.Queue = queue.Queue()
        key = os.environ.get("KVFERRY_CONTROL_KEY") or secrets.token_hex(32)  # our two processes only
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "NIXL_LOG_LEVEL": "WARN",
            "KVFERRY_CONTROL_KEY": key,
        }
        self.results: dict[str, dict[int, dict[str, Any]]] = {"prefill": {}, "decode": {}}
        self.outcomes: Counter[str] = Counter()
        self.by_flow: dict[str, Counter[str]] = defaultdict(Counter)
        self.violations: list[dict[str, Any]] = []
        self.violation_count = 0
        self.kills: list[dict[str, Any]] = []
        self.rss: list[RssTrack] = []
        self.incarnations = {"prefill": 0, "decode": 0}
        self.t0 = time.monotonic()
        self.last_progress = 0.0
        self.done = 0  # rooms judged
        self.reported = 0  # rooms decode reported (the progress line)
        self.sides: dict[str, Side] = {}
        # Prefill's control addresses, once it is up; a restarted prefill binds the same ports.
        self.prefill_addresses: list[str] = []
        self.executors: set[str] = set()  # which executor each side's processes ran (any restart)
        # Transfers of lost peers released still in flight (past the agent's drain bound), over
        # every incarnation of each side: nothing fences those, so a run shows how many there were.
        self.abandoned: Counter[str] = Counter()

    # ---- processes --------------------------------------------------------------------------
    def _common(self, role: str) -> list[str]:
        c = self.c
        return [
            "--seed", str(c.seed), "--flows", ",".join(c.flows), "--abort-rate", str(c.abort_rate),
            "--prefill-tp", str(c.prefill_tp), "--decode-tp", str(c.decode_tp),
            "--segment-timeout-s", str(c.segment_timeout_s), "--incarnation", str(self.incarnations[role]),
            "--engine", c.engine,
            "--deadline-scale", str(c.deadline_scale),
        ]  # fmt: skip

    def _launch(self, role: str) -> tuple[tuple[str, ...], list[str], dict[str, str]]:
        """(command prefix, extra arguments, environment) of a side's process: here, this host."""
        return (), [], self.env

    def _start(self, role: str) -> None:
        args = self._common(role)
        if role == "prefill":
            ports = ",".join(a.rsplit(":", 1)[1] for a in self.prefill_addresses)
            args += ["--ports", ports] if ports else []
        else:
            args += ["--prefill", *self.prefill_addresses]
        prefix, extra, env = self._launch(role)
        side = Side(role, self.incarnations[role], args + extra, self.events, env, prefix)
        self.sides[role] = side
        self.rss.append(RssTrack(role, side.incarnation))
        ready = self._wait(side, "ready", START_TIMEOUT_S)
        self.executors.update(ready.get("executors", ()))
        if role == "prefill":
            self.prefill_addresses = ready["addresses"]

    def _wait(self, side: Side, event: str, timeout_s: float) -> dict[str, Any]:
        """Handle events (room outcomes of any side) until ``side`` says ``event``."""
        return self._wait_any(side, (event,), timeout_s)[1]

    def _wait_any(self, side: Side, events: tuple[str, ...], timeout_s: float) -> tuple[str, dict[str, Any]]:
        """Handle events (room outcomes of any side) until ``side`` says one of ``events``."""
        end = time.monotonic() + timeout_s
        event = "/".join(events)
        while not any(e in side.seen for e in events):
            left = end - time.monotonic()
            if left <= 0:
                raise SideDied(f"{side.role} said no {event!r} within {timeout_s:.0f} s; log: {side.tail()}")
            try:
                who, msg = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                self._tick()
                continue
            if msg is None:
                who.dead = True
                if who is side:
                    rc = side.proc.wait(30)
                    raise SideDied(f"{side.role} exited (rc={rc}) before {event!r}; log: {side.tail()}")
            elif msg["event"] == "room":
                self.results[who.role][msg["i"]] = msg
                self.reported += who.role == "decode"
            elif msg["event"] == "room_final":  # a kept room's status changed while settling
                self.results[who.role].setdefault(msg["i"], {}).update(msg, event="room")
            else:
                self._count(who, msg)
                who.seen[msg["event"]] = msg
                who.ran |= msg["event"] in ("segment", "inflight")
            self._tick()
        first = next(e for e in events if e in side.seen)
        return first, side.seen.pop(first)

    def _sample(self) -> None:
        now = time.monotonic() - self.t0
        for role, side in self.sides.items():
            if side.ran and not side.dead and side.proc.poll() is None:
                kb = rss_kb(side.proc.pid)
                track = next(t for t in reversed(self.rss) if t.side == role)
                if kb:
                    track.samples.append((now - (side.started - self.t0), self.done, kb))

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self.last_progress < 2.0:
            return
        self.last_progress = now
        el = now - self.t0
        rss = ", ".join(
            f"{r} {rss_kb(s.proc.pid) / 1024:.0f} MB" for r, s in self.sides.items() if s.proc.poll() is None
        )
        o = self.outcomes
        self.progress(
            f"soak: {self.reported}/{self.c.rooms} rooms, {self.reported / max(el, 1e-9):.0f} rooms/s "
            f"(judged: {o['success']} ok, {o['aborted']} aborted, {o['killed']} killed, "
            f"{self.violation_count} violations), {len(self.kills)} kills, RSS {rss}, {el:.0f} s"
        )

    # ---- checks -----------------------------------------------------------------------------
    def _violation(self, kind: str, **detail: Any) -> None:
        self.violation_count += 1
        if len(self.violations) < 50:
            self.violations.append({"kind": kind, **detail})

    def _judge(self, plan: sp.SoakRoom, victim: str | None, fault: str | None = None) -> None:
        """``fault``: a network or process fault hit the room's segment, so it may end Success or
        Failed, but alike on both sides (and an aborted room still Failed on both)."""
        p = self.results["prefill"].pop(plan.index, None)
        d = self.results["decode"].pop(plan.index, None)
        info = {"room": plan.index, "flow": plan.flow, "abort": plan.abort}
        if d is not None and d.get("canary_bad"):
            # Found when the room's pages or aux row were handed out: a write landed in them
            # while they were free (a late write of an earlier room), whatever this room did.
            self._violation("canary", canary=d["canary_bad"], **info)
        if plan.hold and victim is not None:
            outcome = self._judge_kill(victim, d if victim == "prefill" else p, info)
        elif p is None or d is None:
            self._violation("no_outcome", side="prefill" if p is None else "decode", **info)
            outcome = "violation"
        elif "still live" in p["reason"] + d["reason"]:
            self._violation("hang", prefill=p["status"], decode=d["status"], **info)
            outcome = "violation"
        elif plan.abort is not None:
            outcome = self._judge_abort(plan.abort, p, d, info)
        else:
            outcome = self._judge_ended(p, d, fault, info)
        self.outcomes[outcome] += 1
        self.by_flow[plan.flow][outcome] += 1
        self.done += 1
        self._counted(plan, outcome, fault)

    def _judge_kill(self, victim: str, surv: dict[str, Any] | None, info: dict[str, Any]) -> str:
        """A room held in flight when ``victim`` was killed: the survivor must fail it, and say
        the peer died."""
        if surv is None:
            self._violation("no_outcome", side="decode" if victim == "prefill" else "prefill", **info)
        elif "still live" in surv["reason"]:
            self._violation("hang", side=surv, **info)
        elif set(surv["status"]) != {FAILED}:
            self._violation("hit_by_kill_not_failed", victim=victim, status=surv["status"], **info)
        elif not all(any(m in r for m in DEATH_MARKS) for r in surv["reason"]):
            if self.kill_deadline_is_violation or not _by_deadline(surv["reason"]):
                # The core must notice the death itself (heartbeats, a refused write, a
                # lease), not by a room deadline.
                self._violation("hit_by_kill_wrong_reason", victim=victim, reasons=surv["reason"], **info)
            else:
                return "killed_by_deadline"
        else:
            return "killed"
        return "violation"

    def _judge_abort(self, abort: str, p: dict[str, Any], d: dict[str, Any], info: dict[str, Any]) -> str:
        """An aborted room, both sides reported: Failed on both, or (a late abort) Success on both."""
        if set(p["status"]) == set(d["status"]) == {FAILED}:
            return "aborted"
        if abort in sp.LATE_ABORTS and set(p["status"]) == set(d["status"]) == {SUCCESS}:
            # Decode's abort came after the room had ended: a no-op (core/receiver.py, "every
            # byte landed"), so the room is a Success on both sides, its bytes checked as any.
            return self._bytes_checked(d, info, "abort_after_success")
        self._violation("aborted_not_failed", prefill=p["status"], decode=d["status"], **info)
        return "violation"

    def _judge_ended(
        self, p: dict[str, Any], d: dict[str, Any], fault: str | None, info: dict[str, Any]
    ) -> str:
        """A room neither aborted nor held at a kill, both sides reported."""
        if set(p["status"]) == set(d["status"]) == {SUCCESS}:
            return self._bytes_checked(d, info, "success")
        if fault is not None and set(p["status"]) == set(d["status"]) == {FAILED}:
            return "failed_by_deadline" if _by_deadline(p["reason"] + d["reason"]) else "failed"
        reasons = [r for r in p["reason"] + d["reason"] if r][:2]
        if fault is not None:
            # Every rank's reason, in rank order ("" for a rank that did not fail): which rank
            # said what is the first thing a disagreement's diagnosis needs.
            by_rank = {"prefill_reasons": p["reason"], "decode_reasons": d["reason"]}
            self._violation(
                "disagree", prefill=p["status"], decode=d["status"], reasons=reasons, **by_rank, **info
            )
        else:
            self._violation("failed", prefill=p["status"], decode=d["status"], reasons=reasons, **info)
        return "violation"

    def _bytes_checked(self, d: dict[str, Any], info: dict[str, Any], outcome: str) -> str:
        """``outcome`` for a room Success on both sides whose bytes and aux row decode found right."""
        if d["bad_bytes"] or not d["aux_ok"]:
            self._violation("corrupted", bad_bytes=d["bad_bytes"], first_bad=d["first_bad"], **info)
            return "violation"
        return outcome

    def _counted(self, plan: sp.SoakRoom, outcome: str, fault: str | None) -> None:
        """A judged room (coverage tables hook here)."""

    # ---- the run ----------------------------------------------------------------------------
    def _segment(self, start: int, end: int, kill: bool) -> None:
        c = self.c
        hold_from = end - min(c.hold, end - start) if kill else end
        for side in self.sides.values():
            side.tell(cmd="run", start=start, end=end, hold_from=hold_from)
        victim = None
        if kill:
            victim = self._victim(start)
            survivor = "decode" if victim == "prefill" else "prefill"
            wait_s = c.segment_timeout_s + 30
            # A side that gave up on its segment (a room hung) says "segment" instead: its rooms
            # are judged (hang), and the kill still happens so the run goes on.
            said = {r: self._wait_any(s, ("inflight", "segment"), wait_s)[0] for r, s in self.sides.items()}
            self._sample()
            dead = self.sides[victim]
            t_kill = time.monotonic()
            dead.kill()
            if said[survivor] == "inflight":
                self.sides[survivor].tell(cmd="killed")
                self._wait(self.sides[survivor], "segment", wait_s)
            t_failed = time.monotonic()
            self._drain(dead)
            dead.close()
            self.incarnations[victim] += 1
            self._start(victim)
            self.kills.append(
                {
                    "victim": victim,
                    "after_room": end,
                    "rooms_in_flight": end - hold_from,
                    "survivor_failed_them_s": round(t_failed - t_kill, 2),
                    "restart_s": round(time.monotonic() - t_failed, 2),
                }
            )
        else:
            for side in self.sides.values():
                self._wait(side, "segment", c.segment_timeout_s + 30)
        self._sample()
        for plan in sp.segment_rooms(c.seed, start, end, hold_from, c.flows, c.abort_rate):
            self._judge(plan, victim)

    def _victim(self, start: int) -> str:
        """The side a kill after segment ``start`` kills: prefill first, then they alternate."""
        return "prefill" if len(self.kills) % 2 == 0 else "decode"

    def _drain(self, dead: Side) -> None:
        """The killed side's last lines (its reader ends with None) before its results are judged."""
        while not dead.dead:
            try:
                who, msg = self.events.get(timeout=30)
            except queue.Empty:
                return  # its reader never ended: judged with what arrived
            if msg is None:
                who.dead = True
            elif msg["event"] == "room":
                self.results[who.role][msg["i"]] = msg
            else:
                self._count(who, msg)
                who.seen[msg["event"]] = msg

    def _count(self, who: Side, msg: dict[str, Any]) -> None:
        """A side's running totals (segment ends, its final report) into the run's."""
        n = msg.get("abandoned")
        if n is not None and n > who.abandoned:
            self.abandoned[who.role] += n - who.abandoned
            who.abandoned = n

    def _segments(self) -> list[tuple[int, int, bool]]:
        return segments(self.c)

    def run(self) -> dict[str, Any]:
        """The report of every room judged; one stopped by SIGTERM or Ctrl-C (``interrupted``)
        reports the rooms judged until then, once both processes are gone."""
        c = self.c
        stopped_by_time = interrupted = False
        end_state: dict[str, Any] = {}
        error = None
        try:
            with terminate_as_interrupt():
                self._start("prefill")
                self._start("decode")
                for start, end, kill in self._segments():
                    if time.monotonic() - self.t0 >= c.max_seconds:
                        stopped_by_time = True
                        break
                    self._segment(start, end, kill)
                end_state = self._finish()
        except SideDied as e:
            error = str(e)
            self._violation("side_died", detail=error[:3000])
        except KeyboardInterrupt:
            interrupted = True
        finally:
            for side in self.sides.values():
                side.close()
        wall = time.monotonic() - self.t0
        rss = [t.summary(c.warmup_s, c.rss_bound_mb) for t in self.rss]
        for r in rss:
            if r["checked"] and not r["ok"]:
                self._violation("rss_growth", **r)
        report = {
            "ok": self.violation_count == 0,
            "config": {**asdict(c), "flows": list(c.flows)},
            "rooms_run": self.done,
            "stopped_by_time": stopped_by_time,
            "interrupted": interrupted,
            "wall_s": round(wall, 1),
            "rooms_per_s": round(self.done / wall, 1) if wall else 0.0,
            "outcomes": {
                k: self.outcomes.get(k, 0)
                for k in (
                    "success",
                    "aborted",
                    "abort_after_success",
                    "killed",
                    "killed_by_deadline",
                    "violation",
                )
            },
            "by_flow": {f: dict(v) for f, v in sorted(self.by_flow.items())},
            "kills": self.kills,
            "rss": rss,
            "abandoned": {role: self.abandoned[role] for role in ("prefill", "decode")},
            "end_state": end_state,
            "violation_count": self.violation_count,
            "violations": self.violations,
            "replay": replay_command(c),
            "executors": sorted(self.executors),
        }
        return report

    def _finish(self) -> dict[str, Any]:
        p, d = self.sides["prefill"], self.sides["decode"]
        for side in (p, d):
            side.tell(cmd="finish")
        pd, dd = self._wait(p, "done", 90), self._wait(d, "done", 90)
        self._sample()
        for side in (p, d):
            side.tell(cmd="exit")
        stuck = self._wait(p, "closed", 60)["stuck"] + self._wait(d, "closed", 60)["stuck"]
        for side in (p, d):
            side.proc.wait(30)
        state = {
            "prefill_leaks": [{k: v for k, v in x.items() if v} for x in pd["leaks"]],
            "decode_leaks": [{k: v for k, v in x.items() if v} for x in dd["leaks"]],
            "prefill_copies": pd["copies"],
            "decode_waiting_fence": dd["waiting_fence"],
            "decode_pages_free": dd["pages_free"],
            "errors": pd["errors"] + dd["errors"],
            "driver_errors": _sum_counts(pd["driver_errors"] + dd["driver_errors"]),
            "stuck_threads": stuck,
            # The cores' own account (lost peers, resends, fences that expired, transfers cut).
            "prefill_counters": _sum_counts(pd["counters"]),
            "decode_counters": _sum_counts(dd["counters"]),
        }
        if any(state["prefill_leaks"]) or any(state["decode_leaks"]):
            self._violation("tables_not_empty", prefill=state["prefill_leaks"], decode=state["decode_leaks"])
        if dd.get("canary_bad"):
            self._violation("canary", where="free pages at the end", canary=dd["canary_bad"])
        if any(pd["copies"]) or dd["waiting_fence"] or dd["pages_free"] != sp.DECODE_PAGES:
            self._violation(
                "allocations_not_empty", copies=pd["copies"], waiting_fence=dd["waiting_fence"],
                decode_pages_free=dd["pages_free"],
            )  # fmt: skip
        if state["errors"] or stuck:
            self._violation("thread_errors", errors=state["errors"][:5], stuck=stuck)
        unexpected = {k: v for k, v in state["driver_errors"].items() if k not in DRIVER_ERRORS_OK}
        if unexpected and not self.kills:  # a kill makes writes to the dead peer fail: expected
            self._violation("driver_errors", errors=unexpected)
        return state


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does: a run started in the background by a
    non-interactive shell ignores SIGINT, so SIGTERM is how a long run is stopped, and it must
    clean up and report alike."""

    def interrupt(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave SIGTERM alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def rss_line(x: dict[str, Any], bound_mb: float, who: str) -> str:
    """One process's RSS verdict for a summary ("" when it was never sampled)."""
    if x["checked"]:
        verdict = "ok" if x["ok"] else f"over the {bound_mb} MB bound"
        return (
            f"  RSS {who}: {x['baseline_mb']} MB after warm-up -> {x['last_mb']} MB "
            f"({x['growth_mb']:+} MB, {verdict}); first sample {x['first_mb']} MB"
        )
    if x["samples"]:
        return (
            f"  RSS {who}: {x['first_mb']} -> {x['last_mb']} MB (lived shorter than the warm-up: not checked)"
        )
    return ""


def _by_deadline(reasons: list[str]) -> bool:
    """Every failed rank's reason is a room deadline (the core's "timed out while STATE"), not a
    failure the rank was told or saw (a lost heartbeat, a refused write, an abort)."""
    said = [r for r in reasons if r]
    return bool(said) and all("timed out while" in r for r in said)


def _sum_counts(dicts: list[dict[str, int]]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for d in dicts:
        out.update(d)
    return dict(out)


def run_soak(c: SoakConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    check_config(c)
    return Soak(c, progress).run()
