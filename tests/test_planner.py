"""Transfer planner: counts and shapes on the named cases, and typed errors for bad input."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from kvferry.core.errors import PlanError
from kvferry.core.geometry import PRESETS, Layout, ModelGeometry, PoolGeometry, make_pools
from kvferry.core.planner import plan_rank_pair, plan_room

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refmodel

QWEN = PRESETS["qwen3-8b"]
DS = PRESETS["deepseek-v3"]
SMALL = ModelGeometry("small", num_layers=2, num_kv_heads=4, head_dim=4)


def _pools(model: ModelGeometry, tp: int, ps: int, n: int, layout: Layout = Layout.SGLANG_NHD):
    return make_pools(model, tp, ps, n, layout)


def test_equal_tp_contiguous_pages_is_one_descriptor_per_region() -> None:
    src, dst = _pools(QWEN, 2, 16, 300), _pools(QWEN, 2, 16, 300)
    pages = np.arange(10, 266)
    room = plan_room(src, dst, pages, pages, 0, 4096)
    assert [(p.src_rank, p.dst_rank) for p in room.pairs] == [(0, 0), (1, 1)]
    for p in room.pairs:
        assert p.count == 72 and p.descriptors_unmerged == 72 * 4096
        assert (p.length == 4096 * 4 * 128 * 2).all()
        assert (p.src_offset == 10 * 16 * 4 * 256).all()
    assert room.total_bytes == 4096 * QWEN.token_bytes


def test_equal_tp_fragmented_pages_gives_one_descriptor_per_run() -> None:
    src, dst = _pools(SMALL, 1, 4, 20), _pools(SMALL, 1, 4, 20)
    sp = np.array([3, 4, 5, 9, 1, 2])
    dp = np.array([7, 8, 0, 1, 2, 3])
    # Runs where both sides continue: pages (3,4 -> 7,8), (5 -> 0), (9 -> 1), (1,2 -> 2,3).
    plan = plan_rank_pair(src[0], dst[0], sp, dp, 0, 24)
    assert plan.count == 4 * 4
    assert plan.descriptors_unmerged == 24 * 4


def test_prefill_larger_writes_at_its_head_offset() -> None:
    src, dst = _pools(QWEN, 4, 16, 8), _pools(QWEN, 2, 16, 8)
    pages = np.arange(4)
    plan = plan_rank_pair(src[3], dst[1], pages, pages, 0, 64)
    # Prefill rank 3 holds heads 6,7 = local heads 2,3 of decode rank 1 (relative, not global).
    assert (plan.num_heads, plan.head_start) == (2, 6)
    assert plan.count == plan.descriptors_unmerged == 64 * 72
    assert (plan.length == 2 * 256).all()
    assert plan.dst_offset[1] - plan.dst_offset[0] == 4 * 256
    assert plan.dst_offset[0] == 2 * 256
    assert plan_rank_pair(src[3], dst[0], pages, pages, 0, 64).count == 0


def test_decode_larger_reads_its_slice() -> None:
    src, dst = _pools(QWEN, 2, 16, 8), _pools(QWEN, 8, 16, 8)
    pages = np.arange(4)
    plan = plan_rank_pair(src[1], dst[5], pages, pages, 0, 64)
    assert (plan.head_start, plan.num_heads) == (5, 1)
    assert plan.src_offset[0] == 1 * 256  # local head 1 of prefill rank 1 (heads 4..7)
    assert plan.count == 64 * 72  # the slice is strided in the source
    assert plan.dst_offset[1] - plan.dst_offset[0] == 256  # decode side is dense, source is not


def test_mla_prefill_larger_has_dummies() -> None:
    src, dst = _pools(DS, 4, 64, 4), _pools(DS, 2, 64, 4)
    pages = np.arange(2)
    room = plan_room(src, dst, pages, pages, 0, 100)
    assert [(p.src_rank, p.dst_rank) for p in room.pairs] == [(0, 0), (2, 1)]
    assert sum(x.is_dummy for x in room.links) == 2
    assert all(p.count == 61 for p in room.pairs)
    assert plan_rank_pair(src[1], dst[0], pages, pages, 0, 100).is_dummy
    assert room.total_bytes == 2 * 100 * 61 * 576 * 2


def test_different_page_sizes_map_by_token() -> None:
    src, dst = _pools(SMALL, 1, 1, 64), _pools(SMALL, 1, 16, 4)
    sp = np.arange(64)
    plan = plan_rank_pair(src[0], dst[0], sp, np.array([2, 3]), 0, 32)
    assert plan.count == 4  # one run per region: both sides are contiguous
    chunk = plan_rank_pair(src[0], dst[0], sp, np.array([2, 3]), 20, 32)
    assert (chunk.src_offset == 20 * 4 * 8).all()
    assert (chunk.dst_offset == (3 * 16 + 4) * 4 * 8).all()


def test_head_major_layouts_coalesce_whole_pages() -> None:
    src = _pools(SMALL, 1, 8, 4, Layout.VLLM_HND)
    dst = _pools(SMALL, 1, 8, 4, Layout.VLLM_HND)
    plan = plan_rank_pair(src[0], dst[0], [0, 1], [2, 3], 0, 16)
    assert plan.count == 4 and plan.descriptors_unmerged == 16 * 4 * 4
    mixed = plan_rank_pair(src[0], _pools(SMALL, 1, 8, 4)[0], [0, 1], [2, 3], 0, 16)
    # HND -> NHD: (token, head) pieces land apart, except (token 7, head 3) -> (token 8, head 0),
    # which is contiguous on both sides (end of source page 0 / start of page 1; decode slots 7->8).
    assert mixed.count == 4 * (16 * 4 - 1)


def test_empty_chunk() -> None:
    src, dst = _pools(SMALL, 1, 4, 4), _pools(SMALL, 1, 4, 4)
    plan = plan_rank_pair(src[0], dst[0], [0], [1], 2, 2)
    assert plan.count == 0 and plan.total_bytes == 0


def test_arrays_are_read_only_int64() -> None:
    src, dst = _pools(SMALL, 1, 4, 4), _pools(SMALL, 1, 4, 4)
    plan = plan_rank_pair(src[0], dst[0], [0], [1], 0, 4)
    for arr in (plan.src_region, plan.src_offset, plan.dst_region, plan.dst_offset, plan.length):
        assert arr.dtype == np.int64 and not arr.flags.writeable


def test_chunk_offsets_accumulate() -> None:
    """Chunk N must land after chunk N-1, not at offset 0 (the upstream bug)."""
    src, dst = _pools(SMALL, 2, 4, 16), _pools(SMALL, 1, 4, 16)
    sp, dp = np.arange(8), np.arange(8, 16)
    src_mem = [refmodel.source_memory(p, sp, 32) for p in src]
    dst_mem = refmodel.blank(dst[0], 0)
    for lo, hi in ((0, 10), (10, 11), (11, 32)):
        for p in plan_room(src, dst, sp, dp, lo, hi).pairs:
            refmodel.apply_plan(p, src_mem[p.src_rank], dst_mem)
    expected = refmodel.blank(dst[0], 0)
    refmodel.write_room(dst[0], expected, dp, 0, 32)
    for r in expected:
        np.testing.assert_array_equal(dst_mem[r], expected[r])


@pytest.mark.parametrize(
    ("sp", "dp", "lo", "hi", "match"),
    [
        ([0, 4], [0, 1], 0, 8, "prefill page id 4 out of range"),
        ([0, 1], [-1, 1], 0, 8, "decode page id -1 out of range"),
        ([0, 1], [0], 0, 8, "exceed the decode allocation"),
        ([0], [0, 1], 0, 8, "exceed the prefill allocation"),
        ([0, 1], [1, 1], 0, 8, "repeat"),
        ([0, 1], [0, 1], 5, 4, "not a valid range"),
        ([0, 1], [0, 1], -1, 4, "not a valid range"),
        ([0.0, 1.0], [0, 1], 0, 4, "integers"),
        ([[0, 1]], [0, 1], 0, 4, "1-D"),
        ([0, 1], [0, 1], 0, 4.0, "integer"),
    ],
)
def test_bad_input_is_a_plan_error(sp: list, dp: list, lo: int, hi: int, match: str) -> None:
    src, dst = _pools(SMALL, 1, 4, 4), _pools(SMALL, 1, 4, 4)
    with pytest.raises(PlanError, match=match):
        plan_rank_pair(src[0], dst[0], sp, dp, lo, hi)
    with pytest.raises(PlanError, match=match):
        plan_room(src, dst, sp, dp, lo, hi)


@pytest.mark.parametrize(
    "other",
    [
        ModelGeometry("small", 2, 4, 4, "fp8_e4m3"),
        ModelGeometry("small", 3, 4, 4),
        ModelGeometry("small", 2, 4, 8),
        ModelGeometry("small", 2, 8, 4),
    ],
)
def test_mismatched_models_are_rejected(other: ModelGeometry) -> None:
    src = PoolGeometry(SMALL, 1, 0, 4, 4)
    dst = PoolGeometry(other, 1, 0, 4, 4)
    with pytest.raises(PlanError, match="incompatible"):
        plan_rank_pair(src, dst, [0], [0], 0, 4)
    with pytest.raises(PlanError, match="incompatible"):
        plan_room([src], [dst], [0], [0], 0, 4)


def test_repeated_page_in_a_big_pool_is_rejected() -> None:
    # Few pages in a large pool take the sort path of the duplicate check, not the page table.
    src, dst = _pools(SMALL, 1, 4, 4), _pools(SMALL, 1, 4, 10_000)
    with pytest.raises(PlanError, match="repeat"):
        plan_rank_pair(src[0], dst[0], [0, 1], [9_000, 9_000], 0, 8)


def test_room_pools_must_be_one_server() -> None:
    src = _pools(SMALL, 2, 4, 4)
    with pytest.raises(PlanError, match="pools given"):
        plan_room(src[:1], src, [0], [0], 0, 4)
    with pytest.raises(PlanError, match="not rank"):
        plan_room((src[1], src[0]), src, [0], [0], 0, 4)
