"""Steady state: which requests a run is judged on, whether the deployment kept up, and how sure
several seeds make a number.

- Window: requests arriving from ``warmup_s`` to the last arrival. The warm-up (empty queues,
  decode batches still filling) is excluded; a request of the window that never finished counts
  against the SLOs.
- Overload: a deployment is overloaded when what it completes falls short of what is offered, or
  when the requests waiting for their first token keep growing, or when the run was stopped
  because they grew past what a deployment meeting the TTFT SLO could hold. Said in words, with
  the busiest instances' shares.
- Seeds: a metric over several seeds is a mean with a 95% confidence interval (Student's t);
  two flows whose intervals overlap are a tie.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Interval", "overload_words", "queue_limit", "t95"]

# Student's t for a two-sided 95% interval, by degrees of freedom (n - 1); beyond 30: ~normal.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
_T95.update({10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042})


def t95(dof: int) -> float:
    if dof < 1:
        return math.inf
    keys = [k for k in sorted(_T95) if k <= dof]
    return _T95[keys[-1]] if dof <= 30 else 1.96


@dataclass(frozen=True, slots=True)
class Interval:
    """Mean and 95% confidence half-width of one metric over seeds (half-width 0 for one seed)."""

    mean: float
    half: float
    n: int

    @staticmethod
    def of(values: Sequence[float]) -> Interval:
        xs = [v for v in values if not math.isnan(v)]
        if not xs:
            return Interval(math.nan, math.nan, 0)
        m = sum(xs) / len(xs)
        if len(xs) < 2:
            return Interval(m, 0.0, 1)
        var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
        return Interval(m, t95(len(xs) - 1) * math.sqrt(var / len(xs)), len(xs))

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half

    def overlaps(self, other: Interval) -> bool:
        return self.lo <= other.hi and other.lo <= self.hi

    def text(self, fmt: str = ".0f") -> str:
        if math.isnan(self.mean):
            return "-"
        if self.n < 2:
            return format(self.mean, fmt)
        return f"{format(self.mean, fmt)} +- {format(self.half, fmt)}"


def queue_limit(rate_per_s: float, ttft_slo_ms: float) -> int:
    """Requests waiting for a first token past which a run stops as overloaded.

    By Little's law a deployment whose requests meet the TTFT SLO holds about rate x TTFT of them
    at once; four times the SLO's worth (and at least 32, for the noise of Poisson arrivals at a
    low rate) means most requests now miss it, and the queue only grows from there.
    """
    return max(32, math.ceil(4 * rate_per_s * ttft_slo_ms / 1000))


def overload_words(
    offered_rps: float,
    completed_rps: float,
    waiting_first: float,
    waiting_last: float,
    busy: dict[str, float],
    stopped: str,
) -> str:
    """ "" when the deployment kept up; else why it did not, in words.

    Overloaded: the run was stopped by its queue, or the requests waiting for a first token (mean
    of the window's first and last thirds, sampled once a simulated second) more than doubled and
    number at least 16. Completions short of the offered rate alone are not overload: completions
    lag arrivals by a request's whole duration (500 tokens are seconds), so they are said only as
    the supporting figure."""
    growing = waiting_last >= max(16, 2 * waiting_first)
    if not (stopped or growing):
        return ""
    parts = [stopped] if stopped else []
    if growing:
        parts.append(
            f"requests waiting for a first token grew from {waiting_first:.0f} to {waiting_last:.0f}"
        )
    if offered_rps > 0:
        parts.append(f"offered {offered_rps:.2f} req/s, completed {completed_rps:.2f} req/s")
    top = sorted(busy.items(), key=lambda kv: -kv[1])[:2]
    if top:
        parts.append("busiest: " + ", ".join(f"{k} {v:.0%} busy" for k, v in top))
    return "overloaded: " + "; ".join(parts)
