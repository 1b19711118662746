"""Chrome/Perfetto trace writer: one process per node, one track per worker, NIC, and event family.

Open the file at https://ui.perfetto.dev (or chrome://tracing). Transfers are spans from post to
DONE/ERR on the initiator's NIC track; a worker's chunk is a span on that worker's track; status
changes, control traffic, notifications and faults are instant events on their own tracks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvferry.sim.trace import Event

_TRACK_OF = {
    "status": "rooms",
    "room_arrive": "rooms",
    "verify": "rooms",
    "free_pages": "rooms",
    "ctrl_drop": "control",
    "ctrl_send": "control",
    "notif_drop": "notifs",
    "notif_send": "notifs",
    "crash": "faults",
    "restart": "faults",
    "link_up": "faults",
    "link_down": "faults",
    "link_speed": "faults",
    "xfer_err_injected": "faults",
    "violation": "faults",
}


def _jsonable(v: Any) -> Any:
    if isinstance(v, bool | int | float | str) or v is None:
        return v
    if isinstance(v, tuple | list):
        return [_jsonable(x) for x in v]
    return str(v)


def chrome_events(events: list[Event]) -> list[dict[str, Any]]:
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    out: list[dict[str, Any]] = []

    def pid(node: str) -> int:
        if node not in pids:
            pids[node] = len(pids) + 1
            out.append({"ph": "M", "name": "process_name", "pid": pids[node], "args": {"name": node}})
        return pids[node]

    def tid(node: str, track: str) -> int:
        key = (node, track)
        if key not in tids:
            tids[key] = len(tids) + 1
            out.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid(node),
                    "tid": tids[key],
                    "args": {"name": track},
                }
            )
        return tids[key]

    posts: dict[int, Event] = {}
    chunks: dict[tuple[str, int], Event] = {}
    for ev in events:
        args = {k: _jsonable(v) for k, v in ev.attrs}
        if ev.kind == "post":
            posts[ev.get("xid")] = ev
            continue
        if ev.kind in ("xfer_done", "xfer_err"):
            start = posts.pop(ev.get("xid"), None)
            if start is not None:
                out.append(
                    {
                        "ph": "X",
                        "name": f"write {ev.get('tag')}",
                        "cat": ev.kind,
                        "pid": pid(ev.node),
                        "tid": tid(ev.node, "nic"),
                        "ts": start.t / 1000,
                        "dur": max(ev.t - start.t, 1) / 1000,
                        "args": {**{k: _jsonable(v) for k, v in start.attrs}, "result": ev.kind[5:]},
                    }
                )
            continue
        if ev.kind == "chunk_begin":
            chunks[(ev.node, ev.get("worker"))] = ev
            continue
        if ev.kind == "chunk_end":
            start = chunks.pop((ev.node, ev.get("worker")), None)
            if start is not None:
                out.append(
                    {
                        "ph": "X",
                        "name": f"room {start.get('room')} chunk {start.get('chunk')}",
                        "cat": "worker",
                        "pid": pid(ev.node),
                        "tid": tid(ev.node, f"worker {ev.get('worker')}"),
                        "ts": start.t / 1000,
                        "dur": max(ev.t - start.t, 1) / 1000,
                        "args": args,
                    }
                )
            continue
        track = _TRACK_OF.get(ev.kind, "events")
        out.append(
            {
                "ph": "i",
                "s": "t",
                "name": ev.kind if ev.kind != "status" else f"{ev.get('status')} room {ev.get('room')}",
                "cat": track,
                "pid": pid(ev.node),
                "tid": tid(ev.node, track),
                "ts": ev.t / 1000,
                "args": args,
            }
        )
    return out


def write(events: list[Event], path: str | Path, metadata: dict[str, Any] | None = None) -> None:
    doc = {"traceEvents": chrome_events(events), "displayTimeUnit": "ns", "otherData": metadata or {}}
    Path(path).write_text(json.dumps(doc))
