"""``kvferry chaos``: the soak's processes on two hosts made of network namespaces, with seeded
partitions, slow links, stalls, kills and abort bursts (``kvferry/tools/chaos/``)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from kvferry.commands import bad_input, check_seed, extras
from kvferry.commands.options import DRAWN_FLOWS, DrawnFlows, JsonReport, RssBoundMb, options
from kvferry.commands.progress import EXIT_INTERRUPTED


def register(app: typer.Typer) -> None:
    app.command("chaos")(chaos)


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            p, d = (int(x) for x in part.split("-"))
        except ValueError:
            bad_input(f"--tp: {part!r} is not PREFILL-DECODE, e.g. 2-1")
        out.append((p, d))
    return tuple(out)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


@dataclass(frozen=True)
class ChaosOpts:
    rooms: Annotated[int, typer.Option(help="Rooms to run (each checked), split over the TP pairs.")] = 2000
    seed: Annotated[int, typer.Option(help="Seed of the rooms and of the fault schedule.")] = 0
    tp: Annotated[str, typer.Option(help="TP pairs PREFILL-DECODE, run one after another.")] = "1-1,2-1,1-2"
    flows: DrawnFlows = DRAWN_FLOWS
    abort_rate: Annotated[
        float | None,
        typer.Option(help="Share of rooms aborted by either side (default 0.05; 0 with --liveness)."),
    ] = None
    segment_rooms: Annotated[int, typer.Option(help="Rooms per segment; a fault hits one segment.")] = 25
    fault_share: Annotated[float, typer.Option(help="Share of segments that get a fault.")] = 0.5
    faults: Annotated[
        str | None,
        typer.Option(
            help="Fault kinds drawn: partition_short, partition_long, slow_link, stall, kill, abort_burst "
            "(default all; with --liveness partition_short,slow_link)."
        ),
    ] = None
    liveness: Annotated[
        bool,
        typer.Option(help="Draw only faults the protocol rides out; every room must end Success."),
    ] = False
    max_seconds: Annotated[float, typer.Option(help="Stop starting rooms after this long, then report.")] = (
        3600.0
    )
    rss_bound_mb: RssBoundMb = 64.0
    warmup_s: Annotated[float, typer.Option(help="Seconds of a process's life before its RSS baseline.")] = (
        45.0
    )
    deadline_scale: Annotated[
        float,
        typer.Option(
            help="Stretch the rooms' own deadlines (and the fence) by this factor, for a loaded host; "
            "the heartbeat timeout stays."
        ),
    ] = 1.0
    plant: Annotated[str, typer.Option(hidden=True, help="Plant a bug (checker self-test).")] = ""
    as_json: JsonReport = False


@options(ChaosOpts)
def chaos(o: ChaosOpts) -> None:
    """Prefill and decode as processes on two hosts (network namespaces on a bridge; needs root):
    real NIXL with UCX over TCP on their veths, the authenticated control plane on the same
    addresses, every flow and TP pair, and a seeded schedule of faults on the real network and
    processes. Exits 1 on any lost, hung, corrupted or disagreeing room, a write outside a live
    room (canaries), a leaked table or RSS growth."""
    extras.require("real", "kvferry chaos")
    from kvferry.tools.chaos import netns
    from kvferry.tools.chaos import run as engine

    check_seed(o.seed)
    cfg = _config(o)
    try:
        engine.check_config(cfg)
    except ValueError as e:
        bad_input(str(e))
    why = netns.why_not_available()
    if why:
        bad_input(f"chaos: {why}")
    gone = "every process, fault and namespace it made was removed"
    try:
        report = engine.run_chaos(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except KeyboardInterrupt:  # before the run began (its own interrupts end in a report)
        print(f"chaos: interrupted; {gone}", file=sys.stderr)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except netns.NetError as e:
        bad_input(f"chaos: could not set up the hosts: {e}")
    typer.echo(json.dumps(report) if o.as_json else summary(report))
    if report["interrupted"]:
        rooms = report["rooms_run"]
        print(f"chaos: interrupted after {rooms} rooms (reported above); {gone}", file=sys.stderr)
        raise typer.Exit(EXIT_INTERRUPTED)
    if not report["ok"]:
        print(f"chaos FAILED with seed {o.seed}; replay: {report['replay']}", file=sys.stderr)
        raise typer.Exit(1)


def _config(o: ChaosOpts) -> Any:
    """The run's ChaosConfig; --liveness's defaults where the options give none."""
    from kvferry.tools.chaos import run as engine
    from kvferry.tools.chaos.schedule import KINDS, LIVENESS_KINDS

    kinds = _names(o.faults) if o.faults is not None else (LIVENESS_KINDS if o.liveness else KINDS)
    return engine.ChaosConfig(
        rooms=o.rooms, seed=o.seed, tp_pairs=_pairs(o.tp), flows=_names(o.flows),
        abort_rate=o.abort_rate if o.abort_rate is not None else (0.0 if o.liveness else 0.05),
        segment_rooms=o.segment_rooms, fault_share=o.fault_share, kinds=kinds, liveness=o.liveness,
        plant=o.plant, max_seconds=o.max_seconds, rss_bound_mb=o.rss_bound_mb, warmup_s=o.warmup_s,
        deadline_scale=o.deadline_scale,
    )  # fmt: skip


def summary(r: dict[str, Any]) -> str:
    from kvferry.commands.soak import INTERRUPTED
    from kvferry.tools.coverage import table

    c, cov = r["config"], r["coverage"]
    net, by_side = r["network"], cov["faults_by_side"]
    lines = [
        f"kvferry chaos: seed {c['seed']}, prefill host {net['hosts']['prefill']}, decode host "
        f"{net['hosts']['decode']} (UCX {net['ucx']['UCX_TLS']} on {net['ucx']['UCX_NET_DEVICES']}), "
        f"heartbeat timeout {net['heartbeat_timeout_s']} s" + (", liveness class" if c["liveness"] else ""),
        f"rooms: {r['rooms_run']} of {c['rooms']} in {r['wall_s']} s ({r['rooms_per_s']} rooms/s)"
        + (" (stopped by --max-seconds)" if r["stopped_by_time"] else "")
        + (INTERRUPTED if r["interrupted"] else ""),
        "  outcomes: " + ", ".join(f"{k} {v}" for k, v in r["outcomes"].items()),
        "  faults: " + ", ".join(_fault_count(k, n, by_side.get(k)) for k, n in cov["faults"].items()),
        "  transfers abandoned unfenced (a lost peer's, past the agent's drain bound): "
        + ", ".join(f"{k} {v}" for k, v in r["abandoned"].items()),
        *table("flow", cov["by_flow"]),
        *table("TP", cov["by_tp"]),
        *table("fault", cov["by_fault"]),
    ]
    for f in r["faults"][:12]:
        lines.append(
            f"  at {f['t_s']} s, TP {f['tp']}, rooms {f['rooms'][0]}-{f['rooms'][1] - 1}: {f['kind']}"
        )
    if len(r["faults"]) > 12:
        lines.append(f"  ... and {len(r['faults']) - 12} more faults (--json lists them all)")
    from kvferry.tools.soak import rss_line

    for x in r["rss"]:
        if x["checked"]:  # short-lived processes (most of a short run) say nothing
            lines.append(rss_line(x, c["rss_bound_mb"], f"TP {x['tp']} {x['side']}#{x['incarnation']}"))
    if r["ok"] and r["interrupted"]:
        lines.append("verdict so far: no violation in the rooms judged before the interrupt")
    elif r["ok"]:
        lines.append(
            "verdict: OK, every room terminal, Success bytes equal, both sides agree, canaries untouched, "
            "tables empty"
        )
    else:
        lines.append(f"verdict: FAILED, {r['violation_count']} violation(s); first ones:")
        lines += [f"  {json.dumps(v)[:400]}" for v in r["violations"][:10]]
    lines.append(f"replay: {r['replay']}")
    return "\n".join(lines)


def _fault_count(kind: str, n: int, sides: dict[str, int] | None) -> str:
    """``kill 3 (prefill 2, decode 1)``: how many, and on which side (none for a burst of aborts)."""
    if not n or sides is None:
        return f"{kind} {n}"
    return f"{kind} {n} (" + ", ".join(f"{side} {m}" for side, m in sides.items()) + ")"
