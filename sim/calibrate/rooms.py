"""The per-room control path, fitted to the ms per room of ``kvferry bench nixl --json`` rows.

NIXL's per-write telemetry (fit.py) covers the wire and the posting; it does not contain what a
room costs around its writes: the control messages crossing the runtime's threads and ZMQ (the
TransferInfo, a StagingReq/StagingRsp round trip, a pull's offer and reply) and the wait before the
runtime handles a write's notification or completion (its data thread sees them on its next poll
of NIXL). docs/benchmarks.md, "Where a small room's time goes", times both on CPU loopback.

Five costs of the simulated fabric stand for them: ``control_latency`` (one control message, one
way, through the runtime), ``completion_delay`` (from a write landing to the target runtime
handling its notification, or the initiator its DONE), and three kinds of host work that hold a
rank's one runtime thread, so that they queue behind each other on a rank: ``kernel_submit``
(each gather or scatter's submit, which is validation, the page-id upload and the launcher, and
the pickup of its completion; the kernel bench's launch stays the bare launch on the stream),
``staging_handle`` (each StagingReq granted on decode, each StagingRsp and Watermark handled on
prefill: the staged flows' own round trip and slot return) and ``control_send`` (each control
message sent: encoding, signing, ZMQ). The hops are those docs/benchmarks.md, "Where a ring
room's time goes on the GPU", times on the H100. How many of each lie on a room's critical path
is not assumed: each bench row is simulated with the fabric fitted from telemetry (the five
costs 0), and again with each cost set to a probe value; the time each probe adds, divided by
the probe, is that row's count (1 control message for a direct room, 3 for a staged one, 2
staging messages for a TP 1->1 ring room, 17 for a TP 2->1 batch of 8 queued at decode, ...).
Then ``measured - simulated = sum(count_i * cost_i)`` is fitted by least absolute relative
deviation with every cost >= 0: robust, so a row the fabric misses for another reason does not
drag the per-room costs. Where two costs have the same count on every row (a TP 1->1 ring room
has as many copies as staging messages) only rows that separate them (other TP pairs, rooms in
flight) tell them apart; the fit may then put the whole of a shared effect on one. (A copy's
completion picked up after a pure delay, rather than by work that holds the rank, was tried as
a cost: on rows simulated with both, the counts' linear model could not tell the two apart, so
the copy's host work is one serial cost.)

Held-out check as for the writes: the rows' distinct token counts are sorted and every third from
the second is held out; the fit sees only the others. The MAPE of the ms per room is computed by
simulating the rows again with the fitted costs (not from the linear model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from kvferry.sim.calibrate.fit import mape, nnls, split_sizes
from kvferry.sim.calibrate.inputs import CalibrationError
from kvferry.sim.calibrate.predict import BenchRow, Prediction, predict

__all__ = ["RoomFit", "fit_rooms", "lad"]

PROBE_US = 1000.0  # large against jitter, small enough that nothing else changes order
TERMS = (
    "control_latency_ns",
    "completion_delay_ns",
    "kernel_submit_ns",
    "staging_handle_ns",
    "control_send_ns",
)


@dataclass(frozen=True, slots=True)
class RoomFit:
    control_latency_us: float
    completion_delay_us: float
    copy_submit_us: float  # host work per gather or scatter on the rank's thread
    staging_handle_us: float  # host work per staging message (0 when no staged row needs it)
    control_send_us: float  # the sender's host work per control message
    rows_fit: int
    rows_heldout: int
    tokens_fit: tuple[int, ...]
    tokens_heldout: tuple[int, ...]
    mape_fit_pct: float
    mape_heldout_pct: float
    # The same held-out rows on the fabric without the two costs (the telemetry fit alone, with
    # the fabric's default 50 us control latency): what the per-room terms buy.
    mape_heldout_without_pct: float
    # per row: control messages, completions, copies and staging messages on its path
    counts: tuple[tuple[float, ...], ...]
    predictions: tuple[Prediction, ...]  # every row, with the fitted costs


def lad(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """argmin sum |a x - b| with x >= 0: iteratively reweighted non-negative least squares."""
    x = nnls(a, b)
    for _ in range(iters):
        w = 1.0 / np.sqrt(np.maximum(np.abs(a @ x - b), 1e-6))
        nxt = nnls(a * w[:, None], b * w)
        if np.allclose(nxt, x, rtol=1e-9, atol=1e-12):
            break
        x = nxt
    return x


Simulate = Callable[[BenchRow, dict[str, Any]], Prediction]


def fit_rooms(
    rows: Sequence[BenchRow], profile: str, fabric: dict[str, Any], simulate: Simulate | None = None
) -> RoomFit:
    """Fit the per-room costs to ``rows`` simulated on ``profile`` with ``fabric`` overrides
    (the telemetry fit's numbers). ``simulate`` replaces the simulator (tests)."""
    run: Simulate = simulate or (lambda row, fab: predict(row, profile, fab))
    fit_tokens, held_tokens = _split(rows)
    zero = {**fabric, "control_jitter_ns": 0, **dict.fromkeys(TERMS, 0)}
    probe = round(PROBE_US * 1000)
    base = [run(r, zero).predicted_ms for r in rows]
    counts = []
    for r, t0 in zip(rows, base, strict=True):
        per = [(run(r, {**zero, term: probe}).predicted_ms - t0) / (PROBE_US / 1000) for term in TERMS]
        counts.append(tuple(max(0.0, c) for c in per))
    meas = np.array([r.room_mb * r.inflight / r.measured_gbps for r in rows])
    k = np.array(counts)
    resid = meas - np.array(base)
    train = np.array([r.tokens not in held_tokens for r in rows])
    # Relative deviation: each row divided by its measured time, as the MAPE we report.
    x = lad(k[train] / meas[train, None], resid[train] / meas[train])
    ctrl_us, comp_us, submit_us, staging_us, send_us = (float(v) * 1000 for v in x)  # ms -> us
    fitted = {**fabric, **{t: round(float(v) * 1e6) for t, v in zip(TERMS, x, strict=True)}}
    preds = [run(r, fitted) for r in rows]
    before = [run(r, fabric) for r in rows]
    pred_ms = np.array([p.predicted_ms for p in preds])
    before_ms = np.array([p.predicted_ms for p in before])
    held = ~train
    return RoomFit(
        control_latency_us=ctrl_us,
        completion_delay_us=comp_us,
        copy_submit_us=submit_us,
        staging_handle_us=staging_us,
        control_send_us=send_us,
        rows_fit=int(train.sum()),
        rows_heldout=int(held.sum()),
        tokens_fit=tuple(fit_tokens),
        tokens_heldout=tuple(held_tokens),
        mape_fit_pct=mape(pred_ms[train], meas[train]),
        mape_heldout_pct=mape(pred_ms[held], meas[held]),
        mape_heldout_without_pct=mape(before_ms[held], meas[held]),
        counts=tuple(counts),
        predictions=tuple(preds),
    )


def _split(rows: Sequence[BenchRow]) -> tuple[list[int], list[int]]:
    if not rows:
        raise CalibrationError("--rooms: no bench rows")
    try:
        return split_sizes([r.tokens for r in rows])
    except CalibrationError:
        raise CalibrationError(
            "--rooms: the bench rows have fewer than 3 distinct --tokens; fitting the per-room cost "
            "with held-out rows needs at least 3 (run the bench at several --tokens)"
        ) from None
