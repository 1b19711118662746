"""The ``kvferry`` command line. Each subcommand lives in its own module under kvferry.commands."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="kvferry",
    help="Move KV caches from prefill to decode servers, plan the bytes, and prove it in simulation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """kvferry: prefill/decode KV-cache transfer, planned, simulated and proven."""


def _register() -> None:
    # Imported lazily so `kvferry --help` stays fast and optional extras stay optional.
    from kvferry.commands import register_all

    register_all(app)


def main() -> None:
    _register()
    app()
