"""A READ's cost a descriptor (NicSpec.read_desc_ns), fitted to the pull flow's bench rows.

Pull moves a room by READs that decode posts. With unequal TP a READ is descriptor-bound as a
different-TP write is (a head slice a descriptor, one per token and layer: 294,912 for a TP 2->1
room of 2,048 qwen3-8b tokens), so the room's time is mostly decode's posting. Where a pull
room's telemetry holds decode's READs, the posting fit reads the cost from them (posting.py);
telemetry taken before `kvferry bench nixl --telemetry` recorded them (every H200 set of
2026-12-02) holds prefill's writes only, and a pull room has none. Then the READ cost is fitted
here to the pull rows' ms, as the shared host wire is (hostshare.py): each candidate simulated,
the one whose rows miss least (relative error) kept, on a grid around the WRITE's cost, refined
around the best.

Fitted twice: before the per-room costs (rooms.py), so that their fit sees the pull rows near
their READ cost, and again with them in place, which is the one kept. The per-room costs are a few
milliseconds of rooms that take seconds, but they move when decode's first READ begins, and with
every rank on one GPU (NicSpec.shared_desc_ns) a post that begins while another process posts pays
``max(read_desc, 2 * shared_desc)`` a descriptor to its end: on the H200's TP 2->1 pull room of
2,048 tokens that moved the simulated room by 5% (2,156 against 2,058 ms).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.sim.calibrate.fit import refine_min
from kvferry.sim.calibrate.predict import BenchRow, Simulate, rows_mape

__all__ = ["KEY", "ReadFit", "fit_read_desc", "read_rows"]

KEY = "read_desc_ns"


@dataclass(frozen=True, slots=True)
class ReadFit:
    read_desc_us: float
    rows: int
    mape_before_pct: float  # the rows with READs at the WRITE's cost a descriptor
    mape_pct: float  # in sample: every such row is in the fit


def read_rows(rows: Sequence[BenchRow]) -> list[BenchRow]:
    """Rows whose time is mostly READ posting: pull with unequal TP (head slices)."""
    return [r for r in rows if r.flow == "pull" and r.prefill_tp != r.decode_tp]


def fit_read_desc(rows: Sequence[BenchRow], fabric: dict[str, Any], run: Simulate) -> ReadFit | None:
    """The READ cost a descriptor best fitting ``rows`` simulated by ``run`` over ``fabric`` (which
    has the WRITE's ``per_desc_ns``); None where no row is a pull room with unequal TP."""
    use = read_rows(rows)
    write_ns = int(fabric.get("per_desc_ns", 0))
    if not use or write_ns <= 0:
        return None
    before = rows_mape(run, use, {**fabric, KEY: 0})
    # 0 means "as a WRITE", so the grid stays above 0: a tenth to ten times the WRITE's cost, then
    # refined three times around the best (each step an eighth of the one before).
    err, ns = refine_min(
        lambda v: rows_mape(run, use, {**fabric, KEY: round(v)}),
        write_ns / 10,
        write_ns * 10,
        (before, float(write_ns)),
        rounds=4,
        floor=1.0,
        snap=lambda x: float(round(x)),
    )
    return ReadFit(ns / 1000, len(use), before, err)
