"""What both room machines share beyond the table engine (core/machine.py): tombstones, queries,
peers, heartbeats and deadlines.

A pair absent from a side's table fails the room with a reason naming the pair; a handler that
raises fails the room and keeps the exception; an outcome the table does not list fails the room
(a bug caught, not propagated). Failed is reached only through the table (``TableEngine.fail``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import Any, ClassVar

from kvferry.core.commands import DropPeer, SendControl, StatusChanged
from kvferry.core.deadlines import DeadlineHeap
from kvferry.core.errors import LocalMisuseError, ProtocolError, WireError
from kvferry.core.flows.parts import RankFlowPart
from kvferry.core.kvpoll import KVPoll
from kvferry.core.machine import RoomError, RoomFailure, RoomStateError, TableEngine, Transition, step
from kvferry.core.messages import decode_control

__all__ = [
    "EngineFlowContext",
    "RoomEngine",
    "RoomError",
    "RoomFailure",
    "RoomStateError",
    "Tombstones",
    "Transition",
    "UnknownRoomError",
    "WrongSideError",
    "step",
]


class UnknownRoomError(ProtocolError, KeyError):
    """poll() of a room this side never had (or forgot after its tombstone expired)."""


class WrongSideError(ProtocolError):
    """A message only the other side should receive (e.g. TransferInfo at a decode rank)."""


class Tombstones:
    """Finished (room, transfer_id) pairs, with their final status, kept for ``ttl`` ns.

    A message that names a tombstoned pair is ignored and counted: it never writes and never
    resurrects the room. A later incarnation of the same room id carries another transfer_id, so
    it is not confused with the old one.

    A pair expires on the first multiple of ``grid`` (``ttl`` / 16) at or after ``ttl`` from its
    end, not at exactly ``ttl``: the pairs ending within one grid step expire together, at one
    deadline, so a busy rank wakes once per step for them instead of once per room (a fifth of a
    simulated room's wake-ups were these). A pair is kept at least ``ttl`` (the safety rule of
    ``Timeouts.problems``) and less than ``ttl + grid``.
    """

    __slots__ = ("_by_key", "_heap", "_latest", "_reasons", "grid", "next_deadline", "ttl")

    def __init__(self, ttl: int) -> None:
        self.ttl = ttl
        self.grid = max(1, ttl // 16)
        self._by_key: dict[tuple[int, str], KVPoll] = {}
        self._latest: dict[int, str] = {}
        # Why a Failed pair failed: a local open that comes after the room was failed by its peer
        # (or by a peer the transport could not load) is told that reason, not only "finished".
        self._reasons: dict[tuple[int, str], str] = {}
        self._heap = DeadlineHeap()
        # The earliest expiry, or None: the heap's own query, bound once (asked after every
        # engine call, a forwarding method was one call more each time).
        self.next_deadline: Callable[[], int | None] = self._heap.next

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, room: int, transfer_id: str, status: KVPoll, now: int, reason: str = "") -> None:
        key = (room, transfer_id)
        self._by_key[key] = status
        if reason:
            self._reasons[key] = reason
        self._latest[room] = transfer_id
        due = now + self.ttl
        self._heap.set(key, due + (-due) % self.grid)

    def fail(self, room: int, transfer_id: str) -> bool:
        """The peer reported failure after we released the room: record the outcome both sides
        agree on (poll says Failed); nothing is resurrected. True if the record changed."""
        key = (room, transfer_id)
        if self._by_key.get(key, KVPoll.Failed) is KVPoll.Failed:
            return False
        self._by_key[key] = KVPoll.Failed
        return True

    def get(self, room: int, transfer_id: str) -> KVPoll | None:
        return self._by_key.get((room, transfer_id))

    def finished_reason(self, room: int, transfer_id: str) -> str:
        """What a local open of a tombstoned pair is told: it finished, and why if it failed."""
        why = self._reasons.get((room, transfer_id))
        return f"room already finished: {why}" if why else "room already finished"

    def latest(self, room: int) -> tuple[str, KVPoll] | None:
        tid = self._latest.get(room)
        if tid is None:
            return None
        return tid, self._by_key[(room, tid)]

    @property
    def longest(self) -> int:
        """The longest a pair is kept: less than ``ttl + grid``."""
        return self.ttl + self.grid - 1

    def expire(self, now: int) -> None:
        for key in self._heap.pop_due(now):
            room, tid = key  # type: ignore[misc]
            self._by_key.pop(key, None)
            self._reasons.pop(key, None)
            if self._latest.get(room) == tid:
                del self._latest[room]


def new_counters() -> Counter[str]:
    return Counter()


class EngineFlowContext:
    """What both sides' flow contexts share (core/flows/registry.py): the rank, the pool, the
    planner, the clock, emitting commands and sending control messages. Read from the engine at
    each call: a test or a planted bug may swap the engine's parts."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    @property
    def endpoint(self) -> Any:
        return self._engine.endpoint

    @property
    def pool(self) -> Any:
        return self._engine.pool

    @property
    def planner(self) -> Callable[..., Any]:
        return self._engine.planner

    @property
    def counters(self) -> Counter[str]:
        return self._engine.counters

    @property
    def deadlines(self) -> DeadlineHeap:
        """The rank's deadline heap: a flow arms and cancels its own kinds of deadline there (the
        room machine hands each due one back to the flow)."""
        return self._engine.deadlines

    @property
    def timeouts(self) -> Any:
        return self._engine.timeouts

    def now(self) -> int:
        now: int = self._engine._now
        return now

    def emit(self, command: Any) -> None:
        self._engine._out.append(command)

    def send(self, peer: Any, msg: Any) -> None:
        self._engine._send(peer, msg)

    def count(self, what: str) -> None:
        self._engine.counters[what] += 1

    def track(
        self, name: str, mentions: Callable[[int], bool], size: Callable[[], int] | None = None
    ) -> None:
        """Register a flow's per-room table with the engine (``RoomEngine.track``)."""
        self._engine.track(name, mentions, size)

    def room_table(self, name: str) -> dict[Any, Any]:
        """A flow's per-room table, room key -> the flow's record of the room
        (``RoomEngine.room_table``)."""
        return self._engine.room_table(name)

    def room(self, room: int) -> Any:
        """The live room of that id, if any."""
        return self._engine.rooms.get(room)

    def is_failed(self, r: Any) -> bool:
        """For a flow's code, which knows no room state: is the room Failed?"""
        failed: bool = r.state is self._engine.FAILED
        return failed

    def fail_room(self, r: Any, failure: RoomFailure) -> None:
        """Fail a room outside its own step (the table's funnel, ``TableEngine.fail``)."""
        self._engine.fail(r, failure)

    def flow_input(self, room: int, tid: str, inp: Enum, payload: Any, sender: Any = None) -> None:
        """One of the component's own inputs (``RankFlowPart.table``) for a room, run on the room
        machine's table like any room input (a room not live is counted; decode: ``sender``, if
        given, must be one of the room's)."""
        e = self._engine
        if sender is None:
            e._room_input(room, tid, inp, payload)
        else:
            e._room_input(room, tid, inp, payload, sender=sender)


class RoomEngine(TableEngine):
    """What the sender and receiver engines share: table dispatch (``TableEngine``), queries, the
    tick horizon, peers and heartbeats.

    A subclass sets the ``TableEngine`` class attributes and ``STATUS`` (state -> KVPoll), and
    provides ``rooms``, ``tombstones``, ``deadlines``, ``counters``, ``_now``, ``_out``,
    ``_entered`` and ``_maybe_finish``. Handlers are methods the table's ``Transition.handler``
    entries point at.
    """

    STATUS: ClassVar[Mapping[Any, KVPoll]]

    rooms: dict[int, Any]
    # Made empty first thing in the side's __init__ (``_new_tables``): every registered per-room
    # table, and the flows' tables of ``room_table``.
    _tables: dict[str, tuple[Callable[[int], bool], Callable[[], int] | None]]
    _room_tables: dict[str, dict[Any, Any]]
    tombstones: Tombstones
    deadlines: DeadlineHeap
    counters: Counter[str]
    last_internal_error: BaseException | None
    # The rank's flow components, in the order every hook calls them (core/flows/parts.py), and
    # what they own: control message type -> handler, deadline kind -> handler (``_route_parts``).
    parts: tuple[RankFlowPart, ...] = ()
    # The parts that keep a clock of their own (override ``next_deadline``): the others' answer
    # is always None, and ``next_deadline`` is asked after every engine call.
    _timed_parts: tuple[RankFlowPart, ...] = ()
    _routes: dict[type, Callable[[Any], None]]
    _deadline_routes: dict[str, Callable[[Any], None]]

    def _guarded(self, fn: Callable[[bytes], None], data: bytes) -> None:
        """Peer input must never raise out of the engine (it would kill a driver thread): a bug
        outside any room's dispatch is counted and kept for inspection; tests assert none."""
        try:
            fn(data)
        except Exception as exc:
            self.counters["internal_error"] += 1
            self.last_internal_error = exc

    def _send(self, peer: Any, msg: Any) -> None:
        self._out.append(SendControl(peer=peer, msg=msg))

    def _control_in(self, data: bytes) -> Any:
        """A control message off the wire, or None (garbage is counted, never raised); any
        message from a known peer proves it alive."""
        try:
            msg = decode_control(data)
        except WireError:
            self.counters["wire_error"] += 1
            return None
        peer = self.peers.get(msg.src)
        if peer is not None:
            peer.last_seen = self._now
        return msg

    def apply(self, room: int, inp: Any, payload: Any, now: int) -> list[Any]:
        """Table-level entry: feed ``inp`` straight to a live room (tests and tools; runtimes use
        ``handle``). Unknown rooms are ignored like any message for them."""
        self._now = now
        self._out = out = []
        r = self.rooms.get(room)
        if r is not None:
            self._dispatch(r, inp, payload)
        self._out = []
        return out

    def poll(self, room: int) -> KVPoll:
        r = self.rooms.get(room)
        if r is not None:
            return self.STATUS[r.state]
        t = self.tombstones.latest(room)
        if t is None:
            raise UnknownRoomError(room)
        return t[1]

    def state(self, room: int) -> Any:
        r = self.rooms.get(room)
        return None if r is None else r.state

    def failure(self, room: int) -> RoomFailure | None:
        r = self.rooms.get(room)
        return None if r is None else r.failure

    def next_deadline(self) -> int | None:
        # ``earliest`` of the engine's and its parts' deadlines, unrolled: asked after every
        # engine call, it is one of the simulator's most frequent calls.
        best = self.deadlines.next()
        t = self.tombstones.next_deadline()
        if t is not None and (best is None or t < best):
            best = t
        for p in self._timed_parts:
            t = p.next_deadline()
            if t is not None and (best is None or t < best):
                best = t
        return best

    # --- the per-room tables: every one registered, so quiescence checks miss none ------------------

    def _new_tables(self) -> None:
        self._tables, self._room_tables = {}, {}

    def track(
        self, name: str, mentions: Callable[[int], bool], size: Callable[[], int] | None = None
    ) -> None:
        """Register a per-room table: ``mentions(room)`` says whether it still names the room,
        ``size()`` how many entries it holds (all zero once every room settled; at zero it
        mentions no room, which ``referencing`` relies on)."""
        self._tables[name] = (mentions, size)

    def _track_rooms(self) -> None:
        """The tables every room machine keeps: its rooms and its rooms by peer."""
        self.track("rooms", lambda room: room in self.rooms, lambda: len(self.rooms))
        self.track(
            "rooms_by_peer",
            lambda room: any(room in s for s in self.rooms_by_peer.values()),
            lambda: sum(len(s) for s in self.rooms_by_peer.values()),
        )

    def room_table(self, name: str) -> dict[Any, Any]:
        """The per-room table ``name`` of a flow that keeps no component of its own (its halves
        are stateless): room key -> the flow's record of that room. Made and registered
        (``track``) on first use; a removed room's entry goes with it (``_forget``)."""
        tables = self._room_tables
        table = tables.get(name)
        if table is None:
            table = tables[name] = {}
            self.track(name, lambda room: any(k[0] == room for k in table), table.__len__)
        return table

    def references(self, room: int) -> list[str]:
        """Names of the per-room tables that still mention ``room`` (empty once released)."""
        return [name for name, (mentions, _) in self._tables.items() if mentions(room)]

    def referencing(self, rooms: Iterable[int]) -> set[str]:
        """``references`` of every room of ``rooms`` together. An empty table (size 0) is not
        asked per room: at a run's end, where every table is empty, the simulator's check of
        every room against every table is one size per table."""
        rooms = list(rooms)
        out: set[str] = set()
        for name, (mentions, size) in self._tables.items():
            if size is not None and not size():
                continue
            for room in rooms:
                if mentions(room):
                    out.add(name)
                    break
        return out

    def table_sizes(self) -> dict[str, int]:
        """Entries of every registered table that has a size (the runtime's ``leaks()``)."""
        return {name: size() for name, (_, size) in self._tables.items() if size is not None}

    # --- rooms: the same rules on both sides ---------------------------------------------------------

    def _live(self, room: int, tid: str) -> Any:
        """The live room of this incarnation, or None (counted: tombstoned, stale, unknown)."""
        r = self.rooms.get(room)
        if r is not None and r.tid == tid:
            return r
        if self.tombstones.get(room, tid) is not None:
            self.counters["tombstoned"] += 1
        elif r is not None:
            self.counters["stale_transfer_id"] += 1
        else:
            self.counters["unknown_room"] += 1
        return None

    def _completion(self, ids: dict[int, Any], done_id: int, unknown: str, inp: Any, event: Any) -> None:
        """A completion by id (write, copy): its room's input, or counted when the id is unknown."""
        key = ids.pop(done_id, None)
        if key is None:
            self.counters[unknown] += 1
        else:
            self._room_input(key[0], key[1], inp, event)

    def _room_input(self, room: int, tid: str, inp: Any, payload: Any) -> None:
        raise NotImplementedError

    def _refuse_open(self, room: int, tid: str, reason: str) -> None:
        self._out.append(StatusChanged(room=room, transfer_id=tid, status=KVPoll.Failed, reason=reason))

    def _open_tombstoned(self, room: int, tid: str) -> bool:
        """A local open of a finished (room, transfer_id): told it finished, and why if it failed."""
        if self.tombstones.get(room, tid) is None:
            return False
        self.counters["open_tombstoned"] += 1
        self._refuse_open(room, tid, self.tombstones.finished_reason(room, tid))
        return True

    def _forget(self, r: Any, peers: Any) -> None:
        """Drop a settled room: out of every table both sides keep, into the tombstones."""
        del self.rooms[r.room]
        for p in peers:
            s = self.rooms_by_peer.get(p)
            if s is not None:
                s.discard(r.room)
                if not s:
                    del self.rooms_by_peer[p]
        self.deadlines.cancel(("room", r.room))
        for table in self._room_tables.values():
            table.pop(r.key, None)
        reason = r.failure.reason if r.failure is not None else ""
        self.tombstones.add(r.room, r.tid, self.STATUS[r.state], self._now, reason)

    def _late_failure(self, msg: Any) -> None:
        """The peer failed a room we already released: the tombstone (and the poller) learn it."""
        if self.tombstones.fail(msg.room, msg.transfer_id):
            self.counters["failed_after_release"] += 1
            reason = f"failed on {msg.src} after release: {msg.reason}"
            self._out.append(
                StatusChanged(room=msg.room, transfer_id=msg.transfer_id, status=KVPoll.Failed, reason=reason)
            )

    # --- time and peers: the same rules on both sides -------------------------------------------

    TIMEOUT: ClassVar[Enum]  # the side's input for a room's deadline
    PEER_LOST: ClassVar[Enum]  # the side's input for a peer declared dead
    peers: dict[Any, Any]
    rooms_by_peer: dict[Any, set[int]]
    timeouts: Any

    def _tick(self) -> None:
        """Fire every due deadline: room deadlines, heartbeats, peer loss; the side's own kinds
        (resends, held requests) go to ``_on_deadline``."""
        now = self._now
        self.tombstones.expire(now)
        for key in self.deadlines.pop_due(now):
            kind, what = key
            if kind == "room":
                r = self.rooms.get(what)
                if r is not None:
                    self._dispatch(r, self.TIMEOUT, None)
            elif kind == "hb":
                if what in self.peers:
                    self._heartbeat(what)
                    for p in self.parts:
                        p.heartbeat(what)
                    self.deadlines.set(key, now + self.timeouts.heartbeat_interval_ns)
            elif kind == "loss":
                self._check_loss(what)
            elif kind in self._deadline_routes:
                self._deadline_routes[kind](what)  # a flow's own deadline (core/flows/parts.py)
            else:
                self._on_deadline(kind, what)
        for p in self.parts:
            p.tick(now)

    def _arm_peer(self, peer: Any) -> None:
        self.deadlines.set(("hb", peer), self._now + self.timeouts.heartbeat_interval_ns)
        self.deadlines.set(("loss", peer), self._now + self.timeouts.heartbeat_timeout_ns)

    def _check_loss(self, peer: Any) -> None:
        """Any message from a peer refreshes ``last_seen``; silence for the heartbeat timeout
        loses it (its rooms fail), otherwise look again when it could next be silent that long."""
        p = self.peers.get(peer)
        if p is None:
            return
        silent_until = p.last_seen + self.timeouts.heartbeat_timeout_ns
        if silent_until > self._now:
            self.deadlines.set(("loss", peer), silent_until)
        else:
            self._lose_peer(peer)

    def _lose_peer(self, peer: Any, unusable: str = "") -> None:
        """A peer declared dead (heartbeat), or ``unusable`` (why the driver could not load it):
        its rooms fail, and it is forgotten until it registers again."""
        self.counters["peer_unusable" if unusable else "peer_lost"] += 1
        self._parts_peer_lost(peer)
        self._peer_gone(peer)
        del self.peers[peer]
        self.deadlines.cancel(("hb", peer))
        self.deadlines.cancel(("loss", peer))
        self._out.append(DropPeer(peer=peer, reason=unusable or "heartbeat lost"))
        payload = (peer, f"unusable here: {unusable}") if unusable else peer
        for room in sorted(self.rooms_by_peer.get(peer, ())):
            r = self.rooms.get(room)
            if r is not None:
                self._dispatch(r, self.PEER_LOST, payload)

    def _heartbeat(self, peer: Any) -> None:
        raise NotImplementedError

    def _on_deadline(self, kind: str, what: Any) -> None:
        raise NotImplementedError

    def _peer_gone(self, peer: Any) -> None:
        """Side-specific state to drop with a lost peer (after its flow components')."""

    def _route_parts(self, parts: tuple[RankFlowPart, ...]) -> None:
        """Compose the rank's flow components: hooks go to each in this order; a message type, a
        deadline kind or a room input goes to the one component that claims it."""
        self.parts = parts
        self._timed_parts = tuple(p for p in parts if type(p).next_deadline is not RankFlowPart.next_deadline)
        self._routes, self._deadline_routes = {}, {}
        for p in parts:
            for table, claims in ((self._routes, p.routes()), (self._deadline_routes, p.deadline_kinds())):
                for what, handler in claims.items():
                    if what in table:
                        raise LocalMisuseError(f"two flow components claim {what!r}")
                    table[what] = handler
        self._part_rows = self._flow_rows(parts)

    def _flow_rows(self, parts: tuple[RankFlowPart, ...]) -> dict[Any, dict[Any, Transition]]:
        """Every component's own inputs as rows of the room table (``transition``): a component's
        row for a status is the row of the one room state that reports that status."""
        state_of = {status: state for state, status in self.STATUS.items()}
        if len(state_of) != len(self.STATUS):
            raise LocalMisuseError("two room states report one status: a flow's table cannot name them")
        rows: dict[Any, dict[Any, Transition]] = {state: {} for state in self.STATUS}
        for p in parts:
            for status, row in p.table().items():
                state = state_of[status]
                for inp, tr in row.items():
                    if inp in rows[state] or inp in self.TABLE[state]:
                        raise LocalMisuseError(f"two tables claim {inp!r}")
                    nxt = {outcome: state_of[s] for outcome, s in tr.next.items()}
                    rows[state][inp] = Transition(_part_handler(p, tr.handler), nxt)
        return rows

    def _parts_peer_lost(self, peer: Any) -> None:
        """Every flow component hears that ``peer`` is gone, with the live rooms it served."""
        rooms = [self.rooms[room] for room in sorted(self.rooms_by_peer.get(peer, ())) if room in self.rooms]
        for p in self.parts:
            p.peer_lost(peer, rooms)

    def _h_ignore(self, r: Any, inp: Any, payload: Any) -> str:
        self.counters[f"ignored_{inp.value}"] += 1
        return "stay"


def _part_handler(part: RankFlowPart, handler: Callable[..., str | None]) -> Callable[..., str | None]:
    """A component's table handler as the room table calls it (the engine first: dropped)."""

    def run(engine: Any, r: Any, inp: Any, payload: Any) -> str | None:
        return handler(part, r, inp, payload)

    return run
