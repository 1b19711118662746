"""Chrome/Perfetto trace writer: one process per node, tracks per worker, NIC, room and event family.

Open the file at https://ui.perfetto.dev (or chrome://tracing). Spans ("X" events):

- a write, from post to DONE/ERR, on the initiator's NIC tracks, named by the room and chunk its
  notification carries (``write room 3 chunk 1``); ``NoteTap`` (given to
  ``campaign.run_one(before_run=...)``) is where the notification comes from;
- a worker's chunk, on that worker's track;
- a room's life on each rank, from its first status to its terminal one (Success or Failed), with
  one nested span per status, on the node's room tracks.

Spans that overlap in time get tracks of their own ("nic", "nic 2", ...; "rooms", "rooms 2", ...):
a viewer draws the spans of one track as a stack, which only works when they nest. Control
traffic, notifications, faults and other moments are instant events on their own tracks. Every id
(room ids are 63-bit) and every integer past 2**53 is written as a string: a JavaScript viewer
reads JSON numbers as doubles and would round it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvferry.core.errors import WireError
from kvferry.core.kvpoll import KVPoll
from kvferry.core.messages import ChunkNote, decode_note
from kvferry.sim.trace import Event

if TYPE_CHECKING:
    from kvferry.sim.world import World

_TRACK_OF = {
    "room_arrive": "rooms",
    "verify": "rooms",
    "free_pages": "rooms",
    "ctrl_drop": "control",
    "ctrl_send": "control",
    "notif_drop": "notifs",
    "notif_send": "notifs",
    "abort": "faults",
    "crash": "faults",
    "restart": "faults",
    "link_up": "faults",
    "link_down": "faults",
    "link_speed": "faults",
    "xfer_err_injected": "faults",
    "violation": "faults",
}
_TERMINAL = frozenset((KVPoll.Success.name, KVPoll.Failed.name))
_ID_KEYS = frozenset(("room", "key", "xid", "staged", "transfer_id"))
_JS_SAFE_INT = 2**53 - 1


def _jsonable(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > _JS_SAFE_INT:
        return str(v)
    if isinstance(v, bool | int | float | str) or v is None:
        return v
    if isinstance(v, tuple | list):
        return [_jsonable(x) for x in v]
    return str(v)


def _arg(key: str, v: Any) -> Any:
    if key in _ID_KEYS and isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return _jsonable(v)


def _args(attrs: tuple[tuple[str, Any], ...] | dict[str, Any]) -> dict[str, Any]:
    items = attrs.items() if isinstance(attrs, dict) else attrs
    return {k: _arg(k, v) for k, v in items}


def _us(ns: int) -> float:
    return ns / 1000


class _Tracks:
    """Process and track numbers, with their name events, and lanes: the tracks of one family
    ("nic", "nic 2", ...) among which spans that overlap in time are spread so each track nests."""

    def __init__(self, out: list[dict[str, Any]]) -> None:
        self.out = out
        self.pids: dict[str, int] = {}
        self.tids: dict[tuple[str, str], int] = {}
        self.busy: dict[tuple[str, str], list[bool]] = {}

    def pid(self, node: str) -> int:
        if node not in self.pids:
            self.pids[node] = len(self.pids) + 1
            self.out.append(
                {"ph": "M", "name": "process_name", "pid": self.pids[node], "args": {"name": node}}
            )
        return self.pids[node]

    def tid(self, node: str, track: str) -> int:
        key = (node, track)
        if key not in self.tids:
            self.tids[key] = len(self.tids) + 1
            self.out.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": self.pid(node),
                    "tid": self.tids[key],
                    "args": {"name": track},
                }
            )
        return self.tids[key]

    def take_lane(self, node: str, family: str) -> int:
        lanes = self.busy.setdefault((node, family), [])
        for i, busy in enumerate(lanes):
            if not busy:
                lanes[i] = True
                return i
        lanes.append(True)
        return len(lanes) - 1

    def free_lane(self, node: str, family: str, lane: int) -> None:
        self.busy[(node, family)][lane] = False

    def lane_tid(self, node: str, family: str, lane: int) -> int:
        return self.tid(node, family if lane == 0 else f"{family} {lane + 1}")


@dataclass(slots=True)
class _Write:
    post: Event
    lane: int
    name: str
    args: dict[str, Any]


@dataclass(slots=True)
class _RoomLife:
    """One room on one rank, from its first status to its terminal one."""

    room: int
    start: int
    lane: int
    args: dict[str, Any]
    phases: list[tuple[str, int, int]] = field(default_factory=list)  # (status, start, end)
    status: str = ""
    since: int = 0


def _note(post: Event, notes: dict[int, bytes]) -> ChunkNote | None:
    # A post record carrying ``notif`` wins; the fabric records none, so NoteTap taps it.
    raw = post.get("notif", notes.get(post.get("xid")))
    if not raw:
        return None
    try:
        return decode_note(raw)
    except WireError:
        return None  # not a chunk note: the write keeps its plain name


class _Converter:
    def __init__(self, notes: dict[int, bytes]) -> None:
        self.out: list[dict[str, Any]] = []
        self.tracks = _Tracks(self.out)
        self.notes = notes
        self.keys: dict[int, int] = {}  # room id -> scheduler key, the "room" column of summaries
        self.writes: dict[int, _Write] = {}
        self.chunks: dict[tuple[str, int], Event] = {}
        self.rooms: dict[tuple[str, int], _RoomLife] = {}
        self.ended: dict[tuple[str, int], str] = {}  # (node, room) -> its terminal status
        self.last_ns = 0

    def label(self, room: int) -> str:
        return f"room {self.keys.get(room, room)}"

    def span(
        self, name: str, cat: str, pid: int, tid: int, start: int, end: int, args: dict[str, Any]
    ) -> None:
        self.out.append(
            {
                "ph": "X",
                "name": name,
                "cat": cat,
                "pid": pid,
                "tid": tid,
                "ts": _us(start),
                "dur": _us(max(end - start, 0)),
                "args": args,
            }
        )

    def instant(self, ev: Event, name: str, track: str) -> None:
        self.out.append(
            {
                "ph": "i",
                "s": "t",
                "name": name,
                "cat": track,
                "pid": self.tracks.pid(ev.node),
                "tid": self.tracks.tid(ev.node, track),
                "ts": _us(ev.t),
                "args": _args(ev.attrs),
            }
        )

    # --- writes ---------------------------------------------------------------------------------
    def post(self, ev: Event) -> None:
        note = _note(ev, self.notes)
        args = _args({k: v for k, v in ev.attrs if k != "notif"})
        if note is not None:
            args |= _args(
                {
                    "room": note.room,
                    "transfer_id": note.transfer_id,
                    "chunk": note.chunk_index,
                    "tokens": [note.token_start, note.token_end],
                    "is_last": note.is_last,
                }
            )
        lane = self.tracks.take_lane(ev.node, "nic")
        self.writes[ev.get("xid")] = _Write(ev, lane, self.write_name(ev, note), args)

    def write_name(self, post: Event, note: ChunkNote | None) -> str:
        """By the post's tag if it has one, else by the room and chunk its notification names."""
        if post.get("tag") is not None:
            return f"write {post.get('tag')}"
        if note is None:
            return f"write {post.get('src')} -> {post.get('dst')}"
        what = "aux row" if note.aux else f"chunk {note.chunk_index}"
        return f"write {self.label(note.room)} {what}" + (" (staged)" if note.staged >= 0 else "")

    def end_write(self, xid: int, node: str, t: int, result: str, reason: str = "") -> None:
        w = self.writes.pop(xid, None)
        if w is None:
            return
        self.tracks.free_lane(node, "nic", w.lane)
        args = {**w.args, "result": result} | ({"reason": reason} if reason else {})
        tid = self.tracks.lane_tid(node, "nic", w.lane)
        self.span(w.name, f"xfer_{result.lower()}", self.tracks.pid(node), tid, w.post.t, t, args)

    # --- worker chunks --------------------------------------------------------------------------
    def end_chunk(self, node: str, worker: int, t: int, extra: dict[str, Any]) -> None:
        start = self.chunks.pop((node, worker), None)
        if start is None:
            return
        name = f"{self.label(start.get('room'))} chunk {start.get('chunk')}"
        tid = self.tracks.tid(node, f"worker {worker}")
        self.span(name, "worker", self.tracks.pid(node), tid, start.t, t, _args(start.attrs) | extra)

    # --- rooms ----------------------------------------------------------------------------------
    def status(self, ev: Event) -> None:
        key = (ev.node, ev.get("room"))
        status = ev.get("status")
        if key in self.ended:
            # News after the terminal status (a release-time failure, an old incarnation's
            # report): a moment, not part of the span.
            self.instant(ev, f"{status} {self.label(key[1])} (after {self.ended[key]})", "rooms")
            return
        life = self.rooms.get(key)
        if life is None:
            lane = self.tracks.take_lane(ev.node, "rooms")
            life = self.rooms[key] = _RoomLife(
                key[1], ev.t, lane, _args({"room": key[1], "key": ev.get("key")})
            )
        else:
            life.phases.append((life.status, life.since, ev.t))
        life.status, life.since = status, ev.t
        if status in _TERMINAL:
            life.args |= {"final": status} | ({"reason": ev.get("reason")} if ev.get("reason") else {})
            self.end_room(ev.node, life, ev.t)
            self.ended[key] = status

    def end_room(self, node: str, life: _RoomLife, t: int) -> None:
        del self.rooms[(node, life.room)]
        self.tracks.free_lane(node, "rooms", life.lane)
        pid, tid = self.tracks.pid(node), self.tracks.lane_tid(node, "rooms", life.lane)
        # The parent before its status spans: they can start at the same time as it does.
        self.span(self.label(life.room), "room", pid, tid, life.start, t, life.args)
        for status, start, end in life.phases:
            self.span(status, "room_status", pid, tid, start, end, {"room": str(life.room)})

    # --- dispatch -------------------------------------------------------------------------------
    def add(self, ev: Event) -> None:
        self.last_ns = max(self.last_ns, ev.t)
        kind = ev.kind
        if kind == "room_arrive":
            self.keys[ev.get("room")] = ev.get("key")
        if kind == "post":
            self.post(ev)
        elif kind in ("xfer_done", "xfer_err"):
            self.end_write(ev.get("xid"), ev.node, ev.t, kind[5:].upper(), ev.get("reason") or "")
        elif kind == "chunk_begin":
            self.end_chunk(ev.node, ev.get("worker"), ev.t, {"cut": "began again"})
            self.chunks[(ev.node, ev.get("worker"))] = ev
        elif kind == "chunk_end":
            self.end_chunk(ev.node, ev.get("worker"), ev.t, {})
        elif kind == "status":
            if ev.get("key") is not None:
                self.keys.setdefault(ev.get("room"), ev.get("key"))
            self.status(ev)
        else:
            if kind == "crash":
                self.crash(ev)
            self.instant(ev, kind, _TRACK_OF.get(kind, "events"))

    def crash(self, ev: Event) -> None:
        # A crashed node's workers stop mid-chunk and never say chunk_end.
        for node, worker in [k for k in self.chunks if k[0] == ev.node]:
            self.end_chunk(node, worker, ev.t, {"cut": "node crashed"})

    def finish(self) -> list[dict[str, Any]]:
        """Close what the run left open at its last event, saying so."""
        for xid in list(self.writes):
            self.end_write(xid, self.writes[xid].post.node, self.last_ns, "UNFINISHED")
        for node, worker in list(self.chunks):
            self.end_chunk(node, worker, self.last_ns, {"cut": "run ended"})
        for (node, _room), life in list(self.rooms.items()):
            life.phases.append((life.status, life.since, self.last_ns))
            life.args |= {"final": "unfinished"}
            self.end_room(node, life, self.last_ns)
        return self.out


def chrome_events(events: list[Event], notes: dict[int, bytes] | None = None) -> list[dict[str, Any]]:
    """The trace as Chrome trace events; ``notes``: each write's notification by transfer id."""
    conv = _Converter(notes or {})
    for ev in events:
        conv.add(ev)
    return conv.finish()


def write(
    events: list[Event],
    path: str | Path,
    metadata: dict[str, Any] | None = None,
    notes: dict[int, bytes] | None = None,
) -> int:
    """Write the trace as Chrome JSON; returns the number of events in the file."""
    trace_events = chrome_events(events, notes)
    other = {k: _jsonable(v) for k, v in (metadata or {}).items()}
    doc = {"traceEvents": trace_events, "displayTimeUnit": "ns", "otherData": other}
    Path(path).write_text(json.dumps(doc))
    return len(trace_events)


class NoteTap:
    """Keeps each write's notification, by transfer id, as the fabric records its post.

    The fabric's post record carries the write's tag, which the driver leaves None, but not its
    notification, which says the room and chunk; the transfer is in the fabric's table when the
    post is recorded, so a trace listener can read it there. Listeners do not enter the trace
    hash: a traced run keeps its digest.
    """

    def __init__(self, world: World) -> None:
        self.fabric = world.fabric
        self.notes: dict[int, bytes] = {}
        world.trace.listeners.append(self)

    def __call__(self, ev: Event) -> None:
        if ev.kind != "post":
            return
        x = self.fabric.xfers.get(ev.get("xid"))
        if x is not None and x.notif:
            self.notes[x.xid] = x.notif
