"""Steps run at once with the outcome of running them in order (sim/deploy/in_order.py), and the
capacity search narrowing configurations side by side with it: every configuration takes the
same rates, whichever run finishes first."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.sim.deploy import capacity
from kvferry.sim.deploy.capacity import Workload, search
from kvferry.sim.deploy.in_order import InOrder
from kvferry.sim.deploy.spec import DeploySpec

from tests import executor_jobs as fns


def _outcomes(reads: list[list[int]], parallel: bool, sleeps: list[float], wait: bool = True) -> list[int]:
    """Step i records 1 + the sum of what the steps it reads recorded (0 for one not recorded)."""
    got = [0] * len(reads)
    steps = InOrder(len(reads), parallel)

    def step(i: int) -> None:
        total = 1
        for j in reads[i]:
            if wait:
                steps.wait(j)
            total += got[j]
        time.sleep(sleeps[i])
        got[i] = total

    steps.run(step)
    return got


@st.composite
def _dags(draw: Any) -> tuple[list[list[int]], list[float]]:
    n = draw(st.integers(1, 8))
    reads = [draw(st.lists(st.integers(0, i - 1), max_size=3)) if i else [] for i in range(n)]
    return reads, [draw(st.sampled_from([0.0, 0.001, 0.005])) for _ in range(n)]


@settings(max_examples=40, deadline=None)
@given(_dags())
def test_steps_at_once_record_what_they_would_in_order(dag: tuple[list[list[int]], list[float]]) -> None:
    reads, sleeps = dag
    assert _outcomes(reads, True, sleeps) == _outcomes(reads, False, sleeps)


def test_without_the_waits_a_step_reads_what_is_not_there_yet() -> None:
    """The planted bug the test above must catch: a later step that does not wait for a slow one."""
    reads, sleeps = [[], [0]], [0.05, 0.0]
    assert _outcomes(reads, True, sleeps, wait=False) != _outcomes(reads, False, sleeps)


def test_a_failing_step_is_re_raised_and_the_steps_waiting_for_it_give_up() -> None:
    ran: list[int] = []
    steps = InOrder(4, parallel=True)

    def step(i: int) -> None:
        if i == 1:
            raise ValueError("step 1 broke")
        if i in (2, 3):
            steps.wait(1)  # never gets past: step 1 failed
        ran.append(i)

    with pytest.raises(ValueError, match="step 1 broke"):
        steps.run(step)
    assert ran == [0] and steps.stopped


@pytest.mark.parametrize("planted", [False, True])
def test_the_search_narrows_side_by_side_exactly_as_in_order(
    monkeypatch: pytest.MonkeyPatch, planted: bool
) -> None:
    """``planted``: the steps do not wait for what they read, and the tables must differ."""
    monkeypatch.setattr(capacity, "_runs", fns.capacity_by_threshold)
    monkeypatch.setattr(capacity, "meets", lambda rs, target: rs[0].met)
    flows = ["direct", "push", "ring", "pinned", "pull"]
    spec = DeploySpec(model="llama-3.1-70b", prefill_tp=8, decode_tp=4)
    w = Workload(8192, 500)

    def table(side_by_side: bool, rate: float | None) -> list[tuple[Any, ...]]:
        # Two workers either way (a round tries as many rates as there are workers); in order:
        # one configuration after the other, as before the search narrowed them side by side.
        monkeypatch.setattr(capacity, "InOrder", lambda n, parallel: InOrder(n, parallel and side_by_side))
        cap = search(spec, [(8, 4)], lambda s: flows, w, rate, max_instances=4, jobs=2)
        cs = cap.candidates
        return [(c.name, c.flow, c.max_rps, c.max_rps_below, c.max_rps_runs, c.max_rps_from) for c in cs]

    for rate in (None, 3.0):
        in_order = table(False, rate)
        assert sum(1 for row in in_order if row[4]) >= 8, "few configurations narrowed: the test tests little"
        if planted:
            monkeypatch.setattr(InOrder, "wait", lambda self, i: None)
            assert table(True, rate) != in_order
            return
        assert table(True, rate) == in_order
