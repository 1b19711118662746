"""Narrowing a configuration's maximum rate (sim/deploy/capacity.py ``max_rate``): whatever the
guess, the answer stays bracketed (a rate met below it, one missed or the bound above); a guess
within 5% closes the interval in two runs. Steady-state runs are replaced by a threshold: a rate
is met when it is at most the configuration's true capacity."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.sim.deploy import capacity
from kvferry.sim.deploy.capacity import _next_rate, max_rate
from kvferry.sim.deploy.spec import DeploySpec


class _Threshold:
    """A runner whose runs meet their rate when it is at most ``capacity``."""

    def __init__(self, capacity_rps: float) -> None:
        self.jobs, self.capacity, self.rates = 1, capacity_rps, []  # type: ignore[var-annotated]

    def map(self, jobs: Sequence[tuple[Any, ...]]) -> list[list[bool]]:
        self.rates.extend(j[1] for j in jobs)
        return [[j[1] <= self.capacity] for j in jobs]


def _narrow(
    truth: float, lo: float, hi: float, steps: int, guess: float = 0.0
) -> tuple[float, float, list[float]]:
    runner = _Threshold(truth)
    lo, hi = max_rate(DeploySpec(), None, (1,), 0.9, lo, hi, steps, None, runner, None, guess)  # type: ignore[arg-type]
    return lo, hi, runner.rates


@pytest.fixture(autouse=True)
def _met_by_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity, "meets", lambda rs, target: rs[0])


@settings(max_examples=500, deadline=None)
@given(
    lo=st.one_of(st.just(0.0), st.floats(0.01, 50.0)),
    width=st.floats(0.001, 100.0),
    aim=st.one_of(st.just(0.0), st.floats(0.001, 200.0)),
    last=st.sampled_from([None, True, False]),
)
def test_a_rate_lies_strictly_inside_and_no_nearer_an_end_than_it_must(
    lo: float, width: float, aim: float, last: bool | None
) -> None:
    hi = lo + width
    r = _next_rate(lo, hi, aim, last)
    assert lo < r < hi, (lo, hi, aim, r)
    if aim and hi > lo * 1.05**2:  # room for a rate 5% from both ends
        assert lo * 1.05 * (1 - 1e-12) <= r <= hi / 1.05 * (1 + 1e-12), (lo, hi, aim, r)


@settings(max_examples=300, deadline=None)
@given(
    capacity_share=st.floats(0.05, 0.99),
    guess_error=st.one_of(st.just(None), st.floats(-0.6, 0.6)),
    steps=st.integers(1, 10),
    lo_share=st.sampled_from([0.0, 0.02, 0.5]),
)
def test_the_answer_stays_bracketed_whatever_the_guess(
    capacity_share: float, guess_error: float | None, steps: int, lo_share: float
) -> None:
    bound = 10.0
    truth = capacity_share * bound
    lo0 = lo_share * bound if lo_share * bound <= truth else 0.0
    guess = 0.0 if guess_error is None else max(lo0, truth * (1 + guess_error))
    lo, hi, rates = _narrow(truth, lo0, bound, steps, guess)
    assert lo0 <= lo <= truth < hi <= bound, (truth, guess, lo, hi, rates)
    assert len(rates) <= steps
    if len(rates) < steps:  # stopped early: only once the interval was closed
        assert hi <= lo * 1.05, (truth, guess, lo, hi, rates)


@settings(max_examples=300, deadline=None)
@given(
    capacity_share=st.floats(0.25, 0.99),
    guess_error=st.one_of(st.just(None), st.floats(-0.4, 0.4)),
)
def test_eight_steps_close_any_interval_the_bound_leaves(
    capacity_share: float, guess_error: float | None
) -> None:
    """The default steps suffice from nothing known but the bound, for an answer at a quarter
    of it or more (the 70B table's are at 0.5-1.0), with a guess up to 40% off either way (7
    steps at most; none: 6)."""
    truth = capacity_share * 10.0
    guess = 0.0 if guess_error is None else truth * (1 + guess_error)
    lo, hi, rates = _narrow(truth, 0.0, 10.0, 8, guess)
    assert lo <= truth < hi <= lo * 1.05, (truth, guess, rates)


@pytest.mark.parametrize("error", [-0.047, -0.02, 0.0, 0.02, 0.047])
def test_a_guess_within_5_percent_closes_the_interval_in_two_runs(error: float) -> None:
    truth = 7.3
    lo, hi, rates = _narrow(truth, 0.0, 10.0, 8, truth * (1 + error))
    assert len(rates) == 2, rates
    assert lo <= truth < hi <= lo * 1.05


def test_a_guess_a_little_too_high_steps_down_5_percent_twice_before_striding_further() -> None:
    """A guess 7% above the answer: two misses 5% apart, then a run met 5% below the second,
    which closes it (three runs; a stride of 15% after the second miss took five)."""
    guess = 7.3 * 1.07
    lo, hi, rates = _narrow(7.3, 0.0, 10.0, 8, guess)
    assert rates == pytest.approx([guess, guess / 1.05, guess / 1.05**2])
    assert lo <= 7.3 < hi <= lo * 1.05
    # Three misses in a row: the stride then grows (15%), as above a run met.
    guess = 7.3 * 1.2
    _, _, rates = _narrow(7.3, 0.0, 10.0, 8, guess)
    assert rates[:4] == pytest.approx([guess, guess / 1.05, guess / 1.05**2, guess / 1.05**2 / 1.15])


def test_a_guess_of_just_above_a_rate_met_takes_one_run_when_that_is_all_there_is() -> None:
    """A larger configuration's first run, just above what a smaller one sustained: a miss
    (the side that limits both is already full) settles it."""
    lo, hi, rates = _narrow(4.6, 4.5, 6.0, 8, guess=4.5)
    assert rates == [pytest.approx(4.5 * 1.05)] and (lo, hi) == (4.5, pytest.approx(4.725))


def test_without_a_guess_each_step_bisects() -> None:
    _, _, rates = _narrow(7.3, 0.0, 9.0, 3)
    assert rates == pytest.approx([4.5, math.sqrt(4.5 * 9.0), math.sqrt(math.sqrt(4.5 * 9.0) * 9.0)])


def test_a_guess_far_off_gallops_no_further_than_the_middle() -> None:
    """A guess at a tenth of the answer: each step three times as far as the last, never past
    the geometric middle of what is left, so it rises every step and still closes."""
    lo, hi, rates = _narrow(9.0, 0.0, 10.0, 12, guess=0.9)
    met = [r for r in rates if r <= 9.0]
    assert met == sorted(met)
    assert rates[1] == pytest.approx(0.9 * 1.05) and rates[2] == pytest.approx(0.945 * 1.15)
    assert lo <= 9.0 < hi <= lo * 1.05 and len(rates) <= 10, rates


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
