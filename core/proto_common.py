"""Pieces both room machines share: transitions, failure records, tombstones, counters.

A machine's transition table maps ``(state, input)`` to a ``Transition``: the handler that runs and
the states it may leave the room in. A pair absent from the table fails the room with a reason
naming the pair; a handler that raises fails the room and keeps the exception; a handler that
lands outside its declared targets fails the room (a bug caught, not propagated).
"""

from __future__ import annotations

from collections import Counter

import msgspec
from kvferry.core.deadlines import DeadlineHeap
from kvferry.core.errors import ProtocolError
from kvferry.core.kvpoll import KVPoll

__all__ = [
    "RoomFailure",
    "Tombstones",
    "Transition",
    "UnknownRoomError",
    "WrongSideError",
]


class UnknownRoomError(ProtocolError, KeyError):
    """poll() of a room this side never had (or forgot after its tombstone expired)."""


class WrongSideError(ProtocolError):
    """A message only the other side should receive (e.g. TransferInfo at a decode rank)."""


class Transition(msgspec.Struct, frozen=True):
    handler: str
    targets: frozenset


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

    __slots__ = ("_by_key", "_heap", "_latest", "ttl")

    def __init__(self, ttl: int) -> None:
        self.ttl = ttl
        self._by_key: dict[tuple[int, str], KVPoll] = {}
        self._latest: dict[int, str] = {}
        self._heap = DeadlineHeap()

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, room: int, transfer_id: str, status: KVPoll, now: int) -> None:
        key = (room, transfer_id)
        self._by_key[key] = status
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
            if self._latest.get(room) == tid:
                del self._latest[room]


def new_counters() -> Counter[str]:
    return Counter()
