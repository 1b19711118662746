"""Fault personalities (swarm testing) and the injector the fabric consults.

Swarm style: rather than every fault at a low rate in every run, one seed draws a *personality*:
each fault kind is on or off, and when on its rate is drawn too. Runs then differ in kind, not only
in luck, which finds bugs that need one fault to be frequent and another absent.

Faults only happen during the fault window; afterwards the network heals (no drops, no ERR, all
links up, crashed nodes restarted) and the liveness deadline starts.
"""

from __future__ import annotations

import random
from collections import Counter

from kvferry.backends.simfabric.faultapi import DELIVER, NOTIF_OK, ControlFate, NotifFate
from kvferry.sim.expected import worst
from kvferry.sim.rng import Streams
from kvferry.sim.scenario_schema import US, FaultEvent, Faults, Scenario
from msgspec.structs import replace

CALM_SHARE = 0.1
CALM_STRETCH = 10
_STRETCHED = ("bootstrap_ns", "waiting_ns", "transfer_ns", "fence_ns", "tombstone_ns")


def calm_stretch(s: Scenario) -> int:
    """How much a calm seed stretches its deadlines: ``CALM_STRETCH``, or more where the rooms
    admitted together queue behind each other for longer than that (seed 2040: eight rooms of
    3,600 descriptors each waited 51 ms in a worker queue under a 50 ms waiting deadline)."""
    t = s.timeouts
    backlog = max(1, min(s.workload.rooms, s.topology.aux_rows)) * worst(s).total_ns
    shortest = max(1, min(t.waiting_ns, t.transfer_ns))
    return max(CALM_STRETCH, -(-backlog // shortest))


def draw_personality(s: Scenario, streams: Streams) -> Scenario:
    """Resolve ``faults.swarm`` into explicit rates and events drawn from the seed.

    The result has ``swarm = false`` and replays identically from the same seed, so it is what a
    failing run saves.
    """
    f = s.faults
    if not f.swarm:
        return s
    if streams["swarm.calm"].random() < CALM_SHARE:
        # A calm seed: nothing injected beyond what the base scenario sets. Most hours in
        # production look like this, and only such runs can hold the core to "every room
        # succeeds" and "nothing is ever resent" (checker: fault_free).
        return _calm(replace(s, faults=replace(f, swarm=False)))
    rng = streams["swarm"]
    # Events first, then the rates: the order of the draws is the seed's personality.
    events = _drawn_events(s, rng)
    resolved = _drawn_rates(f, rng, events)
    if resolved.injects_nothing():  # every rate and event drawn off: as calm as a calm seed
        return _calm(replace(s, faults=resolved))
    return replace(s, faults=resolved)


def _drawn_events(s: Scenario, rng: random.Random) -> list[FaultEvent]:
    """The scenario's own events, then each timed fault kind with probability 0.35 in the window:
    one or two crashes, a link down and a slow link between a prefill and a decode node."""
    window = s.phases.fault_window_us
    nodes = s.node_names()
    prefill = [n for n in nodes if n.startswith("prefill")]
    decode = [n for n in nodes if n.startswith("decode")]
    events = list(s.faults.events)
    if rng.random() < 0.35 and window > 0:
        for _ in range(rng.randint(1, 2)):
            events.append(
                FaultEvent(
                    at_us=rng.randrange(window),
                    kind="crash",
                    node=rng.choice(nodes),
                    duration_us=rng.randrange(200, max(201, window // 2)),
                )
            )
    if rng.random() < 0.35 and window > 0:
        a, b = rng.choice(prefill), rng.choice(decode)
        events.append(
            FaultEvent(
                at_us=rng.randrange(window),
                kind="link_down",
                node=a,
                peer=b,
                duration_us=rng.randrange(100, max(101, window // 3)),
            )
        )
    if rng.random() < 0.35 and window > 0:
        a, b = rng.choice(prefill), rng.choice(decode)
        events.append(
            FaultEvent(
                at_us=rng.randrange(window),
                kind="slow_link",
                node=a,
                peer=b,
                duration_us=rng.randrange(100, max(101, window // 2)),
                factor=round(rng.uniform(0.01, 0.5), 3),
            )
        )
    return events


def _drawn_rates(f: Faults, rng: random.Random, events: list[FaultEvent]) -> Faults:
    """``f`` resolved: each rate the base leaves at 0 drawn on or off (and its value), in field
    order, then the clock skew; ``events`` sorted by time."""

    def rate(current: float, hi: float) -> float:
        if current > 0:
            return current
        return round(rng.uniform(0.0, hi), 4) if rng.random() < 0.5 else 0.0

    return replace(
        f,
        swarm=False,
        ctrl_drop=rate(f.ctrl_drop, 0.2),
        ctrl_dup=rate(f.ctrl_dup, 0.2),
        ctrl_reorder=rate(f.ctrl_reorder, 0.3),
        ctrl_delay=rate(f.ctrl_delay, 0.3),
        xfer_err=rate(f.xfer_err, 0.1),
        abort=rate(f.abort, 0.1),
        notif_drop=rate(f.notif_drop, 0.1),
        notif_delay=rate(f.notif_delay, 0.3),
        clock_skew_max_us=f.clock_skew_max_us or (rng.choice((0, 50, 500, 5000))),
        events=tuple(sorted(events, key=lambda e: (e.at_us, e.kind, e.node, e.peer))),
    )


def _calm(s: Scenario) -> Scenario:
    """``s`` with its deadlines and liveness window stretched, so that queueing under a drawn
    overload (posting 100k descriptors per room, say) is not mistaken for a wedge; a room that
    waits forever still fails its (stretched) deadline, which fault_free reports."""
    k = calm_stretch(s)
    stretched = replace(s.timeouts, **{n: getattr(s.timeouts, n) * k for n in _STRETCHED})
    return replace(s, timeouts=stretched, phases=replace(s.phases, liveness_us=s.phases.liveness_us * k))


class Injector:
    """Implements the fabric's fault hooks from the resolved personality and named streams."""

    def __init__(self, faults: Faults, fault_window_ns: int, streams: Streams) -> None:
        self.f = faults
        self.window_ns = fault_window_ns
        self.ctrl_rng: random.Random = streams["faults.control"]
        self.xfer_rng: random.Random = streams["faults.transfer"]
        self.notif_rng: random.Random = streams["faults.notif"]
        self.counts: Counter[str] = Counter()

    def control_fate(self, src: str, dst: str, now: int) -> ControlFate:
        f = self.f
        if now >= self.window_ns:  # healed (inline: asked per message and write)
            return DELIVER
        rng = self.ctrl_rng
        if f.ctrl_drop and rng.random() < f.ctrl_drop:
            self.counts["ctrl_drop"] += 1
            return ControlFate(dropped=True)
        copies = 1
        if f.ctrl_dup and rng.random() < f.ctrl_dup:
            self.counts["ctrl_dup"] += 1
            copies = 2
        delays = []
        for _ in range(copies):
            extra = 0
            if f.ctrl_delay and rng.random() < f.ctrl_delay:
                self.counts["ctrl_delay"] += 1
                extra += rng.randrange(1, f.ctrl_delay_max_us * US + 2)
            if f.ctrl_reorder and rng.random() < f.ctrl_reorder:
                # A random extra delay of a few control latencies lets later messages overtake.
                self.counts["ctrl_reorder"] += 1
                extra += rng.randrange(1, 200 * US)
            delays.append(extra)
        return ControlFate(dropped=False, extra_delays_ns=tuple(delays))

    def transfer_err(self, src: str, dst: str, now: int) -> bool:
        if now >= self.window_ns or not self.f.xfer_err:  # healed, or no such fault
            return False
        if self.xfer_rng.random() < self.f.xfer_err:
            self.counts["xfer_err"] += 1
            return True
        return False

    def notif_fate(self, src: str, dst: str, now: int) -> NotifFate:
        f = self.f
        if now >= self.window_ns:  # healed (inline: asked per message and write)
            return NOTIF_OK
        rng = self.notif_rng
        if f.notif_drop and rng.random() < f.notif_drop:
            self.counts["notif_drop"] += 1
            return NotifFate(dropped=True)
        if f.notif_delay and rng.random() < f.notif_delay:
            self.counts["notif_delay"] += 1
            return NotifFate(extra_delay_ns=rng.randrange(1, f.notif_delay_max_us * US + 2))
        return NOTIF_OK
