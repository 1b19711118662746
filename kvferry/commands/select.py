"""``kvferry select``: which KV transfer flow for a deployment, what it does to TTFT, and how many
instances of each side serve a rate within the SLOs.

Simulates every applicable flow (direct, ring, pinned, pull, push) of P prefill and D decode
instances over a workload (a concurrency sweep, a steady Poisson rate or a workload file), through
the real core engines and flows on the simulated fabric, ranks them and recommends one with its
knobs. With ``--rate`` and no instance counts (or ``--capacity``), it searches the instance
counts, TP sizes and flows instead (sim/deploy/capacity.py).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import typer

from kvferry.commands import bad_input, check_output_file, check_seed, progress
from kvferry.commands.options import Json, options
from kvferry.commands.progress import interrupted_says

# Bounds that keep one run to minutes on a laptop-class machine, not to hours.
MAX_REQUESTS = 100_000  # requests per load point
MAX_TOKENS = 1 << 20  # input or output tokens of a request
MAX_CONCURRENCY = 100_000
MAX_POINTS = 32  # load points in a sweep
MAX_TP = 64
# Bounds of the spec's knobs that an option or a scenario's [deploy] may set and that
# DeploySpec.check() leaves open above.
KNOB_BOUNDS: dict[str, tuple[int, int]] = {"staging_chunks": (1, 1024), "max_batch": (1, 65536)}


def _ints(text: str, option: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        bad_input(f"{option}: expected comma-separated integers, got {text!r}")
    if not out:
        bad_input(f"{option}: expected at least one value")
    if len(out) > MAX_POINTS:
        bad_input(f"{option}: at most {MAX_POINTS} values, got {len(out)}")
    for x in out:
        if not 1 <= x <= MAX_CONCURRENCY:
            bad_input(f"{option}: each value must be in [1, {MAX_CONCURRENCY}], got {x}")
    return out


def _bounded(value: int, option: str, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        bad_input(f"{option} must be in [{lo}, {hi}], got {value}")


def _positive(value: float, option: str) -> None:
    if not (math.isfinite(value) and value > 0):
        bad_input(f"{option} must be a positive number, got {value}")


def _from_scenario(path: Path) -> dict[str, Any]:
    """The deployment and workload a scenario file describes (model preset, TP, page sizes,
    workers, chunk size, the largest room as input length, its rooms as requests), and its
    [deploy] knobs under "deploy" (checked by the loader, bounded here as the options are)."""
    from kvferry.core.geometry import PRESETS
    from kvferry.sim import scenario as sc
    from kvferry.sim.scenario_deploy import spec_fields

    try:
        s = sc.load(path)
    except sc.ScenarioError as e:
        bad_input(str(e))
    if s.model.name not in PRESETS:
        known = ", ".join(sorted(PRESETS))
        bad_input(f"--scenario {path}: model {s.model.name!r} is not a preset (compute needs one of {known})")
    for key, (lo, hi) in KNOB_BOUNDS.items():
        if key in s.deploy:
            _bounded(s.deploy[key], f"{path}: [deploy].{key}", lo, hi)
    w = s.workload
    return {
        **spec_fields(s),
        "isl": max([r.tokens for r in w.explicit] or [w.tokens_max]),
        "requests": max(1, w.rooms),
        "deploy": dict(s.deploy),
    }


@dataclass(frozen=True)
class DeployOpts:
    """The deployment: model, TP and pages of each side, hardware, flows compared."""

    model: Annotated[
        str,
        typer.Option(help="Model preset: qwen3-8b, llama-3.1-70b, deepseek-v3, qwen3.5-397b-a17b."),
    ] = "qwen3-8b"
    prefill_tp: Annotated[
        str, typer.Option("--prefill-tp", help="Prefill instance's TP size; a list (4,8) searches them.")
    ] = "4"
    decode_tp: Annotated[
        str, typer.Option("--decode-tp", help="Decode instance's TP size; a list (4,8) searches them.")
    ] = "2"
    prefill_page_size: Annotated[int, typer.Option(help="Prefill's tokens per KV page.")] = 16
    decode_page_size: Annotated[int, typer.Option(help="Decode's tokens per KV page.")] = 16
    gpu: Annotated[str, typer.Option(help="GPU profile: h100, h200 or gb200.")] = "h100"
    nic: Annotated[
        str, typer.Option(help="NIC profile: nic-100g/200g/400g, or fitted (kvferry calibrate).")
    ] = "nic-400g"
    flows: Annotated[
        str, typer.Option(help="Flows to compare, comma-separated (default: every applicable one).")
    ] = ""


@dataclass(frozen=True)
class LoadOpts:
    """The workload: request lengths and arrivals (a sweep, a rate or a file), or a scenario's."""

    isl: Annotated[int, typer.Option(help="Input tokens per request.")] = 1000
    osl: Annotated[int, typer.Option(help="Output tokens per request.")] = 100
    concurrency: Annotated[
        str | None, typer.Option(help="Closed-loop concurrency sweep, comma-separated (default 8).")
    ] = None
    rate: Annotated[
        float,
        typer.Option(
            help="Poisson arrivals per second, run for --duration-s in steady state (0: off). "
            "Without instance counts: the capacity search for this rate."
        ),
    ] = 0.0
    duration_s: Annotated[
        float | None, typer.Option("--duration-s", help="Seconds of arrivals at --rate (default 30).")
    ] = None
    warmup_s: Annotated[
        float | None,
        typer.Option(
            "--warmup-s", help="Arrivals not measured, from the start (default: a third, at most 10 s)."
        ),
    ] = None
    workload: Annotated[
        Path | None,
        typer.Option(help="Requests from a file (JSONL or CSV: arrival_s, input_tokens, output_tokens)."),
    ] = None
    trace: Annotated[Path | None, typer.Option(hidden=True)] = None
    scenario: Annotated[
        Path | None,
        typer.Option(
            help="Take model, TP, page sizes, workers, chunk size and lengths from a scenario file, "
            "and its [deploy] table's knobs (gpu, max_batch, ...): the file's values win over "
            "these options."
        ),
    ] = None
    requests: Annotated[int | None, typer.Option(help="Requests per concurrency point (default 64).")] = None


@dataclass(frozen=True)
class ServeOpts:
    """How the deployment serves: instances and routing, batching, SLOs, seeds."""

    instances: Annotated[
        int | None, typer.Option(help="Prefill and decode instances, as many of each (see the next two).")
    ] = None
    prefill_instances: Annotated[
        int | None,
        typer.Option(help="Prefill instances (default: --instances); requests go round-robin."),
    ] = None
    decode_instances: Annotated[
        int | None,
        typer.Option(help="Decode instances (default: --instances); each request to the least loaded."),
    ] = None
    router: Annotated[
        str,
        typer.Option(
            help="How requests spread over several instances: least-requests (prefill round-robin, "
            "decode fewest in flight), round-robin, or least-tokens (fewest tokens outstanding)."
        ),
    ] = "least-requests"
    decode_ep: Annotated[
        int,
        typer.Option(
            help="Expert parallelism over the decode instances (DEP: each an attention-DP rank, "
            "the routed experts spread over this many of them)."
        ),
    ] = 1
    chunk_tokens: Annotated[
        int,
        typer.Option(help="Chunked prefill size in tokens: a chunk, and a prefill step's token budget."),
    ] = 2048
    workers: Annotated[int, typer.Option(help="Transfer queues (one worker each) per prefill rank.")] = 2
    staging_chunks: Annotated[int, typer.Option(help="Ring and pinned pools hold this many chunks.")] = 4
    max_batch: Annotated[int, typer.Option(help="Decode's largest batch.")] = 256
    ttft_slo_ms: Annotated[float, typer.Option(help="TTFT SLO for goodput, in ms.")] = 2000.0
    tpot_slo_ms: Annotated[float, typer.Option(help="TPOT SLO for goodput, in ms.")] = 100.0
    fp8_weights: Annotated[bool, typer.Option(help="FP8 weights (1 byte each) instead of BF16.")] = False
    seed: Annotated[int, typer.Option(help="Seed of the arrivals and of every simulated run.")] = 1
    seeds: Annotated[
        int, typer.Option(help="Runs per point, seeds --seed, --seed+1, ...: means with 95% intervals.")
    ] = 1


@dataclass(frozen=True)
class SearchOpts:
    """The capacity search: its target and limits."""

    capacity: Annotated[
        bool, typer.Option("--capacity", help="Search instance counts (and TP lists) for each flow.")
    ] = False
    attainment: Annotated[
        float, typer.Option(help="Share of requests within both SLOs a configuration must reach.")
    ] = 0.9
    max_instances: Annotated[int, typer.Option(help="Capacity search: instances per side, 1..this.")] = 8
    max_gpus: Annotated[int, typer.Option(help="Capacity search: at most this many GPUs (0: no limit).")] = 0
    max_rate_steps: Annotated[
        int,
        typer.Option(
            help="Capacity search: steady-state runs (one rate each) to narrow a configuration's "
            "maximum rate to within 5%."
        ),
    ] = 8
    jobs: Annotated[
        int,
        typer.Option(help="Capacity search: runs at once, each its own process (default: CPUs, at most 4)."),
    ] = 0
    max_rates: Annotated[
        str,
        typer.Option(
            help="Capacity search: whose maximum sustainable rate to narrow: simulated (with --rate, "
            "every configuration simulated at the rate; without, each balanced configuration) or all "
            "(every configuration within the limits: minutes each on two cores)."
        ),
    ] = "simulated"
    cache: Annotated[
        bool,
        typer.Option(
            "--cache/--no-cache",
            help="Capacity search: keep each steady-state run on disk and answer a run asked again "
            "(another plot, --json, the same question) from there; a run is a pure function of its "
            "options and of kvferry's code, and any change to either is a different entry.",
        ),
    ] = True
    cache_dir: Annotated[
        str,
        typer.Option(
            help="Capacity search: where runs are kept (default: $KVFERRY_CACHE_DIR, else "
            "$XDG_CACHE_HOME/kvferry/runs, else ~/.cache/kvferry/runs)."
        ),
    ] = ""


@dataclass(frozen=True)
class RuntimeOpts:
    """The serving runtime's own costs and policies: control path, pull order, page allocation."""

    control_path: Annotated[
        str,
        typer.Option(
            help="Fitted profile (kvferry calibrate --rooms) whose per-room control path the runtime "
            "pays over the NIC's wire; default: an ideal runtime."
        ),
    ] = ""
    pull_orchestration: Annotated[
        str,
        typer.Option(
            help="When the pull flow's decode side starts: overlapped (decode opens the room at "
            "arrival, READs overlap prefill) or serial (vLLM's proxy order: after prefill finished, "
            "--proxy-hop-ms and decode's running step)."
        ),
    ] = "overlapped"
    proxy_hop_ms: Annotated[
        float,
        typer.Option(
            help="Serial pull: prefill's response to the proxy plus the proxy's request to decode, "
            "in ms (not published: sweep it)."
        ),
    ] = 5.0
    page_allocator: Annotated[
        str,
        typer.Option(
            help="How servers hand out KV pages: sglang (SGLang's disaggregated servers: a sorted "
            "free list, decode taking pages for generated tokens) or lowest-first (the original model)."
        ),
    ] = "sglang"
    decode_reserved_tokens: Annotated[
        int,
        typer.Option(
            help="SGLang's --num-reserved-decode-tokens (sglang allocator): decode admits a request "
            "only with this many tokens to spare for it and each request it holds; when a step still "
            "finds no page, it retracts requests (KV swapped to host)."
        ),
    ] = 512
    every_rank: Annotated[
        bool,
        typer.Option(
            help="Simulate every TP rank. By default each instance pair's transfers run on one of "
            "the identical TP groups its ranks split into: the same timings up to the fabric's "
            "jitter (microseconds a hop), 2-3.4x faster."
        ),
    ] = False


@dataclass(frozen=True)
class OutputOpts:
    as_json: Json = False
    plot: Annotated[Path | None, typer.Option(help="The PNG file to write (needs matplotlib).")] = None


class _Sizes(NamedTuple):
    """Values the options leave to a default that depends on others, once checked."""

    requests: int
    prefill_instances: int
    decode_instances: int
    jobs: int
    duration: float
    warmup: float


def register(app: typer.Typer) -> None:
    app.command("select")(select_cmd)


@options(DeployOpts, LoadOpts, ServeOpts, SearchOpts, RuntimeOpts, OutputOpts)
def select_cmd(
    dep: DeployOpts, load: LoadOpts, serve: ServeOpts, find: SearchOpts, rt: RuntimeOpts, out: OutputOpts
) -> None:
    """Simulate every applicable flow for a deployment and recommend one (ranked table, knobs);
    with --rate and no instance counts, search the instance counts that serve that rate."""
    from kvferry.sim.deploy.capacity import Workload

    check_seed(serve.seed)
    if load.trace is not None:
        bad_input("--trace was renamed --workload (an input here; replay's --trace is an output)")
    if out.plot is not None:
        check_output_file(out.plot, "--plot")
        from kvferry.commands.extras import require

        require("plots", "--plot")
    ptps = _ints(dep.prefill_tp, "--prefill-tp")
    dtps = _ints(dep.decode_tp, "--decode-tp")
    search = _is_search(ptps, dtps, load, serve, find)
    deploy: dict[str, Any] = {}
    if load.scenario is not None:
        dep, load, serve, ptps, dtps, deploy = _with_scenario(load.scenario, dep, load, serve)
    sizes = _check_options(ptps, dtps, dep, load, serve, find, rt)
    want = _flow_names(dep.flows)
    # The file's [deploy] wins over the options, given or default, as its model and TP do.
    spec = replace(_spec(dep, serve, rt, sizes, ptps[0], dtps[0]), **deploy)
    _check_deployments(spec, ptps, dtps, want, search)
    # Progress on stderr, with --json too; Ctrl-C quotes the last line.
    lines = progress.Lines("kvferry select")
    seed_list = [serve.seed + i for i in range(serve.seeds)]
    if search:
        steady = Workload(load.isl, load.osl, sizes.duration, sizes.warmup)
        with interrupted_says(lines.summary):
            _capacity(spec, ptps, dtps, want, steady, load.rate, seed_list, find, sizes.jobs, out, lines)
        return
    points, points_for = _load_points(load, spec, sizes, serve.seed)
    with interrupted_says(lines.summary):
        _flows(spec, points, points_for, want, seed_list, out, lines)


def _is_search(ptps: list[int], dtps: list[int], load: LoadOpts, serve: ServeOpts, find: SearchOpts) -> bool:
    """Whether the options ask for the capacity search; refuses options that contradict it or
    each other."""
    given = (
        ("--instances", serve.instances),
        ("--prefill-instances", serve.prefill_instances),
        ("--decode-instances", serve.decode_instances),
    )
    counted = [o for o, v in given if v is not None]
    search = (
        find.capacity
        or len(ptps) > 1
        or len(dtps) > 1
        or (load.rate > 0 and not counted and load.scenario is None)
    )
    _refuse_conflicts(
        rate=load.rate,
        concurrency=load.concurrency,
        requests=load.requests,
        workload=load.workload,
        duration_s=load.duration_s,
        search=search,
        counted=counted,
        scenario=load.scenario,
    )
    if not search and (find.cache_dir or not find.cache):
        name = "--cache-dir" if find.cache_dir else "--no-cache"
        bad_input(f"{name} is the capacity search's (--capacity, or --rate without instance counts)")
    return search


def _with_scenario(
    path: Path, dep: DeployOpts, load: LoadOpts, serve: ServeOpts
) -> tuple[DeployOpts, LoadOpts, ServeOpts, list[int], list[int], dict[str, Any]]:
    """The options with a scenario file's deployment and lengths in place of theirs, the TP sizes,
    and the file's [deploy] knobs."""
    got = _from_scenario(path)
    dep = replace(dep, model=got["model"], prefill_page_size=got["prefill_page_size"],
                  decode_page_size=got["decode_page_size"])  # fmt: skip
    load = replace(
        load, isl=got["isl"], requests=load.requests if load.requests is not None else got["requests"]
    )
    serve = replace(serve, workers=got["workers"], chunk_tokens=got["chunk_tokens"])
    return dep, load, serve, [got["prefill_tp"]], [got["decode_tp"]], got["deploy"]


def _check_options(
    ptps: list[int],
    dtps: list[int],
    dep: DeployOpts,
    load: LoadOpts,
    serve: ServeOpts,
    find: SearchOpts,
    rt: RuntimeOpts,
) -> _Sizes:
    """Every option within its bounds (one error line for the first that is not), in the order
    --help lists them; the defaults that depend on other options, filled in."""
    from kvferry.sim.deploy.spec import MAX_INSTANCES

    for t in ptps:
        _bounded(t, "--prefill-tp", 1, MAX_TP)
    for t in dtps:
        _bounded(t, "--decode-tp", 1, MAX_TP)
    _bounded(dep.prefill_page_size, "--prefill-page-size", 1, 1024)
    _bounded(dep.decode_page_size, "--decode-page-size", 1, 1024)
    _bounded(load.isl, "--isl", 1, MAX_TOKENS)
    _bounded(load.osl, "--osl", 1, MAX_TOKENS)
    n_requests = 64 if load.requests is None else load.requests
    _bounded(n_requests, "--requests", 1, MAX_REQUESTS)
    n_inst = 1 if serve.instances is None else serve.instances
    _bounded(n_inst, "--instances", 1, MAX_INSTANCES)
    prefill_instances = n_inst if serve.prefill_instances is None else serve.prefill_instances
    decode_instances = n_inst if serve.decode_instances is None else serve.decode_instances
    _bounded(prefill_instances, "--prefill-instances", 1, MAX_INSTANCES)
    _bounded(decode_instances, "--decode-instances", 1, MAX_INSTANCES)
    _bounded(serve.chunk_tokens, "--chunk-tokens", 1, MAX_TOKENS)
    _bounded(serve.workers, "--workers", 1, 64)
    _bounded(serve.staging_chunks, "--staging-chunks", *KNOB_BOUNDS["staging_chunks"])
    _bounded(serve.max_batch, "--max-batch", *KNOB_BOUNDS["max_batch"])
    jobs = _check_search(serve, find)
    duration, warmup = _check_load(serve, find, load)
    _check_runtime(rt)
    return _Sizes(n_requests, prefill_instances, decode_instances, jobs, duration, warmup)


def _check_search(serve: ServeOpts, find: SearchOpts) -> int:
    """The capacity search's options checked; the runs it may make at once."""
    from kvferry.sim.deploy.capacity import MAX_RATES
    from kvferry.sim.deploy.spec import MAX_INSTANCES

    _bounded(serve.seeds, "--seeds", 1, MAX_SEEDS)
    _bounded(find.max_instances, "--max-instances", 1, MAX_INSTANCES)
    _bounded(find.max_gpus, "--max-gpus", 0, 1 << 20)
    _bounded(find.max_rate_steps, "--max-rate-steps", 0, 32)
    _bounded(find.jobs, "--jobs", 0, 64)
    if find.max_rates not in MAX_RATES:
        bad_input(f"--max-rates: expected one of {', '.join(MAX_RATES)}, got {find.max_rates!r}")
    return find.jobs or min(4, os.cpu_count() or 1)


def _check_load(serve: ServeOpts, find: SearchOpts, load: LoadOpts) -> tuple[float, float]:
    """The SLOs and the steady load checked; its duration and warm-up."""
    _positive(serve.ttft_slo_ms, "--ttft-slo-ms")
    _positive(serve.tpot_slo_ms, "--tpot-slo-ms")
    if not (math.isfinite(find.attainment) and 0 < find.attainment <= 1):
        bad_input(f"--attainment must be in (0, 1], got {find.attainment}")
    rate = load.rate
    if not (math.isfinite(rate) and 0 <= rate <= MAX_RATE):
        bad_input(f"--rate must be a number >= 0 and at most {MAX_RATE:g}, got {rate}")
    duration = DEFAULT_DURATION_S if load.duration_s is None else load.duration_s
    if not (math.isfinite(duration) and 0 < duration <= MAX_DURATION_S):
        bad_input(f"--duration-s must be in (0, {MAX_DURATION_S:g}], got {duration}")
    warmup = min(DEFAULT_WARMUP_S, duration / 3) if load.warmup_s is None else load.warmup_s
    if not (math.isfinite(warmup) and 0 <= warmup < duration):
        bad_input(f"--warmup-s must be >= 0 and below --duration-s ({duration:g}), got {warmup}")
    if rate > 0 and math.ceil(rate * duration) > MAX_REQUESTS:
        bad_input(f"--rate x --duration-s gives more than {MAX_REQUESTS:,} requests: shorten the run")
    return duration, warmup


def _check_runtime(rt: RuntimeOpts) -> None:
    from kvferry.sim.deploy.spec import MAX_PROXY_HOP_MS, MAX_RESERVED_TOKENS, PULL_ORCHESTRATIONS
    from kvferry.sim.pages import ALLOCATORS

    if rt.pull_orchestration not in PULL_ORCHESTRATIONS:
        bad_input(
            f"--pull-orchestration: expected one of {', '.join(PULL_ORCHESTRATIONS)}, "
            f"got {rt.pull_orchestration!r}"
        )
    if not (math.isfinite(rt.proxy_hop_ms) and 0 <= rt.proxy_hop_ms <= MAX_PROXY_HOP_MS):
        bad_input(f"--proxy-hop-ms must be in [0, {MAX_PROXY_HOP_MS:g}], got {rt.proxy_hop_ms}")
    _bounded(rt.decode_reserved_tokens, "--decode-reserved-tokens", 0, MAX_RESERVED_TOKENS)
    if rt.page_allocator not in ALLOCATORS:
        bad_input(f"--page-allocator: expected one of {', '.join(ALLOCATORS)}, got {rt.page_allocator!r}")


def _flow_names(flows: str) -> list[str]:
    from kvferry.sim.deploy.spec import FLOWS

    want = [f.strip() for f in flows.split(",") if f.strip()]
    for f in want:
        if f not in FLOWS:
            bad_input(f"--flows: expected names from {', '.join(FLOWS)}, got {f!r}")
    return want


def _spec(dep: DeployOpts, serve: ServeOpts, rt: RuntimeOpts, sizes: _Sizes, ptp: int, dtp: int) -> Any:
    from kvferry.sim.deploy.spec import DeploySpec

    return DeploySpec(
        model=dep.model,
        prefill_tp=ptp,
        decode_tp=dtp,
        prefill_page_size=dep.prefill_page_size,
        decode_page_size=dep.decode_page_size,
        gpu=dep.gpu,
        nic=dep.nic,
        chunk_tokens=serve.chunk_tokens,
        workers=serve.workers,
        staging_chunks=serve.staging_chunks,
        max_batch=serve.max_batch,
        weight_bytes=1 if serve.fp8_weights else 2,
        ttft_slo_ms=serve.ttft_slo_ms,
        tpot_slo_ms=serve.tpot_slo_ms,
        seed=serve.seed,
        prefill_instances=sizes.prefill_instances,
        decode_instances=sizes.decode_instances,
        decode_ep=serve.decode_ep,
        control_path=rt.control_path,
        pull_orchestration=rt.pull_orchestration,
        proxy_hop_ms=rt.proxy_hop_ms,
        page_allocator=rt.page_allocator,
        decode_reserved_tokens=rt.decode_reserved_tokens,
        router=serve.router,
        every_rank=rt.every_rank,
    )


def _check_deployments(spec: Any, ptps: list[int], dtps: list[int], want: list[str], search: bool) -> None:
    """Fail on an impossible deployment (weights that do not fit, a flow that does not apply)
    before the long run."""
    from kvferry.core.errors import KvferryError
    from kvferry.sim.deploy.select import applicable_flows

    try:
        for ptp in ptps:
            for dtp in dtps:
                each = replace(spec, prefill_tp=ptp, decode_tp=dtp)
                each.check()
                each.pages("prefill")
                each.pages("decode")
                staged = set(want) - set(applicable_flows(each))
                if staged and not search:
                    bad_input(
                        f"--flows: {', '.join(sorted(staged))} does not apply to TP{ptp} -> TP{dtp} "
                        f"(applicable: {', '.join(applicable_flows(each))}; equal TP moves whole "
                        "token rows without staging, unequal TP is not simulated layer-wise)"
                    )
    except KvferryError as e:
        bad_input(str(e))


def _load_points(
    load: LoadOpts, spec: Any, sizes: _Sizes, seed: int
) -> tuple[list[Any], Callable[[int], list[Any]]]:
    """The load points of ``seed``, and how to draw those of any seed: the workload file's, a
    steady Poisson rate, or a concurrency sweep."""
    from kvferry.core.errors import KvferryError
    from kvferry.sim.deploy import workload as wl
    from kvferry.sim.deploy.select import LoadPoint
    from kvferry.sim.deploy.steady import queue_limit

    isl, osl, rate = load.isl, load.osl, load.rate
    try:
        if load.workload is not None:
            fixed = [
                LoadPoint(f"workload {load.workload.name}", wl.Arrivals(requests=_workload(load.workload)))
            ]

            def points_for(_seed: int) -> list[LoadPoint]:
                return fixed
        elif rate > 0:
            n = max(16, math.ceil(rate * sizes.duration))

            def points_for(s: int) -> list[LoadPoint]:
                reqs = wl.poisson(rate, n, isl, osl, s)
                return [
                    LoadPoint(
                        f"{rate:g} req/s",
                        wl.Arrivals(requests=reqs),
                        warmup_ns=int(sizes.warmup * 1e9),
                        queue_limit=queue_limit(rate, spec.ttft_slo_ms),
                    )
                ]
        else:
            sweep = _ints(load.concurrency or "8", "--concurrency")

            def points_for(s: int) -> list[LoadPoint]:
                out = []
                for c in sweep:
                    arr, lengths = wl.closed_loop(c, sizes.requests, isl, osl, s)
                    out.append(LoadPoint(f"c={c}", arr, lengths, concurrency=c))
                return out

        points = points_for(seed)
    except KvferryError as e:
        bad_input(str(e))
    return points, points_for


def _workload(path: Path) -> list[Any]:
    from kvferry.sim.deploy import workload as wl

    reqs = wl.load_trace(path)
    if len(reqs) > MAX_REQUESTS:
        bad_input(f"--workload: at most {MAX_REQUESTS:,} requests, got {len(reqs):,}")
    if max(r.input_tokens for r in reqs) > MAX_TOKENS or max(r.output_tokens for r in reqs) > MAX_TOKENS:
        bad_input(f"--workload: tokens per request must be at most {MAX_TOKENS:,}")
    return reqs


MAX_SEEDS = 32
MAX_RATE = 1e6  # requests per second
DEFAULT_DURATION_S = 30.0
DEFAULT_WARMUP_S = 10.0
MAX_DURATION_S = 3600.0


def _refuse_conflicts(
    *,
    rate: float,
    concurrency: str | None,
    requests: int | None,
    workload: Path | None,
    duration_s: float | None,
    search: bool,
    counted: list[str],
    scenario: Path | None,
) -> None:
    """Workload options that contradict each other: one error line naming both."""
    if workload is not None:
        for name, given in (
            ("--rate", rate > 0),
            ("--concurrency", concurrency is not None),
            ("--duration-s", duration_s is not None),
            ("--requests", requests is not None),
            ("--capacity", search),
        ):
            if given:
                bad_input(f"--workload gives the arrivals: {name} does not apply with it")
    if rate > 0 and concurrency is not None:
        bad_input("--rate (open loop) and --concurrency (closed loop) are two workloads: give one")
    if rate > 0 and requests is not None:
        bad_input("--rate runs rate x --duration-s requests: --requests is for --concurrency")
    if duration_s is not None and rate <= 0 and not search:
        bad_input("--duration-s needs --rate (or --capacity)")
    if search and concurrency is not None:
        bad_input("the capacity search runs Poisson arrivals: --concurrency does not apply with it")
    if search and counted:
        bad_input(f"the capacity search chooses the instance counts: {counted[0]} does not apply with it")
    if search and scenario is not None:
        bad_input("the capacity search takes its deployment from the options: --scenario does not apply")


def _flows(
    spec: Any,
    points: Any,
    points_for: Any,
    want: list[str],
    seeds: list[int],
    out: OutputOpts,
    progress: Any,
) -> None:
    from kvferry.core.errors import KvferryError
    from kvferry.sim.deploy import report
    from kvferry.sim.deploy.select import applicable_flows, select

    try:
        sel = select(spec, points, want or applicable_flows(spec), progress, seeds, points_for)
    except KvferryError as e:
        bad_input(str(e))
    _render(out, lambda path: report.plot(sel, path), sel.as_dict, lambda console: report.table(sel, console))
    if any(r.violations for rs in sel.results.values() for r in rs):
        raise typer.Exit(1)


def _capacity(
    spec: Any,
    ptps: list[int],
    dtps: list[int],
    want: list[str],
    steady: Any,
    rate: float,
    seeds: list[int],
    find: SearchOpts,
    jobs: int,
    out: OutputOpts,
    progress: Any,
) -> None:
    from kvferry.core.errors import KvferryError
    from kvferry.sim.deploy import report
    from kvferry.sim.deploy.capacity import search
    from kvferry.sim.deploy.select import applicable_flows, nic_dict

    def flows_of(s: Any) -> list[str]:
        ok = applicable_flows(s)
        return [f for f in want if f in ok] if want else list(ok)

    cache = _run_cache(find)
    try:
        cap = search(
            spec, [(p, d) for p in ptps for d in dtps], flows_of, steady, rate if rate > 0 else None, seeds,
            find.attainment, find.max_instances, find.max_gpus or 1 << 30, find.max_rate_steps, progress,
            jobs, find.max_rates, cache,
        )  # fmt: skip
    except KvferryError as e:
        bad_input(str(e))
    if cache is not None:
        print(cache.summary(), file=sys.stderr)

    def as_dict() -> dict[str, Any]:
        answered = cap.answer.spec(spec) if cap.answer is not None else spec  # as the table says
        deployment = {k: getattr(answered, k) for k in answered.__slots__}
        kept = None
        if cache is not None:
            kept = {"dir": str(cache.root), "kept": cache.hits, "simulated": cache.misses}
        return {
            "mode": "capacity",
            "deployment": deployment,
            "nic": nic_dict(spec.nic),
            **cap.as_dict(),
            "run_cache": kept,
        }

    _render(
        out,
        lambda path: report.plot_capacity(cap, spec, path),
        as_dict,
        lambda console: report.capacity_table(cap, spec, console),
    )
    if any(r.violations for c in cap.candidates for r in c.results):
        raise typer.Exit(1)


def _run_cache(find: SearchOpts) -> Any:
    """The run cache the options ask for (None: --no-cache). A directory named with --cache-dir
    that cannot be made is an error; the default one is a warning, and the search runs without."""
    from kvferry.sim.deploy.run_cache import RunCache, default_dir

    if not find.cache:
        return None
    root = Path(find.cache_dir) if find.cache_dir else default_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK):
            raise PermissionError(f"not writable: {root}")
    except OSError as e:
        if find.cache_dir:
            bad_input(f"--cache-dir: cannot keep runs in {root}: {e}")
        print(f"warning: run cache off ({root}: {e}); --cache-dir keeps runs elsewhere", file=sys.stderr)
        return None
    return RunCache(root)


def _render(
    out: OutputOpts,
    draw: Callable[[Path], None],
    as_dict: Callable[[], dict[str, Any]],
    table: Callable[[Any], None],
) -> None:
    """The plots if asked for, then the result as one JSON line or as a table."""
    from rich.console import Console

    if out.plot is not None:
        try:
            draw(out.plot)
        except OSError as e:
            bad_input(f"--plot {out.plot}: cannot write: {e}")
    if out.as_json:
        sys.stdout.write(json.dumps(_nan_safe(as_dict())) + "\n")
    else:
        table(Console())
        if out.plot is not None:
            Console().print(f"plot written to {out.plot}")


def _nan_safe(x: Any) -> Any:
    """JSON has no NaN: a percentile of no values is null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_nan_safe(v) for v in x]
    return x
