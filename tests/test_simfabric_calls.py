"""``call_after`` pushes its call on SimPy's queue itself: it must run exactly where a Timeout made
at the same moment would, among Timeouts, processes and other calls (every trace depends on it)."""

from __future__ import annotations

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.backends.simfabric.calls import DeadlineTimer, FarTimeouts, call_after

# Each op: (made at, delay, made by call_after?); delays collide often so ties are exercised.
OPS = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 3), st.booleans()),
    min_size=1,
    max_size=40,
)


def _order(ops: list[tuple[int, int, bool]], use_calls: bool) -> list[tuple[int, int]]:
    """Run ``ops`` from one process (each made at its time) and return (time, index) as they fire."""
    env = simpy.Environment()
    fired: list[tuple[int, int]] = []

    def fire(i: int) -> None:
        fired.append((int(env.now), i))
        if i % 3 == 0:  # a call made while firing lands among the rest, at this instant or later
            env.timeout(i % 2).callbacks.append(lambda _e, i=i: fired.append((int(env.now), -i - 1)))

    def driver():  # type: ignore[no-untyped-def]
        for i, (at, delay, as_call) in sorted(enumerate(ops), key=lambda t: (t[1][0], t[0])):
            if at > env.now:
                yield env.timeout(at - env.now)
            if as_call and use_calls:
                call_after(env, delay, fire, i)
            else:
                env.timeout(delay).callbacks.append(lambda _e, i=i: fire(i))

    env.process(driver())
    env.run()
    return fired


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_calls_run_where_timeouts_made_at_the_same_moment_would(ops: list[tuple[int, int, bool]]) -> None:
    assert _order(ops, use_calls=True) == _order(ops, use_calls=False)


def test_a_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="negative delay"):
        call_after(simpy.Environment(), -1, print)


def _far_order(ops: list[tuple[int, int, bool]], use_far: bool) -> list[tuple[int, int]]:
    """Like ``_order``, each op a process waiting on a timeout (a far one or SimPy's own) made at
    its time; others made by firing ops land among them."""
    env = simpy.Environment()
    far = FarTimeouts(env)
    fired: list[tuple[int, int]] = []

    def waiter(i: int, delay: int, as_far: bool):  # type: ignore[no-untyped-def]
        yield far.timeout(delay) if as_far and use_far else env.timeout(delay)
        fired.append((int(env.now), i))
        if i % 3 == 0:  # made while firing: at this instant or later, far or not
            env.process(waiter(-i - 1, i % 2, i % 2 == 0))

    def driver():  # type: ignore[no-untyped-def]
        for i, (at, delay, as_far) in sorted(enumerate(ops), key=lambda t: (t[1][0], t[0])):
            if at > env.now:
                yield env.timeout(at - env.now)
            env.process(waiter(i, delay * 7 % 11, as_far))

    env.process(driver())
    env.run()
    return fired


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_far_timeouts_fire_where_timeouts_made_at_the_same_moment_would(
    ops: list[tuple[int, int, bool]],
) -> None:
    assert _far_order(ops, use_far=True) == _far_order(ops, use_far=False)


def test_far_timeouts_stay_off_the_queue_until_they_are_next() -> None:
    env = simpy.Environment()
    far = FarTimeouts(env)
    events = [far.timeout(d) for d in (50, 10, 30, 20, 40)]
    # The first made, then each one earlier than every one queued: 50, 10; the rest wait.
    assert len(env._queue) == 2  # type: ignore[attr-defined]
    got: list[int] = []
    for ev in events:
        ev.callbacks.append(lambda _e: got.append(int(env.now)))
    env.run()
    assert got == [10, 20, 30, 40, 50]


def test_a_negative_far_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="negative delay"):
        FarTimeouts(simpy.Environment()).timeout(-1)


class _NaiveTimer:
    """``DeadlineTimer``'s plain form: a call per set, which does nothing unless still the last."""

    def __init__(self, env: simpy.Environment, fn) -> None:  # type: ignore[no-untyped-def]
        self.env, self.fn, self.gen = env, fn, 0

    def set(self, delay: int) -> None:
        self.gen += 1
        call_after(self.env, delay, self._fired, self.gen)

    def _fired(self, gen: int) -> None:
        if gen == self.gen:
            self.fn()


def _timer_order(ops: list[tuple[int, int, bool]], held: bool) -> tuple[list[tuple[int, int]], int]:
    """Sets of one timer (``True`` ops) among plain calls, each made at its time; a firing timer
    re-arms itself at times (as a rank's wake-up sets its next deadline) and a call may land at
    its instant. Returns what fired, in order, and the most timer calls ever on SimPy's queue."""
    env = simpy.Environment()
    fired: list[tuple[int, int]] = []
    seen = [0]

    def on_timer() -> None:
        fired.append((int(env.now), -1))
        if len(fired) % 2:
            timer.set(len(fired) % 3)
        else:
            call_after(env, 0, lambda: fired.append((int(env.now), -2)))

    timer = (DeadlineTimer if held else _NaiveTimer)(env, on_timer)

    def driver():  # type: ignore[no-untyped-def]
        for i, (at, delay, is_set) in sorted(enumerate(ops), key=lambda t: (t[1][0], t[0])):
            if at > env.now:
                yield env.timeout(at - env.now)
            if is_set:
                timer.set(delay * 5 % 7)
            else:
                call_after(env, delay, lambda i=i: fired.append((int(env.now), i)))
            ours = sum(1 for e in env._queue if getattr(getattr(e[3], "fn", None), "__self__", None) is timer)  # type: ignore[attr-defined]
            seen[0] = max(seen[0], ours)

    env.process(driver())
    env.run()
    return fired, seen[0]


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_a_deadline_timer_fires_where_a_checked_call_per_set_would(ops: list[tuple[int, int, bool]]) -> None:
    held, held_queued = _timer_order(ops, held=True)
    plain, plain_queued = _timer_order(ops, held=False)
    assert held == plain
    assert held_queued <= plain_queued


def test_a_deadline_moved_later_keeps_one_call_on_the_queue() -> None:
    env = simpy.Environment()
    got: list[int] = []
    timer = DeadlineTimer(env, lambda: got.append(int(env.now)))
    for delay in (10, 20, 30, 40):  # each set moves the deadline later
        timer.set(delay)
    assert len(env._queue) == 1  # type: ignore[attr-defined]  # the first; the last is held
    env.run()
    assert got == [40]
    timer.set(5)
    timer.set(3)  # earlier: queued at once; the 5 stays queued and does nothing
    assert len(env._queue) == 2  # type: ignore[attr-defined]
    env.run()
    assert got == [40, 43]
    with pytest.raises(ValueError, match="negative delay"):
        timer.set(-1)
