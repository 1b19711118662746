"""What one run produced: outcome counts, latencies, bytes and descriptors, faults, violations.

A ``RunResult`` is plain data (JSON-ready through ``as_dict``), so campaign workers can hand it
back across processes and ``--json`` can print it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvferry.core.kvpoll import KVPoll

if TYPE_CHECKING:
    from kvferry.sim.world import World


def percentiles(values: list[int], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, int]:
    """Nearest-rank percentiles (integers, no interpolation); empty input gives no keys."""
    if not values:
        return {}
    v = sorted(values)
    return {f"p{q}": v[min(len(v) - 1, max(0, -(-q * len(v) // 100) - 1))] for q in qs} | {"max": v[-1]}


@dataclass(slots=True)
class RoomOutcome:
    key: int
    room: int
    tokens: int
    chunks: int
    outcome: str
    latency_ns: int  # arrival -> terminal on every decode rank (-1 if never)
    reasons: dict[str, str]
    first_failing: str = ""  # the rank where the room's failure started ("" if none failed)


@dataclass(slots=True)
class RunResult:
    """One run's outcome (``as_dict`` is what ``--json`` prints).

    ``failure_reasons``: failed rooms per reason, most common first. A room counts once, however
    many of its ranks failed, under the reason of its first failing rank (``first_failure``: the
    rank where the failure started), whole, with its numbers and ids replaced by N
    (``reason_class``). The counts sum to ``failed``.
    """

    seed: int
    scenario: str
    rooms: int
    succeeded: int
    failed: int
    violations: list[dict[str, Any]]
    faults: dict[str, int]
    digest: str
    sim_ns: int
    events: int
    transfers: int
    transfers_err: int
    bytes_moved: int
    descriptors: int
    descriptors_charged: int
    control_sent: int
    control_dropped: int
    room_latency_ns: dict[str, int]
    write_latency_ns: dict[str, int]
    failure_reasons: dict[str, int]
    wall_s: float = 0.0
    # "room K: why" for each room whose two sides ended apart for a reason the core cannot help
    agreement_exempt: list[str] = field(default_factory=list)
    rooms_detail: list[RoomOutcome] = field(default_factory=list)
    # Per decode rank offering staged flows: capacities and peak use (ring, pinned, fragmentation).
    staging: dict[str, Any] = field(default_factory=dict)
    scenario_toml: str = ""  # the resolved scenario, filled in for failing runs
    bytes_verified: bool = True  # false for timing-only runs (move_bytes = false) or checks.bytes off
    # TP and server counts of each side, and per server ("prefill0", "decode2") the rooms routed
    # there and how many of them succeeded.
    deployment: dict[str, Any] = field(default_factory=dict)
    # Rooms per flow with their outcomes, the TP pair, rooms failed only by a deadline
    # (sim/campaign.py room_coverage): what a campaign adds up into its coverage tables.
    coverage: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def violated(self) -> list[str]:
        return sorted({v["invariant"] for v in self.violations})

    def as_dict(self, detail: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not detail:
            d.pop("rooms_detail")
        d.pop("scenario_toml")
        return d


def collect(w: World, wall_s: float = 0.0, detail: bool = False) -> RunResult:
    rooms: list[RoomOutcome] = []
    lat: list[int] = []
    reasons: Counter[str] = Counter()
    for r in w.requests:
        dec = w.room_nodes(r, "decode")
        ends = [r.terminal_ns.get(n, -1) for n in dec]
        latency = max(ends) - r.arrival_ns if r.opened and min(ends) >= 0 else -1
        if r.outcome == "success" and latency >= 0:
            lat.append(latency)
        first = first_failure(r.reason, r.status, r.terminal_ns)
        if r.outcome == "failed":
            reasons[reason_class(first[1]) if first else "no reason recorded"] += 1
        if detail:
            rooms.append(
                RoomOutcome(
                    r.key,
                    r.room,
                    r.spec.tokens,
                    len(r.chunks),
                    r.outcome or "open",
                    latency,
                    dict(sorted(r.reason.items())),
                    first[0] if first else "",
                )
            )
    st = w.fabric.stats
    return RunResult(
        seed=w.seed,
        scenario=w.scenario.name,
        bytes_verified=w.scenario.move_bytes and w.scenario.checks.bytes,
        rooms=len(w.requests),
        succeeded=sum(1 for r in w.requests if r.outcome == "success"),
        failed=sum(1 for r in w.requests if r.outcome == "failed"),
        violations=[
            {"invariant": v.invariant, "detail": v.detail, "t_ns": v.t_ns, "room": v.room}
            for v in w.violations
        ],
        faults=dict(sorted(w.injector.counts.items())),
        digest=w.trace.digest(),
        sim_ns=int(w.env.now),
        events=w.trace.count,
        transfers=st.posts,
        transfers_err=st.transfers_err,
        bytes_moved=st.bytes_landed,
        descriptors=st.descriptors_posted,
        descriptors_charged=st.descriptors_charged,
        control_sent=st.control_sent,
        control_dropped=st.control_dropped,
        room_latency_ns=percentiles(lat),
        write_latency_ns=percentiles(w.fabric.write_latencies),
        failure_reasons=dict(reasons.most_common()),
        wall_s=wall_s,
        agreement_exempt=[f"room {k}: {why}" for k, why in w.agreement_exempt],
        rooms_detail=rooms,
        staging=_staging(w),
        deployment=_deployment(w),
    )


def _deployment(w: World) -> dict[str, Any]:
    t = w.scenario.topology
    per: dict[str, dict[str, int]] = {}
    for side, n in (("prefill", t.prefill_instances), ("decode", t.decode_instances)):
        for i in range(n):
            per[f"{side}{i}"] = {"rooms": 0, "succeeded": 0}
    for r in w.requests:
        for name in (f"prefill{r.pre_inst}", f"decode{r.dec_inst}"):
            per[name]["rooms"] += 1
            per[name]["succeeded"] += r.outcome == "success"
    return {
        "prefill_tp": t.prefill_tp,
        "decode_tp": t.decode_tp,
        "prefill_instances": t.prefill_instances,
        "decode_instances": t.decode_instances,
        "instances": per,
    }


def _staging(w: World) -> dict[str, Any]:
    """Staging offered and its peak use per decode rank (empty when no staged flow is offered)."""
    out: dict[str, Any] = {}
    for node in (n for nodes in w.instance_nodes["decode"] for n in nodes):
        eng = w.ranks[node].engine
        if eng.staged.ring is None and eng.staged.pinned is None:
            continue
        out[node] = {
            "ring_bytes": eng.staged.ring.capacity if eng.staged.ring is not None else 0,
            "pinned_bytes": eng.staged.pinned.capacity if eng.staged.pinned is not None else 0,
            **eng.staged.staging_peaks,
        }
    return out


# Reasons that pass on another rank's failure: core/sender.py and core/receiver.py prefix a peer's
# reason with "failed on X" or "aborted by X", or say X stopped sending; the scheduler (sim/world.py)
# aborts the other ranks of a failed room with "failed on another rank". A room's failure never
# started on a rank giving one of these, so they are only picked when no rank gives a reason of
# its own.
_RELAYED = re.compile(
    r"^(failed on |aborted by )|failed on another rank$|stopped sending before its failure notice arrived$"
)
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?")
_NEVER = 1 << 63


def _rank_order(node: str) -> tuple[str, int]:
    """prefill2 before prefill10: node names sort by side, then by rank number."""
    side = node.rstrip("0123456789")
    return side, int(node[len(side) :] or 0)


def first_failure(
    reasons: dict[str, str], status: dict[str, KVPoll], terminal_ns: dict[str, int]
) -> tuple[str, str] | None:
    """(rank, reason) of the rank where a room's failure started, None if no rank failed.

    A reason of the rank's own beats one passed on from another rank; then the earliest to end,
    then rank order (decode ranks before prefill ranks, by number), so the pick is deterministic.
    """
    failed = [n for n in reasons if status.get(n) is KVPoll.Failed]
    if not failed:
        return None
    rank = min(
        failed,
        key=lambda n: (
            _RELAYED.search(reasons[n]) is not None,
            terminal_ns.get(n, _NEVER),
            _rank_order(n),
        ),
    )
    return rank, reasons[rank]


def reason_class(reason: str) -> str:
    """The whole reason with its numbers and ids replaced by N, so that the same failure on other
    rooms, chunks or ranks groups together and still reads as a sentence: "timed out while
    waiting (chunk N to decode#N: ring space of decode#N not drained yet (round N, [N, N)))"."""
    return _NUMBER.sub("N", reason)
