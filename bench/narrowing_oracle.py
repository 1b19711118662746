"""How many steady-state runs the capacity search's narrowing (sim/deploy/capacity.py ``max_rate``)
takes, and how narrow it ends, against a threshold oracle: a rate is met when it is at most the
configuration's true capacity. No simulation: the search's logic alone, over guesses of a given
error, against bisection (no guess). Run time counts a run met as its rate and one missed as two
thirds of it (a run's requests scale with its rate; one that misses stops early), over the answer.

Run: ``uv run python bench/narrowing_oracle.py [--draws 300] [--steps 3] [--jobs 2]``
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from typing import Any

from kvferry.sim.deploy import capacity
from kvferry.sim.deploy.spec import DeploySpec


class _Threshold:
    def __init__(self, jobs: int, capacity_rps: float) -> None:
        self.jobs, self.capacity, self.cost = jobs, capacity_rps, 0.0

    def map(self, jobs: Sequence[tuple[Any, ...]]) -> list[list[bool]]:
        met = [j[1] <= self.capacity for j in jobs]
        self.cost += sum(j[1] * (1.0 if m else _MISS) for j, m in zip(jobs, met, strict=True))
        return [[m] for m in met]


_MISS = 0.65  # a run that misses stops early: about this share of a run met at its rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=300)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    capacity.meets = lambda rs, target: rs[0]  # type: ignore[assignment]
    bound = 10.0
    print("guess error | runs a configuration | run time / answer | ends wider than 5% | mean width / answer")
    for spread in (None, 0.05, 0.1, 0.25, 0.4):
        rnd = random.Random(2)
        runs_total, wide, width, cost = 0, 0, 0.0, 0.0
        for _ in range(args.draws):
            truth = rnd.uniform(0.5, 0.99) * bound
            guess = 0.0 if spread is None else truth * rnd.uniform(1 - spread, 1 + spread)
            runs = [0]
            runner = _Threshold(args.jobs, truth)
            lo, hi = capacity.max_rate(
                DeploySpec(), None, (1,), 0.9, 0.0, bound, args.steps, None,  # type: ignore[arg-type]
                runner, runs, guess,  # type: ignore[arg-type]
            )  # fmt: skip
            cost += runner.cost / truth
            assert lo <= truth < hi, (truth, guess, lo, hi)
            runs_total += runs[0]
            wide += hi - lo > 0.05 * max(lo, 1e-9)
            width += (hi - lo) / truth
        name = "none (bisection)" if spread is None else f"within {spread:.0%}"
        print(
            f"{name} | {runs_total / args.draws:.2f} | {cost / args.draws:.2f} | {wide / args.draws:.0%} | "
            f"{width / args.draws:.1%}"
        )


if __name__ == "__main__":
    main()
