"""Descriptor arithmetic: NIXL-style dense-run merging and vectorised byte copies."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class DescList:
    """One transfer's descriptors: equal-length int64 arrays, as the planner emits them."""

    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray

    @property
    def count(self) -> int:
        return int(self.length.size)

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum()) if self.length.size else 0

    @staticmethod
    def of(src_region, src_offset, dst_region, dst_offset, length) -> DescList:
        arrs = [
            np.asarray(a, dtype=np.int64).reshape(-1)
            for a in (src_region, src_offset, dst_region, dst_offset, length)
        ]
        n = arrs[0].size
        if any(a.size != n for a in arrs):
            raise ValueError("descriptor arrays differ in length")
        return DescList(*arrs)


def merge_dense_runs(d: DescList) -> DescList:
    """Merge consecutive descriptors that are contiguous on both sides, as NIXL's prepped lists do.

    Only neighbours in list order merge (NIXL does not sort), so the result depends on the order
    the planner produced; a planner that already coalesced gets its list back unchanged.
    """
    n = d.count
    if n <= 1:
        return d
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


def gather_index(offset: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Flat byte indices covered by (offset, length) pairs, in descriptor order."""
    total = int(length.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    starts = np.cumsum(length) - length
    return np.repeat(offset - starts, length) + np.arange(total, dtype=np.int64)
