"""The capacity search's narrowing replayed on recorded answers: how many steady-state runs each
flow's balanced configurations take, with the search's own guesses or with another guess, and no
simulation. A configuration meets a rate when the rate is at most its recorded capacity (the
geometric middle of the interval its real search ended with), so a replay of the current code takes
exactly the runs the recorded search took; a different guess shows what it would have taken.

Input: the JSON of ``kvferry select ... --capacity --json`` (its candidates and per-instance
bounds), or the trimmed copy kept here (``bench/capacity-70b.json``: llama-3.1-70b, TP 8 -> 4, H100,
nic-400g, 8,192 / 500 tokens).

Guesses (``--guess``):
- ``search``: the capacity search's own (``sim/deploy/capacity.py`` ``_guess``).
- ``queue``: a two-sided queueing guess, kept as a measured negative. A configuration's TTFT budget
  is spent waiting on both sides, ``a W(r/Bp, P) + b W(r/Bd, D) = 1``, W Sakasegawa's M/M/c wait
  (``--wait kingman``: rho/(1-rho)/c); ``a`` and ``b`` fitted by least squares to the same flow's
  smaller configurations, the rate solved for. It reads both sides' bounds, where the search's
  guess reads only the limiting side's share, so it should suit direct, whose share of its bound
  falls with its prefill-to-decode ratio. It did not pay (docs/benchmarks.md, "The capacity
  search's guess from both sides' queues").

Run: ``uv run python bench/guess_replay.py [FILE] [--guess search|queue] [--wait sakasegawa|kingman]``
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from kvferry.sim.deploy import capacity as cap
from kvferry.sim.deploy.spec import DeploySpec

_MISS = 0.65  # a run that misses stops early: about this share of a run met at its rate
DEFAULT = Path(__file__).with_name("capacity-70b.json")


class _Oracle:
    """The search's runner: a rate is met when it is at most the configuration's capacity."""

    jobs = 1

    def __init__(self, capacity_rps: dict[tuple[str, int, int], float]) -> None:
        self.capacity, self.cost = capacity_rps, 0.0

    def map(self, jobs: Sequence[tuple[Any, ...]]) -> list[list[bool]]:
        out = []
        for spec, rate, *_ in jobs:
            truth = self.capacity[(spec.flow, spec.prefill_instances, spec.decode_instances)]
            met = rate <= truth
            self.cost += rate * (1.0 if met else _MISS) / truth  # run time, in units of a run at capacity
            out.append([met])
        return out


def _wait(rho: float, servers: int, form: str) -> float:
    if rho >= 1:
        return math.inf
    if form == "kingman":
        return rho / (1 - rho) / servers
    return rho ** (math.sqrt(2 * (servers + 1)) - 1) / (servers * (1 - rho))


def queue_guess(per: dict[str, dict[str, Any]], form: str) -> Callable[..., float]:
    """``_guess``'s signature: the two-sided queueing guess where two smaller configurations of
    the flow are known, the search's own otherwise (and its chain-at-bound rule first)."""
    own = cap._guess

    def sides(c: cap.Candidate) -> tuple[float, float]:
        b = per[f"TP{c.prefill_tp}->TP{c.decode_tp} {c.flow}"]
        return c.prefill * b["prefill_rps"], c.decode * b["decode_rps"]

    def guess(
        c: cap.Candidate, lo: float, before: Sequence[cap.Candidate], wait: Callable[..., None]
    ) -> float:
        if near := cap._at_bound(c, before, wait):
            return max(lo, near)
        for o in reversed(before):  # another flow at as many prefill instances, limited alike
            if o.prefill == c.prefill and o.limit == c.limit:
                wait(o)
                if o.max_rps:
                    return max(lo, o.max_rps / o.bound_rps * c.bound_rps)
        rows = []
        for o in before:
            if cap._same_kind(o, c) and o.prefill <= c.prefill and o.decode <= c.decode:
                wait(o)
                if o.max_rps:
                    bp, bd = sides(o)
                    rows.append(
                        (_wait(o.max_rps / bp, o.prefill, form), _wait(o.max_rps / bd, o.decode, form))
                    )
        if len(rows) < 2:
            return own(c, lo, before, wait)
        coef, *_ = np.linalg.lstsq(np.array(rows), np.ones(len(rows)), rcond=None)
        a, b = (max(0.0, float(x)) for x in coef)
        bp, bd = sides(c)
        met, missed = 0.0, min(bp, bd)
        for _ in range(50):
            mid = (met + missed) / 2
            if a * _wait(mid / bp, c.prefill, form) + b * _wait(mid / bd, c.decode, form) <= 1:
                met = mid
            else:
                missed = mid
        return max(lo, met)

    return guess


def replay(recorded: dict[str, Any], guess: str, form: str) -> tuple[Counter[str], float]:
    """Runs per flow and the run time of ``_balanced`` on ``recorded``'s capacities."""
    truth = {
        (c["flow"], c["prefill_instances"], c["decode_instances"]): math.sqrt(
            c["max_rps"] * c["max_rps_below"]
        )
        for c in recorded["candidates"]
        if c["max_rps"] is not None and not c.get("runs_of")
    }
    fields = DeploySpec.__dataclass_fields__
    base = DeploySpec(**{k: v for k, v in recorded["deployment"].items() if k in fields})
    cands = [
        cap.Candidate(
            c["prefill_tp"],
            c["decode_tp"],
            c["flow"],
            c["prefill_instances"],
            c["decode_instances"],
            c["bound_rps"],
            c["bound_side"],
        )
        for c in recorded["candidates"]
    ]
    oracle = _Oracle(truth)
    search = cap._Search(base, None, (1,), recorded["attainment_target"], 8, lambda _m: None, oracle)  # type: ignore[arg-type]
    saved_meets, saved_guess = cap.meets, cap._guess
    cap.meets = lambda rs, target: rs[0]  # type: ignore[assignment,return-value]
    if guess == "queue":
        cap._guess = queue_guess(recorded["per_instance_bounds"], form)
    try:
        cap._balanced(cands, recorded["per_instance_bounds"], 8, search)
    finally:
        cap.meets, cap._guess = saved_meets, saved_guess
    runs: Counter[str] = Counter()
    for c in cands:
        if c.max_rps_runs:
            runs[c.flow] += c.max_rps_runs
            assert c.max_rps <= truth[(c.flow, c.prefill, c.decode)] < c.max_rps_below, c.name
    return runs, oracle.cost


def trim(recorded: dict[str, Any]) -> dict[str, Any]:
    """What a replay reads (the per-seed results left out)."""
    keep = ("prefill_tp", "decode_tp", "flow", "prefill_instances", "decode_instances", "bound_rps",
            "bound_side", "max_rps", "max_rps_below", "max_rps_runs", "runs_of")  # fmt: skip
    return {
        "deployment": recorded["deployment"],
        "attainment_target": recorded["attainment_target"],
        "per_instance_bounds": recorded["per_instance_bounds"],
        "candidates": [{k: c[k] for k in keep} for c in recorded["candidates"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--guess", choices=("search", "queue"), default="search")
    ap.add_argument("--wait", choices=("sakasegawa", "kingman"), default="sakasegawa")
    ap.add_argument("--trim-to", type=Path, help="write the file's trimmed copy here and stop")
    args = ap.parse_args()
    recorded = json.loads(args.file.read_text())
    if args.trim_to:
        args.trim_to.write_text(json.dumps(trim(recorded), separators=(",", ":")) + "\n")
        return
    recorded_runs = sum(c["max_rps_runs"] for c in recorded["candidates"])
    runs, cost = replay(recorded, args.guess, args.wait)
    name = args.guess + (f" ({args.wait})" if args.guess == "queue" else "")
    per_flow = ", ".join(f"{flow} {n}" for flow, n in sorted(runs.items()))
    print(f"recorded search: {recorded_runs} runs")
    total = sum(runs.values())
    print(f"replayed, guess {name}: {per_flow} = {total} runs, run time {cost:.1f} (a run at capacity: 1)")


if __name__ == "__main__":
    main()
