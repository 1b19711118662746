"""``kvferry chaos``: the soak's prefill and decode processes on two hosts (network namespaces on
one bridge), real NIXL with UCX over TCP on their veths and the authenticated ZMQ control plane on
the same addresses, with a seeded schedule of partitions, slow links, stalls, kills and abort
bursts. The soak's machinery runs the rooms and checks them (``kvferry/tools/soak.py``); this
adds the hosts, the faults, the rule for rooms a fault hit, and the coverage tables.

A room in a segment a network or process fault hit may end Success (bytes checked) or Failed,
but alike on both sides, and so may a room of the segment right after it (the fault's aftermath:
after a long partition TCP's retransmission backoff keeps the old connections silent for seconds
past the heal, long enough for a heartbeat timeout); every other room is judged as the soak
judges it. Canaries in free
pages and aux rows catch a write that lands outside a live room (a late write after a heal or a
thaw). In the liveness class (``liveness``) only faults the protocol rides out are drawn and
every room that was not aborted must end Success.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvferry.backends.loopback import plan as sp
from kvferry.tools.chaos import netns
from kvferry.tools.chaos.inject import HOSTS, Injector
from kvferry.tools.chaos.schedule import KINDS, LIVENESS_KINDS, SIDES, Fault, plan
from kvferry.tools.soak import Soak, SoakConfig, terminate_as_interrupt

PLANTS = ("reuse_unfenced",)
SIDED_KINDS = tuple(k for k in KINDS if k != "abort_burst")  # a burst's aborts come from both sides
# Once a faulted segment's rooms are terminal and the fault is undone, the two sides must come to
# agree on every room within the window a failure notice is resent in (the fence deadline): a
# Success the peer overruled turns Failed when the held-up notice arrives, which after a long
# partition waits for TCP's retransmission backoff. Asked every SETTLE_POLL_S until they agree.
SETTLE_POLL_S = 0.5
TP_PAIRS = ((1, 1), (2, 1), (1, 2))
# Over UCX's TCP transport a write held through a partition lands whenever the connection comes
# back: decode keeps a failed room's pages past the fence until its writer says Stopped (which it
# does once its writes ended), for up to TCP's own bound on a silent connection (tcp_retries2 = 15:
# about 924 s). A writer that never answers shows as pages still held at the end (a leak). The
# agents keep a lost peer's transfers as long before releasing them unfenced (``abandoned``), so
# a writer's Stopped never vouches for a transfer TCP may still deliver.
QUARANTINE_S = 900.0


@dataclass(frozen=True)
class ChaosConfig:
    rooms: int = 2000
    seed: int = 0
    tp_pairs: tuple[tuple[int, int], ...] = TP_PAIRS
    flows: tuple[str, ...] = sp.FLOWS
    abort_rate: float = 0.05
    segment_rooms: int = 25
    fault_share: float = 0.5
    kinds: tuple[str, ...] = KINDS
    liveness: bool = False
    plant: str = ""
    max_seconds: float = 3600.0
    rss_bound_mb: float = 64.0
    warmup_s: float = 45.0
    segment_timeout_s: float = 60.0
    deadline_scale: float = 1.0  # rooms' own deadlines stretched on a loaded host (plan.timeouts)


def check_config(c: ChaosConfig) -> None:
    """Raise ValueError naming the option for a value the run cannot use."""
    soak_like = SoakConfig(
        rooms=c.rooms, seed=c.seed, flows=c.flows, abort_rate=c.abort_rate, kill_every=0,
        max_seconds=c.max_seconds, rss_bound_mb=c.rss_bound_mb, warmup_s=c.warmup_s,
        deadline_scale=c.deadline_scale,
    )  # fmt: skip
    from kvferry.tools.soak import check_config as check_soak

    check_soak(soak_like)
    for p, d in c.tp_pairs:
        if p not in (1, 2, 4) or d not in (1, 2, 4):
            raise ValueError(f"--tp: each pair is PREFILL-DECODE with sizes 1, 2 or 4, got {p}-{d}")
    if not c.tp_pairs:
        raise ValueError("--tp: give at least one pair, e.g. 1-1")
    if c.rooms < len(c.tp_pairs):
        raise ValueError(f"--rooms must be at least one per TP pair ({len(c.tp_pairs)}), got {c.rooms}")
    if not 2 * 4 <= c.segment_rooms <= 10_000:
        raise ValueError(f"--segment-rooms must be in [8, 10000], got {c.segment_rooms}")
    if not 0.0 <= c.fault_share <= 1.0:
        raise ValueError(f"--fault-share must be in [0, 1], got {c.fault_share}")
    bad = [k for k in c.kinds if k not in KINDS]
    if bad or not c.kinds:
        raise ValueError(f"--faults: unknown kind(s) {bad}; known: {list(KINDS)}")
    if c.liveness:
        extra = [k for k in c.kinds if k not in LIVENESS_KINDS]
        if extra:
            raise ValueError(
                f"--liveness draws only faults the protocol rides out ({', '.join(LIVENESS_KINDS)}); "
                f"drop {extra} from --faults"
            )
        if c.abort_rate:
            raise ValueError("--liveness needs --abort-rate 0 (every room must end Success)")
    if c.plant and c.plant not in PLANTS:
        raise ValueError(f"--plant: unknown bug {c.plant!r} (known: {', '.join(PLANTS)})")
    if not 10.0 <= c.segment_timeout_s <= 3600:
        raise ValueError(f"--segment-timeout-s must be in [10, 3600], got {c.segment_timeout_s}")


def replay_command(c: ChaosConfig) -> str:
    tp = ",".join(f"{p}-{d}" for p, d in c.tp_pairs)
    line = (
        f"kvferry chaos --seed {c.seed} --rooms {c.rooms} --tp {tp} --flows {','.join(c.flows)} "
        f"--abort-rate {c.abort_rate} --segment-rooms {c.segment_rooms} --fault-share {c.fault_share} "
        f"--faults {','.join(c.kinds)}"
    )
    line += f" --deadline-scale {c.deadline_scale:g}" if c.deadline_scale != 1.0 else ""
    return line + (" --liveness" if c.liveness else "") + (f" --plant {c.plant}" if c.plant else "")


def pair_ranges(c: ChaosConfig) -> list[tuple[tuple[int, int], int, int]]:
    """(TP pair, first room, end room): the rooms split evenly, each pair its own index range."""
    n, k = divmod(c.rooms, len(c.tp_pairs))
    out, at = [], 0
    for i, tp in enumerate(c.tp_pairs):
        size = n + (i < k)
        out.append((tp, at, at + size))
        at += size
    return out


def segment_starts(c: ChaosConfig) -> list[tuple[int, int]]:
    """Every segment (start, end) of the run, pair after pair."""
    return [
        (s, min(s + c.segment_rooms, end))
        for _tp, start, end in pair_ranges(c)
        for s in range(start, end, c.segment_rooms)
    ]


class Coverage:
    """Rooms per flow, TP pair and fault kind, with their outcomes; faults by kind."""

    def __init__(self) -> None:
        self.by_flow: dict[str, Counter[str]] = defaultdict(Counter)
        self.by_tp: dict[str, Counter[str]] = defaultdict(Counter)
        self.by_fault: dict[str, Counter[str]] = defaultdict(Counter)
        self.faults: Counter[str] = Counter()
        self.sides: dict[str, Counter[str]] = defaultdict(Counter)  # kind -> the side it hit

    def fault(self, kind: str, side: str) -> None:
        self.faults[kind] += 1
        if kind in SIDED_KINDS:
            self.sides[kind][side] += 1

    def add(self, flow: str, tp: str, fault: str | None, outcome: str) -> None:
        self.by_flow[flow][outcome] += 1
        self.by_tp[tp][outcome] += 1
        self.by_fault[fault or "none"][outcome] += 1

    def as_dict(self, flows: tuple[str, ...], kinds: tuple[str, ...], tps: list[str]) -> dict[str, Any]:
        """Every flow, pair and kind the run asked for appears, drawn or not (a zero is visible)."""

        def table(d: dict[str, Counter[str]], keys: list[str]) -> dict[str, dict[str, int]]:
            return {k: {"rooms": sum(d[k].values()), **dict(sorted(d[k].items()))} for k in keys}

        return {
            "by_flow": table(self.by_flow, list(flows)),
            "by_tp": table(self.by_tp, tps),
            "by_fault": table(self.by_fault, ["none", *kinds]),
            "faults": {k: self.faults.get(k, 0) for k in kinds},
            "faults_by_side": {
                k: {side: self.sides[k].get(side, 0) for side in SIDES} for k in kinds if k in SIDED_KINDS
            },
        }


class PairRun(Soak):
    """The soak on the chaos hosts for one TP pair: its rooms are ``[start, end)`` of the run."""

    # Across namespaces on a loaded host, a room opened a second or more before the kill can reach
    # its own deadline before the survivor's heartbeat timeout runs out: the room still ends Failed
    # on the survivor with nothing leaked, so it is counted apart (killed_by_deadline), not judged a
    # violation. The loopback soak keeps the strict rule.
    kill_deadline_is_violation = False

    def __init__(self, chaos: Chaos, tp: tuple[int, int], start: int, end: int, max_seconds: float) -> None:
        c = chaos.c
        cfg = SoakConfig(
            rooms=end - start, seed=c.seed, prefill_tp=tp[0], decode_tp=tp[1], flows=c.flows,
            abort_rate=c.abort_rate, kill_every=0, max_seconds=max_seconds, rss_bound_mb=c.rss_bound_mb,
            warmup_s=c.warmup_s, segment_timeout_s=c.segment_timeout_s, deadline_scale=c.deadline_scale,
        )  # fmt: skip
        self.tp_name = f"{tp[0]}->{tp[1]}"
        super().__init__(cfg, lambda line: chaos.progress(f"[TP {self.tp_name}] {line}"))
        self.chaos, self.start_room, self.end_room = chaos, start, end
        self.fault_kind: str | None = None
        self.aftermath: str | None = None  # the kind of the fault the last segment had

    def _launch(self, role: str) -> tuple[tuple[str, ...], list[str], dict[str, str]]:
        net, host = self.chaos.net, HOSTS[role]
        env = {**self.env, **net.ucx_env()}
        extra = ["--host", net.address(host), "--drain-s", str(QUARANTINE_S)]
        if role == "decode":
            extra += ["--quarantine-s", str(QUARANTINE_S)]
            if self.chaos.c.plant:
                env["KVFERRY_SOAK_PLANT"] = self.chaos.c.plant
        return net.exec_prefix(host), extra, env

    def _segments(self) -> list[tuple[int, int, bool]]:
        faults = self.chaos.faults
        return [
            (s, e, s in faults and faults[s].kind == "kill")
            for s, e in segment_starts(self.chaos.c)
            if self.start_room <= s < self.end_room
        ]

    def _segment(self, start: int, end: int, kill: bool) -> None:
        f = self.chaos.faults.get(start)
        after, self.aftermath = self.aftermath, None
        self.fault_kind = f.kind if f is not None else after
        try:
            if f is None and after is not None:
                self._faulted_segment(start, end, None, after)
            elif f is None or f.kind == "kill":
                if f is not None:
                    self.chaos.log_fault(f, self.tp_name, start, end, time.monotonic())
                super()._segment(start, end, kill)
            else:
                self._faulted_segment(start, end, f, f.kind)
                if f.kind != "abort_burst":
                    self.aftermath = f.kind
        finally:
            self.fault_kind = None

    def _victim(self, start: int) -> str:
        return self.chaos.faults[start].side  # the schedule drew it, and the fault line names it

    def _faulted_segment(self, start: int, end: int, f: Fault | None, kind: str) -> None:
        """A segment with fault ``f`` injected, or (``f`` None) in the aftermath of a ``kind``."""
        c = self.c
        rate = f.abort_rate if f is not None and f.kind == "abort_burst" else c.abort_rate
        for side in self.sides.values():
            side.tell(cmd="run", start=start, end=end, hold_from=end, abort_rate=rate, keep=True)
        inj = None
        if f is not None and f.kind == "abort_burst":
            self.chaos.log_fault(f, self.tp_name, start, end, time.monotonic())
        elif f is not None:
            base, at = self.reported, min(f.at_room, end - start - 1)  # a room still in flight
            inj = Injector(
                self.chaos.net, f, pid=lambda role: self.sides[role].proc.pid if role in self.sides else None,
                ready=lambda: self.reported - base >= at,
                on_apply=lambda at: self.chaos.log_fault(f, self.tp_name, start, end, at),
            )  # fmt: skip
            self.chaos.injectors.append(inj)
            inj.start()
        try:
            for side in self.sides.values():
                self._wait(side, "segment", c.segment_timeout_s + 30 + (f.for_s if f else 0.0))
            if f is not None and inj is not None:
                inj.join(f.for_s + 30)  # the fault runs its course before the rooms are judged
        finally:
            if inj is not None:  # at once when the segment ended early (an interrupt, a side died)
                inj.stop()
                inj.join(30)
                self.chaos.injectors.remove(inj)
        self._settle(start, end, time.monotonic() + sp.timeouts(c.deadline_scale).fence_ns / 1e9 + 2.0)
        if f is not None and inj is not None and (inj.error or inj.applied_at is None):
            self._violation("fault_not_injected", fault=f.as_dict(), error=inj.error or "never applied")
        self._sample()
        # A burst of aborts is no network fault: its rooms are judged as strictly as any.
        hit = None if kind == "abort_burst" else kind
        for room in sp.segment_rooms(c.seed, start, end, end, c.flows, rate):
            self._judge(room, None, hit)

    def _settle(self, start: int, end: int, until: float) -> None:
        """Ask both sides for their kept rooms' news until every room's statuses agree (or the
        resend window is over: the judge then reports the disagreement), then release them."""
        while True:
            for side in self.sides.values():
                side.tell(cmd="settle")
            for side in self.sides.values():
                self._wait(side, "settled", 60)
            if not self._disagreeing(start, end) or time.monotonic() >= until:
                break
            time.sleep(SETTLE_POLL_S)
        for side in self.sides.values():
            side.tell(cmd="release")
        for side in self.sides.values():
            self._wait(side, "released", 60)

    def _disagreeing(self, start: int, end: int) -> bool:
        p, d = self.results["prefill"], self.results["decode"]
        for i in range(start, end):
            if i in p and i in d and len({*p[i]["status"], *d[i]["status"]}) > 1:
                return True
        return False

    def _counted(self, plan: sp.SoakRoom, outcome: str, fault: str | None) -> None:
        self.chaos.coverage.add(plan.flow, self.tp_name, self.fault_kind, outcome)
        if self.chaos.c.liveness and plan.abort is None and outcome not in ("success", "violation"):
            self._violation(
                "not_live", room=plan.index, flow=plan.flow, fault=self.fault_kind, outcome=outcome
            )


class Chaos:
    def __init__(self, c: ChaosConfig, progress: Callable[[str], None] | None) -> None:
        self.c = c
        self.progress = progress or (lambda _line: None)
        self.net = netns.Network(hosts=2)
        hb_s = sp.timeouts().heartbeat_timeout_ns / 1e9
        segs = segment_starts(c)
        by_index = plan(c.seed, len(segs), c.fault_share, c.kinds, hb_s, c.liveness)
        self.faults: dict[int, Fault] = {segs[i][0]: f for i, f in by_index.items()}
        self.coverage = Coverage()
        self.fault_log: list[dict[str, Any]] = []
        self.injectors: list[Injector] = []
        self.t0 = time.monotonic()

    def log_fault(self, f: Fault, tp: str, start: int, end: int, at: float) -> None:
        t = round(at - self.t0, 2)
        self.coverage.fault(f.kind, f.side)
        self.fault_log.append({"t_s": t, "tp": tp, "rooms": [start, end], **f.as_dict()})
        self.progress(f"chaos: fault at {t:.2f} s (TP {tp}, rooms {start}-{end - 1}): {f.describe()}")

    def run(self) -> dict[str, Any]:
        """The report; a run stopped by SIGTERM or Ctrl-C reports the rooms judged until then
        (``interrupted``), once every process, fault and namespace it made is gone."""
        c = self.c
        reports: list[tuple[PairRun, dict[str, Any]]] = []
        left: list[str] = []
        interrupted = False
        with terminate_as_interrupt():
            removed = netns.remove_stale()
            if removed:
                self.progress(f"chaos: removed namespaces of an earlier run that was killed: {removed}")
            try:
                self.net.open()
                ranges = pair_ranges(c)
                for i, (tp, start, end) in enumerate(ranges):
                    budget = c.max_seconds - (time.monotonic() - self.t0)
                    share = max(1.0, budget / (len(ranges) - i))
                    run = PairRun(self, tp, start, end, share)
                    reports.append((run, run.run()))  # an interrupt inside ends it with a report
                    if reports[-1][1]["interrupted"]:
                        interrupted = True
                        break
            except KeyboardInterrupt:  # between the pairs' runs, or while the hosts were made
                interrupted = True
            finally:
                for inj in list(self.injectors):
                    inj.stop()
                    inj.join(30)
                left = self.net.close()
        return self._report(reports, left, interrupted)

    def _report(
        self, reports: list[tuple[PairRun, dict[str, Any]]], left: list[str], interrupted: bool
    ) -> dict[str, Any]:
        c = self.c
        wall = time.monotonic() - self.t0
        violations: list[dict[str, Any]] = []
        count = 0
        outcomes: Counter[str] = Counter()
        for run, r in reports:
            count += r["violation_count"]
            violations += [{"tp": run.tp_name, **v} for v in r["violations"]]
            outcomes.update(run.outcomes)
        if left:
            count += 1
            violations.append({"kind": "namespaces_left", "names": left})
        rooms = sum(r["rooms_run"] for _run, r in reports)
        abandoned: Counter[str] = Counter()
        for run, _r in reports:
            abandoned.update(run.abandoned)
        tps = [f"{p}->{d}" for p, d in c.tp_pairs]
        return {
            "ok": count == 0,
            "config": {**asdict(c), "tp_pairs": [list(t) for t in c.tp_pairs], "flows": list(c.flows),
                       "kinds": list(c.kinds)},
            "network": {
                "hosts": {role: self.net.address(host) for role, host in HOSTS.items()},
                "ucx": self.net.ucx_env(),
                "heartbeat_timeout_s": sp.timeouts().heartbeat_timeout_ns / 1e9,
            },
            "rooms_run": rooms,
            "stopped_by_time": any(r["stopped_by_time"] for _run, r in reports),
            "interrupted": interrupted,
            "wall_s": round(wall, 1),
            "rooms_per_s": round(rooms / wall, 1) if wall else 0.0,
            "outcomes": dict(sorted(outcomes.items())),
            "coverage": self.coverage.as_dict(c.flows, c.kinds, tps),
            "faults": self.fault_log,
            "kills": [{"tp": run.tp_name, **k} for run, r in reports for k in r["kills"]],
            "rss": [{"tp": run.tp_name, **x} for run, r in reports for x in r["rss"]],
            # Transfers of lost peers released still in flight past the agent's drain bound (every
            # incarnation): nothing fences them, so a late write they make is the canaries' to catch.
            "abandoned": {role: abandoned[role] for role in ("prefill", "decode")},
            "end_state": {run.tp_name: r["end_state"] for run, r in reports},
            "violation_count": count,
            "violations": violations[:50],
            "replay": replay_command(c),
        }  # fmt: skip


def run_chaos(c: ChaosConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    check_config(c)
    why = netns.why_not_available()
    if why:
        raise RuntimeError(why)
    return Chaos(c, progress).run()
