"""``call_after`` pushes its call on SimPy's queue itself: it must run exactly where a Timeout made
at the same moment would, among Timeouts, processes and other calls (every trace depends on it)."""

from __future__ import annotations

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.backends.simfabric.calls import FarTimeouts, call_after

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
