"""Pieces both room machines share: transitions, failure records, tombstones, counters.

A machine's transition table maps ``(state, input)`` to a ``Transition``: the handler that runs and
the states it may leave the room in. A pair absent from the table fails the room with a reason
naming the pair; a handler that raises fails the room and keeps the exception; a handler that
lands outside its declared targets fails the room (a bug caught, not propagated).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, ClassVar

import msgspec
from kvferry.core.commands import DropPeer
from kvferry.core.deadlines import DeadlineHeap
from kvferry.core.errors import LocalMisuseError, ProtocolError
from kvferry.core.kvpoll import KVPoll

__all__ = [
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


class Transition(msgspec.Struct, frozen=True):
    """``handler`` is the engine's handler itself (unbound: engine, room, input, payload); it
    returns an outcome ("stay", "ready", "running", "done", "failed"), and ``next`` maps each
    outcome it may return to the state the room moves to. The table, not the handler, decides."""

    handler: Callable[..., str | None]
    next: Mapping[str, Any]

    @property
    def targets(self) -> frozenset:
        return frozenset(self.next.values())


def step(handler: Callable[..., str | None], **next_state: Any) -> Transition:
    """One table entry: ``step(handler, stay=S, ready=W)``."""
    return Transition(handler, next_state)


class RoomFailure(msgspec.Struct, frozen=True):
    """Why a room failed. ``error`` is the original exception when one caused it (type and
    message preserved for whoever polls the room)."""

    reason: str
    error: BaseException | None = None
    at_ns: int = 0

    @property
    def error_type(self) -> str | None:
        return None if self.error is None else type(self.error).__name__


class Tombstones:
    """Finished (room, transfer_id) pairs, with their final status, kept for ``ttl`` ns.

    A message that names a tombstoned pair is ignored and counted: it never writes and never
    resurrects the room. A later incarnation of the same room id carries another transfer_id, so
    it is not confused with the old one.
    """

    __slots__ = ("_by_key", "_heap", "_latest", "_reasons", "ttl")

    def __init__(self, ttl: int) -> None:
        self.ttl = ttl
        self._by_key: dict[tuple[int, str], KVPoll] = {}
        self._latest: dict[int, str] = {}
        # Why a Failed pair failed: a local open that comes after the room was failed by its peer
        # (or by a peer the transport could not load) is told that reason, not only "finished".
        self._reasons: dict[tuple[int, str], str] = {}
        self._heap = DeadlineHeap()

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, room: int, transfer_id: str, status: KVPoll, now: int, reason: str = "") -> None:
        key = (room, transfer_id)
        self._by_key[key] = status
        if reason:
            self._reasons[key] = reason
        self._latest[room] = transfer_id
        self._heap.set(key, now + self.ttl)

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

    def next_deadline(self) -> int | None:
        return self._heap.next()

    def expire(self, now: int) -> None:
        for key in self._heap.pop_due(now):
            room, tid = key  # type: ignore[misc]
            self._by_key.pop(key, None)
            self._reasons.pop(key, None)
            if self._latest.get(room) == tid:
                del self._latest[room]


def new_counters() -> Counter[str]:
    return Counter()


class RoomError(ProtocolError):
    """A room-level protocol violation detected inside a handler (the room fails with it), in
    what a peer sent: counted as ``remote_violation``."""


class RoomStateError(ProtocolError):
    """The room cannot go on for a reason of our own, found inside a handler (a chunk the
    scheduler handed over before decode said how long the room is, that turns out too long; a
    peer gone since its TransferInfo): the room fails with it, but no peer misbehaved."""


class RoomEngine:
    """What the sender and receiver engines share: table dispatch, queries, the tick horizon.

    A subclass sets ``TABLE`` (state -> input -> Transition), ``STATUS`` (state -> KVPoll),
    ``FAILED`` (its absorbing state) and ``SUCCESS``, and provides ``rooms``, ``tombstones``, ``deadlines``,
    ``counters``, ``_now``, ``_out``, ``_fail``, ``_entered`` and ``_maybe_finish``. Handlers are
    methods the table's ``Transition.handler`` entries point at.
    """

    TABLE: ClassVar[Mapping[Any, Mapping[Any, Transition]]]
    # The inputs ``_bookkeep`` acts on: the others skip the call.
    BOOKKEEP: ClassVar[frozenset[Any]] = frozenset()
    STATUS: ClassVar[Mapping[Any, KVPoll]]
    FAILED: ClassVar[Enum]
    SUCCESS: ClassVar[Enum]  # with FAILED, the states ``_maybe_finish`` acts on

    rooms: dict[int, Any]
    tombstones: Tombstones
    deadlines: DeadlineHeap
    counters: Counter[str]
    last_internal_error: BaseException | None
    _now: int
    _out: list[Any]

    def _fail(self, r: Any, failure: RoomFailure) -> None:
        raise NotImplementedError

    def _entered(self, r: Any) -> None:
        raise NotImplementedError

    def _maybe_finish(self, r: Any) -> None:
        raise NotImplementedError

    def _bookkeep(self, r: Any, inp: Any, payload: Any) -> None:
        """Per-side bookkeeping every state needs, whatever the table says about the input.
        Called only for the inputs in ``BOOKKEEP``: a side that handles another here lists it."""

    def _guarded(self, fn: Callable[[bytes], None], data: bytes) -> None:
        """Peer input must never raise out of the engine (it would kill a driver thread): a bug
        outside any room's dispatch is counted and kept for inspection; tests assert none."""
        try:
            fn(data)
        except Exception as exc:
            self.counters["internal_error"] += 1
            self.last_internal_error = exc

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
        a, b = self.deadlines.next(), self.tombstones.next_deadline()
        if a is None:
            return b
        return a if b is None else min(a, b)

    def _dispatch(self, r: Any, inp: Any, payload: Any) -> None:
        # The hottest function of both engines (every room input): locals over attribute lookups.
        if inp in self.BOOKKEEP:
            self._bookkeep(r, inp, payload)
        before = r.state
        failed = self.FAILED
        tr = self.TABLE[before].get(inp)
        if tr is None:
            self.counters["illegal_input"] += 1
            self._fail(r, RoomFailure(f"{inp.value} not allowed while {before.value}", at_ns=self._now))
        else:
            try:
                outcome = tr.handler(self, r, inp, payload) or "stay"
            except LocalMisuseError:
                raise  # our own caller's mistake: theirs to handle, the room is untouched
            except Exception as exc:
                # One room's exception fails that room only, type and message kept for the poller.
                self.counters["room_exception"] += 1
                if isinstance(exc, RoomError):
                    self.counters["remote_violation"] += 1
                self._fail(r, RoomFailure(f"{type(exc).__name__}: {exc}", error=exc, at_ns=self._now))
                outcome = "failed"
            state = r.state
            if state is not failed:
                nxt = tr.next.get(outcome)
                if nxt is None:
                    self._fail(
                        r, RoomFailure(f"internal: {inp.value} while {before.value}: outcome {outcome!r}")
                    )
                elif nxt is not before:
                    if state is not before:
                        self._fail(r, RoomFailure(f"internal: a handler moved the room to {state.value}"))
                    else:
                        r.state = nxt
        state = r.state
        if state is not before and state is not failed:
            self._entered(r)
            state = r.state  # entering a state may fail the room (a push lease refused)
        # ``_maybe_finish`` acts only on a settled room (both sides return at once for a live one):
        # the call is skipped for the live rooms most inputs leave behind.
        if state is failed or state is self.SUCCESS:
            self._maybe_finish(r)

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
                    self.deadlines.set(key, now + self.timeouts.heartbeat_interval_ns)
            elif kind == "loss":
                self._check_loss(what)
            else:
                self._on_deadline(kind, what)

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
        """Side-specific state to drop with a lost peer."""

    def _h_ignore(self, r: Any, inp: Any, payload: Any) -> str:
        self.counters[f"ignored_{inp.value}"] += 1
        return "stay"
