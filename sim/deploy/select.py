"""Which flow for a deployment: simulate every applicable flow over the workload's load points,
rank them, and recommend one with its reason and its knobs."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvferry.sim import scenario as sc
from kvferry.sim.deploy.metrics import DeployResult
from kvferry.sim.deploy.run import build_scenario, simulate
from kvferry.sim.deploy.spec import FLOWS, DeploySpec
from kvferry.sim.deploy.workload import Arrivals, DeployRequest

__all__ = ["LoadPoint", "Selection", "applicable_flows", "select"]


@dataclass(frozen=True, slots=True)
class LoadPoint:
    label: str
    arrivals: Arrivals
    lengths: tuple[DeployRequest, ...] = ()
    concurrency: int = 0  # for the TTFT-against-concurrency plot (0: open loop)


@dataclass(frozen=True, slots=True)
class Selection:
    spec: DeploySpec
    results: dict[str, list[DeployResult]]  # flow -> one result per load point, in order
    ranking: list[str]  # flows, best first
    recommendation: str
    reason: str
    knobs: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {
            "deployment": {k: getattr(self.spec, k) for k in self.spec.__slots__},
            "ranking": self.ranking,
            "recommendation": self.recommendation,
            "reason": self.reason,
            "knobs": self.knobs,
            "results": {f: [r.as_dict() for r in rs] for f, rs in self.results.items()},
        }


UNSTAGED = ("direct", "pull", "push")  # the planner's descriptors, moved by WRITE, READ or leased WRITE


def applicable_flows(spec: DeploySpec) -> tuple[str, ...]:
    """Every flow for unequal TP; equal TP sends whole token rows, which the core's policy never
    stages, so only the unstaged flows (register-then-write, pull, push) apply."""
    if spec.prefill_tp == spec.decode_tp:
        return UNSTAGED
    return FLOWS


TIE = 1.05  # TTFT p99s within 5% of each other rank as equal: a tail that close is noise


def _score(rs: Sequence[DeployResult]) -> tuple[float, float, float]:
    """Higher is better: SLO attainment, then lower TTFT p99 (in 5% steps), then lower TTFT p50
    (at the heaviest load point, where flows differ most)."""
    r = rs[-1]
    bad = any(x.failed or x.unfinished or x.violations for x in rs)
    att = -1.0 if bad else sum(x.slo_attained for x in rs) / len(rs)
    p99 = r.ttft_ms.p99 if not math.isnan(r.ttft_ms.p99) else math.inf
    p50 = r.ttft_ms.p50 if not math.isnan(r.ttft_ms.p50) else math.inf
    step = math.floor(math.log(p99) / math.log(TIE)) if 0 < p99 < math.inf else math.inf
    return (att, -step, -p50)


def knobs(
    spec: DeploySpec, flow: str, s: sc.Scenario, results: Sequence[DeployResult] = ()
) -> dict[str, Any]:
    """The settings the flow ran with, named as the seeds' servers name them, and how much of
    its staging the heaviest load point used."""
    f = sc.staging_sizes(replace(s, flows=replace(s.flows, flow=flow)))
    out: dict[str, Any] = {
        "flow": flow,
        "transfer_queues (SGLANG_DISAGGREGATION_QUEUE_SIZE, one worker each)": spec.workers,
        "chunked_prefill_size (tokens)": spec.chunk_tokens,
    }
    if spec.page_allocator == "sglang":
        out["num_reserved_decode_tokens (--num-reserved-decode-tokens)"] = spec.decode_reserved_tokens
        short = max(results, key=lambda x: x.retractions, default=None)
        if short is not None and short.retractions:
            out["decode_memory"] = (
                f"decode ran out of pages at {short.label}: {short.retractions} retractions, "
                f"{short.swap_ms:.0f} ms of swaps; more decode memory (TP, instances) avoids them, "
                "a larger --decode-reserved-tokens trades them for waits at admission"
            )
    staged = flow not in UNSTAGED
    if staged:
        out["staging (SGLANG_DISAGG_STAGING_BUFFER)"] = True
        out["staging_buffer_per_worker_mb"] = round(f.worker_buffer_bytes / 2**20, 1)
    if flow == "ring":
        out["decode_ring_mb (SGLANG_DISAGG_STAGING_POOL_SIZE_MB)"] = round(f.ring_bytes / 2**20, 1)
    if flow == "pinned":
        out["decode_pinned_pool_mb"] = round(f.pinned_bytes / 2**20, 1)
        out["prefill_pinned_pool_mb"] = round(f.prefill_pinned_bytes / 2**20, 1)
    if staged and results:
        r = max(reversed(results), key=lambda x: x.staging_peak_bytes.get(flow, 0))  # ties: heaviest load
        peak = r.staging_peak_bytes.get(flow, 0)
        size = f.ring_bytes if flow == "ring" else f.pinned_bytes
        out[f"decode_{flow}_peak_in_use_mb"] = round(peak / 2**20, 1)
        if size and peak >= size:
            out["sizing"] = (
                f"the {flow} filled up at {r.label} (chunks waited for space): raise --staging-chunks"
            )
        elif size:
            out["sizing"] = f"at most {peak / size:.0%} of the {flow} in use (at {r.label})"
    return out


def _reason(best: str, results: dict[str, list[DeployResult]], ranking: list[str]) -> str:
    r = results[best][-1]
    head = (
        f"{best}: TTFT p50 {r.ttft_ms.p50:.0f} ms / p99 {r.ttft_ms.p99:.0f} ms and "
        f"{r.slo_attained:.0%} of requests within the SLOs at {r.label}"
    )
    if len(ranking) < 2:
        return head + " (the only flow asked for)"
    parts = [head]
    for name in ranking[1:]:
        other = results[name][-1]
        if other.ttft_ms.p50 > 0 and r.ttft_ms.p50 > 0:
            ratio = other.ttft_ms.p50 / r.ttft_ms.p50
            if 1 / TIE <= ratio <= TIE:
                parts.append(f"the same TTFT p50 as {name} within 5% ({other.ttft_ms.p50:.0f} ms)")
            else:
                parts.append(f"{ratio:.1f}x lower TTFT p50 than {name} ({other.ttft_ms.p50:.0f} ms)")
    split = r.split_ms
    dominant = max(split, key=lambda k: split[k]) if any(split.values()) else ""
    if dominant:
        parts.append(f"its transfers spend most in {dominant} ({split[dominant]:.1f} ms mean)")
    mem = sum(r.extra_memory_bytes.values())
    parts.append(
        f"costs {mem / 2**20:.0f} MiB of staging per prefill + decode rank"
        if mem
        else "needs no staging memory"
    )
    return "; ".join(parts)


def select(
    spec: DeploySpec,
    points: Sequence[LoadPoint],
    flows: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Selection:
    flows = tuple(flows) if flows else applicable_flows(spec)
    results: dict[str, list[DeployResult]] = {}
    n = len(flows) * len(points)
    i = 0
    for flow in flows:
        fs = replace(spec, flow=flow)
        results[flow] = []
        for p in points:
            i += 1
            if progress is not None:
                progress(f"[{i}/{n}] {flow} at {p.label}")
            results[flow].append(simulate(fs, p.arrivals, p.lengths, label=p.label))
    ranking = sorted(flows, key=lambda f: _score(results[f]), reverse=True)
    best = ranking[0]
    pool = points[0].arrivals.requests or points[0].lengths
    s = build_scenario(replace(spec, flow=best), pool)
    return Selection(
        spec, results, ranking, best, _reason(best, results, ranking), knobs(spec, best, s, results[best])
    )
