"""The seeded fault schedule: which segment of rooms gets which fault, when and for how long.

A run is cut into segments of rooms (per TP pair, in order); a share of them gets one fault each.
The first faulted segments take every kind once, in a seeded order, so even a short run covers
each kind; the rest draw kinds at random. A fault starts once decode has reported ``at_room``
rooms of its segment (so rooms are in flight when it hits, however fast the machine), and lasts
``for_s``. Everything follows from the seed alone; the faults' real times (printed as they
happen) depend on the machine, not on the draw.

The heartbeat timeout sets the durations: a short partition ends before a missed heartbeat can
fail the peer's rooms, a long one and a stall last past it (and end well before the fence, so the
failure notices still reach the peer after the heal).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

KINDS = ("partition_short", "partition_long", "slow_link", "stall", "kill", "abort_burst")
# Faults the protocol promises to ride out: every room of the liveness class must end Success.
LIVENESS_KINDS = ("partition_short", "slow_link")
SIDES = ("prefill", "decode")
BURST_ABORT_RATE = 0.7
MAX_AT_ROOM = 8  # of the soak's window of 16 rooms in flight: the rest are still moving


@dataclass(frozen=True)
class Fault:
    kind: str
    side: str  # whose link or process (a stall's, a kill's victim); a burst of aborts ignores it
    at_room: int  # starts once decode reported this many rooms of its segment
    for_s: float = 0.0  # how long the link is down or slow, or the process stopped
    rate_kbit: int = 0  # slow_link
    abort_rate: float = 0.0  # abort_burst

    def describe(self) -> str:
        if self.kind.startswith("partition"):
            return f"{self.kind}: {self.side} host's link down for {self.for_s:.1f} s"
        if self.kind == "slow_link":
            return f"slow_link: {self.side} host's link at {self.rate_kbit} kbit/s for {self.for_s:.1f} s"
        if self.kind == "stall":
            return f"stall: {self.side} process stopped (SIGSTOP) for {self.for_s:.1f} s"
        if self.kind == "kill":
            return f"kill: {self.side} killed (SIGKILL) with rooms in flight, restarted as a new incarnation"
        return f"abort_burst: {self.abort_rate:.0%} of the segment's rooms aborted"

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v or k in ("kind", "at_room")}


def draw(rng: random.Random, kind: str, heartbeat_timeout_s: float, liveness: bool) -> Fault:
    side = rng.choice(SIDES)
    at = rng.randint(0, MAX_AT_ROOM)
    hb = heartbeat_timeout_s
    if kind == "partition_short":
        top = 0.33 * hb if liveness else 0.5 * hb
        return Fault(kind, side, at, round(rng.uniform(0.1 * hb, top), 2))
    if kind == "partition_long":
        return Fault(kind, side, at, round(rng.uniform(hb + 1.0, hb + 3.0), 2))
    if kind == "slow_link":
        rate = rng.choice((2000, 4000) if liveness else (1000, 2000, 4000))
        top = 0.5 * hb if liveness else hb
        return Fault(kind, side, at, round(rng.uniform(0.3 * hb, top), 2), rate_kbit=rate)
    if kind == "stall":
        return Fault(kind, side, at, round(rng.uniform(hb + 0.5, hb + 2.0), 2))
    if kind == "kill":
        return Fault(kind, side, 0)
    if kind == "abort_burst":
        return Fault(kind, side, 0, abort_rate=BURST_ABORT_RATE)
    raise ValueError(f"unknown fault kind {kind!r}")


def plan(
    seed: int,
    segments: int,
    share: float,
    kinds: tuple[str, ...],
    heartbeat_timeout_s: float,
    liveness: bool = False,
) -> dict[int, Fault]:
    """Segment index -> its fault. Segment 0 of the run stays clean (both sides settle first),
    and so does the segment after each fault (its aftermath, judged with it). Every kind is drawn
    at least once if the run has room for it (``share`` > 0)."""
    rng = random.Random(f"kvferry-chaos:{seed}")
    first = list(kinds)
    rng.shuffle(first)
    out: dict[int, Fault] = {}
    for seg in range(1, segments):
        if seg - 1 in out or rng.random() >= share:
            continue
        kind = first.pop(0) if first else rng.choice(kinds)
        out[seg] = draw(rng, kind, heartbeat_timeout_s, liveness)
    free = [s for s in range(1, segments) if not {s - 1, s, s + 1} & set(out)]
    while first and free and share > 0:
        seg = free.pop(rng.randrange(len(free)))
        out[seg] = draw(rng, first.pop(0), heartbeat_timeout_s, liveness)
        free = [s for s in free if abs(s - seg) > 1]
    return out
