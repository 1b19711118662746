"""``kvferry select``: which KV transfer flow for a deployment, and what it does to TTFT.

Simulates every applicable flow (direct, ring, pinned, pull, push) of P prefill and D decode instances over
a workload (a concurrency sweep, a Poisson rate or a trace file), through the real core engines
and flows on the simulated fabric, ranks them and recommends one with its knobs.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from kvferry.commands import bad_input, check_output_file, check_seed

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


def register(app: typer.Typer) -> None:
    @app.command("select")
    def select_cmd(
        model: Annotated[
            str,
            typer.Option(help="Model preset: qwen3-8b, llama-3.1-70b, deepseek-v3, qwen3.5-397b-a17b."),
        ] = "qwen3-8b",
        prefill_tp: Annotated[int, typer.Option("--prefill-tp", help="Prefill instance's TP size.")] = 4,
        decode_tp: Annotated[int, typer.Option("--decode-tp", help="Decode instance's TP size.")] = 2,
        prefill_page_size: Annotated[int, typer.Option(help="Prefill's tokens per KV page.")] = 16,
        decode_page_size: Annotated[int, typer.Option(help="Decode's tokens per KV page.")] = 16,
        gpu: Annotated[str, typer.Option(help="GPU profile: h100, h200 or gb200.")] = "h100",
        nic: Annotated[
            str, typer.Option(help="NIC profile: nic-100g/200g/400g, or fitted (kvferry calibrate).")
        ] = "nic-400g",
        flows: Annotated[
            str, typer.Option(help="Flows to compare, comma-separated (default: every applicable one).")
        ] = "",
        isl: Annotated[int, typer.Option(help="Input tokens per request.")] = 1000,
        osl: Annotated[int, typer.Option(help="Output tokens per request.")] = 100,
        concurrency: Annotated[
            str, typer.Option(help="Closed-loop concurrency sweep, comma-separated (e.g. 1,8,64).")
        ] = "8",
        rate: Annotated[
            float, typer.Option(help="Poisson arrivals per second instead of a concurrency sweep (0: off).")
        ] = 0.0,
        trace: Annotated[
            Path | None, typer.Option(help="Request trace (JSONL or CSV) instead of a generated workload.")
        ] = None,
        scenario: Annotated[
            Path | None,
            typer.Option(
                help="Take model, TP, page sizes, workers, chunk size and lengths from a scenario file, "
                "and its [deploy] table's knobs (gpu, max_batch, ...): the file's values win over "
                "these options."
            ),
        ] = None,
        requests: Annotated[int, typer.Option(help="Requests per load point.")] = 64,
        instances: Annotated[
            int, typer.Option(help="Prefill and decode instances, as many of each (see the next two).")
        ] = 1,
        prefill_instances: Annotated[
            int | None,
            typer.Option(help="Prefill instances (default: --instances); requests go round-robin."),
        ] = None,
        decode_instances: Annotated[
            int | None,
            typer.Option(help="Decode instances (default: --instances); each request to the least loaded."),
        ] = None,
        decode_ep: Annotated[
            int,
            typer.Option(
                help="Expert parallelism over the decode instances (DEP: each an attention-DP rank, "
                "the routed experts spread over this many of them)."
            ),
        ] = 1,
        chunk_tokens: Annotated[
            int,
            typer.Option(help="Chunked prefill size in tokens: a chunk, and a prefill step's token budget."),
        ] = 2048,
        workers: Annotated[int, typer.Option(help="Transfer queues (one worker each) per prefill rank.")] = 2,
        staging_chunks: Annotated[int, typer.Option(help="Ring and pinned pools hold this many chunks.")] = 4,
        max_batch: Annotated[int, typer.Option(help="Decode's largest batch.")] = 256,
        ttft_slo_ms: Annotated[float, typer.Option(help="TTFT SLO for goodput, in ms.")] = 2000.0,
        tpot_slo_ms: Annotated[float, typer.Option(help="TPOT SLO for goodput, in ms.")] = 100.0,
        fp8_weights: Annotated[bool, typer.Option(help="FP8 weights (1 byte each) instead of BF16.")] = False,
        seed: Annotated[int, typer.Option(help="Seed of the arrivals and of every simulated run.")] = 1,
        control_path: Annotated[
            str,
            typer.Option(
                help="Fitted profile (kvferry calibrate --rooms) whose per-room control path the runtime "
                "pays over the NIC's wire; default: an ideal runtime."
            ),
        ] = "",
        pull_orchestration: Annotated[
            str,
            typer.Option(
                help="When the pull flow's decode side starts: overlapped (decode opens the room at "
                "arrival, READs overlap prefill) or serial (vLLM's proxy order: after prefill finished, "
                "--proxy-hop-ms and decode's running step)."
            ),
        ] = "overlapped",
        proxy_hop_ms: Annotated[
            float,
            typer.Option(
                help="Serial pull: prefill's response to the proxy plus the proxy's request to decode, "
                "in ms (not published: sweep it)."
            ),
        ] = 5.0,
        page_allocator: Annotated[
            str,
            typer.Option(
                help="How servers hand out KV pages: sglang (SGLang's disaggregated servers: a sorted "
                "free list, decode taking pages for generated tokens) or lowest-first (the original model)."
            ),
        ] = "sglang",
        decode_reserved_tokens: Annotated[
            int,
            typer.Option(
                help="SGLang's --num-reserved-decode-tokens (sglang allocator): decode admits a request "
                "only with this many tokens to spare for it and each request it holds; when a step still "
                "finds no page, it retracts requests (KV swapped to host)."
            ),
        ] = 512,
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
        plot: Annotated[Path | None, typer.Option(help="Write PNG plots here (needs matplotlib).")] = None,
    ) -> None:
        """Simulate every applicable flow for a deployment and recommend one (ranked table, knobs)."""
        from rich.console import Console

        from kvferry.core.errors import KvferryError
        from kvferry.sim.deploy import workload as wl
        from kvferry.sim.deploy.select import LoadPoint, applicable_flows, select
        from kvferry.sim.deploy.spec import (
            FLOWS,
            MAX_INSTANCES,
            MAX_PROXY_HOP_MS,
            MAX_RESERVED_TOKENS,
            PULL_ORCHESTRATIONS,
            DeploySpec,
        )
        from kvferry.sim.pages import ALLOCATORS

        check_seed(seed)
        if plot is not None:
            check_output_file(plot, "--plot")
            from kvferry.commands.extras import require

            require("plots", "--plot")
        deploy: dict[str, Any] = {}
        if scenario is not None:
            got = _from_scenario(scenario)
            model, prefill_tp, decode_tp = got["model"], got["prefill_tp"], got["decode_tp"]
            prefill_page_size, decode_page_size = got["prefill_page_size"], got["decode_page_size"]
            workers, chunk_tokens, isl, requests = (
                got["workers"],
                got["chunk_tokens"],
                got["isl"],
                got["requests"],
            )
            deploy = got["deploy"]
        _bounded(prefill_tp, "--prefill-tp", 1, MAX_TP)
        _bounded(decode_tp, "--decode-tp", 1, MAX_TP)
        _bounded(prefill_page_size, "--prefill-page-size", 1, 1024)
        _bounded(decode_page_size, "--decode-page-size", 1, 1024)
        _bounded(isl, "--isl", 1, MAX_TOKENS)
        _bounded(osl, "--osl", 1, MAX_TOKENS)
        _bounded(requests, "--requests", 1, MAX_REQUESTS)
        _bounded(instances, "--instances", 1, MAX_INSTANCES)
        prefill_instances = instances if prefill_instances is None else prefill_instances
        decode_instances = instances if decode_instances is None else decode_instances
        _bounded(prefill_instances, "--prefill-instances", 1, MAX_INSTANCES)
        _bounded(decode_instances, "--decode-instances", 1, MAX_INSTANCES)
        _bounded(chunk_tokens, "--chunk-tokens", 1, MAX_TOKENS)
        _bounded(workers, "--workers", 1, 64)
        _bounded(staging_chunks, "--staging-chunks", *KNOB_BOUNDS["staging_chunks"])
        _bounded(max_batch, "--max-batch", *KNOB_BOUNDS["max_batch"])
        _positive(ttft_slo_ms, "--ttft-slo-ms")
        _positive(tpot_slo_ms, "--tpot-slo-ms")
        if not (math.isfinite(rate) and rate >= 0):
            bad_input(f"--rate must be a number >= 0, got {rate}")
        if pull_orchestration not in PULL_ORCHESTRATIONS:
            bad_input(
                f"--pull-orchestration: expected one of {', '.join(PULL_ORCHESTRATIONS)}, "
                f"got {pull_orchestration!r}"
            )
        if not (math.isfinite(proxy_hop_ms) and 0 <= proxy_hop_ms <= MAX_PROXY_HOP_MS):
            bad_input(f"--proxy-hop-ms must be in [0, {MAX_PROXY_HOP_MS:g}], got {proxy_hop_ms}")
        _bounded(decode_reserved_tokens, "--decode-reserved-tokens", 0, MAX_RESERVED_TOKENS)
        if page_allocator not in ALLOCATORS:
            bad_input(f"--page-allocator: expected one of {', '.join(ALLOCATORS)}, got {page_allocator!r}")
        want = [f.strip() for f in flows.split(",") if f.strip()]
        for f in want:
            if f not in FLOWS:
                bad_input(f"--flows: expected names from {', '.join(FLOWS)}, got {f!r}")
        spec = DeploySpec(
            model=model,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            prefill_page_size=prefill_page_size,
            decode_page_size=decode_page_size,
            gpu=gpu,
            nic=nic,
            chunk_tokens=chunk_tokens,
            workers=workers,
            staging_chunks=staging_chunks,
            max_batch=max_batch,
            weight_bytes=1 if fp8_weights else 2,
            ttft_slo_ms=ttft_slo_ms,
            tpot_slo_ms=tpot_slo_ms,
            seed=seed,
            prefill_instances=prefill_instances,
            decode_instances=decode_instances,
            decode_ep=decode_ep,
            control_path=control_path,
            pull_orchestration=pull_orchestration,
            proxy_hop_ms=proxy_hop_ms,
            page_allocator=page_allocator,
            decode_reserved_tokens=decode_reserved_tokens,
        )
        # The file's [deploy] wins over the options, given or default, as its model and TP do.
        spec = replace(spec, **deploy)
        try:
            spec.check()
            staged = set(want) - set(applicable_flows(spec))
            if staged:
                bad_input(
                    f"--flows: equal TP moves whole token rows without staging; {', '.join(sorted(staged))} "
                    f"does not apply (applicable: {', '.join(applicable_flows(spec))})"
                )
            if trace is not None:
                reqs = wl.load_trace(trace)
                if len(reqs) > MAX_REQUESTS:
                    bad_input(f"--trace: at most {MAX_REQUESTS:,} requests, got {len(reqs):,}")
                if (
                    max(r.input_tokens for r in reqs) > MAX_TOKENS
                    or max(r.output_tokens for r in reqs) > MAX_TOKENS
                ):
                    bad_input(f"--trace: tokens per request must be at most {MAX_TOKENS:,}")
                points = [LoadPoint(f"trace {trace.name}", wl.Arrivals(requests=reqs))]
            elif rate > 0:
                reqs = wl.poisson(rate, requests, isl, osl, seed)
                points = [LoadPoint(f"{rate:g} req/s", wl.Arrivals(requests=reqs))]
            else:
                points = []
                for c in _ints(concurrency, "--concurrency"):
                    arr, lengths = wl.closed_loop(c, requests, isl, osl, seed)
                    points.append(LoadPoint(f"c={c}", arr, lengths, concurrency=c))
            # Fail on an impossible deployment (weights that do not fit) before the long run.
            spec.pages("prefill")
            spec.pages("decode")
        except KvferryError as e:
            bad_input(str(e))
        from kvferry.commands import progress

        lines = progress.Lines("kvferry select")  # on stderr, with --json too; Ctrl-C quotes the last
        try:
            with progress.interrupted_says(lines.summary):
                sel = select(spec, points, want or applicable_flows(spec), progress=lines)
        except KvferryError as e:
            bad_input(str(e))
        if plot is not None:
            from kvferry.sim.deploy.report import plot as draw

            try:
                draw(sel, plot)
            except OSError as e:
                bad_input(f"--plot {plot}: cannot write: {e}")
        if as_json:
            sys.stdout.write(json.dumps(_nan_safe(sel.as_dict())) + "\n")
        else:
            from kvferry.sim.deploy.report import table

            table(sel, Console())
            if plot is not None:
                Console().print(f"plots written to {plot}")
        bad = any(r.violations for rs in sel.results.values() for r in rs)
        if bad:
            raise typer.Exit(1)


def _nan_safe(x: Any) -> Any:
    """JSON has no NaN: a percentile of no values is null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_nan_safe(v) for v in x]
    return x
