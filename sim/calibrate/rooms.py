"""The per-room control path, fitted to the ms per room of ``kvferry bench nixl --json`` rows.

NIXL's per-write telemetry (fit.py) covers the wire and the posting; it does not contain what a
room costs around its writes: the control messages crossing the runtime's threads and ZMQ (the
TransferInfo, a StagingReq/StagingRsp round trip, a pull's offer and reply) and the wait before the
runtime handles a write's notification or completion (its data thread sees them on its next poll
of NIXL). docs/benchmarks.md, "Where a small room's time goes", times both on CPU loopback.

Five costs of the simulated fabric stand for them: ``control_latency`` (one control message, one
way, through the runtime), ``completion_delay`` (from a write landing to the target runtime
handling its notification, or the initiator its DONE), and three kinds of host work that hold a
rank's one runtime thread, so that they queue behind each other on a rank: ``kernel_submit`` (each
gather or scatter's submit, which is validation, the page-id upload and the launcher, and the
pickup of its completion; the kernel bench's launch stays the bare launch on the stream),
``staging_handle`` (each StagingReq granted on decode, each StagingRsp and Watermark handled on
prefill: the staged flows' own round trip and slot return) and ``control_send`` (each control
message sent: encoding, signing, ZMQ). Three more: ``room_handle`` (each TransferInfo or PullOffer
planned), ``completion_handle`` (each notification or DONE handled) and ``push_handle`` (a push
room's TransferInfo, decode's registration, taken into the lease registry: traced on an H200 at
150-200 us over a direct room's; only push rows count it). The hops are those docs/benchmarks.md,
"Where a ring room's time goes on the GPU", times on the H100. How many of each lie on a room's
critical path is not assumed: each bench row is simulated with the fabric fitted from telemetry
(the costs 0), and again with each cost set to a probe value; the time each probe adds, divided by
the probe, is that row's count (1 control message for a direct room, 3 for a staged one, 2 staging
messages for a TP 1->1 ring room, 17 for a TP 2->1 batch of 8 queued at decode, ...).
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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from kvferry.sim.calibrate.fit import mape, nnls, split_sizes
from kvferry.sim.calibrate.inputs import CalibrationError
from kvferry.sim.calibrate.predict import BenchRow, Prediction, Simulate, predict

__all__ = ["RoomFit", "fit_rooms", "lad"]

PROBE_US = 1000.0  # large against jitter, small enough that nothing else changes order
# Linearizations: at 0, then again where each fit left the costs (the best kept). Two were enough
# for seven costs; with push's registration as an eighth, the second pass left the H200 fit rows
# at 12.1% where the seven-cost fit had found 7.6%, and the fourth found 7.5% (docs/fidelity.md).
PASSES = 4
TERMS = (
    "control_latency_ns",
    "completion_delay_ns",
    "kernel_submit_ns",
    "staging_handle_ns",
    "control_send_ns",
    "room_handle_ns",
    "completion_handle_ns",
    "push_handle_ns",
)


@dataclass(frozen=True, slots=True)
class RoomFit:
    control_latency_us: float
    completion_delay_us: float
    copy_submit_us: float  # host work per gather or scatter on the rank's thread
    staging_handle_us: float  # host work per staging message (0 when no staged row needs it)
    control_send_us: float  # the sender's host work per control message
    room_handle_us: float  # host work per TransferInfo or PullOffer handled (the room's plan)
    completion_handle_us: float  # a rank's host work per notification or DONE handled
    push_handle_us: float  # the push flow's extra host work per registration (its TransferInfo)
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

    def overrides(self) -> dict[str, int]:
        """The fitted costs as a scenario's [fabric] keys (TERMS), in ns."""
        us = (
            self.control_latency_us,
            self.completion_delay_us,
            self.copy_submit_us,
            self.staging_handle_us,
            self.control_send_us,
            self.room_handle_us,
            self.completion_handle_us,
            self.push_handle_us,
        )
        return {t: round(v * 1000) for t, v in zip(TERMS, us, strict=True)}


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


def fit_rooms(
    rows: Sequence[BenchRow],
    profile: str,
    fabric: dict[str, Any],
    simulate: Simulate | None = None,
    passes: int = PASSES,
    check: Sequence[BenchRow] = (),
) -> RoomFit:
    """Fit the per-room costs to ``rows`` simulated on ``profile`` with ``fabric`` overrides
    (the telemetry fit's numbers). ``simulate`` replaces the simulator (tests). ``check``: rows
    measured apart to be held out (every row of ``rows`` is then fit); without them, some room
    sizes of ``rows`` are held out."""
    run: Simulate = simulate or (lambda row, fab: predict(row, profile, fab))
    if check:
        if not rows:
            raise CalibrationError("--rooms: no bench rows")
        fit_tokens, held_tokens = sorted({r.tokens for r in rows}), sorted({r.tokens for r in check})
        train = np.array([True] * len(rows) + [False] * len(check))
        rows = [*rows, *check]
    else:
        fit_tokens, held_tokens = _split(rows)
        train = np.array([r.tokens not in held_tokens for r in rows])
    meas = np.array([r.room_mb * r.inflight / r.measured_gbps for r in rows])
    # Relative deviation: each row divided by its measured time, as the MAPE we report. (Each row
    # weighted by 1 / its group's rows, flow, rooms in flight and equal TP or not, was tried: on
    # the H200's held-out rows it missed by 10.7% against 9.9% unweighted; docs/fidelity.md.)
    w = 1.0 / meas[train]
    x = np.zeros(len(TERMS))
    best: tuple[float, np.ndarray, list[Prediction]] | None = None
    first_counts: list[tuple[float, ...]] = []
    for _ in range(passes):
        # Linearized where the last pass left the costs: a cost that queues rooms on one thread
        # adds less than its count at 0 once another cost queues them (pipeline stages overlap).
        at = _with(fabric, x)
        preds = [run(r, at) for r in rows]
        t0 = np.array([p.predicted_ms for p in preds])
        if x.any():
            best = _better(best, x, preds, t0, meas, train, w)
        counts = _counts(run, rows, at, t0)
        first_counts = first_counts or counts
        k = np.array(counts)
        x = lad(k[train] * w[:, None], (meas - t0 + k @ x)[train] * w)
    preds = [run(r, _with(fabric, x)) for r in rows]
    best = _better(best, x, preds, np.array([p.predicted_ms for p in preds]), meas, train, w)
    _, x, preds = best
    us = (float(v) * 1000 for v in x)
    ctrl_us, comp_us, submit_us, staging_us, send_us, room_us, handle_us, push_us = us
    pred_ms = np.array([p.predicted_ms for p in preds])
    before_ms = np.array([run(r, fabric).predicted_ms for r in rows])
    held = ~train
    return RoomFit(
        control_latency_us=ctrl_us,
        completion_delay_us=comp_us,
        copy_submit_us=submit_us,
        staging_handle_us=staging_us,
        control_send_us=send_us,
        room_handle_us=room_us,
        completion_handle_us=handle_us,
        push_handle_us=push_us,
        rows_fit=int(train.sum()),
        rows_heldout=int(held.sum()),
        tokens_fit=tuple(fit_tokens),
        tokens_heldout=tuple(held_tokens),
        mape_fit_pct=mape(pred_ms[train], meas[train]),
        mape_heldout_pct=mape(pred_ms[held], meas[held]),
        mape_heldout_without_pct=mape(before_ms[held], meas[held]),
        counts=tuple(first_counts),
        predictions=tuple(preds),
    )


def _with(fabric: dict[str, Any], x: np.ndarray) -> dict[str, Any]:
    """The fabric with the costs ``x`` (ms), control jitter off."""
    return {
        **fabric,
        "control_jitter_ns": 0,
        **{t: round(float(v) * 1e6) for t, v in zip(TERMS, x, strict=True)},
    }


def _counts(
    run: Simulate, rows: Sequence[BenchRow], at: dict[str, Any], t0: np.ndarray
) -> list[tuple[float, ...]]:
    """Each row's count of each cost at ``at``: the time a probe's more of it adds, over the probe."""
    probe = round(PROBE_US * 1000)
    out = []
    for r, base in zip(rows, t0, strict=True):
        per = [(run(r, {**at, t: at[t] + probe}).predicted_ms - base) / (PROBE_US / 1000) for t in TERMS]
        out.append(tuple(max(0.0, c) for c in per))
    return out


def _better(
    best: tuple[float, np.ndarray, list[Prediction]] | None,
    x: np.ndarray,
    preds: list[Prediction],
    t0: np.ndarray,
    meas: np.ndarray,
    train: np.ndarray,
    w: np.ndarray,
) -> tuple[float, np.ndarray, list[Prediction]]:
    """The costs whose simulation misses the fit rows least (the weighted relative error)."""
    err = float((np.abs(t0 - meas)[train] * w).sum())
    return (err, x, preds) if best is None or err < best[0] else best


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
