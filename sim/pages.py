"""KV page (and aux row) allocators of one simulated server, and how contiguous their grants are.

Two policies, both remembering the owner of every unit (the invariant checker reads ``owner``):

- ``LowestFirst``: a heap, the lowest free id first. Freed ids are reused at once, so under
  requests of one length the holes a request leaves are refilled whole and every grant stays one
  run; under mixed lengths grants straddle holes. The simulator's original policy (every scenario
  and the aux rows use it).
- ``SortedFreeList``: SGLang's paged allocator as disaggregated servers run it (``need_sort`` is on
  for prefill and decode): grants are taken from the front of a free list that starts ascending;
  freed pages wait in a release list and rejoin the free list, which is then sorted, only when the
  front cannot cover a request. Grants are contiguous until the first such merge; after it, pages
  still held at the merge are holes in the sorted list and a grant spans runs between them.

Why contiguity matters: the direct flow's descriptors merge only where both a prefill and a
decode page continue their predecessors (``pair_runs``), so runs per request set its descriptor
count at equal TP.
"""

from __future__ import annotations

import heapq
from typing import Protocol

import numpy as np

__all__ = [
    "ALLOCATORS",
    "FREE",
    "LowestFirst",
    "PageAllocator",
    "SortedFreeList",
    "make_allocator",
    "pair_runs",
    "runs",
]

FREE = -1
# Spellings accepted by DeploySpec.page_allocator / `kvferry select --page-allocator`.
ALLOCATORS = ("sglang", "lowest-first")


class PageAllocator(Protocol):
    owner: np.ndarray  # key holding each unit, FREE if none

    @property
    def used(self) -> int: ...

    def alloc(self, count: int, key: int) -> np.ndarray | None: ...

    def free(self, ids: np.ndarray, key: int) -> None: ...


def _give_back(owner: np.ndarray, ids: np.ndarray, key: int) -> None:
    """Mark ``ids`` free; they must all be ``key``'s (a double free is a simulator bug)."""
    owners = owner[ids].tolist()  # a room's few pages: Python beats numpy's .any() here
    if owners.count(key) != len(owners):
        raise AssertionError(f"freeing units not owned by {key}")
    owner[ids] = FREE


class LowestFirst:
    """Lowest free id first (a heap: deterministic, no draw)."""

    def __init__(self, n: int) -> None:
        self.owner = np.full(n, FREE, dtype=np.int64)
        self._free: list[int] = list(range(n))
        heapq.heapify(self._free)

    @property
    def used(self) -> int:
        return self.owner.size - len(self._free)

    def alloc(self, count: int, key: int) -> np.ndarray | None:
        if count > len(self._free):
            return None
        ids = np.array([heapq.heappop(self._free) for _ in range(count)], dtype=np.int64)
        self.owner[ids] = key
        return ids

    def free(self, ids: np.ndarray, key: int) -> None:
        _give_back(self.owner, ids, key)
        for i in ids.tolist():
            heapq.heappush(self._free, i)


class SortedFreeList:
    """SGLang's ``PagedTokenToKVPoolAllocator`` with ``need_sort`` (our own code, same policy).

    ``start``: where the front of the free list stands when the run begins. 0 is a fresh server
    (every page free, ascending). ``start = k`` is a server that had already handed out pages
    ``[0, k)`` and got them all back before the run: they wait in the release list, so the first
    merge comes after ``n - k`` pages of grants instead of ``n``.
    """

    def __init__(self, n: int, start: int = 0) -> None:
        if not 0 <= start <= n:
            raise ValueError(f"start must be in [0, {n}], got {start}")
        self.owner = np.full(n, FREE, dtype=np.int64)
        self._free = np.arange(start, n, dtype=np.int64)
        self._head = 0  # grants come from _free[_head:]; slicing a cursor, not the array, is O(1)
        self._released: list[np.ndarray] = [np.arange(start, dtype=np.int64)] if start else []
        self._n_released = start
        self.merges = 0

    @property
    def used(self) -> int:
        return self.owner.size - (self._free.size - self._head) - self._n_released

    def alloc(self, count: int, key: int) -> np.ndarray | None:
        if count > self._free.size - self._head:
            self._merge()
        if count > self._free.size - self._head:
            return None
        ids = self._free[self._head : self._head + count].copy()
        self._head += count
        self.owner[ids] = key
        return ids

    def free(self, ids: np.ndarray, key: int) -> None:
        _give_back(self.owner, ids, key)
        if len(ids):
            self._released.append(np.asarray(ids, dtype=np.int64).copy())
            self._n_released += len(ids)

    def _merge(self) -> None:
        if not self._released:
            return
        self._free = np.sort(np.concatenate([self._free[self._head :], *self._released]))
        self._head = 0
        self._released = []
        self._n_released = 0
        self.merges += 1


def make_allocator(kind: str, n: int, start: int = 0) -> LowestFirst | SortedFreeList:
    if kind == "lowest-first":
        return LowestFirst(n)
    if kind == "sglang":
        return SortedFreeList(n, start)
    raise ValueError(f"page allocator: expected one of {', '.join(ALLOCATORS)}, got {kind!r}")


def runs(ids: np.ndarray) -> int:
    """Contiguous ascending runs in a request's page list (0 for none)."""
    a = np.asarray(ids, dtype=np.int64)
    # ``np.diff`` by hand: the same differences without its Python-level checks (per request).
    return int(a.size and 1 + np.count_nonzero(a[1:] - a[:-1] != 1))


def pair_runs(src: np.ndarray, dst: np.ndarray) -> int:
    """Runs over which both page lists continue together: where a page-aligned descriptor of one
    layer and K|V merges with the next (equal page sizes; the shorter list bounds it)."""
    n = min(len(src), len(dst))
    if n == 0:
        return 0
    s = np.asarray(src[:n], dtype=np.int64)
    d = np.asarray(dst[:n], dtype=np.int64)
    return 1 + int(np.count_nonzero((s[1:] - s[:-1] != 1) | (d[1:] - d[:-1] != 1)))
