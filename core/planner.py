"""The transfer planner: which bytes of a prefill rank's pool go where in a decode rank's pool.

Pure and vectorised. The token is the unit that maps: token ``t`` of a room lives in slot
``t % page_size`` of page ``pages[t // page_size]`` on each side, whatever the two page sizes are.
A rank pair exchanges the global heads its ``Link`` names (see ``geometry.links``), for every
region (layer x K|V, or layer for MLA).

Descriptors are ``(src_region, src_offset, dst_region, dst_offset, length)`` in bytes, always
prefill memory -> decode memory, whoever posts them (push WRITE or pull READ).

Why one region is planned once: every region of a pool has the same layout, and region ``r`` of
the source maps to region ``r`` of the destination, so the (src_offset, dst_offset, length)
pattern of one region is the pattern of all of them. The per-token work is done once and tiled
over the ``num_regions`` regions; the cost is ``O(T log T)`` in tokens, independent of layers.

Coalescing: pieces (one token's head range, or one (token, head) where a side is head-major in a
page) are sorted by source offset and adjacent pieces merge when both sides continue contiguously.
Within a region each source byte is sent at most once, so a piece's contiguous successor, if any,
is the next piece in source order: the merged count is the number of maximal contiguous runs,
the minimum any descriptor list can have (descriptors never span regions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

import numpy as np
from kvferry.core.errors import PlanError
from kvferry.core.geometry import Link, ModelGeometry, PoolGeometry, links

__all__ = [
    "Direction",
    "RankPlan",
    "RoomPlan",
    "as_page_ids",
    "check_room",
    "consecutive",
    "find_link",
    "frozen",
    "plan_rank_pair",
    "plan_room",
]


class Direction(StrEnum):
    """Who posts the descriptors: prefill WRITEs into decode (push) or decode READs (pull)."""

    WRITE = "write"
    READ = "read"


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


@dataclass(frozen=True, slots=True, eq=False)
class RankPlan:
    """Descriptors one (prefill rank, decode rank) pair moves for tokens ``[token_start, token_end)``.

    The five arrays are read-only int64 arrays of equal length ``count``. Regions ascend; within a
    region a merged plan's source offsets ascend and a direct (``coalesce=False``) plan is in token
    order (then head order on a head-major side). ``descriptors_unmerged`` is the count before
    coalescing. ``src_region == dst_region`` always (region ids name the same (layer, kind)).
    """

    src_rank: int
    dst_rank: int
    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray
    descriptors_unmerged: int
    count: int
    total_bytes: int
    head_start: int
    num_heads: int
    token_start: int
    token_end: int
    direction: Direction = Direction.WRITE

    @property
    def is_dummy(self) -> bool:
        return self.num_heads == 0


@dataclass(frozen=True, slots=True, eq=False)
class RoomPlan:
    """Every rank pair of a room (or of one chunk of it).

    ``links``: all pairings, dummies included (a decode rank waits for each of them to finish).
    ``pairs``: the plans of the real senders, in ``links`` order.
    """

    links: tuple[Link, ...]
    pairs: tuple[RankPlan, ...]
    token_start: int
    token_end: int

    @property
    def count(self) -> int:
        return sum(p.count for p in self.pairs)

    @property
    def descriptors_unmerged(self) -> int:
        return sum(p.descriptors_unmerged for p in self.pairs)

    @property
    def total_bytes(self) -> int:
        return sum(p.total_bytes for p in self.pairs)


# --- validation -----------------------------------------------------------------------------------


def as_page_ids(pages: object, pool: PoolGeometry, side: str) -> np.ndarray:
    """Page ids as a 1-D int64 array, checked: integers, in range, no page listed twice."""
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise PlanError(f"{side} page ids must be a 1-D array, got shape {arr.shape}")
    # The kinds np.issubdtype(dtype, np.integer) accepts (timedelta64 is a signed integer), minus its cost.
    if arr.size and arr.dtype.kind not in "ium":
        raise PlanError(f"{side} page ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        # The few pages of a typical room: Python's min, max and set beat numpy's per-call cost.
        ids = arr.tolist() if arr.size <= 64 else None
        lo, hi = (min(ids), max(ids)) if ids is not None else (int(arr.min()), int(arr.max()))
        if lo < 0 or hi >= pool.num_pages:
            bad = lo if lo < 0 else hi
            raise PlanError(f"{side} page id {bad} out of range [0, {pool.num_pages})")
        # A page table over the pool is O(n + pages); sorting is cheaper for a tiny room in a big pool.
        if ids is not None:
            repeated = len(set(ids)) != len(ids)
        elif arr.size * 16 >= pool.num_pages:
            repeated = bool(np.bincount(arr, minlength=pool.num_pages).max() > 1)
        else:
            repeated = np.unique(arr).size != arr.size
        if repeated:
            # Two tokens sharing a page slot would overwrite each other: never plan that.
            raise PlanError(f"{side} page ids repeat a page")
    return arr


def check_room(
    src: PoolGeometry,
    dst: PoolGeometry,
    src_pages: object,
    dst_pages: object,
    token_start: int,
    token_end: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Validate one rank pair's inputs; return the page id arrays. Raises PlanError."""
    why = src.model.same_kv_shape(dst.model)
    if why is not None:
        raise PlanError(f"prefill and decode KV caches are incompatible: {why}")
    for name, value in (("token_start", token_start), ("token_end", token_end)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool):
            raise PlanError(f"{name} must be an integer, got {value!r}")
    if not 0 <= token_start <= token_end:
        raise PlanError(f"token range [{token_start}, {token_end}) is not a valid range")
    sp = as_page_ids(src_pages, src, "prefill")
    dp = as_page_ids(dst_pages, dst, "decode")
    if sp.size * src.page_size < token_end:
        raise PlanError(
            f"tokens up to {token_end} exceed the prefill allocation of "
            f"{sp.size} pages x {src.page_size} tokens"
        )
    if dp.size * dst.page_size < token_end:
        raise PlanError(
            f"tokens up to {token_end} exceed the decode allocation of "
            f"{dp.size} pages x {dst.page_size} tokens"
        )
    return sp, dp


@lru_cache(maxsize=256)
def _link_map(model: ModelGeometry, prefill_tp: int, decode_tp: int) -> dict[tuple[int, int], Link]:
    return {(x.prefill_rank, x.decode_rank): x for x in links(model, prefill_tp, decode_tp)}


def find_link(src: PoolGeometry, dst: PoolGeometry) -> Link | None:
    """The link between two ranks, or None when they never exchange anything."""
    return _pair_shape(src, dst).link


def _lookup_link(src: PoolGeometry, dst: PoolGeometry) -> Link | None:
    return _link_map(src.model, src.tp_size, dst.tp_size).get((src.tp_rank, dst.tp_rank))


# --- planning ------------------------------------------------------------------------------------


def _slot_parts(pages: np.ndarray, page_size: int, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return pages[tokens // page_size], tokens % page_size


def region_pattern(
    src: PoolGeometry,
    dst: PoolGeometry,
    sp: np.ndarray,
    dp: np.ndarray,
    head_start: int,
    num_heads: int,
    token_start: int,
    token_end: int,
    coalesce: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(src_offset, dst_offset, length, unmerged count) of one region; identical for every region."""
    if coalesce and _slots_are_pieces(src, dst, num_heads):
        return _segment_pattern(src, dst, sp, dp, head_start, token_start, token_end)
    tokens = np.arange(token_start, token_end, dtype=np.int64)
    s_page, s_tip = _slot_parts(sp, src.page_size, tokens)
    d_page, d_tip = _slot_parts(dp, dst.page_size, tokens)
    s_head = head_start - src.head_start
    d_head = head_start - dst.head_start
    hb = src.head_bytes
    s_base = s_page * src.page_stride + s_tip * src.token_stride + s_head * src.head_stride
    d_base = d_page * dst.page_stride + d_tip * dst.token_stride + d_head * dst.head_stride
    if src.layout.head_major_in_page or dst.layout.head_major_in_page:
        # A token's heads are not contiguous on a head-major side: one piece per (token, head).
        j = np.arange(num_heads, dtype=np.int64)
        s_off = (s_base[:, None] + j * src.head_stride).ravel()
        d_off = (d_base[:, None] + j * dst.head_stride).ravel()
        piece = hb
    else:
        s_off, d_off, piece = s_base, d_base, num_heads * hb
    unmerged = int(s_off.size)
    if not coalesce or unmerged == 0:
        return s_off, d_off, np.full(unmerged, piece, dtype=np.int64), unmerged
    order = np.argsort(s_off, kind="stable")
    s_off, d_off = s_off[order], d_off[order]
    # brk[i]: a run starts at piece i; brk[unmerged] closes the last run, so that one
    # flatnonzero gives every run's start and end (no append, no diff: per-call costs).
    brk = np.empty(unmerged + 1, dtype=bool)
    brk[0] = brk[unmerged] = True
    np.not_equal(s_off[1:], s_off[:-1] + piece, out=brk[1:unmerged])
    brk[1:unmerged] |= d_off[1:] != d_off[:-1] + piece
    edges = np.flatnonzero(brk)
    starts = edges[:-1]
    lengths = (edges[1:] - starts) * piece
    return s_off[starts], d_off[starts], lengths, unmerged


def _slots_are_pieces(src: PoolGeometry, dst: PoolGeometry, num_heads: int) -> bool:
    """A token's piece is its whole slot on both sides (token-major pages, the link carrying every
    head the slots hold): the tokens of one page segment (one page on each side) are then one
    contiguous piece on both sides, and a plan can be computed per segment instead of per token."""
    if src.layout.head_major_in_page or dst.layout.head_major_in_page:
        return False
    piece = num_heads * src.head_bytes
    return piece == src.token_stride and piece == dst.token_stride


def _segment_pattern(
    src: PoolGeometry,
    dst: PoolGeometry,
    sp: np.ndarray,
    dp: np.ndarray,
    head_start: int,
    token_start: int,
    token_end: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``region_pattern`` computed per page segment, for ``_slots_are_pieces`` pairs.

    A segment's per-token pieces are adjacent on both sides, so they always merge: one piece per
    segment (a segment starts at the range's start and at every page boundary of either side)
    gives the same runs from arrays a page size or so shorter, which is most of a 4096-token
    plan's cost. Same outputs as the per-token path (property-tested).
    """
    unmerged = token_end - token_start
    if unmerged == 0:
        return _EMPTY, _EMPTY, _EMPTY, 0
    sps, dps = src.page_size, dst.page_size
    t0 = np.arange(-(-token_start // sps) * sps, token_end, sps, dtype=np.int64)
    if dps != sps:  # both sides' page boundaries (a sort: only when they differ)
        t0 = np.union1d(t0, np.arange(-(-token_start // dps) * dps, token_end, dps, dtype=np.int64))
    if not t0.size or t0[0] != token_start:
        t0 = np.concatenate(([token_start], t0))
    t1 = np.empty_like(t0)
    t1[:-1] = t0[1:]
    t1[-1] = token_end
    piece = src.token_stride  # == dst.token_stride for these pairs
    s_head = (head_start - src.head_start) * src.head_stride
    d_head = (head_start - dst.head_start) * dst.head_stride
    s_off = sp[t0 // sps] * src.page_stride + (t0 % sps) * piece + s_head
    d_off = dp[t0 // dps] * dst.page_stride + (t0 % dps) * piece + d_head
    length = (t1 - t0) * piece
    order = np.argsort(s_off, kind="stable")
    s_off, d_off, length = s_off[order], d_off[order], length[order]
    n = s_off.size
    brk = np.empty(n + 1, dtype=bool)
    brk[0] = brk[n] = True
    np.not_equal(s_off[1:], s_off[:-1] + length[:-1], out=brk[1:n])
    brk[1:n] |= d_off[1:] != d_off[:-1] + length[:-1]
    edges = np.flatnonzero(brk)
    starts = edges[:-1]
    last = edges[1:] - 1
    return s_off[starts], d_off[starts], s_off[last] + length[last] - s_off[starts], unmerged


# Above this many page segments a chunk is planned by numpy (``region_pattern``), below it in
# Python (``_dense_runs``): a typical chunk touches a few pages, where numpy's per-call cost
# exceeds the work.
_DENSE_RUNS_MAX_SEGMENTS = 64


class _PairShape:
    """What planning for one (prefill pool, decode pool) pair needs that depends on the pair alone:
    derived once per pair instead of through the geometry's properties on every chunk (the
    staged flows ask ``find_link`` per lane too)."""

    __slots__ = (
        "d_c", "d_ps", "dense", "dps", "head_start", "link", "max_dense_tokens", "n_regions",
        "num_heads", "piece", "pools", "s_c", "s_ps", "sps",
    )  # fmt: skip

    def __init__(self, src: PoolGeometry, dst: PoolGeometry) -> None:
        self.pools = (src, dst)  # held: the cache's id keys stay theirs while the entry lives
        self.link = link = _lookup_link(src, dst)  # raises for a pair of no topology: not cached
        self.head_start, self.num_heads = (link.head_start, link.num_heads) if link else (0, 0)
        self.n_regions = src.model.num_regions
        self.dense = _slots_are_pieces(src, dst, self.num_heads)
        self.piece = self.num_heads * src.head_bytes
        self.sps, self.dps = src.page_size, dst.page_size
        self.max_dense_tokens = _DENSE_RUNS_MAX_SEGMENTS * min(self.sps, self.dps)
        self.s_ps, self.d_ps = src.page_stride, dst.page_stride
        self.s_c = (self.head_start - src.head_start) * src.head_stride
        self.d_c = (self.head_start - dst.head_start) * dst.head_stride


# (id(src), id(dst)) -> shape: identity keys, because a pool's dataclass hash is Python code over
# the model's every field; an entry holds its pools, so their ids are not reused while it lives.
_PAIR_SHAPES: dict[tuple[int, int], _PairShape] = {}
_PAIR_SHAPES_MAX = 256


def _pair_shape(src: PoolGeometry, dst: PoolGeometry) -> _PairShape:
    shape = _PAIR_SHAPES.get((id(src), id(dst)))
    if shape is None:
        if len(_PAIR_SHAPES) >= _PAIR_SHAPES_MAX:
            _PAIR_SHAPES.clear()  # a process planning over many pool objects: start again
        shape = _PAIR_SHAPES[(id(src), id(dst))] = _PairShape(src, dst)
    return shape


def consecutive(ids: list[int]) -> bool:
    """Page ids that follow one another (the usual allocation): on a dense layout, whose pages
    are each as many rows as a page's tokens fill, their rows then form one contiguous run, the
    shortcut the planner and the byte patterns (backends/pattern.py) take."""
    return bool(ids) and ids[-1] - ids[0] == len(ids) - 1 and ids == list(range(ids[0], ids[-1] + 1))


def _dense_runs(
    shape: _PairShape, sp: np.ndarray, dp: np.ndarray, token_start: int, token_end: int
) -> tuple[list[int], list[int], list[int]] | None:
    """``region_pattern``'s merged runs as lists, computed per page segment instead of per
    token, where a token's piece is the whole token slot on both sides (token-major, the link
    covering all of each side's heads); None elsewhere (the caller uses ``region_pattern``).

    There, tokens with the same page on both sides (a segment) are contiguous on both; pieces lie
    on a grid of ``piece`` bytes (pages never overlap), so segments never interleave: sorting
    segments by source offset sorts their pieces, and two segments adjacent in that order merge
    exactly when the numpy version would merge their boundary pieces.
    """
    if not shape.dense or token_end - token_start > shape.max_dense_tokens:
        return None
    piece, sps, dps = shape.piece, shape.sps, shape.dps
    s_ps, d_ps, s_c, d_c = shape.s_ps, shape.d_ps, shape.s_c, shape.d_c
    s_first, d_first = token_start // sps, token_start // dps
    s_pages = sp[s_first : (token_end - 1) // sps + 1].tolist()
    d_pages = dp[d_first : (token_end - 1) // dps + 1].tolist()
    if s_ps == sps * piece and d_ps == dps * piece and consecutive(s_pages) and consecutive(d_pages):
        # Consecutive page ids on both sides (the usual allocation): every token's piece follows
        # the previous one's on both, so the segments below would merge into this one run.
        so, do = token_start - s_first * sps, token_start - d_first * dps
        return (
            [s_pages[0] * s_ps + so * piece + s_c],
            [d_pages[0] * d_ps + do * piece + d_c],
            [(token_end - token_start) * piece],
        )
    segs: list[tuple[int, int, int]] = []
    t = token_start
    while t < token_end:
        si, so = divmod(t, sps)
        di, do = divmod(t, dps)
        n = min(token_end, t + sps - so, t + dps - do) - t
        segs.append(
            (
                s_pages[si - s_first] * s_ps + so * piece + s_c,
                d_pages[di - d_first] * d_ps + do * piece + d_c,
                n * piece,
            )
        )
        t += n
    segs.sort()  # source offsets are distinct: the same order as numpy's stable argsort
    if not segs:
        return [], [], []
    s_out, d_out, n_out = [segs[0][0]], [segs[0][1]], [segs[0][2]]
    for s, d, n in segs[1:]:
        if s_out[-1] + n_out[-1] == s and d_out[-1] + n_out[-1] == d:
            n_out[-1] += n
        else:
            s_out.append(s)
            d_out.append(d)
            n_out.append(n)
    return s_out, d_out, n_out


def _tile(a: np.ndarray, n: int) -> np.ndarray:
    """``np.tile`` of a 1-D array, without its Python-level overhead (a new contiguous array)."""
    out = np.empty((n, a.size), dtype=a.dtype)
    out[:] = a
    return out.reshape(-1)


def frozen(a: np.ndarray) -> np.ndarray:
    """``a``, read-only (plans and staging maps are cached and shared)."""
    a.setflags(write=False)  # the method: no flags object made per array (several a plan or chunk)
    return a


# Shared region-id arrays are kept only while small: a long-running rank sees many chunk sizes,
# and a per-token plan's array is megabytes (64 x 16,384 x 8 B bounds the cache at 8 MB).
_SHARED_REGION_IDS_MAX = 16_384


def _region_ids(n_regions: int, per: int) -> np.ndarray:
    """Region ids of a plan with ``per`` descriptors per region: read-only (a plan's arrays are
    frozen), so small ones are shared by every plan of that shape."""
    if n_regions * per <= _SHARED_REGION_IDS_MAX:
        return _shared_region_ids(n_regions, per)
    return _build_region_ids(n_regions, per)


@lru_cache(maxsize=64)
def _shared_region_ids(n_regions: int, per: int) -> np.ndarray:
    return _build_region_ids(n_regions, per)


def _build_region_ids(n_regions: int, per: int) -> np.ndarray:
    return frozen(np.repeat(np.arange(n_regions, dtype=np.int64), per))


def _tiled_columns(
    src: PoolGeometry,
    dst: PoolGeometry,
    shape: _PairShape,
    sp: np.ndarray,
    dp: np.ndarray,
    token_start: int,
    token_end: int,
    coalesce: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int, int]:
    """One region's pattern tiled over every region (src offset, dst offset, length columns),
    with the pattern's own size: its descriptors, those before merging, and its bytes."""
    n_regions = shape.n_regions
    runs = _dense_runs(shape, sp, dp, token_start, token_end) if coalesce else None
    if runs is not None:
        s_list, d_list, n_list = runs
        # Tiled over the regions as lists: one array built per column.
        return (
            frozen(np.array(s_list * n_regions, dtype=np.int64)),
            frozen(np.array(d_list * n_regions, dtype=np.int64)),
            frozen(np.array(n_list * n_regions, dtype=np.int64)),
            len(n_list),
            token_end - token_start,
            sum(n_list),
        )
    s_off, d_off, length, unmerged = region_pattern(
        src, dst, sp, dp, shape.head_start, shape.num_heads, token_start, token_end, coalesce
    )
    return (
        frozen(_tile(s_off, n_regions)),
        frozen(_tile(d_off, n_regions)),
        frozen(_tile(length, n_regions)),
        s_off.size,
        unmerged,
        int(length.sum()),
    )


def plan_rank_pair(
    src: PoolGeometry,
    dst: PoolGeometry,
    src_pages: object,
    dst_pages: object,
    token_start: int,
    token_end: int,
    *,
    coalesce: bool = True,
    direction: Direction = Direction.WRITE,
) -> RankPlan:
    """Descriptors prefill rank ``src.tp_rank`` moves into decode rank ``dst.tp_rank``.

    ``src_pages``/``dst_pages`` are the room's page ids from token 0, in order; a chunk passes its
    running ``token_start`` so chunk N lands after chunk N-1, never on top of it. Pairs that never
    exchange bytes (dummies, unrelated ranks) get an empty plan. ``coalesce=False`` returns the
    direct, one-piece-per-(token, region) plan in token order.
    """
    sp, dp = check_room(src, dst, src_pages, dst_pages, token_start, token_end)
    token_start, token_end = int(token_start), int(token_end)
    shape = _pair_shape(src, dst)
    head_start, num_heads = shape.head_start, shape.num_heads
    if num_heads == 0 or token_end == token_start:
        return RankPlan(
            src.tp_rank, dst.tp_rank, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, 0, 0, 0,
            head_start, num_heads, token_start, token_end, direction,
        )  # fmt: skip
    n_regions = shape.n_regions
    src_offset, dst_offset, length_all, per, unmerged, nbytes = _tiled_columns(
        src, dst, shape, sp, dp, token_start, token_end, coalesce
    )
    region = _region_ids(n_regions, per)
    return RankPlan(
        src_rank=src.tp_rank,
        dst_rank=dst.tp_rank,
        src_region=region,
        src_offset=src_offset,
        dst_region=region,
        dst_offset=dst_offset,
        length=length_all,
        descriptors_unmerged=unmerged * n_regions,
        count=per * n_regions,
        total_bytes=nbytes * n_regions,
        head_start=head_start,
        num_heads=num_heads,
        token_start=token_start,
        token_end=token_end,
        direction=direction,
    )


def check_pools(pools: Sequence[PoolGeometry], side: str) -> None:
    """One server's pools: ranks 0..tp-1 in order, one TP size, one model."""
    if not pools:
        raise PlanError(f"no {side} pools given")
    tp = pools[0].tp_size
    if len(pools) != tp:
        raise PlanError(f"{side}: {len(pools)} pools given for TP size {tp}")
    for i, pool in enumerate(pools):
        if pool.tp_rank != i or pool.tp_size != tp or pool.model != pools[0].model:
            raise PlanError(f"{side} pool {i} is not rank {i} of the same TP-{tp} server and model")


def plan_room(
    src_pools: Sequence[PoolGeometry],
    dst_pools: Sequence[PoolGeometry],
    src_pages: object,
    dst_pages: object,
    token_start: int,
    token_end: int,
    *,
    coalesce: bool = True,
    direction: Direction = Direction.WRITE,
) -> RoomPlan:
    """Plan every rank pair of a room (or chunk). All TP ranks of a server share the page ids."""
    check_pools(src_pools, "prefill")
    check_pools(dst_pools, "decode")
    # Fails fast with the plan-level reason before the topology is asked about a foreign model.
    check_room(src_pools[0], dst_pools[0], src_pages, dst_pages, token_start, token_end)
    all_links = links(src_pools[0].model, len(src_pools), len(dst_pools))
    pairs = tuple(
        plan_rank_pair(
            src_pools[x.prefill_rank],
            dst_pools[x.decode_rank],
            src_pages,
            dst_pages,
            token_start,
            token_end,
            coalesce=coalesce,
            direction=direction,
        )
        for x in all_links
        if not x.is_dummy
    )
    return RoomPlan(all_links, pairs, int(token_start), int(token_end))
