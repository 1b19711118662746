"""Scheduled calls: ``fn(*args)`` run by SimPy after a delay, as ``env.timeout(delay)`` with one
callback would, without a Timeout's fields and a closure per call.

The simulator schedules tens of these per room (deliveries, landings, timers, deferred
reactions). A ``_Call`` is queued through ``env.schedule`` with the key a Timeout gets
(time, NORMAL priority, next event id), so it runs at the same step a Timeout created at the same
moment would: the event order, and so every trace, is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import simpy
from simpy.events import NORMAL

__all__ = ["call_after"]


class _Call:
    """The part of a SimPy event that ``Environment.step`` reads: ``callbacks`` and ``_ok``."""

    __slots__ = ("args", "callbacks", "fn")
    _ok = True  # processed like a succeeded Timeout (never a failure to re-raise)

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.callbacks: list[Callable[[Any], None]] | None = [_fire]
        self.fn = fn
        self.args = args


def _fire(ev: _Call) -> None:
    ev.fn(*ev.args)


def call_after(env: simpy.Environment, delay: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` ``delay`` ns from now (``delay`` >= 0), in Timeout order."""
    env.schedule(_Call(fn, args), NORMAL, delay)  # type: ignore[arg-type]
