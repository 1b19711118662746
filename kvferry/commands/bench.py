"""``kvferry bench nixl``: kvferry over real NIXL vs a raw single-descriptor WRITE, same processes."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from kvferry.commands import bad_input, check_output_dir, check_output_file, extras, progress
from kvferry.commands.options import options

# The runtime bench's flows (kvferry/tools/runtime_bench.py FLOWS, which imports NIXL): named here so
# that --help lists them in an environment without the real extra; a test keeps the two equal.
BENCH_FLOWS = ("direct", "ring", "pinned", "pull", "push", "layerwise", "policy")

bench_app = typer.Typer(
    help="Benchmarks that measure their own baseline in the same run.", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")


@dataclass(frozen=True)
class NixlRoomOpts:
    """Which configurations run, and the rooms each moves."""

    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per configuration.")] = False
    config: Annotated[
        list[str] | None, typer.Option("--config", help="Only these configurations, e.g. 'tp1->1 nhd'.")
    ] = None
    rooms: Annotated[int, typer.Option(help="Timed rooms per configuration (0: its default).")] = 0
    tokens: Annotated[int, typer.Option(help="Tokens per room (of --model's KV).")] = 4096
    model: Annotated[
        str, typer.Option(help="Model preset whose KV geometry the rooms have, e.g. llama-3.1-70b.")
    ] = "qwen3-8b"
    chunk_tokens: Annotated[int, typer.Option(help="Tokens per prefill chunk (0: one chunk).")] = 0
    mem: Annotated[str, typer.Option(help="DRAM, or VRAM (torch CUDA pools, one GPU).")] = "DRAM"
    inflight: Annotated[int, typer.Option(help="Rooms in flight at once (a batch).")] = 1
    worker_chunks: Annotated[
        int, typer.Option(help="Chunks whose writes a prefill worker keeps in flight (1: one at a time).")
    ] = 1


@dataclass(frozen=True)
class NixlRuntimeOpts:
    """How the runtime runs: polling, recording, GPUs, descriptors, flows and executor."""

    switch_interval_us: Annotated[
        float,
        typer.Option(
            help="sys.setswitchinterval of both bench processes in microseconds (0: Python's 5 ms): "
            "how long a woken thread may wait for the GIL."
        ),
    ] = 0.0
    active_poll_us: Annotated[
        float,
        typer.Option(
            help="How often (microseconds) the runtime polls NIXL while a room is in flight "
            "(RuntimeConfig.active_idle_max_s). 0 spins, and measured far slower: spinning threads "
            "take the GIL from the ones doing the work."
        ),
    ] = 200.0
    telemetry: Annotated[
        str, typer.Option(help="Write NIXL's per-write telemetry (JSON) to this path (one config).")
    ] = ""
    trace: Annotated[
        str,
        typer.Option(
            help="Record every engine event and command of both processes into this folder (a "
            "subfolder per run: trace.json for ui.perfetto.dev) and print each room's hop timeline."
        ),
    ] = ""
    prefill_gpus: Annotated[
        str, typer.Option(help="VRAM: CUDA_VISIBLE_DEVICES of the prefill process, e.g. '0' or '0,1'.")
    ] = ""
    decode_gpus: Annotated[
        str, typer.Option(help="VRAM: CUDA_VISIBLE_DEVICES of the decode process, e.g. '1'.")
    ] = ""
    direct_post: Annotated[
        str,
        typer.Option(
            help="How descriptors reach NIXL: prepped (index runs into lists prepared once), "
            "oneshot (one descriptor per run, built per post), or auto (oneshot for long runs)."
        ),
    ] = "auto"
    flow: Annotated[
        list[str] | None,
        typer.Option(
            "--flow",
            help=f"Transfer flows to run, comma-separated or repeated: {', '.join(BENCH_FLOWS)} "
            "(policy: the runtime's own choice per room; default: direct,ring,pinned).",
        ),
    ] = None
    engine: Annotated[
        str,
        typer.Option(
            help="Executor of the core's NIXL commands: python, or native (the C engine; falls back "
            "to python, and says so, when it cannot load)."
        ),
    ] = "python"
    handoff: Annotated[
        bool,
        typer.Option(
            help="Time the hand-off instead: decode's TransferInfo already at prefill, from "
            "send(last chunk) to decode's Success."
        ),
    ] = False
    ahead: Annotated[
        bool,
        typer.Option(
            help="Name every chunk's pages before its send (KVSender.plan_ahead): a direct room's "
            "writes are planned and made ready once decode's TransferInfo is in, and send() posts them."
        ),
    ] = False
    process_per_rank: Annotated[
        bool,
        typer.Option(
            "--process-per-rank/--process-per-side",
            help="Each TP rank in a process of its own, as SGLang and vLLM run them; or one process "
            "a side holding all its ranks, which then share one interpreter and CUDA context (the "
            "layout of bench rows before 2026-12-03).",
        ),
    ] = True


@bench_app.command("nixl")
@options(NixlRoomOpts, NixlRuntimeOpts)
def nixl(r: NixlRoomOpts, rt: NixlRuntimeOpts) -> None:
    """Prefill and decode processes on 127.0.0.1 (one a rank, or one a side with
    --process-per-side) move KV rooms of a preset model through kvferry's runtime; the same
    processes then WRITE the same bytes as one NIXL descriptor a rank."""
    extras.require("real", "kvferry bench nixl")
    if r.mem.upper() == "VRAM":
        extras.require("real-gpu", "kvferry bench nixl --mem VRAM")
    # Everything is checked before the first configuration starts: a run is minutes long.
    configs, flows = _check_nixl(r, rt)
    runs = _nixl_runs(configs, flows, replace(r, mem=r.mem.upper()), rt)
    if rt.trace:
        check_output_dir(Path(rt.trace), "--trace")
    if rt.engine == "native":
        from kvferry.backends.nixl.native import describe

        print(f"executor: {describe()}", file=sys.stderr)
    _run_nixl(runs, r.as_json)


def _check_nixl(r: NixlRoomOpts, rt: NixlRuntimeOpts) -> tuple[list[Any], list[str]]:
    """The options checked; the configurations and the flows they ask for."""
    from kvferry.tools.runtime_bench import DEFAULT_CONFIGS, FLOWS

    known = [c.name for c in DEFAULT_CONFIGS]
    unknown = [n for n in r.config or () if n not in known]
    if unknown:
        bad_input(f"--config: unknown configuration(s) {unknown}; known: {known}")
    if r.rooms < 0:
        bad_input(f"--rooms must be >= 0 (0: each configuration's default), got {r.rooms}")
    mem = r.mem.upper()
    if mem not in ("DRAM", "VRAM"):  # the runtime's other kind (TORCH_DRAM) is for its own tests
        bad_input(f"--mem must be DRAM or VRAM, got {mem!r}")
    for name, gpus in (("--prefill-gpus", rt.prefill_gpus), ("--decode-gpus", rt.decode_gpus)):
        if gpus and not all(g.strip().isdigit() for g in gpus.split(",")):
            bad_input(f"{name}: expected GPU indices like '0' or '0,1', got {gpus!r}")
        if gpus and mem != "VRAM":
            bad_input(f"{name} places GPU memory: use it with --mem VRAM")
    flows = [f.strip() for item in rt.flow or ("direct,ring,pinned",) for f in item.split(",") if f.strip()]
    bad = [f for f in flows if f not in FLOWS]
    if bad or not flows:
        bad_input(f"--flow: unknown flow(s) {bad}; known: {list(FLOWS)}")
    configs = [c for c in DEFAULT_CONFIGS if not r.config or c.name in r.config]
    if rt.telemetry:
        check_output_file(Path(rt.telemetry), "--telemetry")
    return configs, flows


def _nixl_runs(configs: list[Any], flows: list[str], r: NixlRoomOpts, rt: NixlRuntimeOpts) -> list[Any]:
    """One run per configuration and flow, each checked."""
    from kvferry.tools.runtime_bench import check_config

    runs = []
    for base in configs:
        for f in flows:
            c = replace(
                base, tokens=r.tokens, model=r.model, chunk_tokens=r.chunk_tokens, mem=r.mem,
                inflight=r.inflight, worker_chunks=r.worker_chunks, switch_interval_us=rt.switch_interval_us,
                active_poll_us=rt.active_poll_us, direct_post=rt.direct_post, engine=rt.engine,
                handoff=rt.handoff, ahead=rt.ahead, flow=f, prefill_gpus=rt.prefill_gpus,
                decode_gpus=rt.decode_gpus, process_per_rank=rt.process_per_rank,
            )  # fmt: skip
            if rt.telemetry:
                one = len(configs) * len(flows) == 1
                where = rt.telemetry if one else f"{rt.telemetry}.{c.prefill_tp}-{c.decode_tp}.{f}"
                c = replace(c, telemetry_path=where)
            c = replace(c, rooms=r.rooms or c.rooms)
            if rt.trace:
                c = replace(c, trace_dir=str(Path(rt.trace) / f"tp{c.prefill_tp}-{c.decode_tp}.{f}"))
            try:
                check_config(c)
            except ValueError as e:
                bad_input(f"{c.name}: {e}")
            runs.append(c)
    return runs


def _run_nixl(runs: list[Any], as_json: bool) -> None:
    from kvferry.tools.runtime_bench import run_config

    finished: list[str] = []
    for i, c in enumerate(runs):
        print(
            f"[{i + 1}/{len(runs)}] {c.name} {c.flow} {c.mem}: {c.rooms} batch(es) of {c.inflight}, "
            f"{'a process a rank' if c.process_per_rank else 'a process a side'}",
            file=sys.stderr,
        )
        if c.trace_dir:
            Path(c.trace_dir).mkdir(parents=True, exist_ok=True)
        so_far = f"{len(finished)} of {len(runs)} configurations done" + (
            f" ({', '.join(finished)}; their rows are printed above)" if finished else ""
        )
        with progress.interrupted_says(lambda so_far=so_far: so_far):
            r = run_config(c)
        finished.append(f"{c.name} {c.flow}")
        for h in r.get("hops", ()):
            print(f"  {h['median_us']:>10.1f} us  {h['label']}  ({h['count']} rooms)", file=sys.stderr)
        if as_json:
            typer.echo(json.dumps(r))
        else:
            _print_nixl_row(r)


def _print_nixl_row(r: dict[str, Any]) -> None:
    typer.echo(
        f"{r['config']:<12} {r['flow']:<7} {r['mem']} {r['tokens']} tokens, {r['room_mb']:.0f} MB/room, "
        f"{r['inflight']} in flight: "
        f"kvferry {r['kvferry_gbps']:.2f} GB/s ({r['kvferry_s'] * 1e3:.1f} ms/batch), "
        f"raw 1-descriptor WRITEs {r['raw_gbps']:.2f} GB/s ({r['raw_s'] * 1e3:.1f} ms), "
        f"ratio {r['ratio']:.2f}; {r['descs_requested']} indices -> {r['descs_posted']} posted "
        f"descriptors per write; bytes {'ok' if r['bytes_ok'] else 'WRONG'}"
    )
    if r["handoff_s"] is not None:
        typer.echo(
            f"{'':<12} hand-off (send(last chunk) -> decode Success): {r['handoff_s'] * 1e3:.2f} ms, "
            f"{r['handoff_ratio']:.2f} of the raw write"
        )
    typer.echo(f"{'':<12} executor: {', '.join(r['executor'])}")
    if r["planned_raw_gbps"] is not None:
        typer.echo(
            f"{'':<12} NIXL alone with the same descriptors: {r['planned_raw_gbps']:.2f} GB/s "
            f"({r['planned_raw_s'] * 1e3:.1f} ms), {r['planned_of_raw']:.2f} of raw; "
            f"kvferry {r['ratio_to_planned']:.2f} of it"
        )


@bench_app.command("interference")
def interference(
    engine: Annotated[str, typer.Option(help="Executor of both endpoints: python or native.")] = "python",
    reps: Annotated[int, typer.Option(help="Repetitions of the absent/idle/busy phases (>= 5 advised).")] = 5,
    phase_s: Annotated[float, typer.Option(help="Seconds per phase.")] = 2.0,
    rate: Annotated[float, typer.Option(help="Rooms per second in the busy phase.")] = 20.0,
    tokens: Annotated[int, typer.Option(help="Tokens per room (qwen3-8b KV, TP 1 -> 1, DRAM).")] = 256,
    engine_poll_us: Annotated[
        float,
        typer.Option(help="Native engine: us between polls while a room is in flight (0: back to back)."),
    ] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="The result as one JSON object.")] = False,
) -> None:
    """A scheduler-like thread shares a process with a prefill and a decode endpoint (real NIXL,
    DRAM); its step rate with the endpoints absent, idle and moving rooms, phases alternated."""
    import math
    import sys

    if engine not in ("python", "native"):
        bad_input(f"--engine must be python or native, got {engine!r}")

    for name, value, lo, hi in (
        ("--reps", reps, 1, 1000),
        ("--phase-s", phase_s, 0.01, 3600.0),
        ("--rate", rate, 0.01, 10_000.0),
        ("--tokens", tokens, 1, 131_072),
        ("--engine-poll-us", engine_poll_us, 0.0, 1e6),
    ):
        if not (math.isfinite(value) and lo <= value <= hi):
            bad_input(f"{name} must be in [{lo:g}, {hi:g}], got {value}")
    extras.require("real", "kvferry bench interference")
    from kvferry.backends.runtime.interference import InterferenceConfig, run

    if engine == "native":
        from kvferry.backends.nixl.native import describe

        print(f"executor: {describe()}", file=sys.stderr)
    cfg = InterferenceConfig(
        engine=engine, reps=reps, phase_s=phase_s, rate=rate, tokens=tokens, engine_poll_us=engine_poll_us
    )
    r = run(cfg)
    if as_json:
        typer.echo(json.dumps(r))
        return
    typer.echo(
        f"executor {', '.join(r['executor'])}: {r['rooms_moved']} rooms moved ({r['rooms_per_s']:.1f}/s, "
        f"{r['rooms_failed']} failed) over {reps} repetitions of {phase_s:g} s phases"
    )
    for p in ("idle", "busy"):
        typer.echo(
            f"  scheduler step rate, endpoints {p}: {r[f'{p}_ratio_median']:.3f} of absent "
            f"(spread {r[f'{p}_ratio_min']:.3f}-{r[f'{p}_ratio_max']:.3f}); median step "
            f"{r[f'{p}_step_us_median']:.0f} us (absent {r['absent_step_us_median']:.0f} us)"
        )
    if r["lost_us_per_room"] is not None:
        typer.echo(
            f"  per room: scheduler time lost {r['lost_us_per_room']:.0f} us, endpoints' Python "
            f"threads' CPU {r['python_cpu_us_per_room']:.0f} us"
        )
