"""The push flow's prefill half (vLLM PR 35264): the direct flow's writes under registration leases.

Each TransferInfo of a push room is decode's PUSH_REG: a lease per (room, decode rank) in the
registry (core/resources/leases.py), renewed by decode's heartbeats naming the room. The room's
first chunk is the "forward finished" that matches it; every write (data and aux) is posted only
while its lease lives; a lease that expires, or a registration refused or never matched
(watchdog), fails the room with that reason. Decode's half is the direct flow's: it registers
through its TransferInfo and heartbeats and needs nothing of its own.

``PushSender`` is composed into the sender room machine, which calls it at a few points of a
room's life (info, open, chunk handed over, write posted and finished, last chunk, failure,
removal) and hears back only through ``on_refused(room key, kind, reason)``: a lease that ended
badly. It holds every push table (leases, lease key -> room, per-room keys, writes in flight).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvferry.core import messages as m
from kvferry.core.errors import LocalMisuseError
from kvferry.core.flows.parts import RankFlowPart
from kvferry.core.flows.policy import Flow
from kvferry.core.machine import RoomStateError
from kvferry.core.resources.leases import (
    Finish,
    LeaseMisuseError,
    LeaseRegistry,
    Notice,
    NoticeKind,
    PushReg,
)

# The member's value read once (``wants`` is asked per room; ``Enum.value`` is a property).
_PUSH_NAME = Flow.PUSH.value

__all__ = ["PUSH_MATCHES", "PushSender"]

PUSH_MATCHES = ("transfer_id", "request_id")
_BAD = (NoticeKind.EXPIRED, NoticeKind.FAILED, NoticeKind.REFUSED)

RoomKey = tuple[int, str]


class PushSender(RankFlowPart):
    """Every push registration of one prefill rank, by room."""

    def __init__(
        self,
        *,
        lease_ns: int,
        match_ns: int,
        tombstone_ns: int,
        push_match: str,
        base_id: Callable[[str], str],
        counters: Any,
        on_refused: Callable[[RoomKey, NoticeKind, str], None],
        clock: Callable[[], int],
        policy_override: Callable[[], Flow | None],
    ) -> None:
        """``push_match``: how registrations find their request: ``transfer_id`` (the router's
        id), or ``request_id`` (a client that sends none: decode names the request with its retry
        suffix, matched by the base id, ``base_id``)."""
        if push_match not in PUSH_MATCHES:
            raise LocalMisuseError(f"push_match: expected transfer_id or request_id, got {push_match!r}")
        self.by_request = push_match == "request_id"
        self.leases = LeaseRegistry(
            lease_ns, match_ns, suffix_match=self.by_request, base_id=base_id, tombstone_ns=tombstone_ns
        )
        self.counters = counters
        self._on_refused = on_refused
        self.clock = clock
        self.policy_override = policy_override
        self.rooms: dict[str, RoomKey] = {}  # registry key -> room key
        self.keys: dict[RoomKey, dict[m.Endpoint, str]] = {}  # room -> decode rank -> tid@decodeN
        self.finished: dict[RoomKey, set[Finish]] = {}  # finishes handed to the registry
        self.writes: dict[int, tuple[RoomKey, m.Endpoint]] = {}  # write id in flight -> its lease
        self.fenced_after_room: set[str] = set()  # lease keys of released rooms, still fencing

    @staticmethod
    def wants(flow_override: str | None, policy_override: Flow | None) -> bool:
        """The room will run the push flow: asked per room, or the policy's own override."""
        if flow_override is not None:
            return flow_override == _PUSH_NAME
        return policy_override is Flow.PUSH

    # --- the room's life ------------------------------------------------------------------------

    def register(self, room: RoomKey, info: m.TransferInfo, now: int) -> None:
        """A TransferInfo of a push room is decode's PUSH_REG: a lease for that decode rank."""
        keys = self.keys.setdefault(room, {})
        if info.dummy or info.src in keys:
            return
        key = f"{room[1]}@{info.src.server}{info.src.rank}"
        keys[info.src] = key
        self.rooms[self._reg_key(key)] = room
        transfer_id, request_id = self._reg_ids(key)
        reg = PushReg(
            transfer_id=transfer_id,
            request_id=request_id,
            decode=info.src,
            incarnation=0,  # a restarted decode rank is caught by its registration id (PEER_LOST)
            blocks=tuple(info.dst_pages),
            token_start=info.token_start,
            token_end=info.num_tokens,
        )
        self._notices(self.leases.register(reg, now))

    def withdraw(self, room: RoomKey, now: int) -> None:
        """Registered on the policy's push before the open named another flow: withdraw."""
        for p, key in sorted(self.keys.get(room, {}).items()):
            if self._reg_key(key) in self.leases.leases:
                self.leases.abort(*self._reg_ids(key), p, now)
            self.rooms.pop(self._reg_key(key), None)
        self.keys.pop(room, None)

    def finish(self, room: RoomKey, now: int) -> None:
        """The room's first chunk is computed (its forward pass finished): that matches every
        registration of the room. Called when chunk 0 is handed to its worker and again when it
        runs (a registration that arrived in between); a lease matched already is left alone,
        so the watchdog measures decode's wait for prefill, not the worker queue."""
        for _p, key in sorted(self.keys.get(room, {}).items()):
            lease = self.leases.leases.get(self._reg_key(key))
            fin = self._finish_of(key)
            held = LeaseRegistry.key(fin.transfer_id, fin.request_id) in self.leases.held
            # By request id the finish may have paired with (or been refused for) another entry:
            # it is handed over once.
            again = self.by_request and fin in self.finished.get(room, ())
            if lease is not None and lease.finish is None and not held and not again:
                self.finished.setdefault(room, set()).add(fin)
                self._notices(self.leases.finish(fin, now))

    def post(self, room: RoomKey, peer: m.Endpoint, now: int) -> None:
        """A write to ``peer`` is about to be posted: only under its live lease, and only where
        that registration was paired with this request's own finish (a wrong pairing is an error,
        never a write into another request's blocks)."""
        key = self.keys.get(room, {}).get(peer)
        lease = self.leases.leases.get(self._reg_key(key)) if key is not None else None
        if key is not None and lease is not None and lease.finish is not None:
            if lease.finish != self._finish_of(key):
                self.counters["push_wrong_pair"] += 1
                raise RoomStateError(
                    f"push registration of {peer} was paired with another request's finish "
                    f"({lease.finish.transfer_id or lease.finish.request_id}): nothing is written"
                )
            if self.leases.post(*self._reg_ids(key), now) is not None:
                return
        self._notices(self.leases.drain())
        how = self.leases.finished.get(self._reg_key(key), None) if key is not None else None
        why = how.value if how else "never registered"
        raise RoomStateError(f"push lease of {peer} is over ({why}): nothing is written")

    def posted(self, write_id: int, room: RoomKey, peer: m.Endpoint) -> None:
        """The write ``post`` allowed has its id: its completion goes to the lease."""
        self.writes[write_id] = (room, peer)

    def write_finished(self, r: Any, write_id: int, ok: bool) -> None:
        entry = self.writes.pop(write_id, None)
        if entry is None:
            return
        room, peer = entry
        try:
            notices = self.leases.write_done(*self._reg_ids(self.keys[room][peer]), ok, self.clock())
        except LeaseMisuseError:
            self.counters["push_untracked_write"] += 1  # posted without its lease (never in real code)
            return
        self._notices(notices)

    def completed(self, room: RoomKey, now: int) -> None:
        """The room's last chunk ran: every lease of the room is complete once its writes land."""
        for key in sorted(self.keys.get(room, {}).values()):
            try:
                self._notices(self.leases.complete(*self._reg_ids(key), now))
            except LeaseMisuseError:
                self.counters["push_complete_without_lease"] += 1

    def abort(self, room: RoomKey, now: int) -> None:
        """The room failed: its live leases end (their writes in flight fence them)."""
        for p, key in sorted(self.keys.get(room, {}).items()):
            if self._reg_key(key) in self.leases.leases:
                self.leases.abort(*self._reg_ids(key), p, now)

    def runs(self, r: Any) -> bool:
        """The room runs push: asked for at its open, or the policy's own override."""
        return self.wants(r.opening.flow_override, self.policy_override())

    def opened(self, r: Any) -> None:
        if not self.runs(r):
            self.withdraw(r.key, self.clock())  # registered on the policy's push: another flow

    def transfer_info(self, r: Any, info: m.TransferInfo) -> None:
        if self.runs(r):
            self.register(r.key, info, self.clock())

    def computed(self, r: Any, parked: bool) -> None:
        if self.runs(r):
            if parked:
                self.counters["push_computed_before_registration"] += 1  # the finish-first order
            self.finish(r.key, self.clock())

    def heard_from(self, r: Any, peer: m.Endpoint) -> None:
        self.renew(r.key, peer, self.clock())

    def room_failed(self, r: Any) -> None:
        self.abort(r.key, self.clock())  # its writes in flight fence its leases

    def forget(self, r: Any) -> None:
        self.forget_room(r.key)

    def forget_room(self, room: RoomKey) -> None:
        """The room is gone: a lease still fencing keeps its entry until it ends."""
        for key in self.keys.pop(room, {}).values():
            rkey = self._reg_key(key)
            if self.rooms.get(rkey) == room:
                if rkey in self.leases.leases:
                    self.fenced_after_room.add(rkey)
                else:
                    del self.rooms[rkey]
        self.finished.pop(room, None)

    def renew(self, room: RoomKey, peer: m.Endpoint, now: int) -> None:
        """Decode's heartbeat named the room: its lease lives on."""
        key = self.keys.get(room, {}).get(peer)
        if key is not None:
            self.leases.renew_key(*self._reg_ids(key), now)

    def tick(self, now: int) -> None:
        self._notices(self.leases.tick(now))

    def next_deadline(self) -> int | None:
        return self.leases.next_deadline()

    # --- what the quiescence checks see ---------------------------------------------------------

    def mentions(self, room: int) -> bool:
        """Whether any push table names the room (a released room's entry stays while its lease
        fences, and goes when the lease ends: ``_notices``)."""
        return (
            any(rk[0] == room for rk in self.rooms.values())
            or any(rk[0] == room for rk in self.keys)
            or any(rk[0] == room for rk in self.finished)
            or any(w[0][0] == room for w in self.writes.values())
        )

    def size(self) -> int:
        """Entries of every push table, unfiltered: 0 once every room settled and its leases ended."""
        return len(self.rooms) + len(self.keys) + len(self.finished) + len(self.writes)

    def lease_key(self, tid: str, peer: str) -> str:
        """The registry key of room ``tid``'s registration by decode rank ``peer`` (e.g. decode0)."""
        return self._reg_key(f"{tid}@{peer}")

    # --- keys -------------------------------------------------------------------------------------

    def _reg_ids(self, key: str) -> tuple[str, str]:
        """(transfer_id, request_id) of the registration for ``key`` (``tid@decodeN``): the router's
        id, or with request-id matching the request as decode names it, with its retry suffix."""
        if self.by_request:
            return "", f"{key}-1"
        return key, key.rpartition("@")[0]

    def _reg_key(self, key: str) -> str:
        return LeaseRegistry.key(*self._reg_ids(key))

    def _finish_of(self, key: str) -> Finish:
        """Prefill's finish for ``key``: the request as prefill names it (no retry suffix)."""
        if self.by_request:
            return Finish("", key)
        return Finish(key, key.rpartition("@")[0])

    def _notices(self, notices: list[Notice]) -> None:
        for n in notices:
            if n.kind not in _BAD:
                continue  # MATCHED, DELIVERED, RELEASED: the room's own machine tracks writes and fences
            room = self.rooms.get(LeaseRegistry.key(n.transfer_id, n.request_id))
            if room is not None:
                self._on_refused(room, n.kind, n.reason)
        if self.fenced_after_room:
            # A room that went while its lease fenced (``forget``): its entry goes with the lease.
            for rkey in [k for k in self.fenced_after_room if k not in self.leases.leases]:
                self.fenced_after_room.discard(rkey)
                self.rooms.pop(rkey, None)
