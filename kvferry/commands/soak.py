"""``kvferry soak``: rooms for as long as asked over real NIXL on loopback, with aborts and peer
kills, every room checked (``kvferry/tools/soak.py``)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from kvferry.commands import bad_input, check_seed, extras, progress
from kvferry.commands.options import DRAWN_FLOWS, DrawnFlows, JsonReport, RssBoundMb, options

# The summary's note on a run stopped by SIGTERM or Ctrl-C: what it reports, what it left out.
INTERRUPTED = " (INTERRUPTED: the rooms judged until then; the end-of-run table checks did not run)"


def register(app: typer.Typer) -> None:
    app.command("soak")(soak)


@dataclass(frozen=True)
class SoakOpts:
    rooms: Annotated[int, typer.Option(help="Rooms to run (each checked).")] = 2000
    seed: Annotated[int, typer.Option(help="Seed of every random choice (rooms, flows, aborts, pages).")] = 0
    prefill_tp: Annotated[
        int, typer.Option(help="Prefill TP size (1, 2 or 4), all ranks in one process.")
    ] = 2
    decode_tp: Annotated[int, typer.Option(help="Decode TP size (1, 2 or 4), all ranks in one process.")] = 1
    flows: DrawnFlows = DRAWN_FLOWS
    abort_rate: Annotated[float, typer.Option(help="Share of rooms aborted (by either side).")] = 0.1
    kill_every: Annotated[
        int,
        typer.Option(help="SIGKILL and restart a side every K rooms, prefill first, then decode (0: never)."),
    ] = 500
    hold: Annotated[int, typer.Option(help="Rooms in flight at each kill (they must end Failed).")] = 4
    max_seconds: Annotated[
        float,
        typer.Option(help="Stop starting rooms after this long (checked every 200 rooms), then report."),
    ] = 3600.0
    rss_bound_mb: RssBoundMb = 64.0
    warmup_s: Annotated[
        float, typer.Option(help="Seconds of a process's life before its RSS baseline is taken.")
    ] = 45.0
    engine_name: Annotated[
        str, typer.Option("--engine", help="Executor of both sides' NIXL commands: python or native.")
    ] = "python"
    as_json: JsonReport = False


@options(SoakOpts)
def soak(o: SoakOpts) -> None:
    """A prefill process and a decode process on 127.0.0.1 (real NIXL over UCX, DRAM pools) run
    rooms with chunked prefill, every flow, aborts by both sides and peers killed and restarted;
    exits 1 on any lost, corrupted, hung or wrongly-succeeded room, leaked table or RSS growth."""
    extras.require("real", "kvferry soak")
    from kvferry.tools import soak as engine

    check_seed(o.seed)
    cfg = engine.SoakConfig(
        rooms=o.rooms, seed=o.seed, prefill_tp=o.prefill_tp, decode_tp=o.decode_tp,
        flows=tuple(f.strip() for f in o.flows.split(",") if f.strip()), abort_rate=o.abort_rate,
        kill_every=o.kill_every, hold=o.hold, max_seconds=o.max_seconds, rss_bound_mb=o.rss_bound_mb,
        warmup_s=o.warmup_s, engine=o.engine_name,
    )  # fmt: skip
    try:
        engine.check_config(cfg)
    except ValueError as e:
        bad_input(str(e))
    lines = progress.Lines(f"seed {o.seed}")
    with progress.interrupted_says(lines.summary):  # before the run began (its own end in a report)
        report = engine.run_soak(cfg, progress=lines)
    if o.as_json:
        typer.echo(json.dumps(report))
    else:
        typer.echo(summary(report))
    if report["interrupted"]:
        print(f"soak: interrupted after {report['rooms_run']} rooms (reported above)", file=sys.stderr)
        raise typer.Exit(progress.EXIT_INTERRUPTED)
    if not report["ok"]:
        print(f"soak FAILED with seed {o.seed}; replay: {report['replay']}", file=sys.stderr)
        raise typer.Exit(1)


def summary(r: dict[str, Any]) -> str:
    c, o = r["config"], r["outcomes"]
    kill = f"a side killed every {c['kill_every']} rooms" if c["kill_every"] else "no kills"
    lines = [
        f"kvferry soak: seed {c['seed']}, TP {c['prefill_tp']}->{c['decode_tp']}, "
        f"flows {','.join(c['flows'])}, abort rate {c['abort_rate']}, {kill}, "
        f"executor {','.join(r.get('executors') or ['?'])}",
        f"rooms: {r['rooms_run']} of {c['rooms']} in {r['wall_s']} s ({r['rooms_per_s']} rooms/s)"
        + (" (stopped by --max-seconds)" if r["stopped_by_time"] else "")
        + (INTERRUPTED if r["interrupted"] else ""),
        f"  {o['success']} success (bytes and aux row checked), "
        f"{o['aborted']} aborted (Failed on both sides), "
        + (
            f"{o['abort_after_success']} aborted by decode after they ended (Success, bytes checked), "
            if o.get("abort_after_success")
            else ""
        )
        + f"{o['killed']} hit by a kill (Failed on the survivor), {o['violation']} violating",
        "  by flow: "
        + ", ".join(f"{f} {sum(v.values())} ({v.get('success', 0)} ok)" for f, v in r["by_flow"].items()),
    ]
    for k in r["kills"]:
        lines.append(
            f"  kill {k['victim']} after room {k['after_room']}: survivor failed its {k['rooms_in_flight']} "
            f"rooms in flight in {k['survivor_failed_them_s']} s, restarted in {k['restart_s']} s"
        )
    from kvferry.tools.soak import rss_line

    lines += [s for x in r["rss"] if (s := rss_line(x, c["rss_bound_mb"], f"{x['side']}#{x['incarnation']}"))]
    e = r["end_state"]
    if e:
        clean = not any(e["prefill_leaks"]) and not any(e["decode_leaks"]) and not e["stuck_threads"]
        lines.append(
            "  end: "
            + ("every table empty on both sides, every thread joined" if clean else "TABLES OR THREADS LEFT")
            + f"; driver counters {e['driver_errors']}"
        )
    if r["ok"] and r["interrupted"]:
        lines.append("verdict so far: no violation in the rooms judged before the interrupt")
    elif r["ok"]:
        lines.append("verdict: OK, no room lost, corrupted, hung or wrongly Success")
    else:
        lines.append(f"verdict: FAILED, {r['violation_count']} violation(s); first ones:")
        lines += [f"  {json.dumps(v)[:400]}" for v in r["violations"][:10]]
        lines.append(f"replay: {r['replay']}")
    return "\n".join(lines)
