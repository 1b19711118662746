"""Decode-side GPU staging ring (SGLang PR 22536): where prefill's bulk WRITEs land before the scatter.

Prefill asks for ring space ahead of time (STAGING_REQ); decode answers at once with an offset and
a round (STAGING_RSP) and never waits, because the space may still hold a chunk whose scatter has
not finished. Safety is moved to the writer instead: decode broadcasts a *watermark*, the
(round, offset) of its oldest live allocation, and prefill writes a slot only when
``writable(slot, watermark)`` holds. Watermarks only grow, so a producer that hears them out of
order just keeps the largest.

Two rules keep that deadlock-free:

- an allocation never wraps mid-region: if it does not fit before the end it starts at offset 0
  of the next round, so a slot is one contiguous byte range;
- an emptied ring restarts at offset 0 of a *new* round. Upstream kept the old head instead: free
  [0, 60) of 100, then assign 70 -> wraps to round+1 while the last broadcast watermark still
  says (round, 60), which the slot can never pass, so the producer waited forever.

The oldest live allocation is always writable under the current watermark, which is what
guarantees progress: the consumer can always drain the ring one scatter at a time.

A failed room's allocations cannot be freed until its writers are fenced (a write cut by a lost
peer may still land until the fence deadline, which outlives every room's own deadline), yet
under the plain rule they would hold the watermark, and every room queued behind them on the rank
would time out waiting for it. So a failed room's allocations are *quarantined*: their bytes stay
taken (no later allocation is placed over them) but they stop holding the watermark as soon as no
other live allocation overlaps them, so the ring keeps going around them until the fence frees them.
A request that no gap clear of them fits waits (``assign`` returns None) until one is freed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from kvferry.core.errors import ResourceError
from kvferry.core.resources._common import positive_int, round_up

__all__ = ["RingRefused", "RingSlot", "StagingRing", "Watermark", "writable"]


class Watermark(NamedTuple):
    """Position of the oldest live allocation (or of the head when the ring is empty).

    A tuple, so it orders lexicographically: a later round is always later, whatever the offset.
    """

    round: int
    offset: int


@dataclass(frozen=True, slots=True)
class RingSlot:
    """One allocation: bytes ``[offset, end)`` of the ring, valid for the lap ``round``.

    ``size`` is what was asked for; ``end`` is ``offset + size`` rounded up to the ring's alignment,
    so the next slot starts aligned and the padding belongs to this one.
    """

    alloc_id: int
    offset: int
    round: int
    end: int
    size: int

    @property
    def position(self) -> Watermark:
        """Where the slot starts, as the watermark it would be if it were the oldest live one."""
        return Watermark(self.round, self.offset)


@dataclass(frozen=True, slots=True)
class RingRefused:
    """A request the ring can never satisfy (larger than the whole ring).

    A value, not an exception: the size comes from a peer's STAGING_REQ, so the flow fails that
    room with ``reason`` instead of crashing the rank.
    """

    reason: str


def writable(slot: RingSlot, wm: Watermark) -> bool:
    """Whether ``slot``'s bytes may be written, given that the oldest live allocation is at ``wm``.

    Every live allocation is at or after ``wm``. If ``wm`` is in the slot's round (or later) no
    earlier lap is live, and allocations of one round never overlap. If ``wm`` is one lap behind,
    the live allocations of that lap all start at or after ``wm.offset``, so they are clear of
    ``[slot.offset, slot.end)`` iff ``wm.offset >= slot.end``. Two or more laps behind: never.
    Monotone in ``wm``, so a stale (smaller) watermark only errs on the side of waiting.
    """
    return wm.round >= slot.round or (wm.round == slot.round - 1 and wm.offset >= slot.end)


class StagingRing:
    """Allocator for one decode rank's staging ring: in-order, never waiting, freed in any order."""

    def __init__(self, capacity: int, align: int = 1) -> None:
        self.capacity = positive_int("capacity", capacity)
        self.align = positive_int("align", align)
        self._head = Watermark(0, 0)
        self._next_id = 0
        self._live: dict[int, RingSlot] = {}
        self._owner: dict[int, Hashable] = {}
        self._by_owner: dict[Hashable, dict[int, None]] = {}
        # Live ids in assignment order (= (round, offset) order); freed ids are dropped from the
        # left lazily, so the oldest live allocation is always order[0] in amortised O(1).
        self._order: deque[int] = deque()
        self._used = 0
        # Allocations of failed rooms awaiting their fence: never overlapped by a later one, and
        # out of the watermark once nothing live overlaps them (see the module docstring).
        self._quarantined: dict[int, None] = {}

    # -- queries ---------------------------------------------------------------------------------

    @property
    def head(self) -> Watermark:
        """Where the next allocation would start if it fits before the end of the ring."""
        return self._head

    @property
    def live(self) -> Mapping[int, RingSlot]:
        """Read-only view of the live allocations, by id, in assignment order."""
        return MappingProxyType(self._live)

    @property
    def used(self) -> int:
        """Requested bytes of all live allocations (``sum(slot.size)``)."""
        return self._used

    def __len__(self) -> int:
        return len(self._live)

    def owner_of(self, alloc_id: int) -> Hashable:
        """The owner an allocation was assigned to; ResourceError if it is not live."""
        if alloc_id not in self._live:
            raise ResourceError(f"ring allocation {alloc_id!r} is not live")
        return self._owner[alloc_id]

    def watermark(self) -> Watermark:
        """Position of the oldest live allocation, or the head when the ring is empty.

        Non-decreasing over any sequence of operations: frees only remove the oldest or a later
        allocation, assignments land at or after the head, and emptying moves the head to a new
        round, past everything that was ever live.
        """
        if not self._quarantined:
            if self._order:
                return self._live[self._order[0]].position
            return self._head
        for alloc_id in self._order:
            slot = self._live.get(alloc_id)
            if slot is not None and not self._skippable(alloc_id, slot):
                return slot.position
        return self._head

    def _skippable(self, alloc_id: int, slot: RingSlot) -> bool:
        """A quarantined allocation that no other live one overlaps holds no writer back. One it
        overlaps that is quarantined too has no writer to hold back (two failed rooms of
        consecutive laps would otherwise pin each other, and the watermark, until the fence)."""
        if alloc_id not in self._quarantined:
            return False
        q = self._quarantined
        return not any(
            o.offset < slot.end and slot.offset < o.end
            for i, o in self._live.items()
            if i != alloc_id and i not in q
        )

    def _clear_of_quarantine(self, offset: int, end: int) -> int:
        """``offset`` if ``[offset, end)`` overlaps no quarantined allocation, else the end of the
        first one it overlaps (where the next try starts)."""
        for alloc_id in self._quarantined:
            q = self._live[alloc_id]
            if q.offset < end and offset < q.end:
                return q.end
        return offset

    # -- operations ------------------------------------------------------------------------------

    def assign(self, n: int, owner: Hashable) -> RingSlot | RingRefused | None:
        """Hand out the next ``n`` bytes in ring order, wrapping to a new round rather than splitting.

        Never waits: the space may still be live from an earlier round, and the producer checks
        ``writable`` against the watermark before writing. ResourceError if ``n <= 0``; a
        RingRefused if the (aligned) size exceeds the capacity, since it could never be written;
        None if no gap of the ring is clear of quarantined space (ask again once some is freed).
        """
        positive_int("n", n)
        span = round_up(n, self.align)
        if span > self.capacity:
            return RingRefused(
                f"requested {n} bytes ({span} aligned to {self.align}) > ring capacity {self.capacity}"
            )
        rnd, offset = self._head
        if offset + span > self.capacity:
            rnd, offset = rnd + 1, 0
        if self._quarantined:
            placed = self._place_around_quarantine(rnd, offset, span)
            if placed is None:
                return None
            rnd, offset = placed
        slot = RingSlot(alloc_id=self._next_id, offset=offset, round=rnd, end=offset + span, size=n)
        self._next_id += 1
        self._head = Watermark(rnd, slot.end)
        self._live[slot.alloc_id] = slot
        self._owner[slot.alloc_id] = owner
        self._by_owner.setdefault(owner, {})[slot.alloc_id] = None
        self._order.append(slot.alloc_id)
        self._used += n
        return slot

    def _place_around_quarantine(self, rnd: int, offset: int, span: int) -> tuple[int, int] | None:
        """The first position at or after ``(rnd, offset)`` whose span overlaps no quarantined
        allocation; None if no gap of a whole lap fits it."""
        for _ in range(2 * len(self._quarantined) + 2):
            if offset + span > self.capacity:
                rnd, offset = rnd + 1, 0
            clear = self._clear_of_quarantine(offset, offset + span)
            if clear == offset:
                return rnd, offset
            offset = clear
        return None

    def quarantine(self, owner: Hashable) -> int:
        """``owner`` (a room) failed: its live allocations keep their bytes until freed, but stop
        holding back writers they do not overlap (the watermark may move: broadcast it). Returns
        how many allocations it holds."""
        ids = self._by_owner.get(owner, {})
        for alloc_id in ids:
            self._quarantined[alloc_id] = None
        return len(ids)

    def free(self, alloc_id: int) -> None:
        """Release an allocation once its scatter finished; any order. ResourceError if not live.

        When this empties the ring the head restarts at offset 0 of the next round, so the
        watermark a producer hears now is one that the next allocation (at that very position)
        already satisfies.
        """
        slot = self._live.pop(alloc_id, None)
        if slot is None:
            raise ResourceError(f"ring allocation {alloc_id!r} is not live (unknown or already freed)")
        owner = self._owner.pop(alloc_id)
        ids = self._by_owner[owner]
        del ids[alloc_id]
        if not ids:
            del self._by_owner[owner]
        self._used -= slot.size
        self._quarantined.pop(alloc_id, None)
        while self._order and self._order[0] not in self._live:
            self._order.popleft()
        if not self._live:
            self._order.clear()
            self._restart()

    def _restart(self) -> None:
        """Empty ring: move the head to offset 0 of a new round (the fix for the stale-tail wedge)."""
        self._head = Watermark(self._head.round + 1, 0)

    def free_owner(self, owner: Hashable) -> list[int]:
        """Free every live allocation of ``owner`` (a failed room), returning their ids in order.

        A failed room's allocations pin the watermark and wedge every later room of the rank, so
        cleanup must be able to reclaim them without knowing their ids.
        """
        ids = list(self._by_owner.get(owner, ()))
        for alloc_id in ids:
            self.free(alloc_id)
        return ids
