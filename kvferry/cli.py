"""The ``kvferry`` command line. Each subcommand lives in its own module under kvferry.commands."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer

from kvferry.commands import WholeSummaries

try:  # typer >= 0.20 carries its own copy of click
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover (older typer: click itself)
    from click.exceptions import UsageError  # type: ignore[no-redef]


@contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    try:
        yield
    except UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # no arguments: typer prints the help
            raise
        from kvferry.commands import bad_input

        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        bad_input(e.format_message() + hint)


class _OneLineErrors(WholeSummaries):
    """Typer's usage errors (a wrong type, an unknown option or command) as one ``error: ...``
    line and exit status 2, like every error kvferry reports itself, instead of a usage box.
    Parsing errors arise in ``make_context`` (the root's options) and ``invoke`` (a subcommand's)."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        with _one_line_usage_errors():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        try:
            with _one_line_usage_errors():
                return super().invoke(ctx)
        except KeyboardInterrupt:
            # A command's own summary (kvferry.commands.progress) covers its long part; Ctrl-C
            # anywhere else (start-up, checks, the report) still says so in one line.
            from kvferry.commands.progress import EXIT_INTERRUPTED

            print("\ninterrupted: before the command's work finished", file=sys.stderr, flush=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None


app = typer.Typer(
    name="kvferry",
    help="Move KV caches from prefill to decode servers, plan the bytes, and prove it in simulation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help text is printed as written: rich markup would swallow a "[deploy]" in an option's help.
    rich_markup_mode=None,
    cls=_OneLineErrors,
)


@app.callback()
def _root() -> None:
    """kvferry: prefill/decode KV-cache transfer, planned, simulated and proven."""


_registered = False


def _register() -> None:
    # Imported lazily so `kvferry --help` stays fast and optional extras stay optional. Once only:
    # tests build the app from several modules, and a second registration would add every command
    # again.
    global _registered
    if not _registered:
        from kvferry.commands import register_all

        register_all(app)
        _registered = True


def main() -> None:
    _register()
    app()
