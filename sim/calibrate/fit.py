"""The fit: non-negative least squares of the simulator's cost model on measured writes.

The simulated fabric charges a write ``post_cost + per_desc * descriptors`` of posting, then
``bytes / bandwidth`` on the wire, and DONE reaches the initiator two latencies after the last
byte left (backends/simfabric/fabric.py). So a write's measured time is fitted as

    total_us = c0 + per_desc_us * descriptors + nbytes / bandwidth

with every coefficient >= 0, minimising the squared *relative* error (each row weighted by
1 / its time, so a small write counts as much as a large one, as in the MAPE we report). The
intercept is then split: the fixed posting cost is the intercept of the same fit on NIXL's post
durations (capped at ``c0``), and what is left of ``c0`` is two latencies.

Held-out check: the distinct transfer sizes are sorted and every third one from the second on is
held out; the fit uses the other sizes' rows only, and the MAPE is computed on the held-out rows
only (sizes the fit never saw, inside the fitted range). The written profile is that fit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from kvferry.sim.calibrate.inputs import KERNEL_PATHS, CalibrationError, KernelRow, WriteRow

__all__ = ["FabricFit", "KernelFit", "fit_fabric", "fit_kernels", "nnls", "refine_min", "split_sizes"]


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| with x >= 0, exactly, for a few columns: the optimum is the
    unconstrained least squares on its own support, so try every support and keep the best
    feasible one. Columns are scaled to unit norm first (bytes and counts differ by 1e9)."""
    n = a.shape[1]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    s = a / scale
    best, best_err = np.zeros(n), float(np.sum(b * b))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = s[:, cols]
            x, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x < 0):
                continue
            err = float(np.sum((sub @ x - b) ** 2))
            if err < best_err - 1e-12 * max(best_err, 1.0):
                best, best_err = np.zeros(n), err
                best[list(cols)] = x
    return best / scale


def _weighted(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """NNLS of relative error: divide each row by its measured value."""
    w = 1.0 / y
    return nnls(a * w[:, None], y * w)


def split_sizes(sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """(fit sizes, held-out sizes): every third distinct size from the second on is held out."""
    distinct = sorted(set(sizes))
    if len(distinct) < 3:
        raise CalibrationError(
            f"the telemetry has {len(distinct)} distinct transfer size(s); a fit with held-out sizes "
            "needs at least 3 (run the bench at several --tokens)"
        )
    held = distinct[1::3]
    return [s for s in distinct if s not in held], held


def mape(pred: np.ndarray, meas: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - meas) / meas) * 100.0)


def refine_min(
    err: Callable[[float], float],
    lo: float,
    hi: float,
    best: tuple[float, float],
    rounds: int,
    floor: float,
    snap: Callable[[float], float] = float,
    points: int = 17,
    narrow: int = 16,
) -> tuple[float, float]:
    """(error, value) of the least ``err`` found, from ``best``: ``points`` values over ``[lo, hi]``
    (each ``snap``ped to what the model takes), then ``rounds - 1`` times again over the best so far
    plus and minus ``(hi - lo) / narrow`` of the grid before, never below ``floor``. For one cost
    whose error is not linear in it (a simulated run's, a max() of two costs)."""
    for _ in range(rounds):
        for x in np.linspace(lo, hi, points):
            v = snap(float(x))
            e = err(v)
            if e < best[0]:
                best = (e, v)
        step = (hi - lo) / narrow
        lo, hi = max(floor, best[1] - step), best[1] + step
    return best


@dataclass(frozen=True, slots=True)
class FabricFit:
    post_cost_us: float
    per_desc_us: float
    bandwidth_gbps: float
    latency_us: float
    rows_fit: int
    rows_heldout: int
    sizes_fit: tuple[int, ...]
    sizes_heldout: tuple[int, ...]
    mape_fit_pct: float  # on the rows the fit used
    mape_heldout_pct: float  # on held-out sizes only

    def predict_us(self, nbytes: np.ndarray, descs: np.ndarray) -> np.ndarray:
        """A lone write's time on the simulated fabric: posting, wire, two latencies."""
        wire = nbytes / (self.bandwidth_gbps * 1e3)  # GB/s = 1e3 bytes per us
        return self.post_cost_us + self.per_desc_us * descs + wire + 2 * self.latency_us


def _columns(rows: Sequence[WriteRow]) -> np.ndarray:
    return np.array([[1.0, r.descs, r.nbytes] for r in rows])


def fit_fabric(rows: Sequence[WriteRow]) -> FabricFit:
    fit_sizes, held_sizes = split_sizes([r.nbytes for r in rows])
    held_set = set(held_sizes)
    train = [r for r in rows if r.nbytes not in held_set]
    test = [r for r in rows if r.nbytes in held_set]
    a = _columns(train)
    y = np.array([r.total_us for r in train])
    c0, per_desc, per_byte = _weighted(a, y)
    if per_byte <= 0:
        raise CalibrationError(
            "the fit found no cost per byte (bandwidth would be infinite): the telemetry's sizes "
            "are too close together or too small; run the bench at more --tokens"
        )
    timed = [r for r in train if r.post_us > 0]
    if timed:  # the fixed part of NIXL's post duration, from the same model
        p0 = _weighted(_columns(timed), np.array([r.post_us for r in timed]))[0]
        post = min(p0, c0)
    else:  # no post durations: the whole intercept is posting
        post = c0
    fit = FabricFit(
        post_cost_us=float(post),
        per_desc_us=float(per_desc),
        bandwidth_gbps=float(1e-3 / per_byte),
        latency_us=float((c0 - post) / 2),
        rows_fit=len(train),
        rows_heldout=len(test),
        sizes_fit=tuple(fit_sizes),
        sizes_heldout=tuple(held_sizes),
        mape_fit_pct=0.0,
        mape_heldout_pct=0.0,
    )

    def err(rs: Sequence[WriteRow]) -> float:
        n = np.array([r.nbytes for r in rs], dtype=float)
        d = np.array([r.descs for r in rs], dtype=float)
        return mape(fit.predict_us(n, d), np.array([r.total_us for r in rs]))

    return replace(fit, mape_fit_pct=err(train), mape_heldout_pct=err(test))


@dataclass(frozen=True, slots=True)
class KernelFit:
    launch_us: float  # host cost per call (the bench's host_us median), else the fitted intercept
    launch_source: str
    gpu_gbps: float | None
    pinned_gbps: float | None
    rows: int
    mape_pct: dict[str, float]  # per path, in sample (kernel benches have few sizes)


def fit_kernels(rows: Sequence[KernelRow]) -> KernelFit:
    """Per memory kind, ``seconds = a + bytes / rate`` (NNLS, relative error) over its gather and
    scatter rows; the launch cost the simulator charges per call is the host's cost to issue one
    (``host_us``, as the shipped h100 profile took it), else the fitted device-side intercept."""
    rates: dict[str, float | None] = {}
    intercepts: list[float] = []
    errs: dict[str, float] = {}
    for kind in ("gpu", "pinned"):
        paths = [p for p in KERNEL_PATHS if p.endswith(kind)]
        pts = [(r.nbytes, r.seconds[p]) for r in rows for p in paths if p in r.seconds]
        if len({n for n, _ in pts}) < 2:
            rates[kind] = None  # one size cannot separate launch from rate
            continue
        a = np.array([[1.0, n] for n, _ in pts])
        y = np.array([t * 1e6 for _, t in pts])
        c, per_byte = _weighted(a, y)
        if per_byte <= 0:
            raise CalibrationError(f"kernel bench: the {kind} rows show no cost per byte")
        rates[kind] = 1e-3 / per_byte
        intercepts.append(float(c))
        errs[kind] = mape(a @ np.array([c, per_byte]), y)
    if rates["gpu"] is None and rates["pinned"] is None:
        raise CalibrationError("kernel bench: needs rows of at least 2 sizes for a GPU or pinned path")
    hosts = [r.host_us for r in rows if r.host_us is not None]
    if hosts:
        launch, source = float(np.median(hosts)), "median host_us of the bench rows"
    else:
        launch, source = float(np.mean(intercepts)), "fitted intercept, no host_us in the bench"
    return KernelFit(launch, source, rates["gpu"], rates["pinned"], len(rows), errs)
