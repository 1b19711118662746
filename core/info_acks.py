"""Prefill's InfoAcks, owed instead of sent at once (one control message fewer per room and decode rank).

Decode resends a room's ``TransferInfo`` each heartbeat interval until that sender answers
(``core/receiver.py``), and it already takes the sender's first chunk note as the answer: a sender
writes only after the TransferInfo. So prefill owes the ``InfoAck``: a note posted to that decode
rank for the room settles it (the note is the answer), and what is still owed a quarter of a
heartbeat interval after the first owed TransferInfo arrived goes to that decode rank in one
``InfoAck`` naming every such room. A quarter leaves decode's resend (one interval after its
send) three quarters of an interval for the message delays. A resent TransferInfo, or one for a
room that is failed, tombstoned or stale, is still answered at once (``SenderEngine._on_info``).

The owed entries are a per-room table of the engine (``room_table``): a released room takes its
entries with it, since decode needs no answer for a room prefill finished (it heard the notes, a
RoomFailed, or it resends and the tombstone answers).
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvferry.core import messages as m
from kvferry.core.commands import PostAuxWrite, PostPrepared, PostWrite, SendNotif

__all__ = ["OwedAcks"]

# Commands whose note reaches the decode rank for the room: the note answers its TransferInfo.
_NOTE_CARRIERS = (PostWrite, PostPrepared, PostAuxWrite, SendNotif)


class OwedAcks:
    """The InfoAcks a prefill rank owes, by room key, and one deadline per decode rank owed."""

    KIND: ClassVar[str] = "info_ack"  # read through the class too (a compiled class needs ClassVar)

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.owed: dict[tuple[int, str], set[m.Endpoint]] = engine.room_table("info_acks_owed")
        self.armed: set[m.Endpoint] = set()  # decode ranks with a deadline set

    def owe(self, key: tuple[int, str], peer: m.Endpoint) -> None:
        e = self.engine
        self.owed.setdefault(key, set()).add(peer)
        if peer not in self.armed:
            self.armed.add(peer)
            e.deadlines.set((self.KIND, peer), e._now + e.timeouts.heartbeat_interval_ns // 4)

    def ride(self, out: list[Any]) -> None:
        """The notes leaving in ``out`` answer their rooms' TransferInfos on their decode ranks."""
        rooms = self.engine.rooms
        for cmd in out:
            if type(cmd) in _NOTE_CARRIERS:
                r = rooms.get(cmd.room)
                peers = self.owed.get(r.key) if r is not None else None
                if peers is not None and cmd.peer in peers:
                    peers.discard(cmd.peer)
                    self.engine.counters["info_ack_rode_on_note"] += 1
                    if not peers:
                        del self.owed[r.key]
        if not self.owed:  # nothing left to send: no wake-up for it
            for peer in self.armed:
                self.engine.deadlines.cancel((self.KIND, peer))
            self.armed.clear()

    def fire(self, peer: m.Endpoint) -> None:
        """The deadline for ``peer``: one InfoAck for every room still owed to it (sorted)."""
        self.armed.discard(peer)
        rooms = sorted(k for k, peers in self.owed.items() if peer in peers)
        for k in rooms:
            peers = self.owed[k]
            peers.discard(peer)
            if not peers:
                del self.owed[k]
        if not rooms:
            return
        e = self.engine
        (room, tid), more = rooms[0], rooms[1:]
        e.counters["info_ack_batched"] += len(rooms)
        e._send(peer, m.InfoAck(src=e.endpoint, room=room, transfer_id=tid, more=more))

    def peer_gone(self, peer: m.Endpoint) -> None:
        for k in [k for k, peers in self.owed.items() if peer in peers]:
            self.owed[k].discard(peer)
            if not self.owed[k]:
                del self.owed[k]
        self.armed.discard(peer)
        self.engine.deadlines.cancel((self.KIND, peer))
