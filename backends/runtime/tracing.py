"""Where a real room's time goes, across both processes: a timestamped record of every event a
driver feeds its engine and every command it runs, for ``kvferry bench nixl --trace DIR``.

``DriverTrace`` is the driver's ``trace`` hook (one per endpoint). It only appends
(``time.monotonic_ns()``, thread, what, object): decoding control messages and notifications,
naming and attributing rows to rooms happen once, in ``rows()``, after the run. CLOCK_MONOTONIC is
system-wide, so the rows of a prefill and a decode process on one host share a time base.

``hops()`` turns the rows of several endpoints into a per-room timeline: for each label
("decode in ReceiverOpen", "prefill posted PostWrite", ...) its first time in a room, from decode's
open of that room, as a median over rooms; ``chrome()`` writes them for Perfetto.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from kvferry.core.commands import (
    Gather,
    PostAuxWrite,
    PostRead,
    PostWrite,
    Scatter,
    SendControl,
    StatusChanged,
)
from kvferry.core.errors import WireError
from kvferry.core.events import ControlIn, CopyDone, CopyFailed, NotificationIn, WriteDone, WriteFailed
from kvferry.core.messages import decode_control, decode_note

__all__ = ["DriverTrace", "chrome", "hops"]


class DriverTrace:
    """Append-only; the driver calls it from any of its threads (list.append is atomic)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._raw: list[tuple[int, str, str, Any]] = []

    def __call__(self, what: str, obj: Any) -> None:
        self._raw.append((time.monotonic_ns(), threading.current_thread().name, what, obj))

    def rows(self) -> list[dict[str, Any]]:
        """JSON-ready rows: t_ns, node, thread, what ("in", "run", "posted"), name, room (-1: none)."""
        by_id: dict[tuple[str, int], int] = {}  # write/op id -> room, from the command that began it
        out = []
        for t, thread, what, obj in self._raw:
            name, room = _describe(obj)
            k = type(obj)
            if k in (PostWrite, PostAuxWrite):
                by_id["w", obj.write_id] = room
            elif k is PostRead:
                by_id["w", obj.read_id] = room
            elif k in (Gather, Scatter):
                by_id["c", obj.op_id] = room
            elif k in (WriteDone, WriteFailed):
                room = by_id.get(("w", obj.write_id), -1)
            elif k in (CopyDone, CopyFailed):
                room = by_id.get(("c", obj.op_id), -1)
            out.append(
                {"t_ns": t, "node": self.node, "thread": thread, "what": what, "name": name, "room": room}
            )
        return out


def _describe(obj: Any) -> tuple[str, int]:
    """A row's name (the type; a control message's or status's own name inside) and its room."""
    k = type(obj)
    if k is ControlIn or k is SendControl:
        try:
            msg = decode_control(obj.data) if k is ControlIn else obj.msg
        except WireError:
            return f"{k.__name__} (undecodable)", -1
        return f"{k.__name__} {type(msg).__name__}", _room(msg)
    if k is NotificationIn:
        try:
            note = decode_note(obj.data)
        except WireError:
            return "NotificationIn (undecodable)", -1
        return "NotificationIn", note.room
    if k is StatusChanged:
        return f"StatusChanged {obj.status.name}", obj.room
    return k.__name__, _room(obj)


def _room(obj: Any) -> int:
    return obj.room if "room" in getattr(type(obj), "__struct_fields__", ()) else -1


def hops(rows: list[dict[str, Any]], skip_rooms: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
    """Median over rooms of each label's first time in the room (us from decode's ReceiverOpen,
    or its first row of the room), in time order; ``count``: rooms the label occurred in."""
    per_room: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if r["room"] >= 0 and r["room"] not in skip_rooms:
            per_room.setdefault(r["room"], []).append(r)
    firsts: dict[str, list[float]] = {}
    for rs in per_room.values():
        decode = [r for r in rs if r["node"].startswith("decode")]
        if not decode:
            continue
        # From decode's open (a prefill's early StagingReq may reach decode before it).
        opens = [r["t_ns"] for r in decode if r["what"] == "in" and r["name"] == "ReceiverOpen"]
        t0 = min(opens or [r["t_ns"] for r in decode])
        seen: dict[str, float] = {}
        for r in sorted(rs, key=lambda r: r["t_ns"]):
            label = f"{r['node']} {r['what']} {r['name']}"
            seen.setdefault(label, (r["t_ns"] - t0) / 1e3)
        for label, us in seen.items():
            firsts.setdefault(label, []).append(us)
    out = [
        {"label": label, "median_us": round(statistics.median(v), 1), "count": len(v)}
        for label, v in firsts.items()
    ]
    return sorted(out, key=lambda h: h["median_us"])


def chrome(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Instant events, a process per node and a track per thread (open at ui.perfetto.dev)."""
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    out: list[dict[str, Any]] = []
    t0 = min((r["t_ns"] for r in rows), default=0)
    for r in sorted(rows, key=lambda r: r["t_ns"]):
        pid = pids.setdefault(r["node"], len(pids) + 1)
        tid = tids.setdefault((r["node"], r["thread"]), len(tids) + 1)
        out.append(
            {
                "ph": "i",
                "s": "t",
                "name": f"{r['what']} {r['name']}",
                "pid": pid,
                "tid": tid,
                "ts": (r["t_ns"] - t0) / 1e3,
                "args": {"room": str(r["room"])},
            }
        )
    for node, pid in pids.items():
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": node}})
    for (node, thread), tid in tids.items():
        out.append(
            {"ph": "M", "name": "thread_name", "pid": pids[node], "tid": tid, "args": {"name": thread}}
        )
    return out
