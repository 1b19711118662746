"""Simulate one deployment under one workload: build the scenario, run the DeployWorld (every
instance of both sides in it), collect."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from kvferry.sim import scenario as sc
from kvferry.sim.deploy.metrics import SPLIT_KEYS, DeployResult, Percentiles, transfer_split
from kvferry.sim.deploy.router import Router
from kvferry.sim.deploy.spec import DeployError, DeploySpec
from kvferry.sim.deploy.steady import overload_words
from kvferry.sim.deploy.tracks import Track
from kvferry.sim.deploy.workload import Arrivals, DeployRequest
from kvferry.sim.deploy.world import DeployWorld
from kvferry.sim.pages import pair_runs, runs
from kvferry.sim.rooms import Request

__all__ = [
    "build_scenario",
    "collect",
    "deploy_world",
    "page_runs",
    "run_world",
    "simulate",
    "staging_bytes",
]

NS = 1_000_000_000
MS = 1_000_000


def build_scenario(spec: DeploySpec, lengths: tuple[DeployRequest, ...]) -> sc.Scenario:
    spec.check()
    longest = max(r.input_tokens for r in lengths)
    chunk = min(spec.chunk_tokens, longest)
    try:
        return sc.parse(spec.scenario_dict(longest, chunk), where=f"deployment {spec.model}")
    except sc.ScenarioError as e:
        raise DeployError(str(e)) from None


def staging_bytes(s: sc.Scenario) -> dict[str, int]:
    """The extra memory a flow registers per rank (0 for what it does not use)."""
    f = sc.staging_sizes(s)
    flow = f.flow
    return {
        "decode_ring": f.ring_bytes if flow == "ring" else 0,
        "decode_pinned": f.pinned_bytes if flow == "pinned" else 0,
        "prefill_worker_buffers": f.worker_buffer_bytes * s.topology.workers * (flow in ("ring", "pinned")),
        "prefill_pinned": f.prefill_pinned_bytes if flow == "pinned" else 0,
    }


def deploy_world(
    spec: DeploySpec,
    arrivals: Arrivals,
    lengths: tuple[DeployRequest, ...] = (),
    router: Router | None = None,
    queue_limit: int = 0,
    miss_limit: int = -1,
    warmup_ns: int = 0,
) -> DeployWorld:
    """The deployment's world, not run yet: every instance of both sides on one fabric."""
    pool = arrivals.requests or lengths
    if not pool:
        raise DeployError("the workload has no requests")
    return DeployWorld(
        spec, build_scenario(spec, pool), arrivals, lengths, router, queue_limit, miss_limit, warmup_ns
    )


def run_world(w: DeployWorld, arrivals: Arrivals) -> float:
    """Run it to the end (an hour of simulated time past the last arrival at most); the wall time."""
    last_arrival = max((r.arrival_ns for r in arrivals.requests), default=0)
    return w.run_deploy(last_arrival + 3600 * NS)


def simulate(
    spec: DeploySpec,
    arrivals: Arrivals,
    lengths: tuple[DeployRequest, ...] = (),
    label: str = "",
    warmup_ns: int = 0,
    queue_limit: int = 0,
    miss_limit: int = -1,
) -> DeployResult:
    """``lengths``: the request sizes of a closed loop (ignored for open-loop arrivals).
    ``warmup_ns``: requests arriving before it are run, not measured (sim/deploy/steady.py);
    ``queue_limit``: stop as overloaded past this many requests waiting for a first token;
    ``miss_limit``: stop once more measured requests than this missed an SLO (-1: never)."""
    w = deploy_world(
        spec, arrivals, lengths, queue_limit=queue_limit, miss_limit=miss_limit, warmup_ns=warmup_ns
    )
    wall = run_world(w, arrivals)
    return collect(w, arrivals, wall, label, warmup_ns)


def page_runs(w: DeployWorld) -> dict[str, float]:
    """Mean contiguous page runs per admitted request (see DeployResult.page_runs)."""
    got = [r for r in w.requests if r.pre_pages is not None and r.dec_pages is not None]
    if not got:
        return {}
    pairs = [pair_runs(r.pre_pages, r.dec_pages) for r in got]  # type: ignore[arg-type]
    return {
        "prefill": sum(runs(r.pre_pages) for r in got) / len(got),  # type: ignore[arg-type]
        "decode": sum(runs(r.dec_pages) for r in got) / len(got),  # type: ignore[arg-type]
        "pair": sum(pairs) / len(got),
        "pair_max": float(max(pairs)),
    }


def _reason(req: Request) -> str:
    """Why a request failed, in a form that counts alike across requests (ids and ns dropped)."""
    got = next((r for r in req.reason.values() if r), "") or "no reason given"
    return re.sub(r"\d+", "N", got)[:120]


@dataclass(slots=True)
class _Window:
    """What the requests arriving in the measured window did (sums and samples, in track order)."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    xfer: list[float] = field(default_factory=list)
    split_sum: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    split_n: int = 0
    requests: int = 0
    done_in_window: int = 0  # requests (of any arrival) finished within the window
    good: int = 0
    completed: int = 0
    failed: int = 0
    out_tokens: int = 0
    first: int | None = None
    end: int = 0
    reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def span_s(self) -> float:
        return max(1e-9, (self.end - (self.first or 0)) / NS)


def _measure(w: DeployWorld, warmup_ns: int, last_arrival: int) -> _Window:
    """Latencies and SLOs over the requests that arrived from ``warmup_ns`` to ``last_arrival``."""
    m = _Window()
    writes: dict[int, list[tuple[int, int, int, int, int]]] = defaultdict(list)
    for rec in getattr(w.fabric, "xfer_log", None) or ():
        writes[rec[0]].append(rec)
    for key, t in w.tracks.items():
        if t.done_ns >= 0 and warmup_ns <= t.done_ns <= last_arrival:
            m.done_in_window += 1
        if not warmup_ns <= t.arrival_ns <= last_arrival:
            continue
        m.requests += 1
        m.first = t.arrival_ns if m.first is None else min(m.first, t.arrival_ns)
        m.end = max(m.end, t.done_ns)
        if t.failed:
            m.failed += 1
            m.reasons[_reason(w.requests[key])] += 1
        elif t.done_ns >= 0:
            _completed(m, w, key, t, writes.get(w.requests[key].room, []))
    return m


def _completed(
    m: _Window, w: DeployWorld, key: int, t: Track, writes: list[tuple[int, int, int, int, int]]
) -> None:
    """A completed request's latencies, transfer split and SLO verdict into ``m``."""
    m.completed += 1
    m.out_tokens += t.tokens
    ft = (t.first_token_ns - t.arrival_ns) / MS
    tp = (t.done_ns - t.first_token_ns) / MS / max(1, t.tokens - 1)
    m.ttft.append(ft)
    m.tpot.append(tp)
    m.e2e.append((t.done_ns - t.arrival_ns) / MS)
    last_ready = t.chunk_ready_ns[-1] if t.chunk_ready_ns else -1
    if t.kv_done_ns >= 0 and last_ready >= 0:
        m.xfer.append((t.kv_done_ns - last_ready) / MS)
    req = w.requests[key]
    picked = w.picked_ns.get((req.room, len(req.chunks) - 1), -1)
    parts = transfer_split(last_ready, t.kv_done_ns, writes, picked)
    if parts is not None:
        m.split_n += 1
        for k, v in parts.items():
            m.split_sum[k] += v / MS
    if ft <= w.spec.ttft_slo_ms and tp <= w.spec.tpot_slo_ms:
        m.good += 1


def _kept_up(
    w: DeployWorld, arrivals: Arrivals, m: _Window, warmup_ns: int, last_arrival: int
) -> tuple[float, float, str]:
    """Kept up? What completed while requests were arriving, against what arrived; the queue of
    requests waiting for a first token at the window's start and end. Returns the offered and
    completed rates and the overload in words ("" for a closed loop, which cannot overload)."""
    sim_ns = int(w.env.now)
    length_s = max(1e-9, (last_arrival - warmup_ns) / NS)
    offered = m.requests / length_s
    completed_rps = m.done_in_window / length_s
    if arrivals.concurrency:
        return offered, completed_rps, ""
    log = [n for at, n in w.monitor.waiting_log if warmup_ns <= at <= last_arrival]
    third = max(1, len(log) // 3)
    first_q = sum(log[:third]) / third if log else 0.0
    last_q = sum(log[-third:]) / third if log else 0.0
    busy = {
        f"{side}{i}": min(1.0, b / max(1, sim_ns))  # a step booked past the stop counts to it
        for side in ("prefill", "decode")
        for i, b in enumerate(w.busy_ns[side])
    }
    stopped = w.monitor.stopped if w.monitor.overloaded else ""
    return offered, completed_rps, overload_words(offered, completed_rps, first_q, last_q, busy, stopped)


def _staging_peaks(w: DeployWorld) -> dict[str, int]:
    """The most ring and pinned staging any decode rank held at once."""
    peaks = {"ring": 0, "pinned": 0}
    for name, rank in w.ranks.items():
        if name.startswith("decode"):
            got = rank.engine.staged.staging_peaks
            peaks["ring"] = max(peaks["ring"], int(got["ring_assigned"]))
            peaks["pinned"] = max(peaks["pinned"], int(got["pinned_used"]))
    return peaks


def collect(
    w: DeployWorld, arrivals: Arrivals, wall: float = 0.0, label: str = "", warmup_ns: int = 0
) -> DeployResult:
    """The run's numbers, from its tracks, its fabric's write log and its ranks: latencies and
    SLOs over the requests that arrived from ``warmup_ns`` on (the window); whether it kept up."""
    spec, sim_ns = w.spec, int(w.env.now)
    # A run stopped as overloaded ends its window at the stop: later arrivals never came.
    last_arrival = min(max((t.arrival_ns for t in w.tracks.values()), default=0), sim_ns)
    m = _measure(w, warmup_ns, last_arrival)
    offered, completed_rps, overload = _kept_up(w, arrivals, m, warmup_ns, last_arrival)
    span_s, total = m.span_s, m.requests
    return DeployResult(
        flow=spec.flow,
        label=label,
        requests=total,
        completed=m.completed,
        failed=m.failed,
        unfinished=total - m.completed - m.failed,
        sim_s=sim_ns / NS,
        wall_s=wall,
        ttft_ms=Percentiles.of(m.ttft),
        tpot_ms=Percentiles.of(m.tpot),
        e2e_ms=Percentiles.of(m.e2e),
        transfer_ms=Percentiles.of(m.xfer),
        split_ms={k: m.split_sum[k] / m.split_n if m.split_n else 0.0 for k in SPLIT_KEYS},
        goodput_rps=m.good / span_s,
        slo_attained=m.good / total if total else 0.0,
        throughput_tok_s=m.out_tokens / span_s,
        extra_memory_bytes=staging_bytes(w.built),
        staging_peak_bytes=_staging_peaks(w),
        violations=[f"{v.invariant}: {v.detail}" for v in w.violations],
        seed=spec.seed,
        instances={
            f"{side}{i}": {"requests": n, "busy": busy / NS / span_s}
            for side in ("prefill", "decode")
            for i, (n, busy) in enumerate(zip(w.loads.routed[side], w.busy_ns[side], strict=True))
        },
        page_runs=page_runs(w),
        growth_short=w.memory.growth_short,
        retractions=w.memory.retractions,
        swap_ms=w.memory.swap_ns / MS,
        warmup_s=warmup_ns / NS,
        offered_rps=offered,
        completed_rps=completed_rps,
        overload=overload,
        failure_reasons=dict(m.reasons),
        stopped=w.monitor.stopped,
        served_rps=w.log.first_n / max(1e-9, sim_ns / NS),
    )
