"""Run the planner's staging maps (``kvferry.core.staging_layout.StagingMap``) on the kernels.

A map addresses bytes: region ``r``'s token ``i`` head ``j`` goes to ``staging_base + r *
stride_region + i * stride_token + j * stride_head``, and ``slots``/``local_head_start`` say where
it sits in the pool. That is exactly a ``StagingLayout`` in elements plus a slot list, so the
kernels take maps as they are; this module only converts units and checks the map describes the
pool it is run against (all regions in order, NHD heads, same head width).
"""

from __future__ import annotations

import numpy as np
import torch
from kvferry.backends.kernels.api import Backend, KVPool, gather_slots, scatter_slots
from kvferry.backends.kernels.errors import KernelArgError
from kvferry.backends.kernels.layout import StagingLayout
from kvferry.core.staging_layout import StagingMap


def map_layout(m: StagingMap, itemsize: int) -> StagingLayout:
    """The map's staging side in elements of ``itemsize`` bytes."""
    for name in ("staging_base", "stride_region", "stride_token", "stride_head", "head_bytes"):
        if getattr(m, name) % itemsize:
            raise KernelArgError(
                f"map {name}={getattr(m, name)} is not a whole number of {itemsize}-byte elements"
            )
    return StagingLayout(
        num_heads=m.num_heads,
        num_planes=len(m.region_ids),
        num_tokens=len(m.slots),
        head_dim=m.head_bytes // itemsize,
        stride_head=m.stride_head // itemsize,
        stride_plane=m.stride_region // itemsize,
        stride_token=m.stride_token // itemsize,
        base=m.staging_base // itemsize,
    )


def _check(pool: KVPool, m: StagingMap) -> StagingLayout:
    try:
        if not np.array_equal(m.region_ids, np.arange(pool.num_planes)):
            # The kernels walk every plane of the pool in order, one program row per plane.
            raise KernelArgError(
                f"map covers regions {m.region_ids.tolist()}, kernels need all {pool.num_planes}"
            )
        if m.head_bytes != pool.head_dim * pool.itemsize:
            raise KernelArgError(
                f"map head_bytes {m.head_bytes} != pool head row {pool.head_dim * pool.itemsize}"
            )
        if m.pool_head_stride != m.head_bytes:
            raise KernelArgError("map's pool is not [slots, heads, head_dim] (NHD); the kernels need NHD")
        return map_layout(m, pool.itemsize)
    except KernelArgError:
        pool.stats.rejected += 1
        raise


def gather_map(
    pool: KVPool,
    staging: torch.Tensor,
    m: StagingMap,
    *,
    stream: torch.cuda.Stream | None = None,
    backend: Backend = "auto",
    compile_only: bool = False,
) -> torch.cuda.Event | None:
    """Gather the planner's map into ``staging`` (the side's whole staging memory, viewed with the
    pool's element width). An empty map (a dummy pair) moves nothing and returns None."""
    if m.num_heads == 0 or len(m.slots) == 0:
        return None
    layout = _check(pool, m)
    return gather_slots(
        pool, staging, layout, m.slots, head_start=m.local_head_start, stream=stream, backend=backend,
        compile_only=compile_only,
    )  # fmt: skip


def scatter_map(
    pool: KVPool,
    staging: torch.Tensor,
    m: StagingMap,
    *,
    stream: torch.cuda.Stream | None = None,
    backend: Backend = "auto",
    compile_only: bool = False,
) -> torch.cuda.Event | None:
    """Scatter ``staging`` into the pool by the planner's map; None for an empty map."""
    if m.num_heads == 0 or len(m.slots) == 0:
        return None
    layout = _check(pool, m)
    return scatter_slots(
        pool, staging, layout, m.slots, head_start=m.local_head_start, stream=stream, backend=backend,
        compile_only=compile_only,
    )  # fmt: skip
