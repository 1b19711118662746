"""Fault campaigns: many seeds, each a whole run with its own swarm personality, checked.

Without a base scenario every seed also draws its deployment (TP pair, heads or MLA, page sizes,
layouts, workers, workload), so a campaign covers topologies as well as faults. A failing seed is
written out as a resolved scenario file: replaying it (``kvferry replay FILE``) repeats the run
event for event, and dropping it into ``tests/scenarios/`` makes it a regression test.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
from kvferry.sim import executors as ex
from kvferry.sim import scenario as sc
from kvferry.sim.executors import Executor
from kvferry.sim.metrics import RunResult, collect
from kvferry.sim.rng import Streams
from kvferry.sim.world import World


def parse_seeds(text: str) -> list[int]:
    """``"0-999"``, ``"7"``, ``"1,5,10-12"`` -> the seeds, in order, without repeats."""
    out: list[int] = []
    seen: set[int] = set()
    # The whole list (and a set) is built: 10M seeds is about 1 GB, and weeks of runs.
    max_seeds = 10_000_000
    count = 0
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
            else:
                lo = hi = int(part)
        except ValueError:
            raise ValueError(f"bad seed range {part!r}; use e.g. 0-999 or 1,5,10-12") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"bad seed range {part!r}")
        count += hi - lo + 1  # checked before the list is built
        if count > max_seeds:
            raise ValueError(f"too many seeds in {text!r}: at most {max_seeds:,} in one campaign")
        for s in range(lo, hi + 1):
            if s not in seen:
                seen.add(s)
                out.append(s)
    if not out:
        raise ValueError("no seeds given")
    return out


# The share of drawn deployments with several servers a side, and the (prefill, decode) counts
# they draw from: small, since every rank is a node of its own and a seed should stay quick.
MULTI_INSTANCE_SHARE = 0.25
INSTANCE_DRAWS = ((1, 2), (2, 1), (2, 2), (1, 3), (3, 2))


def fuzz_scenario(seed: int, base: sc.Scenario | None = None, hooks: tuple[str, ...] = ()) -> sc.Scenario:
    """The scenario seed ``seed`` runs: ``base`` with swarm faults, or a deployment drawn too."""
    if base is not None:
        return replace(base, seed=seed, faults=replace(base.faults, swarm=True), hooks=base.hooks + hooks)
    rng = Streams(seed)["swarm.topology"]
    heads, mla = rng.choice(((8, False), (8, False), (4, False), (2, False), (1, True)))
    tps = [t for t in (1, 2, 4) if (t <= heads and heads % t == 0) or (t > heads and t % heads == 0)]
    ptp, dtp = rng.choice(tps), rng.choice(tps)
    pps, dps = rng.choice((4, 16, 32)), rng.choice((4, 16, 32))
    layouts = ("sglang_nhd", "vllm_nhd", "vllm_hnd")
    model = sc.ModelSpec(
        name="fuzz",
        num_layers=rng.randint(1, 3),
        num_kv_heads=heads,
        head_dim=rng.choice((4, 8, 16)) if not mla else 32,
        dtype=rng.choice(("bf16", "fp8_e4m3")),
        is_mla=mla,
    )
    rooms = rng.randint(6, 16)
    topo = sc.Topology(
        prefill_tp=ptp,
        decode_tp=dtp,
        prefill_page_size=pps,
        decode_page_size=dps,
        prefill_pages=2048 // pps * 4,
        decode_pages=2048 // dps * 4,
        prefill_layout=rng.choice(layouts),
        decode_layout=rng.choice(layouts),
        workers=rng.randint(1, 3),
        aux_rows=64,
    )
    # The blind spots, from their own stream (every earlier draw of a seed stays as it was):
    # decode allocations shorter or longer than prefill's; chunks handed over back to back with
    # a wide per-write jitter, so several chunks of a room are in flight and land (and notify)
    # out of order even when no fault is injected.
    brng = Streams(seed)["swarm.blind"]
    mismatch = brng.choice((0.0, 0.0, 0.1, 0.3))
    burst = brng.random() < 0.35
    jitter_ns = brng.choice((2_000, 40_000)) if burst else 2_000
    work = sc.Workload(
        rooms=rooms,
        tokens_min=1,
        tokens_max=rng.choice((64, 160, 300)),
        chunk_tokens=rng.choice((0, 16, 48, 64)),
        arrival_mean_us=rng.choice((100, 500, 1500)),
        compute_ns_per_token=0 if burst else sc.Workload().compute_ns_per_token,
        length_mismatch=mismatch,
    )
    fabric = sc.Scenario().fabric
    fabric = replace(fabric, nic=replace(fabric.nic, jitter_ns=jitter_ns))
    # Flows from their own stream, so adding them left every other draw of a seed as it was.
    frng = Streams(seed)["swarm.flows"]
    flows = sc.FlowSpec(
        flow=frng.choice(("policy", "direct", "ring", "pinned", "mixed", "mixed")),
        auto_chunks=frng.choice((1, 1, 2, 4, 16)),  # staging space from one chunk to many
    )
    # Pull from a stream of its own too: a fifth of the seeds run every room pulled, the others
    # keep the flow they drew before pull existed ("mixed" draws it per room as well).
    if Streams(seed)["swarm.flows.pull"].random() < 0.2:
        flows = replace(flows, flow="pull")
    elif Streams(seed)["swarm.flows.push"].random() < 0.25:
        flows = replace(flows, flow="push")
    # Push registrations matched by request id (no router transfer id), from a stream of its own.
    if Streams(seed)["swarm.flows.push_match"].random() < 0.4:
        flows = replace(flows, push_match="request_id")
    # Several servers on one side or both, from a stream of their own: routing, each server's own
    # memory, and faults and aborts that hit one server while its neighbours carry on.
    irng = Streams(seed)["swarm.instances"]
    if irng.random() < MULTI_INSTANCE_SHARE:
        pre_n, dec_n = irng.choice(INSTANCE_DRAWS)
        topo = replace(topo, prefill_instances=pre_n, decode_instances=dec_n)
    # Prefix hits (decode holds the first tokens): a third of the seeds, for half of their rooms.
    if Streams(seed)["swarm.prefix"].random() < 0.3:
        work = replace(work, prefix_hit=0.5)
    return sc.Scenario(
        name=f"fuzz-{seed}",
        seed=seed,
        model=model,
        topology=topo,
        fabric=fabric,
        flows=flows,
        workload=work,
        faults=sc.Faults(swarm=True),
        phases=sc.Phases(fault_window_us=rng.choice((5_000, 15_000, 30_000))),
        hooks=hooks,
    )


def run_one(
    s: sc.Scenario,
    seed: int | None = None,
    keep_trace: bool = False,
    detail: bool = False,
    before_run: Callable[[World], Any] | None = None,
) -> tuple[RunResult, World]:
    """One run, checked. ``before_run`` sees the built world first (a trace viewer's tap)."""
    t0 = time.perf_counter()
    w = World(s, seed=seed, keep_trace=keep_trace)
    if before_run is not None:
        before_run(w)
    w.run()
    res = collect(w, wall_s=time.perf_counter() - t0, detail=detail)
    if res.violations:
        res.scenario_toml = failing_scenario_toml(w, res)
    return res, w


def failing_scenario_toml(w: World, res: RunResult) -> str:
    first = res.violations[0]
    s = replace(
        w.scenario,
        name=f"{w.scenario.name}-seed-{w.seed}"
        if not w.scenario.name.endswith(f"-{w.seed}")
        else w.scenario.name,
        description=f"found by kvferry fuzz: {first['invariant']}: {first['detail']}"[:500],
        seed=w.seed,
        expect_violations=tuple(res.violated()) if w.scenario.hooks else (),
    )
    header = (
        f"# Failing run saved by `kvferry fuzz` (seed {w.seed}). Replay: kvferry replay <this file>\n"
        f"# Violated: {', '.join(res.violated())}. Dropped into tests/scenarios/ it is a regression\n"
        "# test that expects no violation (or exactly those under [expect] for planted bugs).\n"
    )
    return header + sc.dump(s)


def _job(seed: int, base_toml: str | None, hooks: tuple[str, ...]) -> bytes:
    """One seed's run, as msgpack: results cross processes and machines as data, never pickles."""
    base = sc.parse(_loads(base_toml)) if base_toml is not None else None
    res, _ = run_one(fuzz_scenario(seed, base, hooks))
    return msgspec.msgpack.encode(res)


def _loads(text: str) -> dict:
    import tomllib

    return tomllib.loads(text)


def seed_job(base: sc.Scenario | None = None, hooks: tuple[str, ...] = ()) -> Callable[[int], bytes]:
    """The picklable function an executor maps over seeds (the base travels as its TOML text)."""
    return functools.partial(_job, base_toml=sc.dump(base) if base is not None else None, hooks=hooks)


def decode_result(data: bytes) -> RunResult:
    return msgspec.msgpack.decode(data, type=RunResult)


def run_seeds(
    seeds: Sequence[int],
    base: sc.Scenario | None = None,
    hooks: tuple[str, ...] = (),
    executor: Executor | None = None,
    progress: ex.Progress | None = None,
) -> Iterator[RunResult]:
    """Every seed once, yielded as runs finish (any order); ``executor`` defaults to inline."""
    executor = executor or ex.LocalExecutor(1)
    for _, data in executor.map(seed_job(base, hooks), seeds, progress=progress):
        yield decode_result(data)


def campaign(
    seeds: Sequence[int],
    base: sc.Scenario | None = None,
    jobs: int = 1,
    hooks: tuple[str, ...] = (),
    executor: Executor | None = None,
) -> Iterator[RunResult]:
    """Run every seed; yields results in seed order (so output does not depend on ``jobs``)."""
    order = list(seeds)
    held: dict[int, RunResult] = {}
    nxt = 0
    for res in run_seeds(order, base, hooks, executor or ex.LocalExecutor(jobs)):
        held[res.seed] = res
        while nxt < len(order) and order[nxt] in held:
            yield held.pop(order[nxt])
            nxt += 1


def save_failure(res: RunResult, directory: str | Path) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"seed-{res.seed}.toml"
    path.write_text(res.scenario_toml)
    return path


Progress = Callable[[RunResult], None]
