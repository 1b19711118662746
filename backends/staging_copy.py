"""Gather and scatter on CPU memory with numpy: the same bytes the Triton kernels move.

Executes ``core.staging_layout.StagingMap``s between a rank's KV pool regions and one staging
buffer, all as flat ``uint8`` arrays, moving whole copy units (the gcd of the head row and every
offset, typically the head row itself) rather than single bytes. Used by the simulator (bytes in
fake memory), the test harness and the real backend's DRAM pools. Every index is checked before
any byte moves (numpy would wrap a negative index silently), so a bad map raises
``StagingCopyError`` and writes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from kvferry.core.errors import KvferryError
from kvferry.core.staging_layout import StagingMap

__all__ = ["StagingCopyError", "copy_maps", "map_bytes"]


class StagingCopyError(KvferryError):
    """A map that reaches outside the pool region or the staging buffer."""


def _check(what: str, starts: np.ndarray, hb: int, size: int) -> None:
    if starts.size and (int(starts.min()) < 0 or int(starts.max()) + hb > size):
        raise StagingCopyError(
            f"{what}: bytes [{int(starts.min())}, {int(starts.max()) + hb}) outside [0, {size})"
        )


def _unit(smap: StagingMap, pool_start: np.ndarray) -> int:
    """The largest copy unit (bytes) that divides every offset and the head row: moving whole
    units instead of single bytes makes index arrays ``unit`` times smaller."""
    g = math.gcd(smap.head_bytes, smap.staging_base, smap.stride_region, smap.stride_token)
    g = math.gcd(g, smap.stride_head, smap.pool_head_stride)
    if pool_start.size:
        g = math.gcd(g, int(np.gcd.reduce(pool_start.ravel())))
    return max(g, 1)


def _units(buf: np.ndarray, unit: int) -> np.ndarray:
    """``buf`` (flat uint8) as an array of ``unit``-byte elements (its tail, if any, left out)."""
    whole = buf[: buf.size - buf.size % unit]
    return whole.view(np.dtype((np.void, unit))) if unit > 1 else whole


def copy_maps(
    kind: str, regions: Mapping[int, np.ndarray], staging: np.ndarray, maps: Sequence[StagingMap]
) -> int:
    """``kind`` "gather" (pool -> staging) or "scatter" (staging -> pool); returns bytes moved.
    Every map is checked before any byte moves."""
    if kind not in ("gather", "scatter"):
        raise ValueError(f"kind must be gather or scatter, got {kind!r}")
    plans = []
    for smap in maps:
        hb, n, t = smap.head_bytes, smap.num_heads, len(smap.token_offsets)
        if n == 0 or t == 0:
            continue
        j = np.arange(n, dtype=np.int64)[None, :]
        i = np.arange(t, dtype=np.int64)[:, None]
        pool_start = smap.token_offsets[:, None] + j * smap.pool_head_stride  # [t, n] bytes
        unit = _unit(smap, pool_start)
        k = np.arange(hb // unit, dtype=np.int64)  # units of one head row
        for r, rid in enumerate(smap.region_ids.tolist()):
            region = regions.get(rid)
            if region is None:
                raise StagingCopyError(f"map names pool region {rid}, which this rank does not have")
            st_start = (
                smap.staging_base + r * smap.stride_region + i * smap.stride_token + j * smap.stride_head
            )
            _check(f"pool region {rid}", pool_start, hb, region.size)
            _check("staging buffer", st_start, hb, staging.size)
            pool_idx = ((pool_start // unit)[..., None] + k).ravel()
            st_idx = ((st_start // unit)[..., None] + k).ravel()
            plans.append((region, staging, unit, pool_idx, st_idx))
    moved = 0
    for region, stage, unit, pool_idx, st_idx in plans:
        pool_u, stage_u = _units(region, unit), _units(stage, unit)
        if kind == "gather":
            stage_u[st_idx] = pool_u[pool_idx]
        else:
            pool_u[pool_idx] = stage_u[st_idx]
        moved += pool_idx.size * unit
    return moved


def map_bytes(maps: Sequence[StagingMap]) -> int:
    return sum(smap.nbytes for smap in maps)
