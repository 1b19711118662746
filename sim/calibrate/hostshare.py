"""The host wire every process shares, fitted to bench rows where several prefill ranks write host
to host at once (the pinned flow with prefill TP > 1).

The pinned flow's write goes between pinned host buffers over UCX's cma: a copy by the
initiator's CPU through the host's memory. One process alone moves 4-5 GB/s (the telemetry's
``host_bandwidth``, posting.py); two prefill processes writing at once do not move twice that: on
the H200 a TP 2->1 pinned room of 302 MB (2,048 tokens, a fit row) took 56 ms where each process
alone would need 38 ms of host wire, about 6 GB/s together (the H100 showed 6.5 GB/s). So a host
transfer moves at most ``host_shared / k``, k the host transfers active on the fabric
(NicSpec.host_shared_bandwidth_bps), beside its initiator's own wire.

No telemetry has two processes' host writes side by side, so the shared wire is fitted to the
rows' ms: each candidate is simulated and the one whose rows miss least (relative error) kept,
on a grid between one initiator's wire and all of them together, refined around the best.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.sim.calibrate.fit import refine_min
from kvferry.sim.calibrate.predict import BenchRow, Simulate, rows_mape

__all__ = ["HostShareFit", "fit_host_share", "host_share_rows"]

KEY = "host_shared_bandwidth_gbps"


@dataclass(frozen=True, slots=True)
class HostShareFit:
    gbps: float
    rows: int
    mape_before_pct: float  # the rows on the initiators' own wires alone
    mape_pct: float  # in sample: every such row is in the fit


def host_share_rows(rows: Sequence[BenchRow]) -> list[BenchRow]:
    """Rows where more than one process writes host to host at once."""
    return [r for r in rows if r.flow == "pinned" and r.prefill_tp > 1]


def fit_host_share(rows: Sequence[BenchRow], fabric: dict[str, Any], run: Simulate) -> HostShareFit | None:
    """The shared host wire (GB/s) best fitting ``rows`` simulated by ``run`` over ``fabric`` (which
    has the initiators' own ``host_bandwidth_gbps``); None where no row has several host writers or
    the rows are no slower than the initiators' own wires give."""
    use = host_share_rows(rows)
    own = fabric.get("host_bandwidth_gbps")
    if not use or not own:
        return None
    before = rows_mape(run, use, fabric)
    no_effect = own * max(r.prefill_tp for r in use)  # every initiator at its own rate
    err, gbps = refine_min(
        lambda g: rows_mape(run, use, {**fabric, KEY: g}),
        own / 2,
        no_effect,
        (before, no_effect),
        rounds=3,
        floor=own / 4,
    )
    if gbps >= no_effect:
        return None
    return HostShareFit(gbps, len(use), before, err)
