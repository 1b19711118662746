"""Every ``--help`` of the CLI, rendered: every option is listed with its whole help text (nothing
swallowed as markup, nothing cut), every command's summary is whole, and the options that list
their values name every value the code accepts."""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer.main
from kvferry.core.flows.policy import BUILT_FLOWS
from kvferry.core.geometry import PRESETS
from kvferry.sim.scenario import FLOW_CHOICES
from typer.testing import CliRunner

from kvferry.cli import _register, app

runner = CliRunner()


def _commands() -> dict[str, Any]:
    """Every command and group by its path ("" for the root), as click objects."""
    _register()
    out: dict[str, Any] = {}

    def walk(cmd: Any, path: list[str]) -> None:
        out[" ".join(path)] = cmd
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return out


COMMANDS = _commands()


def _help(path: str) -> str:
    r = runner.invoke(app, [*path.split(), "--help"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    return r.output


def _squash(text: str) -> str:
    """Text without whitespace: help wrapped at any width compares equal to its source."""
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_help_lists_every_option_whole(path: str) -> None:
    out = _help(path)
    flat = _squash(out)
    cmd = COMMANDS[path]
    if cmd.help:
        assert _squash(cmd.help) in flat, f"{path}: its description is cut:\n{out}"
    for p in cmd.params:
        if getattr(p, "hidden", False):
            continue
        for opt in p.opts:
            assert opt in out, f"{path}: {opt} is missing from --help"
        if p.help:
            assert _squash(p.help) in flat, f"{path} {p.opts[0]}: help text swallowed or cut:\n{out}"
    for name, sub in (getattr(cmd, "commands", None) or {}).items():
        if not sub.hidden:
            summary = sub.get_short_help_str(limit=1 << 16)
            assert _squash(summary) in flat and "..." not in summary, f"{path}: {name}'s summary is cut"


def test_markup_is_printed_as_written() -> None:
    # A bracketed word in an option's help is text, not a rich style tag.
    assert "[deploy]" in _help("select")


def _option_help(path: str, option: str) -> str:
    (p,) = [p for p in COMMANDS[path].params if option in p.opts]
    return f"{p.help} {p.default}"


def test_bench_nixl_flow_help_names_every_flow() -> None:
    from kvferry.commands.bench import BENCH_FLOWS
    from kvferry.tools.runtime_bench import FLOWS

    assert BENCH_FLOWS == FLOWS
    text = _option_help("bench nixl", "--flow")
    assert all(f in text for f in FLOWS), text


def test_flow_options_name_every_flow() -> None:
    from kvferry.backends.loopback.plan import FLOWS as SOAK_FLOWS

    replay = _option_help("replay", "--flow")
    assert all(f in replay for f in FLOW_CHOICES), replay
    soak = _option_help("soak", "--flows")
    assert all(f in soak for f in SOAK_FLOWS) and all(f.value in soak for f in BUILT_FLOWS), soak


@pytest.mark.parametrize("path", ["plan", "select"])
def test_model_option_names_every_preset(path: str) -> None:
    text = _option_help(path, "--model")
    missing = [m for m in PRESETS if m not in text and not m.startswith("sim-")]
    assert not missing, f"{path} --model help does not name {missing}"
