"""Descriptor arithmetic: NIXL-style dense-run merging and vectorised byte copies."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Up to this many descriptors (whole-page or coalesced plans, aux rows), the checks run in Python:
# numpy's per-call cost exceeds the work.
SMALL = 16
_INT64 = np.dtype(np.int64)


@dataclass(frozen=True, slots=True)
class DescList:
    """One transfer's descriptors: equal-length int64 arrays, as the planner emits them."""

    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray
    # ``rows()``, made on first use: a few descriptors' bounds checks (both sides), merge test,
    # copy and ownership check all read them, where each used to convert the arrays again.
    _rows: list[tuple[int, int, int, int, int]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def count(self) -> int:
        return int(self.length.size)

    def rows(self) -> list[tuple[int, int, int, int, int]]:
        """(src_region, src_offset, dst_region, dst_offset, length) of each descriptor, as Python
        ints (the arrays are taken as read-only: the planner's are)."""
        rows = self._rows
        if rows is None:
            # The columns named one by one: no generator frame per call (a few per transfer).
            rows = list(
                zip(
                    self.src_region.tolist(),
                    self.src_offset.tolist(),
                    self.dst_region.tolist(),
                    self.dst_offset.tolist(),
                    self.length.tolist(),
                    strict=True,
                )
            )
            object.__setattr__(self, "_rows", rows)
        return rows

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The five arrays in constructor order."""
        return (self.src_region, self.src_offset, self.dst_region, self.dst_offset, self.length)

    @property
    def total_bytes(self) -> int:
        n = self.length.size
        if n <= SMALL:
            return sum(self.length.tolist())  # Python ints, without numpy's reduction set-up
        return int(self.length.sum())

    @staticmethod
    def of(src_region, src_offset, dst_region, dst_offset, length) -> DescList:
        # The planner's arrays are already flat int64: taken as they are (asarray and reshape
        # cost more than a few descriptors' worth of work).
        # (``dtype is`` first: int64 arrays share numpy's one int64 dtype object, and the
        # comparison with np.int64 costs more than the rest of the test.)
        # A loop, not a comprehension and a generator (each its own frame, once per transfer).
        arrs = []
        for a in (src_region, src_offset, dst_region, dst_offset, length):
            if not (type(a) is np.ndarray and (a.dtype is _INT64 or a.dtype == np.int64) and a.ndim == 1):
                a = np.asarray(a, dtype=np.int64).reshape(-1)
            arrs.append(a)
        sr, so, dr, do, ln = arrs
        if not sr.size == so.size == dr.size == do.size == ln.size:
            raise ValueError("descriptor arrays differ in length")
        return DescList(sr, so, dr, do, ln)


def merge_dense_runs(d: DescList) -> DescList:
    """Merge consecutive descriptors that are contiguous on both sides, as NIXL's prepped lists do.

    Only neighbours in list order merge (NIXL does not sort), so the result depends on the order
    the planner produced; a planner that already coalesced gets its list back unchanged.
    """
    n = d.count
    if n <= 1:
        return d
    if n <= SMALL and not _joins_any(d):
        return d  # the usual answer for a few descriptors, found without numpy's per-call cost
    joins = (
        (d.src_region[1:] == d.src_region[:-1])
        & (d.dst_region[1:] == d.dst_region[:-1])
        & (d.src_offset[1:] == d.src_offset[:-1] + d.length[:-1])
        & (d.dst_offset[1:] == d.dst_offset[:-1] + d.length[:-1])
    )
    if not joins.any():
        return d
    starts = np.concatenate(([True], ~joins))
    idx = np.flatnonzero(starts)
    lengths = np.add.reduceat(d.length, idx)
    return DescList(d.src_region[idx], d.src_offset[idx], d.dst_region[idx], d.dst_offset[idx], lengths)


def _joins_any(d: DescList) -> bool:
    """Whether any descriptor continues its predecessor on both sides (``merge_dense_runs``'s
    join test, in Python)."""
    rows = d.rows()
    for i in range(1, len(rows)):
        sr, so, dr, do, _ = rows[i]
        psr, pso, pdr, pdo, pn = rows[i - 1]
        if sr == psr and dr == pdr and so == pso + pn and do == pdo + pn:
            return True
    return False


def gather_index(offset: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Flat byte indices covered by (offset, length) pairs, in descriptor order."""
    total = int(length.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    starts = np.cumsum(length) - length
    return np.repeat(offset - starts, length) + np.arange(total, dtype=np.int64)


class RegionSizes:
    """Region id -> size, with a vectorised check that descriptors stay inside their regions.

    Small ids (the planner's, ``< DENSE``) go through a dense array (no per-region loop, no
    ``np.unique``); the rare large ids (the aux buffer) through a dict.
    """

    DENSE = 1 << 12
    __slots__ = ("_dense", "_dense_list", "_sparse")

    def __init__(self, sizes: dict[int, int]) -> None:
        small = [rid for rid in sizes if 0 <= rid < self.DENSE]
        self._dense = np.full((max(small) + 1) if small else 0, -1, dtype=np.int64)
        for rid in small:
            self._dense[rid] = sizes[rid]
        self._sparse = {rid: n for rid, n in sizes.items() if not 0 <= rid < self.DENSE}
        self._dense_list: list[int] = self._dense.tolist()

    def first_violation(self, region: np.ndarray, offset: np.ndarray, length: np.ndarray) -> int:
        """Index of the first descriptor outside its region (or negative/empty), or -1."""
        if region.size == 0:
            return -1
        if region.size <= SMALL:
            # A few descriptors (whole-page or coalesced plans, aux rows): numpy's per-call cost
            # exceeds the work, so the same test in Python.
            dense, n_dense = self._dense_list, len(self._dense_list)
            rows = zip(region.tolist(), offset.tolist(), length.tolist(), strict=True)
            for i, (r, o, n) in enumerate(rows):
                size = dense[r] if 0 <= r < n_dense else self._sparse.get(r, -1)
                if n <= 0 or o < 0 or size < 0 or o + n > size:
                    return i
            return -1
        ends = offset + length
        bad = (length <= 0) | (offset < 0)
        if region.size and int(region.min()) >= 0 and int(region.max()) < self._dense.size:
            size = self._dense[region]
            bad |= (size < 0) | (ends > size)
        else:
            size = np.array([self._size(int(r)) for r in region.tolist()], dtype=np.int64)
            bad |= (size < 0) | (ends > size)
        return int(np.argmax(bad)) if bad.any() else -1

    def first_violation_rows(self, rows: list[tuple[int, int, int, int, int]], col: int) -> int:
        """``first_violation`` of ``DescList.rows()``: of the source side (``col`` 0: region and
        offset in columns 0 and 1) or the destination side (``col`` 2), for a few descriptors."""
        dense, n_dense = self._dense_list, len(self._dense_list)
        for i, row in enumerate(rows):
            r, o, n = row[col], row[col + 1], row[4]
            size = dense[r] if 0 <= r < n_dense else self._sparse.get(r, -1)
            if n <= 0 or o < 0 or size < 0 or o + n > size:
                return i
        return -1

    def _size(self, rid: int) -> int:
        if 0 <= rid < self._dense.size:
            return int(self._dense[rid])
        return self._sparse.get(rid, -1)
