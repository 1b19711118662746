"""Every subcommand and example in an environment without the optional extras (the light one the
README sets up first): no traceback, and a command that needs an extra says which one and how to
install it, in one ``error:`` line with exit status 2.

"Not installed" is emulated in a subprocess: tests/no_extras/sitecustomize.py makes every finder
answer "not found" for the extras' packages, so ``find_spec`` returns None and ``import zmq``
raises ``ModuleNotFoundError: No module named 'zmq'``, as where they were never installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from kvferry.cli import _register, app

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = "zmq,nixl,nixl_cu12,torch,triton,ray,matplotlib,prometheus_client"
KVFERRY = [str(Path(sys.executable).with_name("kvferry"))]  # the installed entry point

# Each leaf subcommand with arguments that reach its work (a small run), and the extra it needs
# (None: runs to its normal end without any extra). {tmp} is a per-test folder.
RUNS: dict[str, tuple[list[str], str | None]] = {
    "version": ([], None),
    "plan": (["--model", "qwen3-8b", "--prefill-tp", "2", "--decode-tp", "1"], None),
    "fuzz": (["--seeds", "0-2", "--save-dir", "{tmp}/ff"], None),
    "replay": (["scenarios/quickstart.toml"], None),
    "demo": ([], None),
    "select": (["--requests", "2", "--concurrency", "1", "--isl", "64", "--osl", "4"], None),
    "calibrate": (["tests/data/telemetry-cpu-loopback.json", "--name", "t", "--out", "{tmp}/t.toml"], None),
    "bench predict": (["tests/data/bench-nixl-two-rows.jsonl", "--profile", "cpu-loopback"], None),
    "soak": (["--rooms", "2"], "real"),
    "fuzz-live": (["--frames", "1", "--rooms", "1"], "real"),
    "bench nixl": (["--rooms", "1", "--tokens", "64"], "real"),
    "bench interference": (["--reps", "1", "--phase-s", "0.1"], "real"),
    "chaos": (["--rooms", "2"], "real"),
}
# Options that need an extra on commands that otherwise run without one.
OPTION_RUNS: list[tuple[str, list[str], str]] = [
    ("fuzz", ["--seeds", "0", "--ray", "local"], "ray"),
    ("select", ["--requests", "2", "--concurrency", "1", "--plot", "{tmp}/p.png"], "plots"),
    ("bench nixl", ["--mem", "VRAM", "--rooms", "1"], "real"),
]
SCRIPTS: list[tuple[str, str]] = [
    ("examples/two_endpoints.py", "real"),
    ("examples/engine_loop.py", "real"),
]


def _leaf_commands() -> list[str]:
    _register()
    out: list[str] = []

    def walk(cmd: object, path: list[str]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
        else:
            out.append(" ".join(path))

    walk(typer.main.get_command(app), [])
    return out


def _run(argv: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests" / "no_extras"), KVFERRY_HIDE_MODULES=HIDDEN)
    env.pop("KVFERRY_CONTROL_KEY", None)
    argv = [a.replace("{tmp}", str(tmp)) for a in argv]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _check(r: subprocess.CompletedProcess[str], extra: str | None, what: str) -> None:
    both = r.stdout + r.stderr
    assert "Traceback" not in both, f"{what}: traceback\n{both[-3000:]}"
    if extra is None:
        assert r.returncode == 0, f"{what}: exit {r.returncode}\n{both[-2000:]}"
        return
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, f"{what}: exit {r.returncode}\n{both[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{what}: {r.stderr!r}"
    assert f"the '{extra}' extra" in lines[0], lines[0]
    assert f"python3 -m uv sync --locked --inexact --no-dev --extra {extra}" in lines[0], lines[0]
    assert f"pip install 'kvferry[{extra}]'" in lines[0], lines[0]


def test_the_emulation_hides_the_extras_as_a_missing_package_would(tmp_path: Path) -> None:
    r = _run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('zmq'))"], tmp_path)
    assert r.stdout.strip() == "None"
    # What the newcomer saw before every command checked first: the backend's import fails.
    r = _run([sys.executable, "-c", "import kvferry.backends.runtime"], tmp_path)
    assert r.returncode == 1 and r.stderr.strip().endswith("ModuleNotFoundError: No module named 'zmq'")
    r = _run([sys.executable, "-c", "import numpy, msgspec, simpy, typer, rich"], tmp_path)
    assert r.returncode == 0, r.stderr  # the base dependencies stay


def test_every_subcommand_has_a_run_here() -> None:
    assert sorted(_leaf_commands()) == sorted(RUNS), "add the new subcommand to RUNS"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_subcommand_without_extras(name: str, tmp_path: Path) -> None:
    args, extra = RUNS[name]
    _check(_run([*KVFERRY, *name.split(), *args], tmp_path), extra, name)


@pytest.mark.parametrize(
    ("name", "args", "extra"), OPTION_RUNS, ids=[f"{n} {a[-2]}" for n, a, _ in OPTION_RUNS]
)
def test_option_without_its_extra(name: str, args: list[str], extra: str, tmp_path: Path) -> None:
    _check(_run([*KVFERRY, *name.split(), *args], tmp_path), extra, f"{name} {' '.join(args)}")


@pytest.mark.parametrize(("script", "extra"), SCRIPTS)
def test_example_without_extras(script: str, extra: str, tmp_path: Path) -> None:
    _check(_run([sys.executable, script], tmp_path), extra, script)
