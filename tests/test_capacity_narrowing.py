"""Narrowing a configuration's maximum rate (sim/deploy/capacity.py ``max_rate``): whatever the
guess, the answer stays bracketed (a rate met below it, one missed or the bound above); a good
guess closes the interval in one round. Steady-state runs are replaced by a threshold: a rate
is met when it is at most the configuration's true capacity."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.sim.deploy import capacity
from kvferry.sim.deploy.capacity import _next_rates, max_rate
from kvferry.sim.deploy.spec import DeploySpec


class _Threshold:
    """A runner whose runs meet their rate when it is at most ``capacity``."""

    def __init__(self, jobs: int, capacity_rps: float) -> None:
        self.jobs, self.capacity, self.rates = jobs, capacity_rps, []  # type: ignore[var-annotated]

    def map(self, jobs: Sequence[tuple[Any, ...]]) -> list[list[bool]]:
        self.rates.append([j[1] for j in jobs])
        return [[j[1] <= self.capacity] for j in jobs]


@pytest.fixture(autouse=True)
def _met_by_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity, "meets", lambda rs, target: rs[0])


@settings(max_examples=300, deadline=None)
@given(
    lo=st.floats(0.0, 50.0),
    width=st.floats(0.001, 100.0),
    k=st.integers(1, 4),
    near=st.one_of(st.just(0.0), st.floats(0.01, 200.0)),
    span=st.floats(0.005, 0.5),
)
def test_rates_are_distinct_and_strictly_inside(
    lo: float, width: float, k: int, near: float, span: float
) -> None:
    hi = lo + width
    rates = _next_rates(lo, hi, k, near, span)
    assert len(rates) == k and rates == sorted(set(rates))
    assert all(lo < r < hi for r in rates), (lo, hi, rates)


@settings(max_examples=200, deadline=None)
@given(
    capacity_share=st.floats(0.05, 0.99),
    guess_error=st.one_of(st.just(None), st.floats(-0.5, 0.5)),
    jobs=st.integers(1, 3),
    steps=st.integers(1, 4),
    lo_share=st.sampled_from([0.0, 0.02]),
)
def test_the_answer_stays_bracketed_whatever_the_guess(
    capacity_share: float, guess_error: float | None, jobs: int, steps: int, lo_share: float
) -> None:
    bound = 10.0
    truth = capacity_share * bound
    lo0 = lo_share * bound if lo_share * bound <= truth else 0.0
    guess = 0.0 if guess_error is None else truth * (1 + guess_error)
    runner = _Threshold(jobs, truth)
    lo, hi = max_rate(DeploySpec(), None, (1,), 0.9, lo0, bound, steps, None, runner, None, guess)  # type: ignore[arg-type]
    assert lo0 <= lo <= truth < hi <= bound, (truth, guess, lo, hi, runner.rates)
    rounds = steps + (1 if guess else 0)
    assert len(runner.rates) <= rounds


@pytest.mark.parametrize("error", [-0.015, 0.0, 0.015])
def test_a_good_guess_closes_the_interval_in_one_round(error: float) -> None:
    truth = 7.3
    runner = _Threshold(2, truth)
    runs = [0]
    lo, hi = max_rate(DeploySpec(), None, (1,), 0.9, 0.0, 10.0, 3, None, runner, runs, truth * (1 + error))  # type: ignore[arg-type]
    assert runs == [2] and len(runner.rates) == 1
    assert lo <= truth < hi and hi - lo <= 0.05 * lo


def test_without_a_guess_the_first_round_bisects() -> None:
    runner = _Threshold(2, 7.3)
    max_rate(DeploySpec(), None, (1,), 0.9, 0.0, 9.0, 1, None, runner)  # type: ignore[arg-type]
    assert runner.rates == [[3.0, 6.0]]


@settings(max_examples=200, deadline=None)
@given(
    a=st.floats(0.2, 5.0),
    top=st.floats(0.5, 1.0),
    ps=st.lists(st.integers(1, 8), min_size=3, max_size=3, unique=True),
)
def test_a_share_on_the_queueing_curve_is_drawn_exactly(a: float, top: float, ps: list[int]) -> None:
    """Shares on ``top * a p / (1 + a p)`` (1/share linear in 1/p): two of them give the third."""

    def share(p: int) -> float:
        return top * a * p / (1 + a * p)

    p, p1, p2 = ps
    assert capacity._share_at(p, [(p1, share(p1)), (p2, share(p2))]) == pytest.approx(min(1.0, share(p)))


@given(
    y1=st.floats(0.05, 1.0),
    y2=st.floats(0.05, 1.0),
    p=st.integers(1, 8),
    p1=st.integers(1, 8),
    p2=st.integers(1, 8),
)
def test_a_drawn_share_is_the_newest_unless_shares_rise_and_never_above_the_bound(
    y1: float, y2: float, p: int, p1: int, p2: int
) -> None:
    if p1 == p2:
        return
    got = capacity._share_at(p, [(p1, y1), (p2, y2)])
    assert 0 < got <= 1.0
    if (y2 - y1) * (p2 - p1) <= 0:  # flat or falling with more instances: no curve to draw
        assert got == y1
    assert capacity._share_at(p, [(p1, y1)]) == y1


def _sized(flow: str, p: int, max_rps: float, below: float, staging: int) -> capacity.Candidate:
    c = capacity.Candidate(8, 4, flow, p, p, 99.0, "prefill compute", staging_bytes=staging)
    c.max_rps, c.max_rps_below = max_rps, below
    return c


def test_the_most_a_gpu_breaks_a_tie_within_the_intervals_by_staging_memory() -> None:
    ring, pinned = _sized("ring", 2, 10.0, 10.4, 100 << 20), _sized("pinned", 2, 10.2, 10.6, 200 << 20)
    best, why = capacity._best_per_gpu([pinned, ring])
    assert best is ring, why  # pinned was seen higher, but ring could sustain as much: a tie
    assert "tied within the narrowing's intervals with 2P x TP8 + 2D x TP4 with pinned" in why
    assert "chosen for less staging memory (100 MiB a rank pair)" in why
    clear = _sized("pinned", 2, 10.5, 10.9, 200 << 20)  # met more than ring could: no tie
    best, why = capacity._best_per_gpu([ring, clear])
    assert best is clear and "tied" not in why
    assert capacity._best_per_gpu([_sized("ring", 1, 0.0, 1.0, 0)]) == (
        None,
        "no configuration sustains any rate within the SLOs",
    )
