"""Scheduled calls: ``fn(*args)`` run by SimPy after a delay.

A call is pushed on SimPy's event queue with exactly the key ``env.timeout(delay)`` would get
(time, NORMAL priority, the environment's next event id), so it runs at the same step such a
Timeout with one callback would: the event order, and so every trace, is unchanged. It is not a
``Timeout``: a slotted object carrying ``fn`` and ``args`` with the two attributes
``Environment.step`` reads (``callbacks``, ``_ok``), so the simulator's tens of calls per room
(deliveries, landings, timers, deferred reactions) skip the Event constructor chain and
``schedule``'s call (about a third of a call's cost). Nothing else in SimPy sees these objects:
no process waits on them.

``FarTimeouts`` serves timeouts set far ahead in bulk (every request's arrival, set when the run
starts): each keeps the key its ``env.timeout`` would have had, but only the earliest few sit on
SimPy's queue, so the queue holds what is in flight rather than every request still to come (a
10,000-room run paid about 12 comparisons per queue operation instead of about 5).
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappop, heappush
from typing import Any

import simpy
from simpy.events import NORMAL

__all__ = ["DeadlineTimer", "FarTimeouts", "call_after"]


def _fire(ev: Any) -> None:
    ev.fn(*ev.args)


_FIRE = (_fire,)  # the callbacks ``step`` runs; it sets ``callbacks`` to None after reading it


class _Call:
    """Filled in by ``call_after`` itself: no ``__init__`` frame per call (dozens per room)."""

    __slots__ = ("args", "callbacks", "fn")
    _ok = True  # ``step`` crashes the run on an event that is not ok
    callbacks: tuple[Callable[[Any], None], ...] | None
    fn: Callable[..., Any]
    args: tuple[Any, ...]


def call_after(env: simpy.Environment, delay: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` ``delay`` ns from now (``delay`` >= 0), in Timeout order."""
    if delay < 0:
        raise ValueError(f"negative delay {delay}")
    call = _Call()
    call.callbacks, call.fn, call.args = _FIRE, fn, args
    # Environment.schedule's key, inlined: the same queue, priority and id counter as a Timeout.
    heappush(env._queue, (env._now + delay, NORMAL, next(env._eid), call))  # type: ignore[misc]


class DeadlineTimer:
    """One timer that each ``set`` re-arms: ``fn()`` runs for the last ``set`` only, at the step
    where ``call_after(env, delay, fn)`` made at that ``set`` would run (its key, and so its
    order among same-time events, is taken at the ``set``).

    The plain way, a ``call_after`` per ``set`` whose call checks that it is still the latest,
    leaves each replaced call on SimPy's queue until its time: a rank's deadline moves several
    times a room, so most of the queue was such calls, compared on every push and pop. Here a
    call whose time comes after one of ours still queued is held off the queue until that one
    fires (``FarTimeouts``' argument: it is later, so it is queued before it can be due), and a
    held one that a newer ``set`` replaces never joins. A replaced call already queued still
    fires and does nothing.
    """

    __slots__ = ("_gen", "_held", "_queued", "env", "fn")

    def __init__(self, env: simpy.Environment, fn: Callable[[], Any]) -> None:
        self.env, self.fn = env, fn
        self._gen = 0  # the last set's; a call of an older one does nothing
        self._queued: list[tuple[int | float, int]] = []  # (time, event id) of ours on the queue
        self._held: tuple[int | float, int, int] | None = None  # (time, event id, gen) off it

    def set(self, delay: int) -> None:
        if delay < 0:
            raise ValueError(f"negative delay {delay}")
        env = self.env
        self._gen += 1
        key = (env._now + delay, next(env._eid))  # type: ignore[attr-defined]
        if self._queued and self._queued[0] < key:
            self._held = (key[0], key[1], self._gen)
        else:
            self._held = None  # replaced before it joined: it would only have done nothing
            self._enqueue(key[0], key[1], self._gen)

    def _enqueue(self, at: int | float, eid: int, gen: int) -> None:
        heappush(self._queued, (at, eid))
        call = _Call()
        call.callbacks, call.fn, call.args = _FIRE, self._fired, (gen,)
        heappush(self.env._queue, (at, NORMAL, eid, call))  # type: ignore[attr-defined]

    def _fired(self, gen: int) -> None:
        heappop(self._queued)  # ours fire in key order: this was the earliest
        held = self._held
        if held is not None:  # later than this one: its turn to join the queue
            self._held = None
            self._enqueue(*held)
        if gen == self._gen:
            self.fn()


class FarTimeouts:
    """``timeout(delay)``: an event that fires exactly where ``env.timeout(delay)`` made now would
    (same time, priority and event id), put on SimPy's queue only once it is the earliest of
    those still off it.

    Why that order holds: ours on the queue fire in key order, so the one firing is the earliest
    of them (``_queued[0]``); when it fires, the earliest waiting one joins the queue. A new one
    earlier than every one of ours on the queue joins at once. So every waiting key is later than
    some key of ours on the queue, and is on the queue before SimPy's clock can pass it.
    """

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        # SimPy's clock is int | float (ints here); not ``float``: mypyc would store a float.
        self._queued: list[tuple[int | float, int]] = []  # (time, event id) of ours on SimPy's queue
        self._waiting: list[tuple[int | float, int, simpy.Event]] = []  # off the queue, by (time, id)

    def timeout(self, delay: int) -> simpy.Event:
        if delay < 0:
            raise ValueError(f"negative delay {delay}")
        env = self.env
        ev = simpy.Event(env)
        ev._ok, ev._value = True, None  # triggered, as a Timeout is from its creation
        ev.callbacks.append(self._fired)  # before the waiting process's own callback
        key = (env._now + delay, next(env._eid))  # type: ignore[attr-defined]
        if not self._queued or key < self._queued[0]:
            self._enqueue(key, ev)
        else:
            heappush(self._waiting, (*key, ev))
        return ev

    def _enqueue(self, key: tuple[int | float, int], ev: simpy.Event) -> None:
        heappush(self._queued, key)
        heappush(self.env._queue, (key[0], NORMAL, key[1], ev))  # type: ignore[attr-defined]

    def _fired(self, _ev: simpy.Event) -> None:
        heappop(self._queued)
        if self._waiting:
            t, eid, nxt = heappop(self._waiting)
            self._enqueue((t, eid), nxt)
