"""Reading the measurements a fit uses: NIXL per-write telemetry and the kernel bench's JSON.

Accepted telemetry files: what ``kvferry bench nixl --telemetry FILE`` writes (``{"config": ...,
"writes": [XferRecord, ...]}``) and ``Telemetry.to_json()`` (``{"totals": ..., "records": [...]}``).
Every problem is a ``CalibrationError`` naming the file and the row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvferry.core.errors import KvferryError

__all__ = [
    "CalibrationError",
    "KernelRow",
    "Telemetry",
    "WriteRow",
    "charged_descs",
    "read_kernels",
    "read_telemetry",
]

_WRITE_KEYS = ("status", "descs_requested", "descs_posted", "nbytes", "post_us", "xfer_us", "wall_ns")


class CalibrationError(KvferryError, ValueError):
    """An input a fit cannot use; the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class WriteRow:
    """One DONE write: bytes, descriptors charged, and its time (us) in whole and in posting."""

    nbytes: int
    descs: int
    total_us: float
    post_us: float  # 0 when NIXL gave no telemetry for it
    source: str


@dataclass(frozen=True, slots=True)
class Telemetry:
    rows: tuple[WriteRow, ...]
    failed: int  # rows not DONE: dropped
    requested_descs: int  # rows whose posted count was unknown (-1): charged as requested
    wall_timed: int  # rows without NIXL durations: timed by our wall clock instead


@dataclass(frozen=True, slots=True)
class KernelRow:
    """One kernel bench configuration: payload bytes and median seconds per path."""

    nbytes: int
    seconds: dict[str, float]  # gather_gpu, scatter_gpu, gather_pinned, scatter_pinned (those present)
    host_us: float | None


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise CalibrationError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CalibrationError(f"{path}: is a directory, give a file") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:  # ValueError: a NUL in the path
        raise CalibrationError(f"{str(path)!r}: cannot read: {e}") from None


def _load_json(path: Path) -> Any:
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{path}: not valid JSON: {e}") from None


def _int(path: Path, where: str, row: dict[str, Any], key: str) -> int:
    if key not in row:
        raise CalibrationError(f"{path}: {where}: missing {key!r}")
    v = row[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise CalibrationError(f"{path}: {where}.{key}: expected an integer, got {v!r}")
    return v


def charged_descs(posted: int, requested: int) -> int:
    """The descriptors a write is charged: NIXL's count after its dense-run merge, or, where NIXL
    gave none (-1: the fallback path, the native engine), the count it was handed."""
    return requested if posted < 0 else posted


def read_telemetry(paths: list[Path]) -> Telemetry:
    rows: list[WriteRow] = []
    failed = requested = wall = 0
    for path in paths:
        data = _load_json(path)
        if isinstance(data, dict) and isinstance(data.get("writes"), list):
            records, key = data["writes"], "writes"
        elif isinstance(data, dict) and isinstance(data.get("records"), list):
            records, key = data["records"], "records"
        else:
            raise CalibrationError(
                f"{path}: not NIXL telemetry (expected an object with a 'writes' or 'records' list, "
                "as `kvferry bench nixl --telemetry` writes)"
            )
        for i, rec in enumerate(records):
            where = f"{key}[{i}]"
            if not isinstance(rec, dict):
                raise CalibrationError(f"{path}: {where}: expected an object, got {type(rec).__name__}")
            if "status" not in rec:
                raise CalibrationError(f"{path}: {where}: missing 'status'")
            vals = {k: _int(path, where, rec, k) for k in _WRITE_KEYS if k != "status"}
            if rec["status"] != "DONE":
                failed += 1
                continue
            for k, v in vals.items():
                if v < (-1 if k == "descs_posted" else 0):
                    raise CalibrationError(f"{path}: {where}.{k}: must be >= 0, got {v}")
            if vals["nbytes"] == 0 or vals["descs_requested"] == 0:
                raise CalibrationError(f"{path}: {where}: a DONE write of no bytes or no descriptors")
            descs = charged_descs(vals["descs_posted"], vals["descs_requested"])
            requested += vals["descs_posted"] < 0
            # NIXL's transfer duration runs from the post to completion; without it, our clock.
            total = float(vals["xfer_us"]) if vals["xfer_us"] > 0 else vals["wall_ns"] / 1e3
            if vals["xfer_us"] <= 0:
                wall += 1
            if total <= 0:
                raise CalibrationError(f"{path}: {where}: no duration (xfer_us and wall_ns are 0)")
            rows.append(WriteRow(vals["nbytes"], descs, total, float(vals["post_us"]), str(path)))
    if not rows:
        raise CalibrationError(
            f"{', '.join(map(str, paths))}: no DONE writes to fit ({failed} failed row(s) dropped)"
        )
    return Telemetry(tuple(rows), failed, requested, wall)


KERNEL_PATHS = ("gather_gpu", "scatter_gpu", "gather_pinned", "scatter_pinned")


def read_kernels(path: Path) -> list[KernelRow]:
    """``bench/kernel_bench.py --json`` output: rows with ``MB`` and median seconds per path."""
    data = _load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not data["rows"]:
        raise CalibrationError(
            f"{path}: not a kernel bench file (expected an object with a non-empty 'rows' list, "
            "as `bench/kernel_bench.py --json` writes)"
        )
    out = []
    for i, row in enumerate(data["rows"]):
        where = f"rows[{i}]"
        if not isinstance(row, dict):
            raise CalibrationError(f"{path}: {where}: expected an object")
        mb = row.get("MB")
        if isinstance(mb, bool) or not isinstance(mb, int | float) or mb <= 0:
            raise CalibrationError(f"{path}: {where}.MB: expected a positive number, got {mb!r}")
        secs = {}
        for k in KERNEL_PATHS:
            v = row.get(k)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
                raise CalibrationError(f"{path}: {where}.{k}: expected seconds > 0, got {v!r}")
            secs[k] = float(v)
        if not secs:
            raise CalibrationError(f"{path}: {where}: none of {', '.join(KERNEL_PATHS)}")
        host = row.get("host_us")
        if host is not None and (isinstance(host, bool) or not isinstance(host, int | float) or host < 0):
            raise CalibrationError(f"{path}: {where}.host_us: expected a number >= 0, got {host!r}")
        out.append(KernelRow(int(mb * 1e6), secs, None if host is None else float(host)))
    return out
