"""``call_after`` pushes its call on SimPy's queue itself: it must run exactly where a Timeout made
at the same moment would, among Timeouts, processes and other calls (every trace depends on it)."""

from __future__ import annotations

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.backends.simfabric.calls import call_after

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
