"""A deployment run's numbers: latency percentiles, goodput under the SLOs, and where each
request's KV transfer spent its time."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["SPLIT_DOC", "SPLIT_KEYS", "DeployResult", "Percentiles", "transfer_split"]

MS = 1e6
SPLIT_KEYS = ("queue", "staging", "posting", "wire", "scatter")
SPLIT_DOC = {
    "queue": "last chunk computed -> a transfer worker takes it up (the transfer queue)",
    "staging": "taken up -> its last write posted: waiting for ring or pinned space, and the gather",
    "posting": "posted -> on the wire: the NIC's posting engine (post + per-descriptor cost) and its "
    "in-flight limit",
    "wire": "on the wire -> landed: bandwidth shared with the other transfers, and latency",
    "scatter": "landed -> Success on every decode rank: scatter kernels (staged flows), notifications",
}


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float

    @staticmethod
    def of(values_ms: Sequence[float]) -> Percentiles:
        if not values_ms:
            return Percentiles(float("nan"), float("nan"), float("nan"), float("nan"))
        a = np.asarray(values_ms, dtype=float)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return Percentiles(float(p50), float(p90), float(p99), float(a.mean()))


@dataclass(slots=True)
class DeployResult:
    flow: str
    label: str  # the workload point (e.g. "concurrency 64")
    requests: int
    completed: int
    failed: int
    unfinished: int
    sim_s: float
    wall_s: float
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    e2e_ms: Percentiles
    transfer_ms: Percentiles  # last chunk computed -> Success on decode
    split_ms: dict[str, float]  # mean per request, SPLIT_KEYS
    goodput_rps: float  # requests per second meeting both SLOs
    slo_attained: float  # fraction of requests meeting both SLOs
    throughput_tok_s: float  # output tokens per second
    extra_memory_bytes: dict[str, int]  # staging each rank registers, by kind
    # Most of decode's ring / pinned pool in use at once, over its ranks (ring: laps handed out
    # ahead of the watermark included, so it can exceed the ring: chunks then waited for space).
    staging_peak_bytes: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    seed: int = 0
    # Per instance ("prefill0", "decode3"): requests routed there, and the share of the run
    # (first arrival to last finish) it spent in forward steps.
    instances: dict[str, dict[str, int | float]] = field(default_factory=dict)
    # How scattered the requests' KV pages were (sim/pages.py): mean contiguous runs per request
    # on each side ("prefill", "decode") and over both at once ("pair": where an equal-TP direct
    # descriptor merges), and the largest pair count ("pair_max").
    page_runs: dict[str, float] = field(default_factory=dict)
    # Generated tokens that found no free decode page even after every other request of the
    # batch was retracted (the sglang page allocator; 0 unless one request outgrows the pool:
    # then decode memory is over-committed and TPOT and TTFT are optimistic).
    growth_short: int = 0
    # Times decode swapped a request out to host memory to make room for generated tokens
    # (SGLang's retraction), and the simulated ms its steps waited for swaps out and back in.
    retractions: int = 0
    swap_ms: float = 0.0
    # Steady state (sim/deploy/steady.py): requests arriving before ``warmup_s`` ran but are not
    # in the numbers above; the arrival rate offered and the completion rate achieved while
    # requests arrived; "" or why the deployment did not keep up, in words; failed requests by
    # reason; why the run stopped before its last request ("" if it did not).
    warmup_s: float = 0.0
    offered_rps: float = 0.0
    completed_rps: float = 0.0
    overload: str = ""
    failure_reasons: dict[str, int] = field(default_factory=dict)
    stopped: str = ""
    # Requests given a first token per simulated second over the whole run (warm-up included):
    # what an overloaded deployment still serves, by which overloaded flows are compared.
    served_rps: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def same_run(self, other: DeployResult) -> bool:
        """Whether ``other`` is this run, figure for figure, but for its flow's name and its wall
        time (NaN percentiles of a run with no measured request compare equal)."""
        mine, theirs = (
            {k: v for k, v in r.as_dict().items() if k not in ("flow", "wall_s")} for r in (self, other)
        )
        return json.dumps(mine, sort_keys=True) == json.dumps(theirs, sort_keys=True)


def transfer_split(
    last_ready_ns: int,
    success_ns: int,
    writes: Sequence[tuple[int, int, int, int, int]],
    picked_ns: int = -1,
) -> dict[str, int] | None:
    """Split (last chunk ready -> Success) along the room's last-landing write; None without one.
    ``picked_ns``: when a transfer worker took the last chunk up (-1: unknown, counted as staging)."""
    if not writes or success_ns < 0 or last_ready_ns < 0:
        return None
    _room, posted, started, landed, _done = max(writes, key=lambda w: w[3])
    posted = max(posted, last_ready_ns)
    picked = min(max(picked_ns, last_ready_ns), posted)
    started = max(started, posted)
    landed = max(landed, started)
    end = max(success_ns, landed)
    return {
        "queue": picked - last_ready_ns,
        "staging": posted - picked,
        "posting": started - posted,
        "wire": landed - started,
        "scatter": end - landed,
    }
