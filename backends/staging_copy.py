"""Gather and scatter on CPU memory with numpy: the same bytes the Triton kernels move.

Executes ``core.staging_layout.StagingMap``s between a rank's KV pool regions and one staging
buffer, all as flat ``uint8`` arrays. Used by the simulator (bytes in fake memory), the test
harness and the real backend's DRAM pools. Every index is checked before any byte moves (numpy
would wrap a negative index silently), so a bad map raises ``StagingCopyError`` and writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from kvferry.core.errors import KvferryError
from kvferry.core.staging_layout import StagingMap

__all__ = ["StagingCopyError", "copy_maps", "map_bytes"]


class StagingCopyError(KvferryError):
    """A map that reaches outside the pool region or the staging buffer."""


def _index(starts: np.ndarray, hb: int) -> np.ndarray:
    return starts[..., None] + np.arange(hb, dtype=np.int64)


def _check(what: str, starts: np.ndarray, hb: int, size: int) -> None:
    if starts.size and (int(starts.min()) < 0 or int(starts.max()) + hb > size):
        raise StagingCopyError(
            f"{what}: bytes [{int(starts.min())}, {int(starts.max()) + hb}) outside [0, {size})"
        )


def copy_maps(
    kind: str, regions: Mapping[int, np.ndarray], staging: np.ndarray, maps: Sequence[StagingMap]
) -> int:
    """``kind`` "gather" (pool -> staging) or "scatter" (staging -> pool); returns bytes moved."""
    if kind not in ("gather", "scatter"):
        raise ValueError(f"kind must be gather or scatter, got {kind!r}")
    plans = []
    for smap in maps:
        hb, n, t = smap.head_bytes, smap.num_heads, len(smap.token_offsets)
        if n == 0 or t == 0:
            continue
        j = np.arange(n, dtype=np.int64)[None, :]
        i = np.arange(t, dtype=np.int64)[:, None]
        pool_start = smap.token_offsets[:, None] + j * smap.pool_head_stride
        for r, rid in enumerate(smap.region_ids.tolist()):
            region = regions.get(rid)
            if region is None:
                raise StagingCopyError(f"map names pool region {rid}, which this rank does not have")
            st_start = (
                smap.staging_base + r * smap.stride_region + i * smap.stride_token + j * smap.stride_head
            )
            _check(f"pool region {rid}", pool_start, hb, region.size)
            _check("staging buffer", st_start, hb, staging.size)
            plans.append((region, _index(pool_start, hb), _index(st_start, hb)))
    moved = 0
    for region, pool_idx, st_idx in plans:
        if kind == "gather":
            staging[st_idx] = region[pool_idx]
        else:
            region[pool_idx] = staging[st_idx]
        moved += pool_idx.size
    return moved


def map_bytes(maps: Sequence[StagingMap]) -> int:
    return sum(smap.nbytes for smap in maps)
