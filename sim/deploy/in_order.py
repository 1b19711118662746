"""Steps that read earlier steps' outcomes, run at once where they do not, with the outcome of
running them in order.

A capacity search narrows configurations one after another because each starts from what the
earlier ones found (a smaller configuration's rate, another flow's share of its bound). Most of
them read only a few earlier ones, though: with a pool of worker processes, the direct, staged
and pull configurations can narrow side by side. Each step runs on its own thread and, before it
reads an earlier step's outcome, waits for that step (``wait``); a step reads nothing else that
other steps write. Its reads then see what they would in order, so every step takes exactly the
runs it would in order, and the search's answer does not depend on which finished first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["InOrder"]

_POLL_S = 0.1  # how often a waiting thread or the joining main thread looks for a failure or Ctrl-C


class _Abandoned(Exception):
    """A step waited for one that failed (or the run was interrupted): it stops without an outcome."""


class InOrder:
    """``n`` steps, step ``i`` a call ``step(i)``: in order on this thread, or (``parallel``) each
    on a thread of its own, waiting only where it calls ``wait``."""

    def __init__(self, n: int, parallel: bool) -> None:
        self.n, self.parallel = n, parallel
        self._done = [threading.Event() for _ in range(n)]
        self._stop = threading.Event()
        self._errors: dict[int, BaseException] = {}

    def wait(self, i: int) -> None:
        """Return once step ``i`` is done (at once in order: it ran before the caller)."""
        while not self._done[i].wait(_POLL_S):
            if self._stop.is_set():
                raise _Abandoned
        if self._stop.is_set():  # it failed, or gave up itself: its outcome is not there
            raise _Abandoned

    @property
    def stopped(self) -> bool:
        """Whether a step failed or the run was interrupted: a step should not record its outcome."""
        return self._stop.is_set()

    def run(self, step: Callable[[int], None]) -> None:
        """Every step; the first failure (lowest step) re-raised once every thread has stopped."""
        if not self.parallel:
            for i in range(self.n):
                step(i)
                self._done[i].set()
            return
        threads = [
            threading.Thread(target=self._one, args=(step, i), name=f"in-order-{i}", daemon=True)
            for i in range(self.n)
        ]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(_POLL_S)  # a timed join: Ctrl-C reaches this thread between them
        except BaseException:
            self._stop.set()  # the waiting steps give up; the running ones lose their workers
            raise
        if self._errors:
            raise self._errors[min(self._errors)]

    def _one(self, step: Callable[[int], None], i: int) -> None:
        try:
            step(i)
        except _Abandoned:
            pass
        except BaseException as e:  # carried to the main thread, which re-raises it
            self._errors[i] = e
            self._stop.set()
        finally:
            self._done[i].set()
