"""Deadlines owned by the core: the timeout settings, and a keyed min-heap of pending deadlines.

The machines never read a clock: every input carries ``now`` (integer ns) and each engine exposes
``next_deadline()`` so that its driver knows when to call it again with a ``Tick``.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

import msgspec

__all__ = ["MS", "SEC", "DeadlineHeap", "Timeouts"]

MS = 1_000_000
SEC = 1_000 * MS


class Timeouts(msgspec.Struct, frozen=True, kw_only=True):
    """Every wait of the protocol, in ns.

    bootstrap_ns: room created until every TransferInfo/registration it needs is in.
    waiting_ns: WaitingForInput until the first chunk (prefill) or first notification (decode).
    transfer_ns: Transferring until done. On prefill it is counted from entering Transferring and
        never renewed, so a prefill room's life is bounded (the fence relies on it); on decode it
        is renewed by every notification or offer that brings news, never by a resent one
        (decode's own liveness, no safety role).
    heartbeat_interval_ns / heartbeat_timeout_ns: peer liveness; the timeout fails its live rooms.
    fence_ns: decode frees a failed room's pages without the peer's Stopped after this long; it
        also bounds the resending of a failure notice (decode's Abort, prefill's RoomFailed).
    tombstone_ns: how long a finished (room, transfer_id) keeps rejecting late messages (at least;
        expiries fall on a grid of tombstone_ns / 16, see ``Tombstones``).
    """

    bootstrap_ns: int = 30 * SEC
    waiting_ns: int = 30 * SEC
    transfer_ns: int = 60 * SEC
    heartbeat_interval_ns: int = 1 * SEC
    heartbeat_timeout_ns: int = 10 * SEC
    fence_ns: int = 180 * SEC
    tombstone_ns: int = 600 * SEC

    def problems(
        self,
        max_msg_delay_ns: int,
        max_write_ns: int,
        expected_transfer_ns: int = 0,
        transfer_what: str = "",
    ) -> list[str]:
        """Why these settings are unsafe on a fabric whose control messages arrive within
        ``max_msg_delay_ns`` (or never) and whose writes finish or fail within ``max_write_ns``,
        for rooms whose transfer is expected to take ``expected_transfer_ns`` (0: not known;
        ``transfer_what`` says what it is made of).

        The fence must outlive anything the peer might still write: a prefill room that never heard
        the Abort lives at most bootstrap + waiting + transfer after the TransferInfo reached it,
        and its last write may take max_write_ns more. Tombstones must outlive late messages.
        A healthy room must not time out: decode waits for its first notification (waiting) and
        prefill's transfer deadline is never renewed, so both must exceed the transfer itself.
        """
        out = []
        for name in self.__struct_fields__:
            if getattr(self, name) <= 0:
                out.append(f"{name} must be positive")
        if self.heartbeat_timeout_ns <= self.heartbeat_interval_ns:
            out.append("heartbeat_timeout_ns must exceed heartbeat_interval_ns")
        writer_life = max_msg_delay_ns + self.bootstrap_ns + self.waiting_ns + self.transfer_ns + max_write_ns
        if self.fence_ns <= writer_life:
            out.append(
                f"fence_ns {self.fence_ns} must exceed the longest a peer may still write ({writer_life})"
            )
        if self.tombstone_ns <= max_msg_delay_ns + self.fence_ns:
            out.append("tombstone_ns must exceed max_msg_delay_ns + fence_ns")
        for name in ("waiting_ns", "transfer_ns"):
            value = getattr(self, name)
            if 0 < value <= expected_transfer_ns:
                what = f" ({transfer_what})" if transfer_what else ""
                out.append(
                    f"{name} {value / MS:.1f} ms is shorter than the expected transfer of the "
                    f"largest room, {expected_transfer_ns / MS:.1f} ms{what}: a healthy room would "
                    "time out; raise it, or leave it out to derive it"
                )
        return out


class DeadlineHeap:
    """At most one pending deadline per key; ``set`` replaces, ``cancel`` removes.

    Replaced entries stay in the heap and are skipped when they surface (cheaper than deleting);
    the heap is rebuilt when stale entries outnumber live ones, so memory stays O(live keys).
    A deadline moved later (a room's deadline pushed on by every message) pushes nothing: the
    key's earlier heap entry stays as its stand-in and is re-pushed at the true time when it
    surfaces. Keys still come out in (deadline, order of their last ``set``), as if every
    ``set`` had pushed.
    """

    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Hashable]] = []
        # key -> (deadline, seq of its last set, (deadline, seq) of its entry in the heap)
        self._live: dict[Hashable, tuple[int, int, tuple[int, int]]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def get(self, key: Hashable) -> int | None:
        entry = self._live.get(key)
        return None if entry is None else entry[0]

    def set(self, key: Hashable, when: int) -> None:
        self._seq = seq = self._seq + 1
        live = self._live
        old = live.get(key)
        if old is not None and old[2][0] <= when:
            # The heap entry surfaces no later than ``when``: keep it as the stand-in.
            live[key] = (when, seq, old[2])
            return
        live[key] = (when, seq, (when, seq))
        heap = self._heap
        heapq.heappush(heap, (when, seq, key))
        if len(heap) > 64 and len(heap) > 2 * len(live):
            self._rebuild()

    def _rebuild(self) -> None:
        live = self._live
        for k, (w, s, _) in live.items():
            live[k] = (w, s, (w, s))
        self._heap = [(w, s, k) for k, (w, s, _) in live.items()]
        heapq.heapify(self._heap)

    def cancel(self, key: Hashable) -> None:
        self._live.pop(key, None)

    def _clean_top(self) -> None:
        heap, live = self._heap, self._live
        while heap:
            _when, seq, key = heap[0]
            entry = live.get(key)
            if entry is not None and entry[2][1] == seq:
                if entry[1] == seq:
                    return
                # A stand-in: the deadline moved later; re-push it at its true (time, order).
                w, s, _ = entry
                live[key] = (w, s, (w, s))
                heapq.heapreplace(heap, (w, s, key))
                continue
            heapq.heappop(heap)

    def next(self) -> int | None:
        heap = self._heap
        if heap:
            when, seq, key = heap[0]
            entry = self._live.get(key)
            if entry is not None and entry[1] == seq:
                return when  # the top is live and current (asked on every pump: no call)
        self._clean_top()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: int) -> list[Hashable]:
        """Keys whose deadline is <= now, earliest first; they are removed."""
        due: list[Hashable] = []
        heap = self._heap
        while True:
            self._clean_top()
            heap = self._heap
            if not heap or heap[0][0] > now:
                return due
            _, _, key = heapq.heappop(heap)
            del self._live[key]
            due.append(key)

    def live_keys(self) -> list[Hashable]:
        return list(self._live)
