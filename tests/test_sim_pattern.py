"""The byte patterns used to judge Success rooms agree with the planner and catch misplacement."""

from __future__ import annotations

import numpy as np
import pytest
from kvferry.backends import pattern
from kvferry.backends.simfabric.descriptors import gather_index
from kvferry.core.geometry import Layout, ModelGeometry, PoolGeometry
from kvferry.core.planner import plan_rank_pair

CASES = [
    # heads, prefill tp, decode tp, prefill page size, decode page size, mla, decode layout
    (8, 2, 1, 16, 16, False, "sglang_nhd"),
    (8, 1, 4, 8, 16, False, "sglang_nhd"),
    (2, 4, 1, 4, 4, False, "vllm_hnd"),
    (1, 2, 1, 16, 8, True, "sglang_nhd"),
    (2, 2, 8, 16, 16, False, "sglang_nhd"),
]


def _mem(pools):
    return [{r.region_id: np.zeros(r.nbytes, np.uint8) for r in p.regions} for p in pools]


@pytest.mark.parametrize(("heads", "ptp", "dtp", "pps", "dps", "mla", "dlayout"), CASES)
def test_pattern_survives_planned_copy_and_detects_shift(heads, ptp, dtp, pps, dps, mla, dlayout) -> None:
    model = ModelGeometry("t", 2, heads, 8 if not mla else 16, "bf16", mla)
    pre = [PoolGeometry(model, ptp, r, pps, 64) for r in range(ptp)]
    dec = [PoolGeometry(model, dtp, r, dps, 64, Layout(dlayout)) for r in range(dtp)]
    pmem, dmem = _mem(pre), _mem(dec)
    rng = np.random.default_rng(0)
    tokens = 100
    sp = rng.permutation(64)[: -(-tokens // pps)]
    dp = rng.permutation(64)[: -(-tokens // dps)]
    for p, m in zip(pre, pmem, strict=True):
        pattern.fill(p, m.__getitem__, 77, sp, 0, tokens)
    for start, end in ((0, 40), (40, 100)):
        for p, pm in zip(pre, pmem, strict=True):
            for d, dm in zip(dec, dmem, strict=True):
                plan = plan_rank_pair(p, d, sp, dp, start, end)
                for i in range(plan.count):
                    s = gather_index(plan.src_offset[i : i + 1], plan.length[i : i + 1])
                    t = gather_index(plan.dst_offset[i : i + 1], plan.length[i : i + 1])
                    dm[int(plan.dst_region[i])][t] = pm[int(plan.src_region[i])][s]
    for d, dm in zip(dec, dmem, strict=True):
        assert pattern.mismatches(d, dm.__getitem__, 77, dp, tokens) == (0, "")
        # Another room key, or bytes one token off, are detected.
        assert pattern.mismatches(d, dm.__getitem__, 78, dp, tokens)[0] > 0
        r0 = dm[0]
        r0[:] = np.roll(r0, d.token_bytes)
        bad, first = pattern.mismatches(d, dm.__getitem__, 77, dp, tokens)
        assert bad > 0 and "region 0" in first


def _reference_byte(pool: PoolGeometry, room_key: int, rid: int, token: int, head: int, b: int) -> int:
    """The pattern's definition, one byte at a time: the top byte of (position + salt) * MUL."""
    hb = pool.head_bytes
    position = ((token * pool.model.num_kv_heads + head) * hb + b) * pattern._MUL_INT
    return ((position + pattern._salt(room_key, rid) * pattern._MUL_INT) & pattern._MASK) >> 56


@pytest.mark.parametrize(("heads", "tp", "rank", "page_size", "layout", "start", "end"), [
    (8, 2, 1, 16, "sglang_nhd", 0, 40),
    (8, 2, 0, 16, "sglang_nhd", 21, 53),
    (4, 1, 0, 4, "vllm_hnd", 5, 19),
    (2, 2, 1, 8, "vllm_nhd", 7, 8),
])  # fmt: skip
@pytest.mark.parametrize("scattered", [True, False])
def test_fill_writes_the_reference_bytes_where_the_geometry_says(
    heads, tp, rank, page_size, layout, start, end, scattered
) -> None:
    """fill's vectorised rows and values against the per-byte definition and the pool's own
    addressing; and mismatches finds none in what fill wrote, one per byte changed."""
    pool = PoolGeometry(
        ModelGeometry("t", 2, heads, 8, "bf16", False), tp, rank, page_size, 32, Layout(layout)
    )
    mem = {r.region_id: np.zeros(r.nbytes, np.uint8) for r in pool.regions}
    n_pages = -(-end // page_size)
    # Scattered ids, and consecutive ones (a dense layout's rows then join across pages).
    pages = (
        np.random.default_rng(page_size).permutation(32)[:n_pages] if scattered else np.arange(3, 3 + n_pages)
    )
    pattern.fill(pool, mem.__getitem__, 91, pages, start, end)
    expect = {rid: np.zeros_like(buf) for rid, buf in mem.items()}
    for rid, buf in expect.items():
        for t in range(start, end):
            page, tip = int(pages[t // page_size]), t % page_size
            for h in range(pool.heads_per_rank):
                at = page * pool.page_stride + tip * pool.token_stride + h * pool.head_stride
                for b in range(pool.head_bytes):
                    buf[at + b] = _reference_byte(pool, 91, rid, t, pool.head_start + h, b)
    for rid, buf in mem.items():
        assert np.array_equal(buf, expect[rid]), rid
    if start == 0:
        assert pattern.mismatches(pool, mem.__getitem__, 91, pages, end) == (0, "")
        page1 = int(pages[1 // page_size])  # token 1, its first head's first byte
        mem[pool.regions[-1].region_id][page1 * pool.page_stride + (1 % page_size) * pool.token_stride] ^= (
            0xFF
        )
        assert pattern.mismatches(pool, mem.__getitem__, 91, pages, end)[0] == 1


def test_values_cache_gives_the_bytes_of_a_fresh_computation() -> None:
    """A room's values are cached per (heads, room) and shared by its fills and checks: filled
    chunk by chunk after a shorter entry (its first chunk's allocation), or at once, or on a pool
    of other page size holding the same heads, the bytes are the ones of the definition; the
    cache stays within its bound."""
    model = ModelGeometry("t", 2, 8, 8, "bf16", False)
    pool = PoolGeometry(model, 2, 1, 16, 32)
    twin = PoolGeometry(model, 2, 1, 8, 64)  # the same heads: the same values key
    pages, twin_pages = np.arange(3, 11), np.arange(40, 56)
    chunked = {r.region_id: np.zeros(r.nbytes, np.uint8) for r in pool.regions}
    whole = {r.region_id: np.zeros(r.nbytes, np.uint8) for r in pool.regions}
    on_twin = {r.region_id: np.zeros(r.nbytes, np.uint8) for r in twin.regions}
    pattern.fill(pool, chunked.__getitem__, 12, pages[:1], 0, 16)  # caches 16 tokens only
    pattern.fill(pool, chunked.__getitem__, 12, pages, 16, 100)  # needs more: computed again
    pattern.fill(twin, on_twin.__getitem__, 12, twin_pages, 0, 100)
    assert pattern.mismatches(twin, on_twin.__getitem__, 12, twin_pages, 100) == (0, "")  # drops it
    pattern.fill(pool, whole.__getitem__, 12, pages, 0, 100)  # a fresh computation
    for rid, buf in whole.items():
        assert np.array_equal(chunked[rid], buf), rid
    assert pattern.mismatches(pool, chunked.__getitem__, 12, pages, 100) == (0, "")
    rid, t, h, b = pool.regions[1].region_id, 57, 2, 5
    at = int(pages[t // 16]) * pool.page_stride + (t % 16) * pool.token_stride + h * pool.head_stride + b
    assert int(whole[rid][at]) == _reference_byte(pool, 12, rid, t, pool.head_start + h, b)
    for key in range(1000, 1700):  # rooms never checked (22 MiB of values): oldest evicted
        pattern.fill(pool, whole.__getitem__, key, pages, 0, 128)
    assert pattern._values_bytes == sum(v.nbytes for v in pattern._VALUES.values())
    assert (
        pattern._values_bytes <= pattern._VALUES_MAX_BYTES
        and (pattern._layout(pool).values_key, 1699) in pattern._VALUES
    )
    assert (pattern._layout(pool).values_key, 1000) not in pattern._VALUES
