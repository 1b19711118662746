"""Simulate one deployment under one workload: build the scenario, run the DeployWorld, collect."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from kvferry.sim import scenario as sc
from kvferry.sim.deploy.metrics import SPLIT_KEYS, DeployResult, Percentiles, transfer_split
from kvferry.sim.deploy.spec import DeployError, DeploySpec
from kvferry.sim.deploy.workload import Arrivals, DeployRequest
from kvferry.sim.deploy.world import DeployWorld

__all__ = ["build_scenario", "simulate", "staging_bytes"]

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


def _split_arrivals(arrivals: Arrivals, k: int) -> list[Arrivals]:
    """Round-robin over ``k`` instance pairs: request i of an open loop goes to pair i % k; a
    closed loop's users and requests are shared out as evenly as they go."""
    if k == 1:
        return [arrivals]
    if arrivals.concurrency:
        return [
            Arrivals(
                concurrency=arrivals.concurrency // k + (j < arrivals.concurrency % k),
                total=arrivals.total // k + (j < arrivals.total % k),
            )
            for j in range(k)
        ]
    return [Arrivals(requests=arrivals.requests[j::k]) for j in range(k)]


def simulate(
    spec: DeploySpec, arrivals: Arrivals, lengths: tuple[DeployRequest, ...] = (), label: str = ""
) -> DeployResult:
    """``lengths``: the request sizes of a closed loop (ignored for open-loop arrivals)."""
    pool = arrivals.requests or lengths
    if not pool:
        raise DeployError("the workload has no requests")
    s = build_scenario(spec, pool)
    worlds: list[DeployWorld] = []
    wall = 0.0
    for j, part in enumerate(_split_arrivals(arrivals, spec.prefill_instances)):
        if part.count == 0 or (part.concurrency == 0 and not part.requests):
            continue
        pair = replace(spec, seed=spec.seed + j)
        w = DeployWorld(
            pair, replace(s, seed=pair.seed), part, lengths[j :: spec.prefill_instances] or lengths
        )
        last_arrival = max((r.arrival_ns for r in part.requests), default=0)
        wall += w.run_deploy(last_arrival + 3600 * NS)  # an hour of simulated time past the last arrival
        worlds.append(w)
    ttft, tpot, e2e, xfer = [], [], [], []
    split_sum: dict[str, float] = defaultdict(float)
    split_n = 0
    good = completed = failed = out_tokens = 0
    first, end, sim_ns = None, 0, 0
    violations: list[str] = []
    peaks = {"ring": 0, "pinned": 0}
    for w in worlds:
        sim_ns = max(sim_ns, int(w.env.now))
        for name, rank in w.ranks.items():
            got = getattr(rank.engine, "staging_peaks", None) if name.startswith("decode") else None
            if got:
                peaks["ring"] = max(peaks["ring"], int(got["ring_assigned"]))
                peaks["pinned"] = max(peaks["pinned"], int(got["pinned_used"]))
        violations += [f"{v.invariant}: {v.detail}" for v in w.violations]
        writes: dict[int, list[tuple[int, int, int, int, int]]] = defaultdict(list)
        for rec in w.fabric.xfer_log or ():
            writes[rec[0]].append(rec)
        for key, t in w.tracks.items():
            first = t.arrival_ns if first is None else min(first, t.arrival_ns)
            end = max(end, t.done_ns)
            if t.failed:
                failed += 1
                continue
            if t.done_ns < 0:
                continue
            completed += 1
            out_tokens += t.tokens
            ft = (t.first_token_ns - t.arrival_ns) / MS
            tp = (t.done_ns - t.first_token_ns) / MS / max(1, t.tokens - 1)
            ttft.append(ft)
            tpot.append(tp)
            e2e.append((t.done_ns - t.arrival_ns) / MS)
            last_ready = t.chunk_ready_ns[-1] if t.chunk_ready_ns else -1
            if t.kv_done_ns >= 0 and last_ready >= 0:
                xfer.append((t.kv_done_ns - last_ready) / MS)
            req = w.requests[key]
            picked = w.picked_ns.get((req.room, len(req.chunks) - 1), -1)
            parts = transfer_split(last_ready, t.kv_done_ns, writes.get(req.room, []), picked)
            if parts is not None:
                split_n += 1
                for k, v in parts.items():
                    split_sum[k] += v / MS
            if ft <= spec.ttft_slo_ms and tp <= spec.tpot_slo_ms:
                good += 1
    span_s = max(1e-9, (end - (first or 0)) / NS)
    total = arrivals.count
    return DeployResult(
        flow=spec.flow,
        label=label,
        requests=total,
        completed=completed,
        failed=failed,
        unfinished=total - completed - failed,
        sim_s=sim_ns / NS,
        wall_s=wall,
        ttft_ms=Percentiles.of(ttft),
        tpot_ms=Percentiles.of(tpot),
        e2e_ms=Percentiles.of(e2e),
        transfer_ms=Percentiles.of(xfer),
        split_ms={k: split_sum[k] / split_n if split_n else 0.0 for k in SPLIT_KEYS},
        goodput_rps=good / span_s,
        slo_attained=good / total if total else 0.0,
        throughput_tok_s=out_tokens / span_s,
        extra_memory_bytes=staging_bytes(s),
        staging_peak_bytes=peaks,
        violations=violations,
        seed=spec.seed,
    )
