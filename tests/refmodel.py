"""Independent reference model of KV pools, for checking plans by moving real (fake) bytes.

Nothing here imports the planner or uses PoolGeometry's stride arithmetic: memory is addressed
through numpy views shaped the way each layout names its axes, and head ownership is recomputed
from its definition. Only plain attributes of the geometry objects are read (sizes, TP, layout).

How to import (tests run with ``--import-mode=importlib``, so ``tests/`` is not on sys.path)::

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import refmodel  # noqa: E402

``rooms()`` is the shared hypothesis strategy (geometry, TP pair, pages, layouts, chunk cuts).

Memory model: one rank's pool is a ``dict`` region_id -> 1-D ``np.uint8`` array of the region's
size. A room's token ``t`` of global head ``g`` in region ``r`` holds ``pattern(r, t, g)`` (bytes
of one head), whatever rank holds it, since TP replicas hold identical KV. Bytes outside the room
hold rank-specific garbage, so a plan that reads outside the room or from the wrong rank shows up.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from hypothesis import strategies as st

# Only to *construct* drawn geometries; the checks below never use its arithmetic.
from kvferry.core.geometry import DType, Layout, ModelGeometry, make_pools

Memory = dict[int, np.ndarray]

# Region order is layer-major with K before V (MLA: one latent per layer); re-derived here.
_LAYOUT_HEAD_MAJOR = "vllm_hnd"


def ref_heads(num_heads: int, tp: int, rank: int) -> range:
    """Global heads ``rank`` holds: ``[r*H/P, (r+1)*H/P)``; replicated: head ``floor(r*H/P)``."""
    if tp <= num_heads:
        return range(rank * num_heads // tp, (rank + 1) * num_heads // tp)
    head = rank * num_heads // tp
    return range(head, head + 1)


def num_regions(model: Any) -> int:
    return model.num_layers * (1 if model.is_mla or getattr(model, "fused_kv", False) else 2)


def head_bytes(model: Any) -> int:
    return model.head_dim * model.dtype.itemsize


def pattern(region: int, tokens: np.ndarray, head: int, nbytes: int) -> np.ndarray:
    """uint8 ``[len(tokens), nbytes]``: the room's bytes of ``head`` at ``tokens`` in ``region``."""
    t = np.asarray(tokens, dtype=np.uint64)[:, None]
    b = np.arange(nbytes, dtype=np.uint64)[None, :]
    x = (np.uint64(region) * np.uint64(1_000_003) + t) * np.uint64(65_537)
    x = (x + np.uint64(head)) * np.uint64(257) + b + np.uint64(0x9E3779B97F4A7C15)
    # splitmix64 finaliser: neighbouring (token, head, byte) give unrelated bytes.
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x & np.uint64(0xFF)).astype(np.uint8)


def logical(pool: Any, buf: np.ndarray) -> np.ndarray:
    """View a region as ``[page, token_in_page, local_head, byte]`` whatever its layout."""
    hpr = len(ref_heads(pool.model.num_kv_heads, pool.tp_size, pool.tp_rank))
    hb = head_bytes(pool.model)
    if str(pool.layout) == _LAYOUT_HEAD_MAJOR:
        return buf.reshape(pool.num_pages, hpr, pool.page_size, hb).transpose(0, 2, 1, 3)
    return buf.reshape(pool.num_pages, pool.page_size, hpr, hb)


def region_size(pool: Any) -> int:
    hpr = len(ref_heads(pool.model.num_kv_heads, pool.tp_size, pool.tp_rank))
    return pool.num_pages * pool.page_size * hpr * head_bytes(pool.model)


def blank(pool: Any, fill: int) -> Memory:
    return {r: np.full(region_size(pool), fill, dtype=np.uint8) for r in range(num_regions(pool.model))}


def garbage(pool: Any, salt: int) -> Memory:
    rng = np.random.default_rng([salt, pool.tp_rank, pool.tp_size])
    return {
        r: rng.integers(0, 256, region_size(pool), dtype=np.uint8) for r in range(num_regions(pool.model))
    }


def write_room(pool: Any, mem: Memory, pages: np.ndarray, token_start: int, token_end: int) -> None:
    """Store the room's pattern for tokens ``[token_start, token_end)`` of every head ``pool`` holds."""
    heads = ref_heads(pool.model.num_kv_heads, pool.tp_size, pool.tp_rank)
    hb = head_bytes(pool.model)
    tokens = np.arange(token_start, token_end)
    pg = np.asarray(pages)[tokens // pool.page_size]
    tip = tokens % pool.page_size
    for r, buf in mem.items():
        view = logical(pool, buf)
        for j, g in enumerate(heads):
            view[pg, tip, j, :] = pattern(r, tokens, g, hb)


def source_memory(pool: Any, pages: np.ndarray, n_tokens: int, salt: int = 0) -> Memory:
    """A prefill rank's pool: garbage everywhere, the room's pattern on its first ``n_tokens``."""
    mem = garbage(pool, salt)
    write_room(pool, mem, pages, 0, n_tokens)
    return mem


def expand(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every byte index covered by the (offset, length) pairs, in order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(offsets, dtype=np.int64) - starts, lengths) + np.arange(total)


def apply(
    src_region: np.ndarray,
    src_offset: np.ndarray,
    dst_region: np.ndarray,
    dst_offset: np.ndarray,
    length: np.ndarray,
    src_mem: Memory,
    dst_mem: Memory,
) -> None:
    """Copy bytes like an RDMA WRITE of these descriptors; asserts every access is in bounds."""
    assert len(src_region) == len(src_offset) == len(dst_region) == len(dst_offset) == len(length)
    assert (np.asarray(length) > 0).all(), "zero or negative length descriptor"
    for r in np.unique(np.concatenate([src_region, dst_region])):
        assert int(r) in src_mem and int(r) in dst_mem, f"region {r} does not exist"
    for r in np.unique(src_region):
        sel = src_region == r
        so, ln = src_offset[sel], length[sel]
        assert (so >= 0).all() and (so + ln <= src_mem[int(r)].size).all(), "source read out of region"
    for r in np.unique(dst_region):
        sel = dst_region == r
        do, ln = dst_offset[sel], length[sel]
        assert (do >= 0).all() and (do + ln <= dst_mem[int(r)].size).all(), "write out of region"
    # Gather every descriptor's bytes first, then write, like independent DMA engines would.
    for rs in np.unique(src_region):
        for rd in np.unique(dst_region[src_region == rs]):
            sel = (src_region == rs) & (dst_region == rd)
            s_idx = expand(src_offset[sel], length[sel])
            d_idx = expand(dst_offset[sel], length[sel])
            dst_mem[int(rd)][d_idx] = src_mem[int(rs)][s_idx]


def apply_plan(plan: Any, src_mem: Memory, dst_mem: Memory) -> None:
    apply(plan.src_region, plan.src_offset, plan.dst_region, plan.dst_offset, plan.length, src_mem, dst_mem)


def write_counts(plans: Iterable[Any], dst_sizes: dict[int, int]) -> dict[int, np.ndarray]:
    """How many descriptors write each destination byte, per region (to find overlaps)."""
    counts = {r: np.zeros(n + 1, dtype=np.int64) for r, n in dst_sizes.items()}
    for p in plans:
        for r in np.unique(p.dst_region):
            sel = p.dst_region == r
            np.add.at(counts[int(r)], p.dst_offset[sel], 1)
            np.add.at(counts[int(r)], p.dst_offset[sel] + p.length[sel], -1)
    return {r: np.cumsum(c)[:-1] for r, c in counts.items()}


def min_runs(plan: Any) -> int:
    """Fewest descriptors that copy the same bytes: the number of maximal runs of the byte map.

    Byte ``b -> d`` continues a run when ``b-1 -> d-1`` is also copied within the same regions.
    """
    if len(plan.length) == 0:
        return 0
    reg = np.repeat(plan.src_region * 1_000_003 + plan.dst_region, plan.length)
    s = expand(plan.src_offset, plan.length)
    d = expand(plan.dst_offset, plan.length)
    order = np.lexsort((s, reg))
    reg, s, d = reg[order], s[order], d[order]
    cont = (reg[1:] == reg[:-1]) & (s[1:] == s[:-1] + 1) & (d[1:] == d[:-1] + 1)
    return int(len(s) - cont.sum())


# --- hypothesis strategy shared by planner and staging tests ---------------------------------------


def _tp_choices(heads: int) -> list[int]:
    return [t for t in range(1, 17) if (t <= heads and heads % t == 0) or (t > heads and t % heads == 0)]


@st.composite
def rooms(draw: st.DrawFn, whole_slots: bool = False, max_heads: int = 64) -> dict[str, Any]:
    """A room: model, TP pair, page sizes, pool sizes, layouts, token count, chunk cuts, seed.
    ``whole_slots``: one TP size and token-major layouts on both sides (the pairs whose tokens
    move as whole slots, planned per page segment). ``max_heads``: the most KV heads drawn (a
    test whose cost grows with the heads, as the Triton interpreter's does, draws fewer)."""
    mla = draw(st.booleans())
    # Any head count 1-64, with extra weight on the power-of-two counts real models use (and
    # which admit the most TP pairs, so P > D and P < D get drawn often).
    pow2 = [h for h in (2, 4, 8, 16, 32, 64) if h <= max_heads]
    heads = 1 if mla else draw(st.one_of(st.integers(1, max_heads), st.sampled_from(pow2)))
    dtype = draw(st.sampled_from(list(DType)))
    # Keep a token's bytes per region small so 16 ranks x 256-token pages stay cheap.
    max_hd = max(1, 128 // (heads * dtype.itemsize))
    head_dim = draw(st.integers(1, min(max_hd, 8)))
    model = ModelGeometry("m", draw(st.integers(1, 2)), heads, head_dim, dtype, is_mla=mla)
    tps = _tp_choices(heads)
    page_sizes = st.one_of(st.integers(1, 8), st.sampled_from([16, 64, 256]), st.integers(1, 256))
    tokens = draw(st.integers(1, 200))
    ps_p, ps_d = draw(page_sizes), draw(page_sizes)
    need_p, need_d = -(-tokens // ps_p), -(-tokens // ps_d)
    # Decode sometimes allocates more pages than the room needs (a real allocator rounds up).
    alloc_d = need_d + draw(st.integers(0, 2))
    n_cuts = draw(st.integers(0, 3))
    cuts = sorted({draw(st.integers(0, tokens)) for _ in range(n_cuts)} | {0, tokens})
    ptp = draw(st.sampled_from(tps))
    layouts = [x for x in Layout if not (whole_slots and x.head_major_in_page)]
    return {
        "model": model,
        "ptp": ptp,
        "dtp": ptp if whole_slots else draw(st.sampled_from(tps)),
        "ps_p": ps_p,
        "ps_d": ps_d,
        "pool_p": need_p + draw(st.integers(0, 3)),
        "pool_d": alloc_d + draw(st.integers(0, 3)),
        "need_p": need_p,
        "alloc_d": alloc_d,
        "layout_p": draw(st.sampled_from(layouts)),
        "layout_d": draw(st.sampled_from(layouts)),
        "tokens": tokens,
        "cuts": cuts,
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def fragmented_pages(rng: np.random.Generator, num_pages: int, needed: int) -> np.ndarray:
    return rng.permutation(num_pages)[:needed].astype(np.int64)


Setup = tuple[list[Any], list[Any], np.ndarray, np.ndarray, np.random.Generator]


def room_setup(room: dict[str, Any], pick: Any = fragmented_pages) -> Setup:
    """A drawn room's prefill and decode pools, its page ids on each side (``pick``: how they are
    chosen, fragmented by default) and the room's generator, for whatever the test draws next."""
    model = room["model"]
    rng = np.random.default_rng(room["seed"])
    src_pools = make_pools(model, room["ptp"], room["ps_p"], room["pool_p"], room["layout_p"])
    dst_pools = make_pools(model, room["dtp"], room["ps_d"], room["pool_d"], room["layout_d"])
    sp = pick(rng, room["pool_p"], room["need_p"])
    dp = pick(rng, room["pool_d"], room["alloc_d"])
    return src_pools, dst_pools, sp, dp, rng
