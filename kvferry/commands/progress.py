"""Progress and interruption for commands that run longer than a few seconds.

Progress goes to stderr, so stdout holds only the report (and ``--json`` stays one object): a
live bar on a terminal, a plain line every few seconds when stderr is a file or a pipe. Ctrl-C
prints one line saying what finished and exits 130 (the shell's status for SIGINT).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import typer

EXIT_INTERRUPTED = 130
# A plain progress line this often when stderr is not a terminal (a log file, CI, a test).
LINE_EVERY_S = float(os.environ.get("KVFERRY_PROGRESS_EVERY_S", "5"))


def stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


@contextmanager
def interrupted_says(summary: Callable[[], str]) -> Iterator[None]:
    """On Ctrl-C inside the block: ``interrupted: <summary()>`` on stderr, exit status 130."""
    try:
        yield
    except KeyboardInterrupt:
        try:
            what = summary()
        except Exception as e:  # the summary must not turn an interrupt into a traceback
            what = f"(no summary: {e})"
        print(f"\ninterrupted: {what}", file=sys.stderr, flush=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


class Lines:
    """A progress callback for engines that report in lines (soak, fuzz-live): each line goes to
    stderr, and the last one is what an interrupt's summary quotes."""

    def __init__(self, context: str) -> None:
        self.context = context
        self.last = ""

    def __call__(self, line: str) -> None:
        self.last = line
        print(line, file=sys.stderr, flush=True)

    def summary(self) -> str:
        return f"{self.context}; last progress: {self.last or 'none yet'}"


class Bar:
    """One task's progress on stderr: ``update(done, status)`` from the thread doing the work."""

    def __init__(self, label: str, total: float, unit: str = "", console: Any = None) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.console = console or stderr_console()
        self.done: float = 0
        self.status = ""
        self._t0 = time.monotonic()
        self._last_line = self._t0
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> Bar:
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            counter = MofNCompleteColumn() if not self.unit else TextColumn("{task.percentage:>3.0f}%")
            self._progress = Progress(
                TextColumn(self.label),
                BarColumn(),
                counter,
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,  # the report replaces it; nothing of it is left in the scrollback
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(self.label, total=self.total, status="")
        return self

    def update(self, done: float, status: str = "") -> None:
        self.done, self.status = done, status
        if self._progress is not None:
            self._progress.update(self._task, completed=done, status=status)
            return
        now = time.monotonic()
        if now - self._last_line >= LINE_EVERY_S:
            self._last_line = now
            self.console.print(self.line(), highlight=False, markup=False)

    def line(self) -> str:
        of = f"{self.done:.0f}/{self.total:.0f}" if not self.unit else f"{self.done / self.total:.0%}"
        rest = f", {self.status}" if self.status else ""
        return f"{self.label}: {of}{rest} ({time.monotonic() - self._t0:.0f} s)"

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)


@contextmanager
def sampled(sample: Callable[[], tuple[float, str]], bar: Bar, every_s: float = 0.25) -> Iterator[None]:
    """Update ``bar`` from ``sample()`` on a thread of its own while the block runs: for work (a
    simulation) that must not be touched, only looked at. ``sample`` reads, never writes."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                bar.update(*sample())
            except Exception:  # a half-built object seen mid-update: the next sample will do
                continue

    t = threading.Thread(target=loop, name="kvferry-progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
