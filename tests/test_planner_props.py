"""Property tests: applying a room's plans by byte copy gives exactly the naive logical re-layout.

Hypothesis draws geometries (MHA/GQA heads 1-64 or MLA, TP sizes up to 16 with replication,
page sizes 1-256 on each side independently, any layout pair, fragmented page ids, chunk splits)
and checks, against tests/refmodel.py (independent of the planner's arithmetic):

- every destination byte of the room ends with the right value, and every other byte of every
  decode rank's pool is untouched;
- no two descriptors of a room write the same destination byte;
- the merged count equals the minimum number of maximal contiguous runs of the byte map;
- chunks planned with their running token offset add up to the whole room, each touching only
  its own tokens; the direct (unmerged) plan moves the same bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.core import planner
from kvferry.core.planner import plan_rank_pair, plan_room

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refmodel


@settings(max_examples=150)
@given(refmodel.rooms())
def test_room_plan_equals_logical_relayout(room: dict) -> None:
    model = room["model"]
    src_pools, dst_pools, sp, dp, _ = refmodel.room_setup(room)
    tokens, cuts = room["tokens"], room["cuts"]

    src_mem = [refmodel.source_memory(p, sp, tokens, salt=1) for p in src_pools]
    dst_mem = [refmodel.blank(p, 0xA5) for p in dst_pools]
    direct_mem = [refmodel.blank(p, 0xA5) for p in dst_pools]
    expected = [refmodel.blank(p, 0xA5) for p in dst_pools]
    hb = refmodel.head_bytes(model)
    n_regions = refmodel.num_regions(model)

    for lo, hi in itertools.pairwise(cuts):
        plan = plan_room(src_pools, dst_pools, sp, dp, lo, hi)
        direct = plan_room(src_pools, dst_pools, sp, dp, lo, hi, coalesce=False)
        for pp, dpl in zip(plan.pairs, direct.pairs, strict=True):
            refmodel.apply_plan(pp, src_mem[pp.src_rank], dst_mem[pp.dst_rank])
            refmodel.apply_plan(dpl, src_mem[dpl.src_rank], direct_mem[dpl.dst_rank])
            assert pp.count == refmodel.min_runs(pp), "merged count is not minimal"
            assert dpl.count == dpl.descriptors_unmerged == pp.descriptors_unmerged
            assert pp.total_bytes == int(pp.length.sum()) == dpl.total_bytes
        for d, pool in enumerate(dst_pools):
            # After chunk [lo, hi) the decode pool holds exactly the room's tokens [0, hi).
            refmodel.write_room(pool, expected[d], dp, lo, hi)
            counts = refmodel.write_counts(
                [p for p in plan.pairs if p.dst_rank == d], {r: b.size for r, b in expected[d].items()}
            )
            for r in range(n_regions):
                np.testing.assert_array_equal(dst_mem[d][r], expected[d][r])
                np.testing.assert_array_equal(direct_mem[d][r], expected[d][r])
                assert counts[r].max(initial=0) <= 1, "two descriptors write the same byte"
        # Pairs the room does not use move nothing, so applying "every pair" cannot double-write.
        used = {(p.src_rank, p.dst_rank) for p in plan.pairs}
        for sp_pool in src_pools:
            for dp_pool in dst_pools:
                if (sp_pool.tp_rank, dp_pool.tp_rank) not in used:
                    assert plan_rank_pair(sp_pool, dp_pool, sp, dp, lo, hi).count == 0
        d_heads = [len(refmodel.ref_heads(model.num_kv_heads, room["dtp"], d)) for d in range(room["dtp"])]
        assert plan.total_bytes == (hi - lo) * n_regions * hb * sum(d_heads)


def _runs_of_pages(rng: np.random.Generator, num_pages: int, needed: int) -> np.ndarray:
    """Page ids in a few contiguous runs (how a real allocator hands them out), not a permutation."""
    n_cuts = min(needed - 1, int(rng.integers(0, 4)))
    cuts = np.sort(rng.choice(np.arange(1, needed), size=n_cuts, replace=False))
    runs = np.split(np.arange(needed, dtype=np.int64), cuts)
    order = rng.permutation(len(runs))
    return np.concatenate([runs[i] for i in order]) + int(rng.integers(0, num_pages - needed + 1))


@settings(max_examples=200)
@given(refmodel.rooms(whole_slots=True), st.booleans())
def test_segment_pieces_equal_token_pieces(room: dict, in_runs: bool) -> None:
    """The per-segment numpy path of whole-slot pairs gives the per-token path's arrays exactly,
    equal page sizes or not."""
    pick = _runs_of_pages if in_runs else refmodel.fragmented_pages
    src_pools, dst_pools, sp, dp, _ = refmodel.room_setup(room, pick)
    for lo, hi in itertools.pairwise(room["cuts"]):
        for s in src_pools:
            for d in dst_pools:
                link = planner.find_link(s, d)
                if link is None or link.num_heads == 0:
                    continue
                assert planner._slots_are_pieces(s, d, link.num_heads)
                args = (s, d, sp, dp, link.head_start, link.num_heads, lo, hi, True)
                fast = planner.region_pattern(*args)
                with _token_path():
                    slow = planner.region_pattern(*args)
                for a, b in zip(fast[:3], slow[:3], strict=True):
                    np.testing.assert_array_equal(a, b)
                assert fast[3] == slow[3] == hi - lo


@contextlib.contextmanager
def _token_path() -> Iterator[None]:
    saved = planner._slots_are_pieces
    planner._slots_are_pieces = lambda *a: False
    try:
        yield
    finally:
        planner._slots_are_pieces = saved


@settings(max_examples=300)
@given(refmodel.rooms())
def test_page_segment_runs_equal_the_per_token_pattern(room: dict) -> None:
    """plan_rank_pair's per-page-segment path (``_dense_runs``) gives the arrays of the per-token
    numpy pattern (``region_pattern``) tiled over the regions, wherever it applies."""
    model = room["model"]
    src_pools, dst_pools, sp, dp, rng = refmodel.room_setup(room)
    if rng.random() < 0.5:  # consecutive page ids: segments that merge across pages
        shift = min(1, room["pool_d"] - dp.size)
        sp, dp = np.arange(sp.size, dtype=np.int64), np.arange(dp.size, dtype=np.int64) + shift
    for lo, hi in itertools.pairwise(room["cuts"]):
        for src in src_pools:
            for dst in dst_pools:
                plan = plan_rank_pair(src, dst, sp, dp, lo, hi)
                if plan.count == 0:
                    continue
                s_off, d_off, length, unmerged = planner.region_pattern(
                    src, dst, sp, dp, plan.head_start, plan.num_heads, lo, hi, True
                )
                n = refmodel.num_regions(model)
                np.testing.assert_array_equal(plan.src_offset, np.tile(s_off, n))
                np.testing.assert_array_equal(plan.dst_offset, np.tile(d_off, n))
                np.testing.assert_array_equal(plan.length, np.tile(length, n))
                np.testing.assert_array_equal(plan.src_region, np.repeat(np.arange(n), s_off.size))
                assert plan.descriptors_unmerged == unmerged * n
                assert plan.total_bytes == int(length.sum()) * n
                assert plan.src_offset.dtype == plan.length.dtype == np.int64
