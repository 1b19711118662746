"""Where a configuration's narrowing starts (sim/deploy/capacity.py ``_guess``): no simulation,
configurations with their results set by hand."""

from __future__ import annotations

import pytest
from kvferry.sim.deploy import capacity
from kvferry.sim.deploy.capacity import Candidate


def _cand(flow: str, p: int, d: int, bound: float, limit: str, got: float | None = None) -> Candidate:
    c = Candidate(8, 4, flow, p, d, bound, limit)
    c.max_rps = got
    return c


def _no_wait(_: Candidate) -> None:
    pass


RING, PRE = "ring", "prefill compute"


def test_a_chain_at_its_bound_starts_the_next_one_there_without_reading_other_flows() -> None:
    """Ring's last two instance counts each sustained the last 5% below their bound: ring at the
    next count starts there too, reading only ring's results (not pinned's of its count, which
    would make the two wait for each other)."""
    r3 = _cand(RING, 3, 3, 10.0, PRE, 10.0 / 1.05)
    r4 = _cand(RING, 4, 4, 13.0, PRE, 13.0 / 1.05)
    other = _cand("pinned", 5, 5, 17.0, PRE, 12.0)  # same count and side: the older rule's source
    read: list[Candidate] = []
    c = _cand(RING, 5, 5, 17.0, PRE)
    assert capacity._guess(c, r4.max_rps or 0.0, [r3, r4, other], read.append) == pytest.approx(17.0 / 1.05)
    assert other not in read


def test_a_chain_short_of_its_bound_takes_the_share_of_another_flow_of_its_count() -> None:
    """One of the two short of the last 5% (90% of its bound): not at the bound, so the share
    that pinned of as many instances sustained (80%) is the guess, as before."""
    r3 = _cand(RING, 3, 3, 10.0, PRE, 9.0)
    r4 = _cand(RING, 4, 4, 13.0, PRE, 13.0 / 1.05)
    other = _cand("pinned", 5, 5, 17.0, PRE, 0.8 * 17.0)
    c = _cand(RING, 5, 5, 17.0, PRE)
    assert capacity._guess(c, 12.0, [r3, r4, other], _no_wait) == pytest.approx(0.8 * 17.0)
    assert capacity._at_bound(c, [r3, r4], _no_wait) == 0.0
    # One smaller configuration at its bound is not yet a chain at its bound.
    assert capacity._at_bound(c, [r4], _no_wait) == 0.0


def test_the_first_of_a_side_with_a_rate_from_below_starts_at_the_share_of_its_count() -> None:
    """Pull at eight decode instances is the first configuration limited by decode's NIC: with
    the rate its smaller neighbour sustained (``lo``) and nothing limited alike, it starts at the
    share that the latest configuration of as many prefill instances sustained (75%), not just
    above ``lo`` (bisecting up from far below)."""
    pull_1 = _cand("pull", 1, 5, 3.4, PRE, 1.7)
    ring_2 = _cand(RING, 2, 2, 6.8, PRE, 0.75 * 6.8)
    c = _cand("pull", 2, 8, 6.0, "decode NIC")
    assert capacity._guess(c, 1.7, [pull_1, ring_2], _no_wait) == pytest.approx(0.75 * 6.0)
    # Without a rate from below it bisects (0: no guess), and a share below ``lo`` gives ``lo``.
    assert capacity._guess(c, 0.0, [pull_1, ring_2], _no_wait) == 0.0
    assert capacity._guess(c, 5.0, [pull_1, ring_2], _no_wait) == 5.0
