"""``kvferry fuzz-live``: hostile control frames at live endpoints while real rooms run
(``kvferry/tools/hostile.py``)."""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

import typer

from kvferry.commands import bad_input, extras, progress
from kvferry.commands.options import JsonReport


def register(app: typer.Typer) -> None:
    app.command("fuzz-live")(fuzz_live)


def fuzz_live(
    seed: Annotated[int, typer.Option(help="Seed of every frame and room.")] = 0,
    frames: Annotated[int, typer.Option(help="Hostile frames to send.")] = 5000,
    rooms: Annotated[int, typer.Option(help="Legitimate rooms moved meanwhile (each checked).")] = 100,
    max_seconds: Annotated[float, typer.Option(help="Stop after this long and report.")] = 300.0,
    as_json: JsonReport = False,
) -> None:
    """Two prefill ranks and a decode rank in this process (real NIXL over UCX, DRAM; the ZMQ
    control plane with its keys) move rooms while random, truncated, oversized, garbage,
    out-of-range (signed by an insider), impostor, replayed and stale frames hit every endpoint;
    exits 1 if a thread died, a room failed or lost bytes, or a byte outside every room changed."""
    # NIXL logs its agents' start to stdout at INFO: keep stdout for the report (and --json).
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    extras.require("real", "kvferry fuzz-live")
    from kvferry.tools.hostile import KINDS, LiveFuzzConfig, run_live_fuzz

    cfg = LiveFuzzConfig(seed=seed, frames=frames, rooms=rooms, max_seconds=max_seconds)
    why = cfg.problems()
    if why:
        bad_input(why)
    lines = progress.Lines(f"seed {seed}")
    with progress.interrupted_says(lines.summary):
        res = run_live_fuzz(cfg, progress=lines)
    if as_json:
        typer.echo(json.dumps(res.as_dict()))
    else:
        typer.echo(
            f"kvferry fuzz-live: seed {seed}, {sum(res.frames_sent.values())} hostile frames in "
            f"{res.wall_s:.1f} s, {res.rooms_success} of {res.rooms_done} legitimate rooms Success "
            "(bytes checked)"
        )
        typer.echo("  sent: " + ", ".join(f"{k} {res.frames_sent.get(k, 0)}" for k in KINDS))
        typer.echo("  rejected: " + ", ".join(f"{k} {v}" for k, v in res.rejected.items()))
        if res.ok:
            typer.echo(
                "verdict: OK, no thread died, no room lost or corrupted, no byte outside a room written"
            )
        else:
            typer.echo("verdict: FAILED" + (" (stopped by --max-seconds)" if res.stopped_early else ""))
            for v in res.violations[:10]:
                typer.echo(f"  {v}")
    if not res.ok:
        replay = f"kvferry fuzz-live --seed {seed} --frames {frames} --rooms {rooms}"
        print(f"fuzz-live FAILED with seed {seed}; replay: {replay}", file=sys.stderr)
        raise typer.Exit(1)
