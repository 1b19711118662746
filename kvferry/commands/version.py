"""``kvferry version``: print the installed version."""

from __future__ import annotations

import typer

import kvferry


def register(app: typer.Typer) -> None:
    @app.command("version")
    def version() -> None:
        """Print the kvferry version."""
        typer.echo(kvferry.__version__)
