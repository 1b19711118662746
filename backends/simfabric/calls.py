"""Scheduled calls: ``fn(*args)`` run by SimPy after a delay.

A call is a SimPy ``Timeout`` (public API: constructed with its environment and delay, which
schedules it with the key every Timeout gets, then a callback appended) that carries ``fn`` and
``args`` itself, so the simulator's tens of calls per room (deliveries, landings, timers, deferred
reactions) need no closure each. It runs at the same step any Timeout created at the same moment
would: the event order, and so every trace, is that of ``env.timeout(delay)`` with one callback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import simpy
from simpy.events import Timeout

__all__ = ["call_after"]


class _Call(Timeout):
    def __init__(
        self, env: simpy.Environment, delay: int, fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        super().__init__(env, delay)
        self.fn = fn
        self.args = args
        self.callbacks.append(_fire)  # type: ignore[union-attr]  # None only once processed


def _fire(ev: Any) -> None:
    ev.fn(*ev.args)


def call_after(env: simpy.Environment, delay: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` ``delay`` ns from now (``delay`` >= 0), in Timeout order."""
    _Call(env, delay, fn, args)
