"""Progress on stderr (never in the report on stdout), and Ctrl-C: one line saying what finished,
exit status 130, no traceback (the process group gets SIGINT, as a terminal's Ctrl-C sends it)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvferry.commands import progress

ROOT = Path(__file__).resolve().parents[1]
KVFERRY = str(Path(sys.executable).with_name("kvferry"))
# The CLI with Python's own Ctrl-C handler: a test run started as a background job of a script
# inherits SIGINT ignored, and the command would then never see the Ctrl-C this file sends.
KVFERRY_CTRL_C = [
    sys.executable,
    "-c",
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); sys.argv[0] = 'kvferry'; "
    "from kvferry.cli import main; main()",
]


def _interrupt(args: list[str], once: str) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """Run ``kvferry args``, send Ctrl-C to its process group once a progress line holding
    ``once`` shows the work is under way (lines every 0.2 s here), and collect what it printed,
    with the worker processes it had when Ctrl-C came (those whose parent is not the command)."""
    env = dict(os.environ, KVFERRY_PROGRESS_EVERY_S="0.2")
    p = subprocess.Popen(
        [*KVFERRY_CTRL_C, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env=env,
    )  # fmt: skip
    assert p.stderr is not None and p.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + 90
    for line in p.stderr:  # the first progress line: the command is past start-up
        seen.append(line)
        if once in line or time.monotonic() > deadline:
            break
    workers = [pid for pid, ppid in _session(p.pid).items() if ppid != p.pid and pid != p.pid]
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, "".join(seen) + err), workers


def _stat(pid: int) -> tuple[str, int]:
    """``pid``'s state letter and parent pid (OSError once it is gone)."""
    rest = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return rest[0], int(rest[1])


def _session(sid: int) -> dict[int, int]:
    """The running processes of session ``sid``, pid -> parent pid (a zombie has exited)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            state, ppid = _stat(int(proc.name))
            if state != "Z" and os.getsid(int(proc.name)) == sid:
                found[int(proc.name)] = ppid
        except OSError:  # gone meanwhile
            continue
    return found


def _running(pid: int) -> bool:
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def _said_what_finished(r: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted: "), r.stderr[-2000:]
    return last


def test_replay_interrupted_says_how_far_the_run_got() -> None:
    line = _said_what_finished(_interrupt(["replay", "bench/load-10k.toml", "--json"], "rooms finished")[0])
    assert "of 10000 rooms finished" in line and "ms simulated" in line, line


def test_fuzz_interrupted_on_two_workers_says_seeds_done(tmp_path: Path) -> None:
    # 31 seeds: under 32 the pool hands out one seed at a time (sim/executors.py), so the first
    # progress line comes after one seed; the run still has about 30 seeds (over 10 s) left when
    # Ctrl-C lands, and its workers are stopped, not left to run what was queued to them.
    args = ["fuzz", "--seeds", "0-30", "--jobs", "2", "--save-dir", str(tmp_path)]
    r, workers = _interrupt(args, "fuzz: ")
    line = _said_what_finished(r)
    assert "of 31 seeds done" in line and "with a violation" in line, line
    assert len(workers) == 2, workers  # the two it ran (under the fork server, not the command)
    assert [pid for pid in workers if _running(pid)] == []  # terminated, and reaped by then


def test_an_interrupted_fuzz_counts_the_seeds_it_reported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kvferry.sim.executors import MapStats
    from typer.testing import CliRunner

    from kvferry.cli import _register, app

    def delivered_then_ctrl_c(seeds: list[int], progress: Any, **_: object) -> Iterator[object]:
        progress(MapStats(total=len(seeds), done=1))  # the executor has a seed's result...
        raise KeyboardInterrupt  # ... and Ctrl-C lands before the command counted it
        yield

    _register()
    monkeypatch.setattr("kvferry.sim.campaign.run_seeds", delivered_then_ctrl_c)
    r = CliRunner().invoke(app, ["fuzz", "--seeds", "0-3", "--save-dir", str(tmp_path)])
    assert r.exit_code == 130 and "interrupted: 0 of 4 seeds done (0 rooms" in r.stderr, r.stderr


def test_fuzz_json_stdout_is_only_the_report(tmp_path: Path) -> None:
    r = subprocess.run(
        [KVFERRY, "fuzz", "--seeds", "0-3", "--json", "--save-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["seeds"] == 4  # one object, no progress frame before or after it


def test_bar_draws_on_a_terminal_and_writes_lines_to_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = io.StringIO()
    with progress.Bar("fuzz", total=4, console=Console(file=tty, force_terminal=True)) as bar:
        bar.update(2, "0 failing seed(s)")
    assert "fuzz" in tty.getvalue()
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    log = io.StringIO()
    with progress.Bar("replay", total=1.0, unit="%", console=Console(file=log, force_terminal=False)) as bar:
        bar.update(0.5, "5/10 rooms finished")
    assert log.getvalue().startswith("replay: 50%, 5/10 rooms finished ("), log.getvalue()


def test_an_interrupt_outside_the_long_part_still_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from kvferry.cli import _register, app

    def stopped(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    _register()
    monkeypatch.setattr("kvferry.commands.sim._run_and_report", stopped)
    r = CliRunner().invoke(app, ["demo"])
    assert r.exit_code == 130 and "interrupted: before the command's work finished" in r.stderr


def test_an_interrupt_summary_that_fails_still_exits_130() -> None:
    import typer

    def broken() -> str:
        raise RuntimeError("half-built")

    with pytest.raises(typer.Exit) as e, progress.interrupted_says(broken):
        raise KeyboardInterrupt
    assert e.value.exit_code == 130
