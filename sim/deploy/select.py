"""Which flow for a deployment: simulate every applicable flow over the workload's load points,
rank them, and recommend one with its reason and its knobs."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from kvferry.core.flows import Flow
from kvferry.sim import scenario as sc
from kvferry.sim.deploy.metrics import DeployResult
from kvferry.sim.deploy.run import build_scenario, simulate
from kvferry.sim.deploy.spec import FLOWS, DeploySpec
from kvferry.sim.deploy.steady import Interval
from kvferry.sim.deploy.workload import Arrivals, DeployRequest

__all__ = ["LoadPoint", "Selection", "applicable_flows", "select"]


@dataclass(frozen=True, slots=True)
class LoadPoint:
    label: str
    arrivals: Arrivals
    lengths: tuple[DeployRequest, ...] = ()
    concurrency: int = 0  # for the TTFT-against-concurrency plot (0: open loop)
    # Steady state (sim/deploy/steady.py): requests arriving before this are not measured, and
    # the run stops as overloaded past this many requests waiting for a first token (0: never).
    warmup_ns: int = 0
    queue_limit: int = 0


@dataclass(frozen=True, slots=True)
class Selection:
    spec: DeploySpec
    results: dict[str, list[DeployResult]]  # flow -> one result per load point (first seed), in order
    ranking: list[str]  # flows, best first
    recommendation: str
    reason: str
    knobs: dict[str, Any]
    # flow -> per load point, one result per seed (``results`` holds the first of each)
    runs: dict[str, list[list[DeployResult]]] = field(default_factory=dict)
    ties: list[str] = field(default_factory=list)  # flows tied with the recommendation
    tie_note: str = ""  # how the tie was called and broken ("" without one)
    interrupted: str = ""  # Ctrl-C: which runs finished ("" when every run did)
    # flow -> the flow whose runs it took after its first run was that one's (``DeploySpec.runs_as``)
    runs_of: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        # The deployment as recommended: its flow is the recommendation, not the spec's default.
        deployment = {k: getattr(self.spec, k) for k in self.spec.__slots__}
        deployment["flow"] = self.recommendation
        return {
            "deployment": deployment,
            "nic": nic_dict(self.spec.nic),
            "ranking": self.ranking,
            "recommendation": self.recommendation,
            "reason": self.reason,
            "ties": self.ties,
            "tie_note": self.tie_note,
            "interrupted": self.interrupted,
            "runs_of": self.runs_of,
            "knobs": self.knobs,
            "summary": {f: _summary(self.runs.get(f) or [[r] for r in rs]) for f, rs in self.results.items()},
            "results": {f: [r.as_dict() for r in rs] for f, rs in self.results.items()},
            "seed_results": {
                f: [[r.as_dict() for r in seeds[1:]] for seeds in pts] for f, pts in self.runs.items()
            }
            if any(len(seeds) > 1 for pts in self.runs.values() for seeds in pts)
            else {},
        }


def nic_dict(name: str) -> dict[str, Any]:
    """The NIC profile as run: its transport, its costs, where each comes from, which are estimates."""
    from dataclasses import asdict

    from kvferry.sim.deploy import hardware

    out = asdict(hardware.nic(name))
    out["estimates"] = list(out["estimates"])
    return out


def _summary(points: Sequence[Sequence[DeployResult]]) -> list[dict[str, Any]]:
    """Per load point, each headline metric as mean and 95% interval over the seeds."""
    out = []
    for rs in points:
        row: dict[str, Any] = {"label": rs[0].label, "seeds": [r.seed for r in rs]}
        for name, get in _METRICS.items():
            iv = Interval.of([get(r) for r in rs])
            row[name] = {"mean": iv.mean, "ci95": iv.half}
        row["overload"] = next((r.overload for r in rs if r.overload), "")
        reasons: dict[str, int] = {}
        for r in rs:
            for k, v in r.failure_reasons.items():
                reasons[k] = reasons.get(k, 0) + v
        row["failure_reasons"] = reasons
        out.append(row)
    return out


_METRICS: dict[str, Callable[[DeployResult], float]] = {
    "ttft_p50_ms": lambda r: r.ttft_ms.p50,
    "ttft_p99_ms": lambda r: r.ttft_ms.p99,
    "tpot_p50_ms": lambda r: r.tpot_ms.p50,
    "tpot_p99_ms": lambda r: r.tpot_ms.p99,
    "slo_attained": lambda r: r.slo_attained,
}


# The planner's descriptors, moved by WRITE, READ, leased WRITE or a WRITE per layer range.
UNSTAGED = tuple(f.value for f in Flow if not f.staged)


def applicable_flows(spec: DeploySpec) -> tuple[str, ...]:
    """Equal TP sends whole token rows, which the core's policy never stages, so only the unstaged
    flows (register-then-write, pull, push, layer-wise) apply. Unequal TP: every flow but
    layer-wise, which would post direct's per-token slices once per layer (posting-bound already)
    and which the deployment model plans in full, every layer (too large to simulate there)."""
    if spec.prefill_tp == spec.decode_tp:
        return UNSTAGED
    return tuple(f for f in FLOWS if f != Flow.LAYERWISE.value)


TIE = 1.05  # with one seed, TTFT p99s within 5% of each other rank as equal: a tail that close is noise


def _score(rs: Sequence[DeployResult]) -> tuple[float, float, float]:
    """Higher is better: SLO attainment, then lower TTFT p99 (in 5% steps), then lower TTFT p50
    (at the heaviest load point, where flows differ most). One seed's results."""
    r = rs[-1]
    bad = any(x.failed or x.unfinished or x.violations or x.overload for x in rs)
    if r.overload:
        # Overloaded: what it still serves, in 5% steps (closer is a tie).
        served = math.floor(math.log(r.served_rps) / math.log(TIE)) if r.served_rps > 0 else -math.inf
        return (-2.0, served, 0.0)
    att = -1.0 if bad else sum(x.slo_attained for x in rs) / len(rs)
    p99 = r.ttft_ms.p99 if not math.isnan(r.ttft_ms.p99) else math.inf
    p50 = r.ttft_ms.p50 if not math.isnan(r.ttft_ms.p50) else math.inf
    step = math.floor(math.log(p99) / math.log(TIE)) if 0 < p99 < math.inf else math.inf
    return (att, -step, -p50)


def _heaviest(runs: Sequence[Sequence[DeployResult]]) -> tuple[Interval, Interval, bool]:
    """Attainment and TTFT p99 over the seeds at the heaviest load point, and whether any run
    failed, left requests unfinished, broke an invariant or was overloaded."""
    last = runs[-1]
    bad = any(x.failed or x.unfinished or x.violations or x.overload for rs in runs for x in rs)
    att = Interval.of([x.slo_attained for x in last])
    p99 = Interval.of([x.ttft_ms.p99 if not math.isnan(x.ttft_ms.p99) else math.inf for x in last])
    return att, p99, bad


def _tied(a: Sequence[Sequence[DeployResult]], b: Sequence[Sequence[DeployResult]]) -> bool:
    """Two flows whose attainment and TTFT p99 differ by no more than the seeds' noise: the 95%
    intervals overlap (several seeds), or within 5% (one seed, which has no interval)."""
    aa, ap, abad = _heaviest(a)
    ba, bp, bbad = _heaviest(b)
    if abad != bbad:
        return False
    over_a, over_b = a[-1][0].overload, b[-1][0].overload
    if over_a or over_b:  # overloaded: compared by what they still serve
        if not (over_a and over_b):
            return False
        sa = Interval.of([x.served_rps for x in a[-1]])
        sb = Interval.of([x.served_rps for x in b[-1]])
        if sa.n > 1:
            return sa.overlaps(sb)
        return max(sa.mean, sb.mean) <= TIE * min(sa.mean, sb.mean)
    if aa.n > 1:
        return aa.overlaps(ba) and ap.overlaps(bp)
    if abs(aa.mean - ba.mean) > 0.01 or math.isinf(ap.mean) or math.isinf(bp.mean):
        return abad and bbad and aa.mean == ba.mean
    return max(ap.mean, bp.mean) <= TIE * min(ap.mean, bp.mean)


def knobs(
    spec: DeploySpec, flow: str, s: sc.Scenario, results: Sequence[DeployResult] = ()
) -> dict[str, Any]:
    """The settings the flow ran with, named as the seeds' servers name them, and how much of
    its staging the heaviest load point used."""
    f = sc.staging_sizes(msgspec.structs.replace(s, flows=msgspec.structs.replace(s.flows, flow=flow)))
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
    if all(rs[-1].overload for rs in results.values()):
        sp = r.instances
        served = "; ".join(f"{f} {results[f][-1].served_rps:.2f}" for f in ranking)
        return (
            f"no flow keeps up at {r.label} with these instances ({', '.join(sp)}): the deployment "
            f"is overloaded whatever moves the KV ({r.overload}). Requests served a first token per "
            f"second before the run stopped: {served}; {best} serves the most. Give more instances, "
            "or drop the instance counts to search them (kvferry select --rate R)"
        )
    head = (
        f"{best}: TTFT p50 {r.ttft_ms.p50:.0f} ms / p99 {r.ttft_ms.p99:.0f} ms and "
        f"{r.slo_attained:.0%} of requests within the SLOs at {r.label}"
    )
    if r.overload:
        head += f" ({r.overload})"
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


def _memory(rs: Sequence[DeployResult]) -> int:
    return sum(rs[-1].extra_memory_bytes.values())


def select(
    spec: DeploySpec,
    points: Sequence[LoadPoint],
    flows: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
    seeds: Sequence[int] = (),
    points_for: Callable[[int], Sequence[LoadPoint]] | None = None,
) -> Selection:
    """Run every flow at every load point for every seed (``points_for(seed)`` draws a seed's own
    arrivals; default: ``points`` for all), rank, call ties and recommend."""
    flows = tuple(flows) if flows else applicable_flows(spec)
    seeds = tuple(seeds) or (spec.seed,)
    flows, runs, interrupted, runs_of = _run_all(spec, points, flows, progress, seeds, points_for)
    results = {f: [rs[0] for rs in runs[f]] for f in flows}
    ranking, ties, group, tie_note = _rank(flows, runs, results, len(seeds))
    best = ranking[0]
    pool = points[0].arrivals.requests or points[0].lengths
    s = build_scenario(replace(spec, flow=best), pool)
    return Selection(
        spec,
        results,
        ranking,
        best,
        _reason(best, results, ranking),
        knobs(spec, best, s, results[best]),
        runs,
        [f for f in ranking[1:] if f in ties or f == group[0]] if ties else [],
        tie_note,
        interrupted,
        runs_of,
    )


def _run_all(
    spec: DeploySpec,
    points: Sequence[LoadPoint],
    flows: tuple[str, ...],
    progress: Callable[[str], None] | None,
    seeds: tuple[int, ...],
    points_for: Callable[[int], Sequence[LoadPoint]] | None,
) -> tuple[tuple[str, ...], dict[str, list[list[DeployResult]]], str, dict[str, str]]:
    """Every flow's runs, per load point, one per seed. Returns the flows run, their runs, what a
    Ctrl-C cut short ("": nothing), and the flows that took another's runs (flow -> that one)."""
    runs: dict[str, list[list[DeployResult]]] = {f: [[] for _ in points] for f in flows}
    n = len(flows) * len(points) * len(seeds)
    i = 0
    # A flow whose runs are another's, event for event (push where its registration costs no host
    # work: ``DeploySpec.runs_as``), runs its first point beside that one; when the two are the
    # same run, it takes that one's for the rest, relabelled. The flows it takes from run first.
    twins = {f: t for f in flows if (t := replace(spec, flow=f).runs_as()) != f and t in flows}
    same: dict[str, bool] = {}  # twin flow -> whether its first run was its twin's
    try:
        for seed in seeds:
            pts = points_for(seed) if points_for is not None else points
            for flow in sorted(flows, key=lambda f: f in twins):
                fs = replace(spec, flow=flow, seed=seed)
                twin = twins.get(flow, "")
                for k, p in enumerate(pts):
                    i += 1
                    taken = bool(twin) and same.get(flow, False)
                    if progress is not None:
                        tail = f" seed {seed}" if len(seeds) > 1 else ""
                        also = f" ({twin}'s run: the same simulation)" if taken else ""
                        progress(f"[{i}/{n}] {flow} at {p.label}{tail}{also}")
                    if taken:
                        runs[flow][k].append(replace(runs[twin][k][-1], flow=flow))
                        continue
                    got = simulate(
                        fs,
                        p.arrivals,
                        p.lengths,
                        label=p.label,
                        warmup_ns=p.warmup_ns,
                        queue_limit=p.queue_limit,
                    )
                    runs[flow][k].append(got)
                    if twin and flow not in same:
                        same[flow] = got.same_run(runs[twin][k][-1])
                        if not same[flow] and progress is not None:
                            progress(f"{flow}'s run at {p.label} is not {twin}'s here: {flow} runs its own")
    except KeyboardInterrupt:
        # Ctrl-C: what finished is still worth showing (the flows whose every point ran once).
        done = [f for f in flows if all(runs[f][k] for k in range(len(points)))]
        if not done:
            raise
        interrupted = f"interrupted after {i - 1} of {n} runs: the table shows {', '.join(done)} only"
        cut = {f: [rs[: min(len(x) for x in runs[f])] for rs in runs[f]] for f in done}
        return tuple(done), cut, interrupted, {f: twins[f] for f, ok in same.items() if ok and f in done}
    return flows, runs, "", {f: twins[f] for f, ok in same.items() if ok}


def _rank(
    flows: tuple[str, ...],
    runs: dict[str, list[list[DeployResult]]],
    results: dict[str, list[DeployResult]],
    n_seeds: int,
) -> tuple[list[str], list[str], list[str], str]:
    """Best first: the first seed's score orders; flows tied with the best (within the seeds'
    noise) are then ordered by staging memory, least first. Returns the ranking, the flows tied
    with the best, the tied group (best first, as scored) and the tie in words."""
    ranking = sorted(flows, key=lambda f: _score([_mean_result(rs) for rs in runs[f]]), reverse=True)
    ties = [f for f in ranking[1:] if _tied(runs[ranking[0]], runs[f])]
    if not ties:
        return ranking, ties, [], ""
    group = [ranking[0], *ties]
    by_memory = sorted(group, key=lambda f: (_memory(results[f]), ranking.index(f)))
    ranking = by_memory + [f for f in ranking if f not in group]
    overloaded = bool(results[ranking[0]][-1].overload)
    what = "requests served a second" if overloaded else "SLO attainment and TTFT p99"
    how = (
        f"their {what} 95% intervals over {n_seeds} seeds overlap"
        if n_seeds > 1
        else f"one seed: {'served rates' if overloaded else 'TTFT p99'} within 5%"
        + ("" if overloaded else " and the same SLO attainment")
    )
    mem = ", ".join(f"{f} {_memory(results[f]) / 2**20:.0f} MiB" for f in by_memory)
    tie_note = (
        f"{' and '.join(group)} tie ({how}); the tie goes to the least staging memory per "
        f"prefill + decode rank ({mem}): {by_memory[0]}"
    )
    return ranking, ties, group, tie_note


def _mean_result(rs: Sequence[DeployResult]) -> DeployResult:
    """One load point's results over seeds as one (attainment and TTFT percentiles averaged;
    failures, unfinished, violations and overload from any seed), for ranking."""
    if len(rs) == 1:
        return rs[0]
    mean = Interval.of
    first = rs[0]
    return replace(
        first,
        slo_attained=mean([r.slo_attained for r in rs]).mean,
        ttft_ms=type(first.ttft_ms)(
            mean([r.ttft_ms.p50 for r in rs]).mean,
            mean([r.ttft_ms.p90 for r in rs]).mean,
            mean([r.ttft_ms.p99 for r in rs]).mean,
            mean([r.ttft_ms.mean for r in rs]).mean,
        ),
        failed=max(r.failed for r in rs),
        unfinished=max(r.unfinished for r in rs),
        violations=[v for r in rs for v in r.violations],
        overload=next((r.overload for r in rs if r.overload), ""),
    )
