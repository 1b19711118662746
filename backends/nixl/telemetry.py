"""Per-transfer telemetry, from NIXL's own counters plus our wall clock.

NIXL (with ``capture_telemetry``) reports for each request its start time, post duration,
transfer duration (microseconds), total bytes and the descriptor count after merging. We keep
them, with the descriptor count we asked for, in a bounded ring so a long run cannot grow memory,
and in running totals. The records are msgspec structs so a run can be dumped as JSON and fed to
the simulator's cost model.

Ownership: any thread may ``record``; every access goes through ``_lock``.
"""

from __future__ import annotations

import threading
from collections import deque

import msgspec


class XferRecord(msgspec.Struct, frozen=True):
    peer: str
    op: str
    status: str  # DONE or ERR
    descs_requested: int  # indices handed to make_prepped_xfer, or rows of a one-shot post
    descs_posted: int  # NIXL's descCount after its dense-run merge (-1 when unavailable)
    nbytes: int
    start_us: int  # NIXL clock
    post_us: int
    xfer_us: int
    wall_ns: int  # post to observed completion, our monotonic clock


class TelemetryTotals(msgspec.Struct):
    transfers: int = 0
    errors: int = 0
    nbytes: int = 0
    descs_requested: int = 0
    descs_posted: int = 0
    post_us: int = 0
    xfer_us: int = 0
    wall_ns: int = 0


class Telemetry:
    def __init__(self, keep: int = 4096) -> None:
        self._lock = threading.Lock()
        self._ring: deque[XferRecord] = deque(maxlen=keep)
        self._totals = TelemetryTotals()

    def record(self, rec: XferRecord) -> None:
        with self._lock:
            self._ring.append(rec)
            t = self._totals
            t.transfers += 1
            t.errors += rec.status != "DONE"
            t.nbytes += rec.nbytes
            t.descs_requested += rec.descs_requested
            t.descs_posted += max(rec.descs_posted, 0)
            t.post_us += rec.post_us
            t.xfer_us += rec.xfer_us
            t.wall_ns += rec.wall_ns

    def clear(self) -> None:
        """Forget the kept records (totals stay): a benchmark's warm-up, for instance."""
        with self._lock:
            self._ring.clear()

    def records(self) -> list[XferRecord]:
        with self._lock:
            return list(self._ring)

    def totals(self) -> TelemetryTotals:
        with self._lock:
            return msgspec.structs.replace(self._totals)

    def to_json(self) -> bytes:
        with self._lock:
            return msgspec.json.encode({"totals": self._totals, "records": list(self._ring)})
