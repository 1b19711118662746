"""Two costs the single-descriptor writes of the main fit cannot show, fitted to the telemetry of
the flows that do show them (``kvferry bench nixl --telemetry`` of direct rooms at different TP,
and of pinned rooms):

- **Posting many descriptors, alone or beside another process.** A different-TP room posts one
  descriptor per token and layer (147,456 for 2,048 qwen3-8b tokens). With every rank on one GPU,
  one process posts them at 5.5-8.8 us each, and two processes posting at once at 8.3-10.7 us each:
  slower, but together faster than one. So a descriptor costs its own process ``per_desc`` (the
  posting CPU work) and the GPU they share ``shared_desc``, and ``k`` processes posting at once each
  take ``max(per_desc, k * shared_desc)`` a descriptor (the fabric: NicSpec.shared_desc_ns).
- **The host wire.** The pinned flow's write goes between pinned host buffers, over UCX's cma (a
  copy by the initiator's CPU, 4.5-5.5 GB/s), not over the GPU's wire (NicSpec.host_bandwidth_bps).
- **A READ's cost a descriptor** (NicSpec.read_desc_ns), from a pull room's telemetry: decode's
  READs, beside the shared device's cost the writes gave. Telemetry taken before the bench
  recorded them has none: the pull rows' ms then give it (readpost.py).

Which writes posted at once is read from the telemetry itself: two writes are concurrent when
their posting intervals (start, start + post_us) overlap by more than half the shorter one.
Both fits minimise the squared relative error, as the main fit does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from kvferry.sim.calibrate.fit import refine_min
from kvferry.sim.calibrate.inputs import CalibrationError, _load_json, charged_descs

__all__ = [
    "FlowFit",
    "HostRow",
    "PostRow",
    "PostingFit",
    "fit_flows",
    "fit_host_wire",
    "fit_posting",
    "fit_read_posting",
    "read_flow_telemetry",
]

# Below this a write's post is dominated by its fixed cost, not its descriptors (the same-TP
# writes: 72 descriptors): those rows belong to the main fit.
MIN_DESCS = 1000


@dataclass(frozen=True, slots=True)
class PostRow:
    descs: int
    post_us: float
    concurrent: int  # writes posting at once with it, itself included
    source: str


@dataclass(frozen=True, slots=True)
class HostRow:
    nbytes: int
    xfer_us: float
    source: str


@dataclass(frozen=True, slots=True)
class PostingFit:
    per_desc_us: float
    shared_desc_us: float
    rows: int
    mape_pct: float  # in sample: every descriptor-bound write of the telemetry is in the fit


@dataclass(frozen=True, slots=True)
class FlowFit:
    """What ``kvferry calibrate --flow-telemetry`` fits: the posting costs (None: the telemetry had
    no descriptor-bound writes) and the host wire (None: no pinned-flow writes)."""

    posting: PostingFit | None
    host_gbps: float | None
    host_rows: int
    host_mape_pct: float
    sources: tuple[str, ...]
    # A READ's cost a descriptor, from decode's READs in pull rooms' telemetry (None: none given).
    read_desc_us: float | None = None
    read_rows: int = 0
    read_mape_pct: float = 0.0

    def overrides(self) -> dict[str, float | int]:
        """As a scenario's [fabric] keys: the posting costs replace the single-process one."""
        out: dict[str, float | int] = {}
        if self.posting is not None:
            out["per_desc_ns"] = round(self.posting.per_desc_us * 1000)
            out["shared_desc_ns"] = round(self.posting.shared_desc_us * 1000)
        if self.host_gbps is not None:
            out["host_bandwidth_gbps"] = float(self.host_gbps)
        if self.read_desc_us is not None:
            out["read_desc_ns"] = round(self.read_desc_us * 1000)
        return out

    def summary(self) -> str:
        parts = []
        if (p := self.posting) is not None:
            parts.append(
                f"descriptors ({p.rows} descriptor-bound writes): {p.per_desc_us:.3f} us a descriptor of one "
                f"process, {p.shared_desc_us:.3f} us on the GPU every process shares (MAPE in sample "
                f"{p.mape_pct:.1f}%)"
            )
        if self.host_gbps is not None:
            parts.append(
                f"host wire {self.host_gbps:.2f} GB/s ({self.host_rows} pinned writes, MAPE in sample "
                f"{self.host_mape_pct:.1f}%)"
            )
        if self.read_desc_us is not None:
            parts.append(
                f"READs {self.read_desc_us:.3f} us a descriptor ({self.read_rows} descriptor-bound READs "
                f"of pull rooms, MAPE in sample {self.read_mape_pct:.1f}%)"
            )
        return "; ".join(parts)

    def as_dict(self) -> dict[str, object]:
        p = self.posting
        return {
            "per_desc_us": None if p is None else p.per_desc_us,
            "shared_desc_us": None if p is None else p.shared_desc_us,
            "posting_rows": 0 if p is None else p.rows,
            "posting_mape_in_sample_pct": None if p is None else p.mape_pct,
            "host_bandwidth_gbps": self.host_gbps,
            "host_rows": self.host_rows,
            "host_mape_in_sample_pct": None if self.host_gbps is None else self.host_mape_pct,
            "read_desc_us": self.read_desc_us,
            "read_rows": self.read_rows,
            "read_mape_in_sample_pct": None if self.read_desc_us is None else self.read_mape_pct,
            "sources": list(self.sources),
        }


def fit_flows(paths: Sequence[Path], post_cost_us: float) -> FlowFit:
    """The fits on the telemetry that has their writes (or READs); an error if it has none."""
    posts, host, reads = _read_all(paths)
    if not posts and not host and not reads:
        raise CalibrationError(
            "--flow-telemetry: neither descriptor-bound writes (different-TP direct rooms) nor "
            "pinned-flow writes nor pull rooms' READs in these files"
        )
    posting = fit_posting(posts, post_cost_us) if posts else None
    gbps, host_mape = fit_host_wire(host) if host else (None, 0.0)
    read, read_mape = (None, 0.0)
    if reads:
        shared = 0.0 if posting is None else posting.shared_desc_us
        read, read_mape = fit_read_posting(reads, post_cost_us, shared)
    return FlowFit(posting, gbps, len(host), host_mape, tuple(map(str, paths)), read, len(reads), read_mape)


def _concurrency(spans: Sequence[tuple[float, float]]) -> list[int]:
    out = []
    for i, (a0, a1) in enumerate(spans):
        k = 1
        for j, (b0, b1) in enumerate(spans):
            if i != j and min(a1, b1) - max(a0, b0) > 0.5 * min(a1 - a0, b1 - b0):
                k += 1
        out.append(k)
    return out


def _descs(w: dict[str, Any]) -> int:
    return int(charged_descs(w["descs_posted"], w["descs_requested"]))


def _post_rows(done: list[dict[str, Any]], one_process: bool, source: str) -> list[PostRow]:
    """Each descriptor-bound write's posting time and how many processes posted at once.

    The descriptors' cost is in the post for the python engine (its ``post_us``) and in the
    transfer for the native one (its post returns at once); ``xfer_us``, from the post's start to
    DONE, holds both (a write's bytes, 0.1 ms of it at most, are noise beside seconds of them).
    A process's writes are worked one after another: with one prefill process (TP 1->D) a
    write's own time starts when the one before it ended; otherwise writes that overlap are
    other processes' (one write per prefill rank a room, TP P->1)."""
    ends = [(float(w["start_us"]), float(w["start_us"] + max(w["post_us"], w["xfer_us"])), w) for w in done]
    spans = sorted(ends, key=lambda e: (e[0], e[1]))
    if one_process:
        rows, free = [], 0.0
        for a0, a1, w in spans:
            rows.append(PostRow(_descs(w), a1 - max(a0, free), 1, source))
            free = a1
    else:
        ks = _concurrency([(a0, a1) for a0, a1, _ in spans])
        rows = [PostRow(_descs(w), a1 - a0, k, source) for (a0, a1, w), k in zip(spans, ks, strict=True)]
    return [r for r in rows if r.descs >= MIN_DESCS]


def read_flow_telemetry(paths: Sequence[Path]) -> tuple[list[PostRow], list[HostRow]]:
    """Descriptor-bound writes (with their concurrency) and pinned-flow host writes."""
    posts, host, _ = _read_all(paths)
    return posts, host


def _done(path: Path, records: list[Any], what: str) -> list[dict[str, Any]]:
    """The DONE records of one list, each checked to carry its numbers."""
    done = []
    for i, w in enumerate(records):
        keys = ("descs_posted", "descs_requested", "nbytes", "start_us", "post_us", "xfer_us")
        if not isinstance(w, dict) or any(
            isinstance(w.get(k), bool) or not isinstance(w.get(k), int | float) for k in keys
        ):
            raise CalibrationError(f"{path}: {what}[{i}]: expected numbers for {', '.join(keys)}")
        if w.get("status") == "DONE" and w["post_us"] > 0 and _descs(w) > 0:
            done.append(w)
    return done


def _read_all(paths: Sequence[Path]) -> tuple[list[PostRow], list[HostRow], list[PostRow]]:
    """Descriptor-bound writes, pinned-flow host writes, and descriptor-bound READs (pull)."""
    posts: list[PostRow] = []
    host: list[HostRow] = []
    reads: list[PostRow] = []
    for path in paths:
        data = _load_json(path)
        if not isinstance(data, dict) or not isinstance(data.get("writes"), list):
            raise CalibrationError(f"{path}: not `kvferry bench nixl --telemetry` output (no 'writes' list)")
        cfg = data.get("config")
        flow = cfg.get("flow") if isinstance(cfg, dict) else None
        if not isinstance(flow, str):
            raise CalibrationError(
                f"{path}: config.flow missing (telemetry of `kvferry bench nixl --flow F`)"
            )
        if flow == "pull":  # its READs are decode's, one process when decode TP is 1
            got = data.get("reads")
            if not isinstance(got, list) or not got:
                raise CalibrationError(
                    f"{path}: a pull room's telemetry without READs (measured before `kvferry bench "
                    "nixl --telemetry` recorded decode's); give its row to --rooms instead: a READ's "
                    "cost a descriptor is fitted to the pull rows' ms"
                )
            reads += _post_rows(_done(path, got, "reads"), cfg.get("decode_tp") == 1, str(path))
            continue
        done = _done(path, data["writes"], "writes")
        if flow == "pinned":
            host += [HostRow(int(w["nbytes"]), float(w["xfer_us"]), str(path)) for w in done]
            continue
        posts += _post_rows(done, cfg.get("prefill_tp") == 1, str(path))
    return posts, host, reads


def _per_desc_model(a: float, b: float, k: np.ndarray) -> np.ndarray:
    return np.maximum(a, k * b)


def fit_posting(rows: Sequence[PostRow], post_cost_us: float) -> PostingFit:
    """per_desc and shared_desc minimising the relative error of ``post_cost + descs *
    max(per_desc, k * shared_desc)``; a grid, refined three times (two parameters, a kink)."""
    if not rows:
        raise CalibrationError("--flow-telemetry: no descriptor-bound writes (different-TP direct rooms)")
    if len({r.concurrent for r in rows}) < 2:
        raise CalibrationError(
            "--flow-telemetry: every descriptor-bound write posted at the same concurrency; the shared "
            "device's cost needs writes of one process alone and of several at once (TP 1->2 and 2->1)"
        )
    y = np.array([max(r.post_us - post_cost_us, 1e-9) / r.descs for r in rows])
    k = np.array([float(r.concurrent) for r in rows])
    lo_a, hi_a, lo_b, hi_b = 0.0, float(y.max()), 0.0, float((y / k).max())
    best = (float("inf"), 0.0, 0.0)
    for _ in range(4):
        for a in np.linspace(lo_a, hi_a, 81):
            for b in np.linspace(lo_b, hi_b, 81):
                err = float(np.sum(((_per_desc_model(a, b, k) - y) / y) ** 2))
                if err < best[0]:
                    best = (err, float(a), float(b))
        _, a0, b0 = best
        da, db = (hi_a - lo_a) / 20, (hi_b - lo_b) / 20
        lo_a, hi_a, lo_b, hi_b = max(0.0, a0 - da), a0 + da, max(0.0, b0 - db), b0 + db
    _, a, b = best
    pred = _per_desc_model(a, b, k)
    return PostingFit(a, b, len(rows), float(np.mean(np.abs(pred - y) / y) * 100))


def fit_read_posting(
    rows: Sequence[PostRow], post_cost_us: float, shared_desc_us: float
) -> tuple[float, float]:
    """(READ cost a descriptor in us, in-sample MAPE %) minimising the relative error of
    ``post_cost + descs * max(read_desc, k * shared_desc)``, the shared device's cost as the writes
    gave it; a grid, refined three times."""
    y = np.array([max(r.post_us - post_cost_us, 1e-9) / r.descs for r in rows])
    k = np.array([float(r.concurrent) for r in rows])
    _, a = refine_min(
        lambda a: float(np.sum(((_per_desc_model(a, shared_desc_us, k) - y) / y) ** 2)),
        0.0,
        float(y.max()),
        (float("inf"), 0.0),
        rounds=4,
        floor=0.0,
        points=161,
        narrow=40,
    )
    pred = _per_desc_model(a, shared_desc_us, k)
    return a, float(np.mean(np.abs(pred - y) / y) * 100)


def fit_host_wire(rows: Sequence[HostRow]) -> tuple[float, float]:
    """(GB/s, in-sample MAPE %) of ``bytes / bandwidth`` on the pinned writes, relative error."""
    if not rows:
        raise CalibrationError("--flow-telemetry: no pinned-flow writes for the host wire")
    r = np.array([row.nbytes / row.xfer_us for row in rows])  # bytes per us each write moved
    # argmin over g of sum((r_i / g - 1)^2) (the relative error of bytes / g): 1/g = sum r / sum r^2.
    gbps = float(np.sum(r**2) / np.sum(r)) / 1e3  # bytes per us -> GB/s
    pred = np.array([row.nbytes / (gbps * 1e3) for row in rows])
    meas = np.array([row.xfer_us for row in rows])
    return gbps, float(np.mean(np.abs(pred - meas) / meas) * 100)
