"""Pinned host range allocator for the CPU bounce (SGLang PR 18968): one pool per GPU, shared by its workers.

The gather kernel writes a chunk's heads into a range of pinned host memory, one WRITE moves the
range, and the range is released when the WRITE (prefill) or the scatter (decode) is done. Ranges
live for very different times, so this is a plain first-fit range allocator over a sorted,
coalesced free list rather than a ring: a short-lived range must not wait behind a long one.

Nothing here blocks. A request that does not fit *now* returns None and the flow defers the chunk;
one that could never fit returns a typed refusal, because deferring it would wait forever.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvferry.core.errors import ResourceError
from kvferry.core.resources._common import positive_int, round_up

__all__ = ["PinnedPool", "PinnedRefused", "Reservation"]


@dataclass(frozen=True, slots=True)
class Reservation:
    """Bytes ``[offset, offset + size)`` of the pool; ``size`` is already rounded up to the alignment."""

    res_id: int
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True, slots=True)
class PinnedRefused:
    """A request larger than the whole pool: a value, not an exception, since the size is the peer's."""

    reason: str


class PinnedPool:
    """First-fit allocator over ``[0, capacity)`` with ranges aligned to ``align`` bytes."""

    def __init__(self, capacity: int, align: int = 64) -> None:
        self.capacity = positive_int("capacity", capacity)
        self.align = positive_int("align", align)
        # Sorted by offset, pairwise disjoint and never adjacent (adjacent ranges are merged).
        self._free: list[tuple[int, int]] = [(0, capacity)]
        self._free_bytes = capacity
        self._next_id = 0
        self._live: dict[int, Reservation] = {}
        self._owner: dict[int, Hashable] = {}
        self._by_owner: dict[Hashable, dict[int, None]] = {}

    # -- queries ---------------------------------------------------------------------------------

    @property
    def live(self) -> Mapping[int, Reservation]:
        """Read-only view of the live reservations by id."""
        return MappingProxyType(self._live)

    @property
    def free_ranges(self) -> tuple[tuple[int, int], ...]:
        """The free list as ``(offset, size)`` pairs, sorted and coalesced."""
        return tuple(self._free)

    @property
    def used(self) -> int:
        """Bytes held by live reservations (aligned sizes)."""
        return self.capacity - self._free_bytes

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    @property
    def largest_free(self) -> int:
        """Size of the largest free range: the largest request that can succeed right now."""
        return max((size for _, size in self._free), default=0)

    @property
    def fragmentation(self) -> float:
        """``1 - largest_free / free_bytes``; 0.0 when free space is one range or none."""
        if len(self._free) <= 1:
            return 0.0
        return 1.0 - self.largest_free / self._free_bytes

    def __len__(self) -> int:
        return len(self._live)

    def owner_of(self, res_id: int) -> Hashable:
        """The owner a reservation was made for; ResourceError if it is not live."""
        if res_id not in self._live:
            raise ResourceError(f"pinned reservation {res_id!r} is not live")
        return self._owner[res_id]

    # -- operations ------------------------------------------------------------------------------

    def reserve(self, n: int, owner: Hashable) -> Reservation | PinnedRefused | None:
        """Reserve ``n`` bytes (rounded up to ``align``) at the lowest offset where they fit.

        None when no free range is large enough now (the caller defers and retries after a free);
        PinnedRefused when the aligned size exceeds the capacity (it never could fit);
        ResourceError when ``n <= 0``.
        """
        positive_int("n", n)
        size = round_up(n, self.align)
        if size > self.capacity:
            return PinnedRefused(
                f"requested {n} bytes ({size} aligned to {self.align}) > pinned pool capacity {self.capacity}"
            )
        i = next((i for i, (_, free_size) in enumerate(self._free) if free_size >= size), None)
        if i is None:
            return None
        offset, free_size = self._free[i]
        if free_size == size:
            del self._free[i]
        else:
            self._free[i] = (offset + size, free_size - size)
        self._free_bytes -= size
        res = Reservation(res_id=self._next_id, offset=offset, size=size)
        self._next_id += 1
        self._live[res.res_id] = res
        self._owner[res.res_id] = owner
        self._by_owner.setdefault(owner, {})[res.res_id] = None
        return res

    def free(self, res_id: int) -> None:
        """Return a reservation's range to the free list, merging it with free neighbours.

        Coalescing keeps the free list short and lets a large request succeed once its space is
        back; ResourceError on an unknown or already freed id.
        """
        res = self._live.pop(res_id, None)
        if res is None:
            raise ResourceError(f"pinned reservation {res_id!r} is not live (unknown or already freed)")
        owner = self._owner.pop(res_id)
        ids = self._by_owner[owner]
        del ids[res_id]
        if not ids:
            del self._by_owner[owner]
        self._free_bytes += res.size
        offset, end = res.offset, res.end
        i = bisect.bisect_left(self._free, (offset,))
        if i < len(self._free) and self._free[i][0] == end:  # merge with the right neighbour
            end += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == offset:  # merge with the left neighbour
            i -= 1
            offset = self._free.pop(i)[0]
        self._free.insert(i, (offset, end - offset))

    def free_owner(self, owner: Hashable) -> list[int]:
        """Free every live reservation of ``owner`` (a failed room), returning their ids in order."""
        ids = list(self._by_owner.get(owner, ()))
        for res_id in ids:
            self.free(res_id)
        return ids
