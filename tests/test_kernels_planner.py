"""The kernels run the planner's staging maps: gather -> one descriptor -> scatter equals the
logical re-layout of the independent reference model (tests/refmodel.py), for both staging formats,
every dtype, MLA, replication, P > D and P < D, chunked rooms and different page sizes per side.

Triton runs in its interpreter on CPU (see tests/test_kernels.py for how and why).
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import numpy as np
import pytest

DEVICE = os.environ.get("KVFERRY_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kvferry.backends.kernels import KernelArgError, KVPool, gather_map, scatter_map  # noqa: E402
from kvferry.backends.kernels import triton_gather_scatter as tk  # noqa: E402
from kvferry.core.geometry import PRESETS, DType, Layout, make_pools  # noqa: E402
from kvferry.core.staging_layout import StagingFormat, plan_staged_pair, plan_staged_room  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refmodel  # noqa: E402

TORCH_DTYPE = {
    DType.BF16: torch.bfloat16,
    DType.FP16: torch.float16,
    DType.FP8_E4M3: torch.float8_e4m3fn,
    DType.FP8_E5M2: torch.float8_e5m2,
    DType.FP32: torch.float32,
}


def to_pool(geom, mem: refmodel.Memory) -> KVPool:
    """A KVPool over the reference memory: region r is plane r, ``[slots, heads, head_dim]``."""
    dt = TORCH_DTYPE[geom.model.dtype]
    planes = []
    for r in range(refmodel.num_regions(geom.model)):
        t = torch.from_numpy(mem[r]).view(geom.num_slots, geom.heads_per_rank, -1).view(dt)
        planes.append(t.to(DEVICE) if DEVICE != "cpu" else t)
    return KVPool(planes, geom.page_size)


def buffer(nbytes: int, dtype: torch.dtype, fill: int) -> torch.Tensor:
    return torch.full((nbytes,), fill, dtype=torch.uint8, device=DEVICE).view(dtype)


# At most 16 heads: the interpreter runs one program per head and plane, so a 46-head room cost
# over half the test's time; the kernels' head arithmetic (first head, head stride, one head per
# program) is the same at 16 (any count 1-16 and every TP pair up to 16 are still drawn, and the
# planner's maps for up to 64 heads are checked against the reference in test_planner_props.py).
@settings(max_examples=15)
@given(
    room=refmodel.rooms(max_heads=16),
    fmt=st.sampled_from(list(StagingFormat)),
    nhd=st.sampled_from([Layout.SGLANG_NHD, Layout.VLLM_NHD]),
)
def test_kernels_run_planner_maps(room: dict, fmt: StagingFormat, nhd: Layout) -> None:
    model = room["model"]
    dt = TORCH_DTYPE[model.dtype]
    rng = np.random.default_rng(room["seed"])
    src_geo = make_pools(model, room["ptp"], room["ps_p"], room["pool_p"], nhd)
    dst_geo = make_pools(model, room["dtp"], room["ps_d"], room["pool_d"], nhd)
    sp = refmodel.fragmented_pages(rng, room["pool_p"], room["need_p"])
    dp = refmodel.fragmented_pages(rng, room["pool_d"], room["alloc_d"])
    src_mem = [refmodel.source_memory(p, sp, room["tokens"], salt=2) for p in src_geo]
    dst_mem = [refmodel.blank(p, 0x5A) for p in dst_geo]
    expected = [refmodel.blank(p, 0x5A) for p in dst_geo]
    src_pools = [to_pool(g, m) for g, m in zip(src_geo, src_mem, strict=True)]
    dst_pools = [to_pool(g, m) for g, m in zip(dst_geo, dst_mem, strict=True)]
    launches = sum(tk.LAUNCHES.values())
    expected_launches = 0
    for lo, hi in itertools.pairwise(room["cuts"]):
        staged = plan_staged_room(src_geo, dst_geo, sp, dp, lo, hi, fmt)
        src_bufs: dict[object, torch.Tensor] = {}
        dst_size: dict[int, int] = {}
        for p in staged.pairs:
            end = max(p.dst_buffer_bytes, p.dst_staging_offset + p.length)
            dst_size[p.dst_rank] = max(dst_size.get(p.dst_rank, 0), end)
        dst_bufs = {d: buffer(n, dt, 0) for d, n in dst_size.items()}
        for p in staged.pairs:
            key = p.src_rank if fmt is StagingFormat.HEAD_MAJOR else (p.src_rank, p.dst_rank)
            sbuf = src_bufs.setdefault(key, buffer(p.src_buffer_bytes, dt, 0xEE))
            gather_map(src_pools[p.src_rank], sbuf, p.gather, backend="triton")
            # The single descriptor, as an RDMA WRITE of bytes would do it.
            s8, d8 = sbuf.view(torch.uint8), dst_bufs[p.dst_rank].view(torch.uint8)
            d8[p.dst_staging_offset : p.dst_staging_offset + p.length] = s8[
                p.src_staging_offset : p.src_staging_offset + p.length
            ]
            expected_launches += 1 if p.length else 0
        for p in staged.pairs:
            scatter_map(dst_pools[p.dst_rank], dst_bufs[p.dst_rank], p.scatter, backend="triton")
            expected_launches += 1 if p.length else 0
        for d, pool in enumerate(dst_geo):
            refmodel.write_room(pool, expected[d], dp, lo, hi)
    assert sum(tk.LAUNCHES.values()) - launches == expected_launches
    for d, pool in enumerate(dst_pools):
        for r, plane in enumerate(pool.planes):
            got = plane.cpu().contiguous().view(torch.uint8).numpy().reshape(-1)
            np.testing.assert_array_equal(got, expected[d][r])


def test_dummy_pair_moves_nothing() -> None:
    model = PRESETS["deepseek-v3"]
    src, dst = make_pools(model, 4, 1, 8), make_pools(model, 2, 1, 8)
    pair = plan_staged_pair(src[1], dst[0], np.arange(8), np.arange(8), 0, 8)  # MLA P > D: dummy
    assert pair.count == 0
    pool = to_pool(src[1], refmodel.blank(src[1], 1))
    assert gather_map(pool, buffer(64, torch.bfloat16, 0), pair.gather) is None
    assert pool.stats.gathers == 0


def test_head_major_in_page_pool_is_rejected() -> None:
    """vLLM HND pages split a token's heads apart; the kernels address NHD only and say so."""
    model = refmodel.ModelGeometry("m", 1, 2, 4)
    src = make_pools(model, 1, 4, 4, Layout.VLLM_HND)
    dst = make_pools(model, 2, 4, 4)
    pair = plan_staged_pair(src[0], dst[0], np.arange(4), np.arange(4), 0, 16)
    pool = to_pool(src[0], refmodel.blank(src[0], 1))
    with pytest.raises(KernelArgError, match="NHD"):
        gather_map(pool, buffer(pair.src_buffer_bytes, torch.bfloat16, 0), pair.gather)
    assert pool.stats.rejected == 1


@settings(max_examples=6, deadline=None)
@given(room=refmodel.rooms(), fmt=st.sampled_from(list(StagingFormat)), base_units=st.integers(0, 7))
def test_kernels_and_the_simulators_numpy_copy_move_the_same_bytes(
    room: dict, fmt: StagingFormat, base_units: int
) -> None:
    """The simulator and the test harness run every staged flow with numpy
    (backends/staging_copy.py); the GPU runs the Triton kernels. For the maps the flows build
    (``staged_map`` with a lane's base), both must put the same bytes at the same places."""
    from kvferry.backends.staging_copy import copy_maps
    from kvferry.core.staging_layout import staged_map

    model = room["model"]
    dt = TORCH_DTYPE[model.dtype]
    rng = np.random.default_rng(room["seed"])
    src_geo = make_pools(model, room["ptp"], room["ps_p"], room["pool_p"], Layout.SGLANG_NHD)
    sp = refmodel.fragmented_pages(rng, room["pool_p"], room["need_p"])
    lo, hi = room["cuts"][0], room["cuts"][1]
    geo = src_geo[-1]
    n = max(1, geo.heads_per_rank // 2)
    base = base_units * geo.head_bytes  # a lane's slot starts anywhere on a head row
    smap = staged_map(geo, sp, geo.head_start, n, lo, hi, fmt, base)
    mem = refmodel.source_memory(geo, sp, room["tokens"], salt=3)
    size = base + smap.nbytes + geo.model.num_regions * (hi - lo) * geo.heads_per_rank * geo.head_bytes
    # Gather: kernels into one buffer, numpy into another.
    kbuf = buffer(size, dt, 0xEE)
    done = gather_map(to_pool(geo, mem), kbuf, smap, backend="triton")
    if done is not None:
        done.synchronize()  # the kernels run on their own stream: wait before reading back
    nbuf = np.full(size, 0xEE, dtype=np.uint8)
    copy_maps("gather", {r: mem[r].reshape(-1) for r in range(len(mem))}, nbuf, (smap,))
    np.testing.assert_array_equal(kbuf.cpu().view(torch.uint8).numpy(), nbuf)
    # Scatter the gathered bytes back into blank pools, both ways: same pools.
    blank = refmodel.blank(geo, 0x11)
    kpool = to_pool(geo, {r: v.copy() for r, v in blank.items()})
    done = scatter_map(kpool, kbuf, smap, backend="triton")
    if done is not None:
        done.synchronize()
    nmem = {r: v.copy() for r, v in blank.items()}
    copy_maps("scatter", {r: nmem[r].reshape(-1) for r in range(len(nmem))}, nbuf, (smap,))
    for r, plane in enumerate(kpool.planes):
        np.testing.assert_array_equal(plane.cpu().contiguous().view(torch.uint8).numpy().reshape(-1), nmem[r])
