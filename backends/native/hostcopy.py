"""Gather and scatter on host memory in C (backends/native/copy.c), off the interpreter.

The same contract and bytes as ``backends.staging_copy.copy_maps`` (the numpy reference): every
map is checked before any byte moves, and a map outside the pool or the staging buffer raises
``StagingCopyError`` with the same message. The copy itself is one foreign call per map through a
ctypes handle that releases the GIL, so the copy thread of a DRAM rank moves a chunk while the
interpreter runs the rest of the endpoint (the numpy version holds the GIL for its index
arithmetic and gives it back only inside the fancy-index copy).

The checks use the extremes of each map's offsets (a sum of arithmetic ranges: its min and max are
exact), not one index per (token, head) as numpy does: C checks them again before it copies.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Mapping, Sequence

import numpy as np
from kvferry.backends.staging_copy import StagingCopyError
from kvferry.core.staging_layout import StagingMap

__all__ = ["available", "copy_maps"]

_i64, _u64 = ctypes.c_int64, ctypes.c_uint64
_WHY = {-1: "a pool range outside its region", -2: "a staging range outside the buffer", -3: "bad arguments"}


@functools.cache
def _lib() -> ctypes.CDLL:
    from kvferry.backends.nixl.native import engine_path

    lib = ctypes.CDLL(str(engine_path()))  # no NIXL needed: the copy is plain C
    fn = lib.kvf_copy_map
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(_u64),
        ctypes.c_void_p,
        _u64,
        ctypes.POINTER(_i64),
        ctypes.c_size_t,
        *([_i64] * 7),
    ]
    return lib


def available() -> str:
    """ "" when the native copy can run here, else one line saying why not."""
    try:
        _lib()
    except (OSError, AttributeError, RuntimeError) as exc:
        return f"native copy unavailable: {exc}"
    return ""


def _extremes(count: int, stride: int) -> tuple[int, int]:
    span = (count - 1) * stride if count > 1 else 0
    return min(span, 0), max(span, 0)


def _check(what: str, lo: int, hi: int, size: int) -> None:
    if lo < 0 or hi > size:
        raise StagingCopyError(f"{what}: bytes [{lo}, {hi}) outside [0, {size})")


def _checked(
    regions: Mapping[int, np.ndarray], staging: np.ndarray, smap: StagingMap
) -> tuple[list[np.ndarray], np.ndarray] | None:
    """The map's regions (in map order) and its token offsets, or None when it moves nothing;
    StagingCopyError on anything outside its buffer (the numpy reference's messages)."""
    hb, n, t = smap.head_bytes, smap.num_heads, len(smap.token_offsets)
    if n == 0 or t == 0:
        return None
    offs = np.ascontiguousarray(smap.token_offsets, dtype=np.int64)
    h_lo, h_hi = _extremes(n, smap.pool_head_stride)
    p_lo, p_hi = int(offs.min()) + h_lo, int(offs.max()) + h_hi + hb
    t_lo, t_hi = _extremes(t, smap.stride_token)
    j_lo, j_hi = _extremes(n, smap.stride_head)
    bufs = []
    for r, rid in enumerate(smap.region_ids.tolist()):
        region = regions.get(rid)
        if region is None:
            raise StagingCopyError(f"map names pool region {rid}, which this rank does not have")
        base = smap.staging_base + r * smap.stride_region
        _check(f"pool region {rid}", p_lo, p_hi, region.size)
        _check("staging buffer", base + t_lo + j_lo, base + t_hi + j_hi + hb, staging.size)
        bufs.append(region)
    return bufs, offs


def copy_maps(
    kind: str, regions: Mapping[int, np.ndarray], staging: np.ndarray, maps: Sequence[StagingMap]
) -> int:
    """``kind`` "gather" (pool -> staging) or "scatter" (staging -> pool); returns bytes moved.
    ``regions``/``staging``: flat, contiguous uint8 arrays. Every map is checked first."""
    if kind not in ("gather", "scatter"):
        raise ValueError(f"kind must be gather or scatter, got {kind!r}")
    if not staging.flags.c_contiguous or any(not r.flags.c_contiguous for r in regions.values()):
        raise StagingCopyError("native copy needs contiguous buffers")
    plans = [(smap, p) for smap in maps if (p := _checked(regions, staging, smap)) is not None]
    fn = _lib().kvf_copy_map
    moved = 0
    for smap, (bufs, offs) in plans:
        ptrs = (ctypes.c_void_p * len(bufs))(*(b.ctypes.data for b in bufs))
        sizes = (_u64 * len(bufs))(*(b.size for b in bufs))
        st = fn(
            int(kind == "scatter"),
            len(bufs),
            ptrs,
            sizes,
            staging.ctypes.data,
            staging.size,
            offs.ctypes.data_as(ctypes.POINTER(_i64)),
            offs.size,
            smap.num_heads,
            smap.head_bytes,
            smap.pool_head_stride,
            smap.staging_base,
            smap.stride_region,
            smap.stride_token,
            smap.stride_head,
        )
        if st != 0:  # the checks above passed: C disagreeing is a bug, never a silent copy
            raise StagingCopyError(f"native copy refused a checked map: {_WHY.get(st, st)}")
        moved += smap.nbytes
    return moved
