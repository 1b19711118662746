"""A deployment run's requests as the client sees them: each one's timeline (``Track``), the
run's arrivals and counts (``RequestLog``), and the monitor that stops an overloaded run
(``Monitor``). sim/deploy/world.py composes them; sim/deploy/run.py collects from them."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import simpy
from kvferry.sim.deploy.spec import DeploySpec
from kvferry.sim.deploy.workload import Arrivals, DeployRequest

__all__ = ["Monitor", "RequestLog", "Track"]


@dataclass(slots=True)
class Track:
    """One request's timeline (ns; -1 until it happens)."""

    req: DeployRequest
    arrival_ns: int
    chunk_ready_ns: list[int] = field(default_factory=list)
    kv_done_ns: int = -1  # Success on every decode rank
    first_token_ns: int = -1
    done_ns: int = -1
    tokens: int = 0
    failed: bool = False
    retractions: int = 0  # times decode swapped it out to make room


class RequestLog:
    """Every request's track by key, what comes next (a closed loop sends a request as one
    finishes), and the counts the monitor and the metrics read."""

    def __init__(
        self, env: simpy.Environment, arrivals: Arrivals, lengths: tuple[DeployRequest, ...]
    ) -> None:
        self.tracks: dict[int, Track] = {}  # by request key
        self.finished = 0
        self.total = arrivals.count
        self.all_done = env.event()
        self.closed = arrivals.concurrency > 0
        self._lengths = list(lengths)
        self._next = 0
        # Requests arrived, given a first token, failed before one: the queue the monitor watches.
        self.arrived_n = self.first_n = self.failed_early_n = 0

    def next_request(self, r: DeployRequest | None) -> DeployRequest:
        """``r``, or a closed loop's next request of the lengths, in order."""
        if r is None:
            r = self._lengths[self._next % len(self._lengths)]
        self._next += 1
        return r

    def finish(self, key: int, failed: bool, now: int) -> Track:
        t = self.tracks[key]
        t.failed = failed
        if failed and t.first_token_ns < 0:
            self.failed_early_n += 1
        t.done_ns = now
        self.finished += 1
        return t

    @property
    def more(self) -> bool:
        """A closed loop has requests still to send."""
        return self.closed and self._next < self.total

    def end_if_all_finished(self) -> None:
        if self.finished >= self.total and not self.all_done.triggered:
            self.all_done.succeed()

    @property
    def waiting(self) -> int:
        """Requests arrived and neither given a first token nor failed."""
        return self.arrived_n - self.first_n - self.failed_early_n


class Monitor:
    """Once a simulated second: log the queue (``waiting_log``: (ns, waiting)); past
    ``queue_limit`` waiting, or ``miss_limit`` measured requests past an SLO, stop the run
    (``stopped`` says why; ``overloaded``: stopped by the queue, not by misses)."""

    def __init__(
        self,
        env: simpy.Environment,
        spec: DeploySpec,
        log: RequestLog,
        queue_limit: int,
        miss_limit: int,
        warmup_ns: int,
    ) -> None:
        self.env, self.log = env, log
        self.ttft_ns, self.tpot_ns = spec.ttft_slo_ms * 1e6, spec.tpot_slo_ms * 1e6
        self.queue_limit, self.miss_limit, self.warmup_ns = queue_limit, miss_limit, warmup_ns
        self.waiting_log: list[tuple[int, int]] = []
        self.stopped = ""
        self.overloaded = False

    def run(self) -> Generator[simpy.Event, Any, None]:
        all_done = self.log.all_done
        while not all_done.triggered:
            yield self.env.timeout(1_000_000_000)
            now, waiting = int(self.env.now), self.log.waiting
            self.waiting_log.append((now, waiting))
            if self.queue_limit and waiting > self.queue_limit and not all_done.triggered:
                self.stopped = (
                    f"stopped at {now / 1e9:.0f} s simulated: {waiting} requests waiting for a first "
                    f"token, more than the {self.queue_limit} a deployment meeting the TTFT SLO would "
                    "hold at this rate"
                )
                self.overloaded = True
                all_done.succeed()
            elif self.miss_limit >= 0 and not all_done.triggered:
                missed = self.missed(now)
                if missed > self.miss_limit:
                    self.stopped = (
                        f"stopped at {now / 1e9:.0f} s simulated: {missed} measured requests already "
                        f"missed an SLO, more than the {self.miss_limit} the attainment asked for allows"
                    )
                    all_done.succeed()

    def missed(self, now: int) -> int:
        """Requests arriving from the warm-up on that can no longer meet both SLOs by ``now``:
        failed, a first token later than the TTFT SLO (or none yet, past it), or more time per
        token so far than the TPOT SLO allows for the tokens still to come."""
        ttft, tpot = self.ttft_ns, self.tpot_ns
        n = 0
        for t in self.log.tracks.values():
            if t.arrival_ns < self.warmup_ns or t.arrival_ns > now:
                continue
            if t.failed:
                n += 1
            elif t.first_token_ns < 0:
                n += now - t.arrival_ns > ttft
            elif t.first_token_ns - t.arrival_ns > ttft:
                n += 1
            elif t.tokens > 1:
                # TPOT is the mean gap after the first token: already over the SLO for the gaps so
                # far, and the rest cannot be shorter than nothing.
                end = t.done_ns if t.done_ns >= 0 else now
                n += (end - t.first_token_ns) > tpot * max(1, t.req.output_tokens - 1)
        return n
