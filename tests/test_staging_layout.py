"""Staging layouts: gather -> one descriptor -> scatter reproduces the logical re-layout.

The staging buffers are also checked against the seeds' layouts by an independent numpy view:
SGLang PR 18968 ``[heads, layers, K|V, tokens, head_dim]`` per rank, SGLang PR 22536 ``[2L, tokens, heads,
head_dim]`` per writer.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.core.errors import PlanError
from kvferry.core.geometry import PRESETS, Layout, make_pools
from kvferry.core.planner import plan_room
from kvferry.core.staging_layout import (
    StagingFormat,
    StagingMap,
    plan_staged_pair,
    plan_staged_room,
    staged_map,
    staged_maps,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refmodel


def _copy_to_staging(m: StagingMap, pool_mem: refmodel.Memory, buf: np.ndarray) -> None:
    region, pool_off, stg_off, length = m.pieces()
    for r in np.unique(region):
        sel = region == r
        buf[refmodel.expand(stg_off[sel], length[sel])] = pool_mem[int(r)][
            refmodel.expand(pool_off[sel], length[sel])
        ]


def _copy_to_pool(m: StagingMap, buf: np.ndarray, pool_mem: refmodel.Memory) -> None:
    region, pool_off, stg_off, length = m.pieces()
    for r in np.unique(region):
        sel = region == r
        idx = refmodel.expand(pool_off[sel], length[sel])
        assert idx.size == 0 or (idx.min() >= 0 and idx.max() < pool_mem[int(r)].size)
        pool_mem[int(r)][idx] = buf[refmodel.expand(stg_off[sel], length[sel])]


@settings(max_examples=100)
@given(room=refmodel.rooms(), fmt=st.sampled_from(list(StagingFormat)))
def test_staged_room_equals_logical_relayout(room: dict, fmt: StagingFormat) -> None:
    model = room["model"]
    src_pools, dst_pools, sp, dp, _ = refmodel.room_setup(room)
    src_mem = [refmodel.source_memory(p, sp, room["tokens"], salt=2) for p in src_pools]
    dst_mem = [refmodel.blank(p, 0x5A) for p in dst_pools]
    expected = [refmodel.blank(p, 0x5A) for p in dst_pools]
    hb = refmodel.head_bytes(model)
    n_regions = refmodel.num_regions(model)
    kinds = 1 if model.is_mla else 2

    for lo, hi in itertools.pairwise(room["cuts"]):
        staged = plan_staged_room(src_pools, dst_pools, sp, dp, lo, hi, fmt)
        direct = plan_room(src_pools, dst_pools, sp, dp, lo, hi)
        assert staged.count == len(direct.pairs) == sum(not x.is_dummy for x in staged.links)
        assert staged.total_bytes == direct.total_bytes
        t = hi - lo
        tokens = np.arange(lo, hi)
        src_bufs: dict[object, np.ndarray] = {}
        dst_size: dict[int, int] = {}
        for p in staged.pairs:
            end = max(p.dst_buffer_bytes, p.dst_staging_offset + p.length)
            dst_size[p.dst_rank] = max(dst_size.get(p.dst_rank, 0), end)
        dst_bufs = {d: np.zeros(n, dtype=np.uint8) for d, n in dst_size.items()}
        dst_writes = {d: np.zeros(n, dtype=np.int64) for d, n in dst_size.items()}
        for p in staged.pairs:
            key = p.src_rank if fmt is StagingFormat.HEAD_MAJOR else (p.src_rank, p.dst_rank)
            sbuf = src_bufs.setdefault(key, np.full(p.src_buffer_bytes, 0xEE, dtype=np.uint8))
            assert sbuf.size == p.src_buffer_bytes
            _copy_to_staging(p.gather, src_mem[p.src_rank], sbuf)
            # The staging block is the seed's layout: check it through an independent view.
            if fmt is StagingFormat.HEAD_MAJOR:
                s_heads = refmodel.ref_heads(model.num_kv_heads, room["ptp"], p.src_rank)
                view = sbuf.reshape(len(s_heads), model.num_layers, kinds, t, hb)
                for g in range(p.head_start, p.head_start + p.num_heads):
                    for r in range(n_regions):
                        got = view[g - s_heads.start, r // kinds, r % kinds]
                        np.testing.assert_array_equal(got, refmodel.pattern(r, tokens, g, hb))
            else:
                view = sbuf.reshape(n_regions, t, p.num_heads, hb)
                for j in range(p.num_heads):
                    for r in range(n_regions):
                        pat = refmodel.pattern(r, tokens, p.head_start + j, hb)
                        np.testing.assert_array_equal(view[r, :, j], pat)
            # The single descriptor.
            dbuf = dst_bufs[p.dst_rank]
            src_slice = sbuf[p.src_staging_offset : p.src_staging_offset + p.length]
            assert src_slice.size == p.length
            dbuf[p.dst_staging_offset : p.dst_staging_offset + p.length] = src_slice
            dst_writes[p.dst_rank][p.dst_staging_offset : p.dst_staging_offset + p.length] += 1
        for writes in dst_writes.values():
            assert writes.max(initial=0) <= 1, "two writers share staging bytes"
            if fmt is StagingFormat.HEAD_MAJOR:
                assert (writes == 1).all(), "the decode rank's staging buffer has holes"
        for p in staged.pairs:
            _copy_to_pool(p.scatter, dst_bufs[p.dst_rank], dst_mem[p.dst_rank])
        for d, pool in enumerate(dst_pools):
            refmodel.write_room(pool, expected[d], dp, lo, hi)
            for r in range(n_regions):
                np.testing.assert_array_equal(dst_mem[d][r], expected[d][r])


def test_head_major_qwen_4_to_2_maps() -> None:
    q = PRESETS["qwen3-8b"]
    src, dst = make_pools(q, 4, 16, 64), make_pools(q, 2, 16, 64)
    pages = np.arange(8, 16)
    room = plan_staged_room(src, dst, pages, pages, 0, 128, StagingFormat.HEAD_MAJOR)
    assert room.count == 4
    hb, r, t = 256, 72, 128
    p = room.pairs[1]  # prefill 1 -> decode 0: global heads 2,3 = decode-local heads 2,3
    assert (p.src_rank, p.dst_rank, p.head_start, p.num_heads) == (1, 0, 2, 2)
    assert p.src_staging_offset == 0 and p.src_buffer_bytes == 2 * r * t * hb
    assert p.dst_staging_offset == 2 * r * t * hb and p.dst_buffer_bytes == 4 * r * t * hb
    assert p.length == 2 * r * t * hb
    g = p.gather
    assert (g.stride_head, g.stride_region, g.stride_token) == (r * t * hb, t * hb, hb)
    assert g.token_offsets[0] == 8 * 16 * 2 * hb and g.pool_head_stride == hb
    assert p.scatter.token_offsets[0] == 8 * 16 * 4 * hb + 2 * hb  # decode local head 2
    assert p.scatter.local_head_start == 2 and p.gather.local_head_start == 0
    np.testing.assert_array_equal(g.slots, np.arange(128, 256))
    assert g.element_strides() == (t * 128, 128, r * t * 128, 0)
    assert p.scatter.element_strides()[3] == 2 * r * t * 128


def test_layer_major_packs_writers_in_the_decode_ring() -> None:
    q = PRESETS["qwen3-8b"]
    src, dst = make_pools(q, 4, 16, 64), make_pools(q, 2, 16, 64)
    pages = np.arange(8)
    room = plan_staged_room(src, dst, pages, pages, 32, 96, StagingFormat.LAYER_MAJOR)
    block = 72 * 64 * 2 * 256
    assert [(p.dst_rank, p.dst_staging_offset, p.length) for p in room.pairs] == [
        (0, 0, block),
        (0, block, block),
        (1, 0, block),
        (1, block, block),
    ]
    g = room.pairs[0].gather
    assert (g.stride_region, g.stride_token, g.stride_head) == (64 * 2 * 256, 2 * 256, 256)


def test_single_descriptor_as_rank_plan() -> None:
    q = PRESETS["qwen3-8b"]
    src, dst = make_pools(q, 2, 16, 8), make_pools(q, 4, 16, 8)
    pair = plan_staged_pair(src[1], dst[3], [0, 1], [2, 3], 0, 32, src_base=4096, dst_base=64)
    rp = pair.as_rank_plan(src_region=1000, dst_region=2000)
    assert rp.count == 1 and rp.total_bytes == pair.length == 72 * 32 * 2 * 256
    assert (rp.src_region[0], rp.src_offset[0]) == (1000, 4096 + 2 * 72 * 32 * 256)  # heads 6,7 of 4..7
    assert (rp.dst_region[0], rp.dst_offset[0], rp.length[0]) == (2000, 64, pair.length)
    dummy = plan_staged_pair(src[0], dst[3], [0, 1], [2, 3], 0, 32).as_rank_plan(1000, 2000)
    assert dummy.count == 0 and dummy.src_offset.size == 0


def test_mla_dummy_pairs_have_empty_maps() -> None:
    ds = PRESETS["deepseek-v3"]
    src, dst = make_pools(ds, 4, 64, 4), make_pools(ds, 2, 64, 4)
    pair = plan_staged_pair(src[1], dst[0], [0], [0], 0, 64)
    assert pair.count == 0 and pair.gather.nbytes == 0 and pair.scatter.nbytes == 0
    room = plan_staged_room(src, dst, [0], [0], 0, 64)
    assert [(p.src_rank, p.dst_rank) for p in room.pairs] == [(0, 0), (2, 1)]


def test_staged_bad_input_is_a_plan_error() -> None:
    q = PRESETS["qwen3-8b"]
    src, dst = make_pools(q, 2, 16, 4), make_pools(q, 2, 16, 4)
    with pytest.raises(PlanError, match="decode allocation"):
        plan_staged_pair(src[0], dst[0], [0, 1, 2], [0], 0, 40)
    with pytest.raises(PlanError, match="out of range"):
        plan_staged_room(src, dst, [0, 9], [0, 1], 0, 20)


@pytest.mark.parametrize("layout", list(Layout))
def test_maps_index_every_token_through_its_page(layout: Layout) -> None:
    """Each token's slot and pool offset are its page's (``pages[t // page_size]``) plus its place
    in the page, for ranges that start and end mid-page, in one page, on scattered page ids, and
    empty; pages short of the range raise."""
    q = PRESETS["qwen3-8b"]
    rng = np.random.default_rng(7)
    for pool in make_pools(q, 4, 16, 64, layout)[1:3]:
        pages = rng.permutation(64)[:20].astype(np.int64)
        for ts, te in ((0, 320), (5, 300), (17, 30), (33, 34), (16, 16), (40, 40), (3, 0)):
            te = max(ts, te)
            m = staged_map(pool, pages, pool.head_start + 1, 1, ts, te, StagingFormat.HEAD_MAJOR, 0)
            t = np.arange(ts, te)
            page, tip = pages[t // 16], t % 16
            np.testing.assert_array_equal(m.slots, page * 16 + tip)
            want = page * pool.page_stride + tip * pool.token_stride + pool.head_stride
            np.testing.assert_array_equal(m.token_offsets, want)
            assert m.slots.dtype == m.token_offsets.dtype == np.int64
            assert not m.slots.flags.writeable and not m.token_offsets.flags.writeable
        with pytest.raises(IndexError):
            staged_map(pool, pages[:3], pool.head_start, 1, 0, 49, StagingFormat.HEAD_MAJOR, 0)


def test_a_few_tokens_of_a_huge_page_are_mapped_without_the_pages_rows() -> None:
    """A page size of 10**12 tokens (`kvferry plan --decode-page-size` takes any positive int):
    a map of five of its tokens indexes them, it does not build the page's 10**12 rows."""
    q = PRESETS["qwen3-8b"]
    (pool,) = make_pools(q, 1, 10**12, 2)
    pages = np.array([1, 0], dtype=np.int64)
    m = staged_map(pool, pages, pool.head_start, 1, 7, 12, StagingFormat.HEAD_MAJOR, 0)
    t = np.arange(7, 12)
    np.testing.assert_array_equal(m.slots, 10**12 + t)
    np.testing.assert_array_equal(m.token_offsets, pool.page_stride + t * pool.token_stride)


@pytest.mark.parametrize("fmt", list(StagingFormat))
def test_maps_of_several_writers_are_each_writers_map(fmt: StagingFormat) -> None:
    """``staged_maps`` (decode's scatter of every writer of a chunk) gives the maps ``staged_map``
    gives one by one, a dummy writer's empty one among them."""
    q = PRESETS["qwen3-8b"]
    dst = make_pools(q, 2, 16, 64)[1]
    pages = np.random.default_rng(3).permutation(64)[:12].astype(np.int64)
    writers = [(dst.head_start, 2, 0), (dst.head_start + 2, 2, 4096), (dst.head_start, 0, 99)]
    for ts, te in ((0, 190), (21, 100), (40, 40)):
        got = staged_maps(dst, pages, writers, ts, te, fmt)
        want = [staged_map(dst, pages, h, n, ts, te, fmt, b) for h, n, b in writers]
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            for name in StagingMap.__dataclass_fields__:
                a, b = getattr(g, name), getattr(w, name)
                if isinstance(b, np.ndarray):
                    assert a.dtype == b.dtype and not a.flags.writeable, name
                    np.testing.assert_array_equal(a, b)
                else:
                    assert a == b, name
