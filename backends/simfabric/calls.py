"""Scheduled calls: ``fn(*args)`` run by SimPy after a delay.

A call is pushed on SimPy's event queue with exactly the key ``env.timeout(delay)`` would get
(time, NORMAL priority, the environment's next event id), so it runs at the same step such a
Timeout with one callback would: the event order, and so every trace, is unchanged. It is not a
``Timeout``: a slotted object carrying ``fn`` and ``args`` with the two attributes
``Environment.step`` reads (``callbacks``, ``_ok``), so the simulator's tens of calls per room
(deliveries, landings, timers, deferred reactions) skip the Event constructor chain and
``schedule``'s call (about a third of a call's cost). Nothing else in SimPy sees these objects:
no process waits on them.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappush
from typing import Any

import simpy
from simpy.events import NORMAL

__all__ = ["call_after"]


def _fire(ev: Any) -> None:
    ev.fn(*ev.args)


_FIRE = (_fire,)  # the callbacks ``step`` runs; it sets ``callbacks`` to None after reading it


class _Call:
    __slots__ = ("args", "callbacks", "fn")
    _ok = True  # ``step`` crashes the run on an event that is not ok

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.callbacks: tuple[Callable[[Any], None], ...] | None = _FIRE
        self.fn = fn
        self.args = args


def call_after(env: simpy.Environment, delay: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` ``delay`` ns from now (``delay`` >= 0), in Timeout order."""
    if delay < 0:
        raise ValueError(f"negative delay {delay}")
    # Environment.schedule's key, inlined: the same queue, priority and id counter as a Timeout.
    heappush(env._queue, (env._now + delay, NORMAL, next(env._eid), _Call(fn, args)))  # type: ignore[attr-defined]
