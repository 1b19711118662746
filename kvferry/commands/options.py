"""Command options declared as data.

A command's options are the fields of a few small frozen dataclasses, each a group of options
that configure one thing (the deployment, the workload, the output...). ``@options(A, B, ...)``
flattens the groups' fields, in order, into the signature typer reads (so ``--help`` lists them
in that order), and calls the command's body with one instance of each group. A field is declared
as a typer option would be: ``name: Annotated[type, typer.Option(help=...)] = default``; a field
without a default is required (an argument). Options that several commands share word for word are
declared once below.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import typer

# --- options shared by several commands (same flag, type and help) ---
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
JsonReport = Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")]
TraceOut = Annotated[Path | None, typer.Option(help="Write a Chrome/Perfetto trace (JSON) here.")]
# The real-NIXL runs (soak, chaos): which flows their rooms use, and the RSS growth they allow.
DRAWN_FLOWS = "direct,ring,pinned,pull,push,layerwise"
DrawnFlows = Annotated[str, typer.Option(help="Flows the rooms are drawn from, comma-separated.")]
RssBoundMb = Annotated[
    float, typer.Option(help="Fail if a process's RSS grows more than this after warm-up (MB).")
]


def options(*groups: type) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give the decorated body the options of ``groups`` (frozen dataclasses), one instance each."""
    params: list[inspect.Parameter] = []
    names: list[list[str]] = []
    for group in groups:
        hints = get_type_hints(group, include_extras=True)  # the Annotated[...] with its typer.Option
        fields = dataclasses.fields(group)
        names.append([f.name for f in fields])
        for f in fields:
            default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=hints[f.name]))  # fmt: skip
    flat = [n for ns in names for n in ns]
    if len(set(flat)) != len(flat):
        raise TypeError(f"options: a name is in two groups: {sorted(n for n in flat if flat.count(n) > 1)}")

    def decorate(body: Callable[..., None]) -> Callable[..., None]:
        def command(**values: Any) -> None:
            body(*(g(**{n: values[n] for n in ns}) for g, ns in zip(groups, names, strict=True)))

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__name__ = body.__name__  # typer names the command after it (unless told)
        command.__qualname__ = body.__qualname__
        command.__module__ = body.__module__
        command.__doc__ = body.__doc__  # the command's help
        return command

    return decorate
