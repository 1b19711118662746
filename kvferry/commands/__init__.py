"""CLI subcommands. Each module exposes ``register(app)``; add one line here per module."""

from __future__ import annotations

import typer


def register_all(app: typer.Typer) -> None:
    from kvferry.commands import bench, plan, sim, version

    version.register(app)
    plan.register(app)
    sim.register(app)
    bench.register(app)
