"""Optional extras (pyproject's ``[project.optional-dependencies]``), checked before a command
that needs one starts: a missing extra is one ``error:`` line naming it and the command that
installs it, exit status 2, never an ImportError's traceback from deep inside the backend.

The light environment the README sets up first (``uv run --locked --no-dev``) has none of them.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import NoReturn

# extra -> (module, distribution) pairs it must provide. The real backend needs NIXL and ZMQ on
# host memory; torch and triton only for GPU pools ("real-gpu": the same extra, checked by the
# commands that take --mem VRAM).
EXTRAS: dict[str, tuple[tuple[str, str], ...]] = {
    "real": (("nixl", "nixl"), ("zmq", "pyzmq")),
    "real-gpu": (("torch", "torch"), ("triton", "triton")),
    "metrics": (("prometheus_client", "prometheus-client"),),
    "plots": (("matplotlib", "matplotlib"),),
    "ray": (("ray", "Ray"),),
}


def install_hint(extra: str) -> str:
    """The commands that install ``extra``: with uv in a clone, or with pip."""
    name = "real" if extra == "real-gpu" else extra
    # --inexact: a plain `uv sync` would remove the extras installed before this one.
    return f"python3 -m uv sync --locked --inexact --no-dev --extra {name} (or pip install 'kvferry[{name}]')"


def missing(extra: str) -> list[str]:
    """The distributions of ``extra`` that cannot be imported here."""
    return [dist for module, dist in EXTRAS[extra] if importlib.util.find_spec(module) is None]


def problem(extra: str, what: str) -> str | None:
    """Why ``what`` cannot run here (``None`` when ``extra`` is installed)."""
    gone = missing(extra)
    if not gone:
        return None
    name = "real" if extra == "real-gpu" else extra
    return (
        f"{what} needs {' and '.join(gone)} (the '{name}' extra), which is not installed; "
        f"install it: {install_hint(extra)}"
    )


def require(extra: str, what: str) -> None:
    """Exit with one ``error:`` line and status 2 (the CLI's bad input) unless ``extra`` is here."""
    why = problem(extra, what)
    if why is not None:
        from kvferry.commands import bad_input

        bad_input(why)


def require_for_script(extra: str, what: str) -> None:
    """``require`` for a plain script (no typer): the same line on stderr, the same status."""
    why = problem(extra, what)
    if why is not None:
        _exit(why)


def _exit(why: str) -> NoReturn:
    from kvferry.commands import EXIT_BAD_INPUT, one_line

    print(f"error: {one_line(why)}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)
