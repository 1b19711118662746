"""``kvferry fuzz``, ``kvferry replay`` and ``kvferry demo``: the simulator from the command line."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvferry.commands import (
    MAX_SEED,
    bad_input,
    check_output_dir,
    check_output_file,
    check_seed,
    extras,
    one_line,
    progress,
)
from kvferry.commands.options import Json, TraceOut, options
from kvferry.sim.executors import MapStats

if TYPE_CHECKING:
    from rich.console import Console

    from kvferry.sim.executors import Executor
    from kvferry.sim.metrics import RunResult
    from kvferry.sim.scenario import Scenario
    from kvferry.sim.world import World

# A job is a process running simulations; past the cores of any machine more of them only thrash.
MAX_JOBS = 256

DEMO_TOML = """
name = "demo"
description = "2 prefill ranks (TP2) -> 1 decode rank (TP1), 36 chunked rooms, a handful of faults"
seed = 0

[model]
name = "sim-tiny"
num_layers = 2
num_kv_heads = 8
head_dim = 8

[topology]
prefill_tp = 2
decode_tp = 1
prefill_pages = 512
decode_pages = 512
workers = 2

[workload]
rooms = 36
tokens_min = 16
tokens_max = 256
chunk_tokens = 64
arrival_mean_us = 800

[faults]
ctrl_drop = 0.03
ctrl_dup = 0.05
ctrl_reorder = 0.05
notif_delay = 0.1
xfer_err = 0.01
abort = 0.03

[[faults.event]]
at_us = 6000
kind = "link_down"
node = "prefill1"
peer = "decode0"
duration_us = 1500

[[faults.event]]
at_us = 12000
kind = "slow_link"
node = "prefill0"
peer = "decode0"
duration_us = 4000
factor = 0.05

[[faults.event]]
at_us = 16000
kind = "crash"
node = "prefill1"
duration_us = 1000

[phases]
fault_window_us = 25000
"""


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f} ms"


def _lat(p: dict[str, int]) -> str:
    if not p:
        return "n/a"
    return " / ".join(f"{k} {_ms(v)}" for k, v in p.items())


def _print_failure_reasons(reasons: dict[str, int], console, top: int = 5) -> None:  # type: ignore[no-untyped-def]
    """One reason a line, whole: reasons hold commas and colons, so a joined line would not read."""
    from rich.markup import escape

    console.print("failed rooms by reason (each room once, as its first failing rank gave it):")
    width = len(str(max(reasons.values())))
    for reason, n in list(reasons.items())[:top]:
        console.print(f"  {n:>{width}}  {escape(reason)}")
    if len(reasons) > top:
        console.print(f"  ... {len(reasons) - top} more reason(s) (--json for all)")


def _deployment_line(d: dict) -> str:
    """``prefill 2 x TP2 -> decode 3 x TP1``, with each server's rooms (succeeded/routed) when a
    side has several."""
    sides = []
    for side in ("prefill", "decode"):
        n = d[f"{side}_instances"]
        sides.append(f"{side} {n} x TP{d[f'{side}_tp']}" if n > 1 else f"{side} TP{d[f'{side}_tp']}")
    line = f"deployment: {' -> '.join(sides)}"
    if _several(d):
        per = ", ".join(f"{k} {v['succeeded']}/{v['rooms']}" for k, v in d["instances"].items())
        line += f"; rooms succeeded/routed per instance: {per}"
    return line


def _several(d: dict) -> bool:
    return bool(d) and (d["prefill_instances"] > 1 or d["decode_instances"] > 1)


def _print_result(res, console, rooms_limit: int = 40) -> None:  # type: ignore[no-untyped-def]
    if res.rooms_detail:
        console.print(_rooms_table(res, rooms_limit))
    if res.deployment:
        console.print(_deployment_line(res.deployment))
    console.print(
        f"rooms: {res.rooms} submitted, [green]{res.succeeded} succeeded[/] "
        f"({'bytes verified' if res.bytes_verified else 'bytes not verified: timing only'}), "
        f"[red]{res.failed} failed[/]"
    )
    if res.failure_reasons:
        _print_failure_reasons(res.failure_reasons, console)
    console.print(f"room latency (arrival -> Success): {_lat(res.room_latency_ns)}")
    console.print(f"write latency (post -> DONE): {_lat(res.write_latency_ns)}")
    console.print(
        f"transfers: {res.transfers} ({res.transfers_err} ERR), {res.bytes_moved:,} bytes, "
        f"{res.descriptors:,} descriptors ({res.descriptors_charged:,} after NIXL merging); "
        f"control messages: {res.control_sent} sent, {res.control_dropped} dropped"
    )
    faults = ", ".join(f"{k} {v}" for k, v in res.faults.items()) or "none"
    console.print(f"faults injected: {faults}")
    console.print(
        # Not the count of a --trace file's events (those are merged into spans, plus track
        # names): this one counts what the hash covers.
        f"simulated {_ms(res.sim_ns)} in {res.wall_s:.2f} s wall, trace hash {res.digest} "
        f"over {res.events:,} simulation events"
    )
    _print_verdict(res, console)


def _rooms_table(res, rooms_limit: int):  # type: ignore[no-untyped-def]
    """The first ``rooms_limit`` rooms: outcome, latency and the first failing rank's reason."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"rooms ({res.rooms})", show_lines=False)
    for col in ("room", "tokens", "chunks", "outcome", "latency", "why (first failing rank)"):
        table.add_column(col)
    for r in res.rooms_detail[:rooms_limit]:
        first = r.first_failing
        table.add_row(
            str(r.key),
            str(r.tokens),
            str(r.chunks),
            "[green]success[/]" if r.outcome == "success" else f"[red]{r.outcome}[/]",
            _ms(r.latency_ns) if r.latency_ns >= 0 else "-",
            escape(f"{first}: {r.reasons[first]}") if first else "",
        )
    if res.rooms > rooms_limit:
        table.caption = f"first {rooms_limit} of {res.rooms} rooms (--json for all)"
    return table


def _print_verdict(res, console) -> None:  # type: ignore[no-untyped-def]
    """The rooms exempt from agreement, then the violations or the invariants that held."""
    if res.agreement_exempt:
        console.print(
            f"agreement not required for {len(res.agreement_exempt)} room(s) (the core cannot "
            f"guarantee it there): {'; '.join(res.agreement_exempt[:5])}"
        )
    if res.violations:
        for v in res.violations[:20]:
            console.print(f"[bold red]VIOLATION[/] {v['invariant']}: {v['detail']}")
        if len(res.violations) > 20:
            console.print(f"... {len(res.violations) - 20} more")
    else:
        checked = "bytes of every Success room, " if res.bytes_verified else ""
        console.print(
            "[bold green]invariants: all held[/] (status monotone, Failed absorbing, write ownership, "
            f"{checked}liveness, conservation, agreement, empty tables, "
            "length mismatches failed, released Success rooms stable"
            + (", every room's traffic on its own servers)" if _several(res.deployment) else ")")
        )


class _Tally:
    """What a campaign's runs add up to, seed by seed as they finish."""

    def __init__(self) -> None:
        from kvferry.sim import campaign as cp

        self.seeds = self.rooms = self.ok = self.failed = self.exempt = 0
        self.faults: Counter[str] = Counter()
        self.violated: Counter[str] = Counter()
        self.failures: list[tuple[RunResult, Path]] = []
        self.coverage = cp.CoverageTally()

    def add(self, res: RunResult, save_dir: Path) -> bool:
        """Count ``res``; a run with a violation is saved as a scenario file (True)."""
        from kvferry.sim import campaign as cp

        self.coverage.add(res)
        self.seeds += 1
        self.rooms += res.rooms
        self.ok += res.succeeded
        self.failed += res.failed
        self.exempt += len(res.agreement_exempt)
        self.faults.update(res.faults)
        if not res.violations:
            return False
        self.violated.update(res.violated())
        try:
            path = cp.save_failure(res, save_dir)
        except OSError as e:
            bad_input(f"--save-dir {save_dir}: cannot save seed {res.seed}: {e}")
        self.failures.append((res, path))
        return True

    def summary(self, seeds: int, wall: float, executor: Executor, stats: MapStats, liveness: bool) -> dict:  # type: ignore[type-arg]
        # Seeds finish in any order on several workers; the report lists them in seed order.
        self.failures.sort(key=lambda rp: rp[0].seed)
        return {
            "seeds": seeds,
            "rooms": self.rooms,
            "succeeded": self.ok,
            "failed": self.failed,
            "faults": dict(sorted(self.faults.items())),
            "agreement_exempt_rooms": self.exempt,
            "violations": dict(sorted(self.violated.items())),
            "failing_seeds": [
                {
                    "seed": r.seed,
                    "invariants": r.violated(),
                    "first": r.violations[0]["detail"],
                    "scenario": str(p),
                    "replay": f"kvferry replay {p}",
                }
                for r, p in self.failures
            ],
            "wall_s": round(wall, 3),
            "seeds_per_minute": round(seeds / wall * 60, 1) if wall > 0 else None,
            "executor": executor.kind,
            "seeds_rerun": stats.resent,  # runs sent again because their worker was lost (each counted once)
            "liveness_class": liveness,
            "coverage": self.coverage.as_dict(liveness),
        }


def _fuzz_campaign(
    executor: Executor,
    seed_list: list[int],
    base: Scenario | None,
    hooks: tuple[str, ...],
    save_dir: Path,
    as_json: bool,
    console: Console,
    liveness: bool = False,
) -> None:
    """Run the seeds on ``executor`` as they finish; report in seed order whatever the executor."""
    from kvferry.sim import campaign as cp

    t0 = time.perf_counter()
    tally = _Tally()
    stats = MapStats(total=len(seed_list))

    def so_far() -> str:
        saved = f"; failing runs saved in {save_dir}/" if tally.failures else ""
        return (
            # The seeds counted here, not the executor's: Ctrl-C may land between the two.
            f"{tally.seeds} of {len(seed_list)} seeds done ({tally.rooms} rooms, {tally.ok} succeeded), "
            f"{len(tally.failures)} with a violation{saved}"
        )

    # The bar is on stderr whatever the report's stream: stdout holds only the report.
    with progress.interrupted_says(so_far), progress.Bar("fuzz", total=len(seed_list)) as bar:

        def show(now: MapStats) -> None:  # after each seed, and when a lost worker's seeds go again
            nonlocal stats
            stats = now
            lost = f", {now.resent} re-run after a lost worker" if now.resent else ""
            bar.update(now.done, f"{len(tally.failures)} failing seed(s){lost}")

        runs = cp.run_seeds(
            seed_list, base=base, hooks=hooks, executor=executor, progress=show, liveness=liveness
        )
        for res in runs:
            if tally.add(res, save_dir):
                show(stats)
    summary = tally.summary(len(seed_list), time.perf_counter() - t0, executor, stats, liveness)
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
    else:
        _print_campaign(summary, tally, executor, stats, console)
    if tally.failures:
        raise typer.Exit(1)


def _print_campaign(
    summary: dict, tally: _Tally, executor: Executor, stats: MapStats, console: Console
) -> None:  # type: ignore[type-arg]
    from kvferry.tools.coverage import table

    console.print(
        f"{summary['seeds']} seeds, {tally.rooms} rooms: {tally.ok} succeeded, {tally.failed} failed "
        f"({summary['seeds_per_minute']} seeds/min on {executor.describe()})"
    )
    if stats.resent:
        console.print(f"{stats.resent} seed run(s) sent again after a lost worker, each counted once")
    console.print(
        "faults injected: " + (", ".join(f"{k} {v}" for k, v in sorted(tally.faults.items())) or "none")
    )
    cov = summary["coverage"]
    for title, key in (("flow", "by_flow"), ("TP", "by_tp"), ("fault (runs that drew it)", "by_fault")):
        for line in table(title, cov[key]):
            console.print(line, markup=False, highlight=False)
    if tally.exempt:
        console.print(
            f"agreement not required for {tally.exempt} room(s): a node holding the room crashed "
            "before both sides settled, or a failure notice was cut off for its whole resend window"
        )
    if not tally.failures:
        console.print("[bold green]no invariant violated[/]")
    else:
        per = ", ".join(f"{k} in {v} seed(s)" for k, v in sorted(tally.violated.items()))
        console.print(f"[bold red]violations[/]: {per}")
    for r, p in tally.failures:
        v = r.violations[0]
        console.print(f"[bold red]seed {r.seed}[/]: {v['invariant']}: {v['detail']}")
        console.print(f"  replay: kvferry replay {p}")


@dataclass(frozen=True)
class FuzzOpts:
    seeds: Annotated[str, typer.Option(help="Seeds to run: 0-999, or 1,5,10-20.")] = "0-99"
    jobs: Annotated[int, typer.Option(help="Worker processes.")] = 1
    ray: Annotated[
        str | None,
        typer.Option(
            metavar="ADDRESS",
            help="Run the seeds on Ray instead: local (start an instance here), auto, HOST:PORT or "
            "ray://HOST:PORT (needs the ray extra).",
        ),
    ] = None
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a report.")] = (
        False
    )
    scenario: Annotated[
        Path | None,
        typer.Option(help="Base scenario (faults drawn per seed); default: deployments drawn too."),
    ] = None
    save_dir: Annotated[Path, typer.Option(help="Where failing runs are written as scenario files.")] = Path(
        "fuzz-failures"
    )
    plant: Annotated[list[str] | None, typer.Option(hidden=True, help="Plant a bug (checker self-test).")] = (
        None
    )
    liveness: Annotated[
        bool,
        typer.Option(
            "--liveness",
            help="Draw only faults the protocol rides out (control drops, duplicates, reordering and "
            "delays, short slow links); every room must end Success.",
        ),
    ] = False


def register(app: typer.Typer) -> None:
    app.command("fuzz")(fuzz)
    app.command("replay")(replay)
    app.command("demo")(demo)


@options(FuzzOpts)
def fuzz(o: FuzzOpts) -> None:
    """Run a seeded fault campaign; exit 1 if any invariant is violated."""
    from rich.console import Console

    from kvferry.sim import executors as ex

    _check_executor(o.jobs, o.ray)
    check_output_dir(o.save_dir, "--save-dir")
    seed_list, base, hooks = _campaign_inputs(o)
    console = Console(stderr=o.as_json)
    try:  # connecting to (or starting) Ray comes last: every cheap check has passed
        executor = ex.make_executor(jobs=o.jobs, ray_address=o.ray)
    except ex.ExecutorError as e:
        bad_input(str(e))
    try:
        with executor:
            _fuzz_campaign(executor, seed_list, base, hooks, o.save_dir, o.as_json, console, o.liveness)
    except ex.WorkerLost as e:  # a finding, not bad input: the run of a seed kills its process
        first, *rest = sorted(e.items)  # type: ignore[type-var]
        then = f" (then {', '.join(map(str, rest))})" if rest else ""
        hint = f"try each seed alone: kvferry fuzz --seeds {first}{then}"
        typer.echo(f"error: {one_line(str(e))}; {hint}", err=True)
        raise typer.Exit(1) from None
    except ex.ExecutorError as e:  # e.g. a node running other kvferry code
        bad_input(str(e))


def _check_executor(jobs: int, ray: str | None) -> None:
    from kvferry.sim import executors as ex

    if not 1 <= jobs <= MAX_JOBS:
        bad_input(f"--jobs must be in [1, {MAX_JOBS}], got {jobs}")
    if ray is not None:
        extras.require("ray", "--ray")
        if jobs != 1:
            bad_input("--jobs and --ray do not go together: Ray spreads the seeds over its cluster's CPUs")
        try:
            ex.check_ray_address(ray)
        except ValueError as e:
            bad_input(str(e))


def _campaign_inputs(o: FuzzOpts) -> tuple[list[int], Scenario | None, tuple[str, ...]]:
    """The seeds, the base scenario and the planted bugs the options give."""
    from kvferry.sim import campaign as cp
    from kvferry.sim import scenario as sc

    try:
        seed_list = cp.parse_seeds(o.seeds)
        base = sc.load(o.scenario) if o.scenario is not None else None
        hooks = tuple(o.plant or ())
        for h in hooks:
            if h not in sc.HOOKS:
                raise sc.ScenarioError(f"--plant: unknown bug {h!r} (known: {', '.join(sc.HOOKS)})")
    except (ValueError, sc.ScenarioError) as e:
        bad_input(str(e))
    if max(seed_list) > MAX_SEED:
        bad_input(f"--seeds: a seed is at most 2**63 - 1, got {max(seed_list)}")
    return seed_list, base, hooks


def replay(
    scenario: Annotated[Path, typer.Argument(help="Scenario TOML file.")],
    seed: Annotated[int | None, typer.Option(help="Override the file's seed.")] = None,
    trace: TraceOut = None,
    as_json: Json = False,
    flow: Annotated[
        str | None,
        typer.Option(
            help="Every room on this flow: policy, direct, ring, pinned, pull, push, layerwise or mixed."
        ),
    ] = None,
) -> None:
    """Run one scenario and report per-room outcomes, latencies, bytes and the invariant verdict."""
    _run_and_report(scenario=scenario, seed=seed, trace=trace, as_json=as_json, flow=flow)


def demo(
    seed: Annotated[int, typer.Option(help="Seed of the demo run.")] = 0,
    trace: TraceOut = None,
    as_json: Json = False,
) -> None:
    """A small P/D deployment (2 prefill ranks, 1 decode rank) under faults, simulated in seconds."""
    _run_and_report(scenario=None, seed=seed, trace=trace, as_json=as_json, demo=True)


def _run_and_report(
    scenario: Path | None,
    seed: int | None,
    trace: Path | None,
    as_json: bool,
    demo: bool = False,
    flow: str | None = None,
) -> None:
    from rich.console import Console

    if seed is not None:
        check_seed(seed)
    if trace is not None:  # checked now: the trace is written after the whole run
        check_output_file(trace, "--trace")
    s = _scenario(scenario, flow, demo)
    console = Console(stderr=as_json)
    if demo and not as_json:
        console.print(
            "[bold]kvferry demo[/]: prefill TP2 -> decode TP1 on a simulated RDMA fabric, "
            f"{s.workload.rooms} rooms, faults: control drop/dup/reorder, notification delay, "
            "transfer ERR, aborts, a link flap, a slow link, a prefill crash + restart"
        )
    res, w, written = _run_traced(s, seed, trace, "replay" if not demo else "demo")
    expected = set(w.scenario.expect_violations)
    unexpected = set(res.violated()) != expected
    if as_json:
        d = res.as_dict(detail=True)
        d["expected_violations"] = sorted(expected)
        d["verdict"] = "fail" if unexpected else "pass"
        if trace is not None:
            d["trace_events"] = written
        sys.stdout.write(json.dumps(d) + "\n")
    else:
        console.print(f"scenario [bold]{w.scenario.name}[/] seed {res.seed}: {w.scenario.description}")
        _print_result(res, console)
        if expected:
            console.print(
                f"expected violations (planted bug): {', '.join(sorted(expected))} -> "
                + ("[green]as expected[/]" if not unexpected else "[red]NOT as expected[/]")
            )
        if trace is not None:
            console.print(f"trace written to {trace}: {written:,} events (open in https://ui.perfetto.dev)")
        if demo:
            console.print(
                "next: [bold]kvferry replay scenarios/crash-and-restart.toml --trace t.json[/], "
                "[bold]kvferry fuzz --seeds 0-199 --jobs 2[/]"
            )
    if unexpected:
        raise typer.Exit(1)


def _scenario(path: Path | None, flow: str | None, demo: bool) -> Scenario:
    """The scenario to run: the demo's or the file's, every room on ``flow`` if given."""
    import tomllib

    from kvferry.sim import scenario as sc

    try:
        s = sc.parse(tomllib.loads(DEMO_TOML), where="demo") if demo else sc.load(path)  # type: ignore[arg-type]
        if flow is not None:
            s = sc.with_flow(s, flow)
    except sc.ScenarioError as e:
        bad_input(str(e))
    return s


def _run_traced(
    s: Scenario, seed: int | None, trace: Path | None, label: str
) -> tuple[RunResult, World, int]:
    """Run ``s`` with a progress bar; write its trace if asked (the events written)."""
    from kvferry.sim import chrome
    from kvferry.sim.campaign import run_one

    written = 0
    taps: list[chrome.NoteTap] = []
    built: list[World] = []

    def before_run(w: World) -> None:
        built.append(w)
        if trace is not None:
            taps.append(chrome.NoteTap(w))

    bar = progress.Bar(label, total=1.0, unit="%")
    with (
        progress.interrupted_says(lambda: _run_so_far(built)),
        bar,
        progress.sampled(lambda: _run_sample(built), bar),
    ):
        res, w = run_one(s, seed=seed, keep_trace=trace is not None, detail=True, before_run=before_run)
    if trace is not None:
        meta = {"scenario": s.name, "seed": res.seed, "digest": res.digest}
        try:
            written = chrome.write(w.trace.events, trace, meta, notes=taps[0].notes)
        except OSError as e:
            bad_input(f"--trace {trace}: cannot write: {e}")
    return res, w, written


def _run_sample(built: list[World]) -> tuple[float, str]:
    """Where a running simulation is (read from another thread; the run itself is not touched):
    the share of its virtual time to the deadline, and its rooms finished."""
    if not built or not built[0].deadline_ns:
        return 0.0, "building"
    w = built[0]
    now = int(w.env.now)
    done = sum(1 for r in w.requests if r.done)
    status = f"{done}/{len(w.requests)} rooms finished, {now / 1e6:.1f} ms simulated"
    return min(now / w.deadline_ns, 1.0), status


def _run_so_far(built: list[World]) -> str:
    if not built:
        return "the scenario was still being built"
    w = built[0]
    done = [r for r in w.requests if r.done]
    return (
        f"{len(done)} of {len(w.requests)} rooms finished, {int(w.env.now) / 1e6:.1f} of "
        f"{w.deadline_ns / 1e6:.1f} ms simulated; no verdict (the invariants are checked at the end)"
    )
