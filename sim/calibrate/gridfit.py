"""One cost fitted to bench rows' ms by simulating them: what the fits that no telemetry gives
(the shared host wire, hostshare.py; a READ's cost a descriptor, readpost.py) share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from kvferry.sim.calibrate.fit import mape
from kvferry.sim.calibrate.predict import BenchRow, Prediction

__all__ = ["Simulate", "refine_min", "rows_mape"]

Simulate = Callable[[BenchRow, dict[str, Any]], Prediction]


def rows_mape(run: Simulate, rows: Sequence[BenchRow], fabric: dict[str, Any]) -> float:
    """Mean relative error (%) of ``rows``' ms simulated by ``run`` over ``fabric``."""
    meas = np.array([r.room_mb * r.inflight / r.measured_gbps for r in rows])
    pred = np.array([run(r, fabric).predicted_ms for r in rows])
    return mape(pred, meas)


def refine_min(
    err: Callable[[float], float],
    lo: float,
    hi: float,
    best: tuple[float, float],
    rounds: int,
    floor: float,
    snap: Callable[[float], float] = float,
) -> tuple[float, float]:
    """(error, value) of the least ``err`` found, from ``best``: 17 values over ``[lo, hi]`` (each
    ``snap``ped to what the simulator takes), then ``rounds - 1`` times again around the best so far,
    each grid an eighth as wide as the one before and never below ``floor``."""
    for _ in range(rounds):
        for x in np.linspace(lo, hi, 17):
            v = snap(float(x))
            e = err(v)
            if e < best[0]:
                best = (e, v)
        step = (hi - lo) / 16
        lo, hi = max(floor, best[1] - step), best[1] + step
    return best
