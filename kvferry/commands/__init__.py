"""CLI subcommands. Each module exposes ``register(app)``; add one line here per module. A command
with many options declares them as frozen dataclasses applied with ``@options`` (options.py), where
options several commands share are declared once.

Every subcommand reports bad input the same way: one ``error: ...`` line on stderr, exit status
2 (``bad_input``), checked before any long run starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import typer
from typer.core import TyperGroup
from typer.models import DefaultPlaceholder

EXIT_BAD_INPUT = 2  # the status typer gives its own usage errors
# Seeds are written back into scenario files (``kvferry fuzz`` saves failing runs as TOML), and
# TOML integers are signed 64-bit.
MAX_SEED = 2**63 - 1


def register_all(app: typer.Typer) -> None:
    from kvferry.commands import bench, calibrate, chaos, fuzz_live, plan, select, sim, soak, version

    version.register(app)
    plan.register(app)
    sim.register(app)
    bench.register(app)
    select.register(app)
    calibrate.register(app)
    soak.register(app)
    fuzz_live.register(app)
    chaos.register(app)
    for group in app.registered_groups:  # sub-apps (bench ...) print their help as the root does
        sub = group.typer_instance
        if sub is not None:
            sub.rich_markup_mode = None
            if isinstance(sub.info.cls, DefaultPlaceholder) or sub.info.cls in (None, TyperGroup):
                sub.info.cls = WholeSummaries


class WholeSummaries(TyperGroup):
    """A command list that gives each command's whole first sentence (wrapped), where click cuts
    it at the terminal's width with "..."."""

    def format_commands(self, ctx: typer.Context, formatter: typer.core.click.HelpFormatter) -> None:  # type: ignore[name-defined]
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=1 << 16)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def one_line(text: str) -> str:
    """``text`` with control characters escaped: a value the user typed cannot split the line."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def bad_input(message: str) -> NoReturn:
    """Print ``error: message`` (one line) on stderr and exit with EXIT_BAD_INPUT."""
    typer.echo(f"error: {one_line(message)}", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def check_seed(seed: int, option: str = "--seed") -> None:
    if not 0 <= seed <= MAX_SEED:
        bad_input(f"{option} must be in [0, 2**63 - 1], got {seed}")


def check_output_file(path: Path, option: str) -> None:
    """Fail now, not after the run, if ``path`` cannot be written as a new or replaced file."""
    if "\0" in str(path):
        bad_input(f"{option}: a path cannot contain a NUL character: {str(path)!r}")
    if path.is_dir():
        bad_input(f"{option} {path}: is a directory, give a file name")
    parent = path.parent
    if not parent.is_dir():
        bad_input(f"{option} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        bad_input(f"{option} {path}: folder {parent} is not writable")


def check_output_dir(path: Path, option: str) -> None:
    """Fail now if ``path`` is a file or lies under one (it is created when first needed)."""
    if "\0" in str(path):
        bad_input(f"{option}: a path cannot contain a NUL character: {str(path)!r}")
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                bad_input(f"{option} {path}: {p} is a file, not a folder")
            return
