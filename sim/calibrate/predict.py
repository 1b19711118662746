"""The simulator's prediction beside a measurement: each row of ``kvferry bench nixl --json``
simulated with a fabric profile, through the real core and flows over the simulated fabric
(sim/world.py, timing only: every cost charged, no byte copied).

A row is one batch of ``inflight`` rooms of ``tokens`` tokens of the row's model, prefill TP P ->
decode TP D, on the row's flow, one chunk per room (the bench's default: its rows do not carry a
chunk size), two transfer queues per prefill rank and staging for ``max(2, inflight)`` chunks, as
the bench configures the runtime. The bench times decode from the first ``init`` of a batch to
its last Success, after a warm-up batch that connects the peers; the simulation runs one small
warm-up room first (its Register and RegisterAck, as the bench's warm-up) and times from the
batch's arrival (decode opens each room then) to the last decode rank's Success. Predicted GB/s =
the batch's bytes over that time.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from kvferry.core.flows import FLOW_NAMES
from kvferry.core.geometry import PRESETS
from kvferry.sim import scenario as sc
from kvferry.sim.calibrate.fit import mape
from kvferry.sim.calibrate.inputs import CalibrationError, read_text

__all__ = [
    "BenchRow",
    "FlowError",
    "Prediction",
    "Simulate",
    "by_flow",
    "layout_note",
    "predict",
    "read_bench",
    "rows_mape",
]

FLOWS = (*FLOW_NAMES, "policy")
MS = 1_000_000
# The bench's warm-up batch connects the peers (Register, RegisterAck) before it times a batch;
# here one small room at 0 does, and the timed batch arrives once it is long done.
WARMUP_TOKENS = 16
BATCH_US = 200_000
S = 1_000_000_000


@dataclass(frozen=True, slots=True)
class BenchRow:
    config: str
    model: str
    prefill_tp: int
    decode_tp: int
    tokens: int
    inflight: int
    flow: str
    room_mb: float
    measured_gbps: float
    raw_gbps: float
    # Every rank on one GPU (the bench's `gpus` "0->0", its default): the ranks share that GPU's
    # descriptor work and that host's wire (FabricSpec.one_gpu). Other placements are simulated
    # with each rank on a GPU of its own.
    one_gpu: bool = True
    # Several ranks of a side ran in one process (the bench's layout before 2026-12-03; rows
    # without `process_per_rank` are such rows). The simulator gives every rank a runtime of its
    # own, as one process a rank does: such a row measures slower than predicted.
    ranks_share_process: bool = False


@dataclass(frozen=True, slots=True)
class Prediction:
    row: BenchRow
    predicted_gbps: float
    predicted_ms: float

    @property
    def measured_ms(self) -> float:
        """The bench's time per batch (its bytes over its GB/s)."""
        return self.row.room_mb * self.row.inflight / self.row.measured_gbps

    @property
    def ratio(self) -> float:
        """measured / predicted: above 1 the real run was faster than the simulator says."""
        return self.row.measured_gbps / self.predicted_gbps

    def as_dict(self) -> dict[str, Any]:
        r = self.row
        return {
            "config": r.config,
            "tp": f"{r.prefill_tp}->{r.decode_tp}",
            "flow": r.flow,
            "tokens": r.tokens,
            "inflight": r.inflight,
            "room_mb": r.room_mb,
            "measured_gbps": r.measured_gbps,
            "raw_gbps": r.raw_gbps,
            "predicted_gbps": self.predicted_gbps,
            "measured_ms": self.measured_ms,
            "predicted_ms": self.predicted_ms,
            # What the simulation leaves out, per batch (negative: the simulation is slower).
            "unexplained_ms": self.measured_ms - self.predicted_ms,
            "ratio": self.ratio,
            "ranks_share_process": r.ranks_share_process,
        }


def _rows(path: Path) -> list[Any]:
    """A JSON list or object, or JSON lines (what ``bench nixl --json`` prints, one per line)."""
    text = read_text(path).strip()
    try:
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        pass
    out = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{path}: line {i + 1}: not valid JSON: {e}") from None
    return out


def _field(path: Path, i: int, row: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in row:
        raise CalibrationError(f"{path}: row {i + 1}: missing {key!r} (a `kvferry bench nixl --json` row?)")
    v = row[key]
    if isinstance(v, bool) or not isinstance(v, kind):
        raise CalibrationError(f"{path}: row {i + 1}: {key}: unexpected value {v!r}")
    return v


def read_bench(path: Path) -> list[BenchRow]:
    rows = _rows(path)
    if not rows:
        raise CalibrationError(f"{path}: no bench rows")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise CalibrationError(f"{path}: row {i + 1}: expected an object")
        tp = _field(path, i, row, "tp", str)
        try:
            p, d = (int(x) for x in tp.split("->"))
        except ValueError:
            raise CalibrationError(f"{path}: row {i + 1}: tp: expected 'P->D', got {tp!r}") from None
        model = _field(path, i, row, "model", str)
        if model not in PRESETS:
            raise CalibrationError(
                f"{path}: row {i + 1}: model {model!r} is not a preset ({sorted(PRESETS)})"
            )
        flow = _field(path, i, row, "flow", str)
        if flow not in FLOWS:
            raise CalibrationError(f"{path}: row {i + 1}: flow {flow!r} is not one of {FLOWS}")
        nums = {k: _field(path, i, row, k, (int, float)) for k in ("room_mb", "kvferry_gbps", "raw_gbps")}
        ints = {k: _field(path, i, row, k, int) for k in ("tokens", "inflight")}
        gpus = row.get("gpus", "0->0")  # rows before the bench named its GPUs ran on GPU 0
        if not isinstance(gpus, str) or "->" not in gpus:
            raise CalibrationError(f"{path}: row {i + 1}: gpus: expected 'PREFILL->DECODE', got {gpus!r}")
        pre_gpus, dec_gpus = gpus.split("->", 1)
        per_rank = row.get("process_per_rank", False)  # absent: measured one process a side
        if not isinstance(per_rank, bool):
            raise CalibrationError(
                f"{path}: row {i + 1}: process_per_rank: expected true or false, got {per_rank!r}"
            )
        if min(ints.values()) < 1 or min(nums.values()) <= 0 or p < 1 or d < 1:
            raise CalibrationError(f"{path}: row {i + 1}: sizes and rates must be positive")
        out.append(
            BenchRow(
                str(row.get("config", tp)), model, p, d, ints["tokens"], ints["inflight"], flow,
                float(nums["room_mb"]), float(nums["kvferry_gbps"]), float(nums["raw_gbps"]),
                pre_gpus == dec_gpus and "," not in pre_gpus, not per_rank and max(p, d) > 1,
            )
        )  # fmt: skip
    return out


def layout_note(rows: list[BenchRow]) -> str | None:
    """A line saying how many rows ran a side's ranks in one process, where any did."""
    n = sum(r.ranks_share_process for r in rows)
    if not n:
        return None
    return (
        f"note: {n} of {len(rows)} rows ran a side's TP ranks in one process (process_per_rank "
        "false or absent: bench rows before 2026-12-03); the simulator gives each rank a runtime "
        "of its own, as `kvferry bench nixl` now does, so those rows measure slower than it "
        "predicts (a TP 2->1 ring room up to 2.3x: docs/fidelity.md)"
    )


def scenario(row: BenchRow, profile: str, fabric: dict[str, Any] | None = None) -> sc.Scenario:
    """The row as a scenario on ``profile``; ``fabric`` overrides keys of its [fabric] table (the
    calibration simulates a fit this way before any profile file holds it)."""
    pages = -(-row.tokens // 16) * row.inflight + -(-WARMUP_TOKENS // 16)
    data: dict[str, Any] = {
        "name": f"predict-{row.config}-{row.flow}",
        "seed": 1,
        "move_bytes": False,
        "model": {"preset": row.model},
        "topology": {
            "prefill_tp": row.prefill_tp,
            "decode_tp": row.decode_tp,
            "prefill_pages": pages,
            "decode_pages": pages,
            "workers": 2,
            "aux_rows": max(64, row.inflight),
        },
        "fabric": {"profile": profile, "one_gpu": row.one_gpu, **(fabric or {})},
        "flows": {"flow": row.flow, "auto_chunks": max(2, row.inflight)},
        "workload": {
            "chunk_tokens": 0,
            "compute_ns_per_token": 0,
            "room": [
                {"tokens": WARMUP_TOKENS, "arrival_us": 0},
                *({"tokens": row.tokens, "arrival_us": BATCH_US} for _ in range(row.inflight)),
            ],
        },
        # The bench's own deadlines (kvferry/tools/runtime_bench.py; the core's 1 s heartbeat): none
        # fires in a healthy row, and a slow control path is not mistaken for a lost peer.
        "timeouts": {
            "bootstrap_ns": 120 * S,
            "waiting_ns": 120 * S,
            "transfer_ns": 120 * S,
            "heartbeat_interval_ns": S,
            "heartbeat_timeout_ns": 60 * S,
        },  # fence and tombstone: derived to outlive these (sim/expected.py)
        "phases": {"fault_window_us": 0},
        "faults": {"swarm": False},
    }
    try:
        return sc.parse(data, where=f"bench row {row.config} {row.flow}")
    except sc.ScenarioError as e:
        raise CalibrationError(str(e)) from None


@dataclass(frozen=True, slots=True)
class FlowError:
    """The MAPE of the ms per batch of one flow's rows at one number of rooms in flight, equal or
    unequal TP, fit or held-out rows. Where a configuration (TP pair, flow, tokens, rooms in
    flight) was measured more than once, ``spread_pct`` is the largest (max - min) / min of its
    measured ms in the group (None: every configuration measured once): a group whose repeats
    differ by more than a target cannot be judged at that target from one of them. And
    ``median_mape_pct`` is the error against each configuration's median run: the lent machines
    differ by up to 2x on the same row (docs/fidelity.md), and the median of several runs is not
    moved by one such machine as their mean is."""

    flow: str
    inflight: int
    tp: str  # "equal" or "unequal"; the pair ("2->1") with ``pairs``; "all" with ``all_tp``
    held_out: bool
    rows: int
    mape_pct: float
    spread_pct: float | None = None
    median_mape_pct: float | None = None


def _config(r: BenchRow) -> tuple[int, int, str, int, int]:
    return (r.prefill_tp, r.decode_tp, r.flow, r.tokens, r.inflight)


def _group_error(preds: list[Prediction]) -> tuple[float, float | None, float]:
    """(MAPE over rows, largest spread of a repeated configuration or None, MAPE over the
    configurations' median measurements)."""
    by_cfg: dict[tuple[int, int, str, int, int], list[Prediction]] = {}
    for p in preds:
        by_cfg.setdefault(_config(p.row), []).append(p)
    rows = [abs(p.predicted_ms - p.measured_ms) / p.measured_ms for p in preds]
    medians, spreads = [], []
    for ps in by_cfg.values():
        ms = [p.measured_ms for p in ps]
        mid = statistics.median(ms)
        medians.append(abs(ps[0].predicted_ms - mid) / mid)
        if len(ms) > 1:
            spreads.append((max(ms) - min(ms)) / min(ms))
    spread = 100 * max(spreads) if spreads else None
    return 100 * sum(rows) / len(rows), spread, 100 * sum(medians) / len(medians)


def _tp_key(r: BenchRow, pairs: bool, all_tp: bool) -> str:
    if all_tp:
        return "all"
    if pairs:
        return f"{r.prefill_tp}->{r.decode_tp}"
    return "equal" if r.prefill_tp == r.decode_tp else "unequal"


def by_flow(
    preds: list[Prediction],
    held_out_tokens: frozenset[int] = frozenset(),
    pairs: bool = False,
    all_tp: bool = False,
) -> list[FlowError]:
    """Per-flow error; rows whose tokens are in ``held_out_tokens`` (room sizes no fit saw) apart
    from the others. Groups split equal from unequal TP by default, each TP pair with ``pairs``;
    ``all_tp`` puts every TP pair of a flow and number in flight in one group, as the per-flow
    target (MAPE <= 10% per flow, 1 and 8 rooms in flight) reads it."""
    if pairs and all_tp:
        raise ValueError("pairs and all_tp are two different groupings: ask for one")
    groups: dict[tuple[str, int, str, bool], list[Prediction]] = {}
    for p in preds:
        r = p.row
        key = (r.flow, r.inflight, _tp_key(r, pairs, all_tp), r.tokens in held_out_tokens)
        groups.setdefault(key, []).append(p)
    return [FlowError(*k, len(v), *_group_error(v)) for k, v in sorted(groups.items())]


Simulate = Callable[[BenchRow, dict[str, Any]], Prediction]  # a row run over fabric overrides


def rows_mape(run: Simulate, rows: Sequence[BenchRow], fabric: dict[str, Any]) -> float:
    """Mean relative error (%) of ``rows``' ms simulated by ``run`` over ``fabric``."""
    meas = np.array([r.room_mb * r.inflight / r.measured_gbps for r in rows])
    pred = np.array([run(r, fabric).predicted_ms for r in rows])
    return mape(pred, meas)


def predict(row: BenchRow, profile: str, fabric: dict[str, Any] | None = None) -> Prediction:
    from kvferry.core.kvpoll import KVPoll
    from kvferry.sim.world import World

    w = World(scenario(row, profile, fabric))
    w.run()
    ends = []
    for req in w.requests[1:]:  # the warm-up room is not timed
        dec = {n: st for n, st in req.status.items() if n.startswith("decode")}
        if not dec or any(st is not KVPoll.Success for st in dec.values()):
            raise CalibrationError(f"{row.config} {row.flow}: a simulated room did not succeed: {req.reason}")
        ends.append(max(req.terminal_ns[n] for n in dec) - req.arrival_ns)
    t_ns = max(ends)
    nbytes = row.room_mb * 1e6 * row.inflight
    return Prediction(row, nbytes / t_ns, t_ns / 1e6)
