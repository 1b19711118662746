"""Head-major staging layouts for the bounce (SGLang PR 18968) and staging-ring (SGLang PR 22536) strategies.

Instead of one descriptor per (token, layer, K|V), a gather kernel on the prefill side copies the
heads a rank pair exchanges, for every layer and token of a chunk, into a staging buffer laid out
so that those bytes are one contiguous block; one descriptor moves the block; a scatter kernel on
the decode side copies it into the decode rank's pages.

Formats (``T`` = tokens of the chunk, ``R`` = regions = layers x K|V, in region-id order, so
``[R]`` is ``[layers, K|V]``; ``hb`` = head_dim x itemsize bytes):

- ``HEAD_MAJOR`` (SGLang PR 18968, pinned CPU bounce): one buffer per *rank*
  ``[heads_per_rank, layers, K|V, T, head_dim]``. Every head range of the rank is contiguous, so a
  prefill rank gathers once and each decode rank it serves gets one descriptor for its slice, and
  each writer into a decode rank fills its own head slice of the decode rank's buffer.
- ``LAYER_MAJOR`` (SGLang PR 22536, GPU staging ring): one block per *writer* (rank pair)
  ``[2L, T, heads_sent, head_dim]``, placed in the decode rank's ring at an offset the ring
  allocator chooses (``dst_base``); in a room plan, writers of one decode rank are packed in link
  order.

Kernel contract (``StagingMap``): for ``r < len(region_ids)``, ``i < len(token_offsets)``,
``j < num_heads`` and byte ``b < head_bytes``::

    pool byte    = region region_ids[r], offset token_offsets[i] + j * pool_head_stride + b
    staging byte = staging_base + r * stride_region + i * stride_token + j * stride_head + b

A gather copies pool -> staging, a scatter staging -> pool. All values are bytes;
``element_strides()`` gives the staging strides in elements of the pool dtype (the form
``backends/kernels/layout.StagingLayout`` takes; its "planes" are these regions).
``token_offsets`` already include the page lookup and the first local head, so a kernel needs no
page table; ``slots`` (page x page_size + token_in_page) is there for kernels that index by slot,
together with ``local_head_start``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

import numpy as np
from kvferry.core.geometry import Link, PoolGeometry, links
from kvferry.core.planner import RankPlan, check_pools, check_room, find_link, frozen

__all__ = [
    "StagedPairPlan",
    "StagedRoomPlan",
    "StagingFormat",
    "StagingMap",
    "plan_staged_pair",
    "plan_staged_room",
    "staged_map",
    "staged_maps",
]


class StagingFormat(StrEnum):
    HEAD_MAJOR = "head_major"  # SGLang PR 18968: [heads, layers, K|V, tokens, head_dim] per rank
    LAYER_MAJOR = "layer_major"  # SGLang PR 22536: [2L, tokens, heads, head_dim] per writer


@dataclass(frozen=True, slots=True, eq=False)
class StagingMap:
    """One side's copy between its pool and its staging buffer (see the module docstring)."""

    region_ids: np.ndarray
    slots: np.ndarray
    token_offsets: np.ndarray
    pool_head_stride: int
    local_head_start: int
    num_heads: int
    head_bytes: int
    staging_base: int
    stride_region: int
    stride_token: int
    stride_head: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return len(self.region_ids) * len(self.token_offsets) * self.num_heads * self.head_bytes

    def element_strides(self) -> tuple[int, int, int, int]:
        """``(stride_region, stride_token, stride_head, staging_base)`` in elements, not bytes.

        For kernels that index a staging tensor of the pool's dtype (every value is a whole number
        of elements by construction).
        """
        isz = self.itemsize
        return (self.stride_region // isz, self.stride_token // isz, self.stride_head // isz,
                self.staging_base // isz)  # fmt: skip

    def pieces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(pool_region, pool_offset, staging_offset, length)``, one per (region, token, head).

        The byte-copy reading of the map: for CPU fallbacks and tests, not for the hot path.
        """
        r = np.arange(len(self.region_ids), dtype=np.int64)[:, None, None]
        i = np.arange(len(self.token_offsets), dtype=np.int64)[None, :, None]
        j = np.arange(self.num_heads, dtype=np.int64)[None, None, :]
        shape = (len(self.region_ids), len(self.token_offsets), self.num_heads)
        pool_region = np.broadcast_to(self.region_ids[:, None, None], shape).ravel()
        pool_offset = np.broadcast_to(
            self.token_offsets[None, :, None] + j * self.pool_head_stride, shape
        ).ravel()
        staging = self.staging_base + r * self.stride_region + i * self.stride_token + j * self.stride_head
        length = np.full(pool_region.size, self.head_bytes, dtype=np.int64)
        return pool_region, pool_offset, np.broadcast_to(staging, shape).ravel(), length


@dataclass(frozen=True, slots=True, eq=False)
class StagedPairPlan:
    """A rank pair's staged transfer: gather, one descriptor, scatter.

    The descriptor copies ``length`` bytes from ``src_staging_offset`` of the prefill rank's
    staging buffer to ``dst_staging_offset`` of the decode rank's. ``src_buffer_bytes`` and
    ``dst_buffer_bytes`` are the buffer sizes the format needs (HEAD_MAJOR: the whole rank's
    buffer; LAYER_MAJOR: this writer's block). A dummy pair has ``count == 0`` and empty maps.
    """

    src_rank: int
    dst_rank: int
    format: StagingFormat
    head_start: int
    num_heads: int
    token_start: int
    token_end: int
    gather: StagingMap
    scatter: StagingMap
    src_staging_offset: int
    dst_staging_offset: int
    length: int
    src_buffer_bytes: int
    dst_buffer_bytes: int

    @property
    def count(self) -> int:
        return 1 if self.length else 0

    @property
    def total_bytes(self) -> int:
        return self.length

    def as_rank_plan(self, src_region: int, dst_region: int) -> RankPlan:
        """The single descriptor as a ``RankPlan``, for backends that post planner descriptors.

        ``src_region``/``dst_region``: the ids under which each side registered its staging memory
        (distinct from the pool's region ids ``0 .. num_regions-1``).
        """
        n = self.count

        def arr(value: int) -> np.ndarray:
            return frozen(np.full(n, value, dtype=np.int64))

        return RankPlan(
            src_rank=self.src_rank,
            dst_rank=self.dst_rank,
            src_region=arr(src_region),
            src_offset=arr(self.src_staging_offset),
            dst_region=arr(dst_region),
            dst_offset=arr(self.dst_staging_offset),
            length=arr(self.length),
            descriptors_unmerged=n,
            count=n,
            total_bytes=self.length,
            head_start=self.head_start,
            num_heads=self.num_heads,
            token_start=self.token_start,
            token_end=self.token_end,
        )


@dataclass(frozen=True, slots=True, eq=False)
class StagedRoomPlan:
    links: tuple[Link, ...]
    pairs: tuple[StagedPairPlan, ...]
    format: StagingFormat
    token_start: int
    token_end: int

    @property
    def count(self) -> int:
        return sum(p.count for p in self.pairs)

    @property
    def total_bytes(self) -> int:
        return sum(p.length for p in self.pairs)


@lru_cache(maxsize=16)
def _region_ids(n: int) -> np.ndarray:
    """Every region of a map, ``0..n-1``: read-only, so one array serves every map of that size."""
    return frozen(np.arange(n, dtype=np.int64))


# Rows of whole pages a map may build beyond twice its tokens (pages of up to 128 tokens take
# the whole-page path for any range).
_WHOLE_PAGES_SLACK = 256


@lru_cache(maxsize=64)
def _in_page(page_size: int, stride: int) -> np.ndarray:
    """``[1, page_size]``: ``tip * stride`` for each token ``tip`` of a page (read-only, shared)."""
    return frozen(np.arange(page_size, dtype=np.int64)[None, :] * stride)


def _token_terms(
    pool: PoolGeometry, pages: np.ndarray, token_start: int, token_end: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per token of ``[token_start, token_end)``: its slot and its pool offset before the head
    term (``page * page_stride + tip * token_stride``); what every writer's map of a chunk
    shares on one side."""
    ps = pool.page_size
    first, last = token_start // ps, -(-token_end // ps)
    if (
        type(pages) is np.ndarray
        and pages.ndim == 1
        and token_end > token_start
        and last <= len(pages)
        and (last - first) * ps <= 2 * (token_end - token_start) + _WHOLE_PAGES_SLACK
    ):
        # Whole pages' rows (each page id plus its in-page terms), cut to the token range: the
        # same integers as indexing per token, without a division per token (numpy's int64
        # divmod was a fifth of a map's cost). Bounded by the range: a few tokens of a huge page
        # (a hostile or mistaken page size) index per token rather than build the page's rows.
        page = pages[first:last, None]
        cut = slice(token_start - first * ps, token_end - first * ps)
        slots = (page * ps + _in_page(ps, 1)).ravel()[cut]
        if pool.page_stride == ps * pool.token_stride:
            # Token-major pages: page * page_stride + tip * token_stride is slot * token_stride.
            offsets = slots * pool.token_stride
        else:
            offsets = (page * pool.page_stride + _in_page(ps, pool.token_stride)).ravel()[cut]
    else:  # empty, or pages that do not cover the range: index per token (and raise as ever)
        tokens = np.arange(token_start, token_end, dtype=np.int64)
        page_idx, tip = np.divmod(tokens, ps)
        page = pages[page_idx]
        offsets = page * pool.page_stride + tip * pool.token_stride
        slots = page * ps + tip
    return frozen(slots), frozen(offsets)


def _side_map(
    pool: PoolGeometry,
    terms: tuple[np.ndarray, np.ndarray],
    head_start: int,
    num_heads: int,
    fmt: StagingFormat,
    base: int,
) -> StagingMap:
    """A writer's map over ``terms`` (``_token_terms`` of its tokens): ``staged_map``'s rule for
    the staging strides and where the writer's heads start from ``base``."""
    slots, offsets = terms
    strides = _strides(fmt, pool.model.num_regions, len(slots), num_heads, pool.head_bytes)
    local = head_start - pool.head_start
    staging_base = base + local * strides[2] if fmt is StagingFormat.HEAD_MAJOR else base
    if local:
        offsets = frozen(offsets + local * pool.head_stride)
    return StagingMap(
        region_ids=_region_ids(pool.model.num_regions),
        slots=slots,
        token_offsets=offsets,
        pool_head_stride=pool.head_stride,
        local_head_start=local,
        num_heads=num_heads,
        head_bytes=pool.head_bytes,
        staging_base=staging_base,
        stride_region=strides[0],
        stride_token=strides[1],
        stride_head=strides[2],
        itemsize=pool.model.dtype.itemsize,
    )


def _strides(fmt: StagingFormat, regions: int, tokens: int, num_heads: int, hb: int) -> tuple[int, int, int]:
    if fmt is StagingFormat.HEAD_MAJOR:
        return (tokens * hb, hb, regions * tokens * hb)
    return (tokens * num_heads * hb, num_heads * hb, hb)


def staged_map(
    pool: PoolGeometry,
    pages: np.ndarray,
    head_start: int,
    num_heads: int,
    token_start: int,
    token_end: int,
    fmt: StagingFormat,
    base: int,
) -> StagingMap:
    """One side's map of a writer's heads ``[head_start, head_start + num_heads)`` (global ids).

    ``base``: where the side's buffer starts in its staging memory: the rank buffer for
    HEAD_MAJOR (the writer's heads sit at their offset inside it), the writer's own block for
    LAYER_MAJOR. Prefill's gather and decode's scatter both come from here, each with its own pool,
    so the two sides agree on every staging byte without sharing a plan.
    """
    if type(fmt) is not StagingFormat:  # a member already (every engine call): no enum call
        fmt = StagingFormat(fmt)
    ts, te = int(token_start), int(token_end)
    if num_heads == 0:
        ts = te  # a dummy moves nothing; its maps are empty but well-formed
    return _side_map(pool, _token_terms(pool, pages, ts, te), head_start, num_heads, fmt, base)


def staged_maps(
    pool: PoolGeometry,
    pages: np.ndarray,
    writers: Sequence[tuple[int, int, int]],
    token_start: int,
    token_end: int,
    fmt: StagingFormat,
) -> tuple[StagingMap, ...]:
    """``staged_map`` of each ``(head_start, num_heads, base)`` writer of one chunk on one side
    (decode's scatter of every writer into its pool): the token terms are computed once and
    shared (read-only), the maps are those ``staged_map`` makes one by one."""
    if type(fmt) is not StagingFormat:  # a member already (every engine call): no enum call
        fmt = StagingFormat(fmt)
    ts, te = int(token_start), int(token_end)
    terms = None
    maps = []
    for head_start, num_heads, base in writers:
        if num_heads == 0:  # a dummy's empty map
            maps.append(staged_map(pool, pages, head_start, num_heads, ts, te, fmt, base))
            continue
        if terms is None:
            terms = _token_terms(pool, pages, ts, te)
        maps.append(_side_map(pool, terms, head_start, num_heads, fmt, base))
    return tuple(maps)


def plan_staged_pair(
    src: PoolGeometry,
    dst: PoolGeometry,
    src_pages: object,
    dst_pages: object,
    token_start: int,
    token_end: int,
    fmt: StagingFormat = StagingFormat.HEAD_MAJOR,
    *,
    src_base: int = 0,
    dst_base: int = 0,
) -> StagedPairPlan:
    """Gather map, single descriptor and scatter map for one rank pair and chunk.

    ``src_base``/``dst_base``: where the format's buffer (HEAD_MAJOR) or this writer's block
    (LAYER_MAJOR) starts inside the registered staging memory of each side.
    """
    sp, dp = check_room(src, dst, src_pages, dst_pages, token_start, token_end)
    fmt = StagingFormat(fmt)
    link = find_link(src, dst)
    g0, n = (link.head_start, link.num_heads) if link else (0, 0)
    t = int(token_end) - int(token_start) if n else 0
    r = src.model.num_regions
    hb = src.head_bytes
    if fmt is StagingFormat.HEAD_MAJOR:
        src_bytes, dst_bytes = src.heads_per_rank * r * t * hb, dst.heads_per_rank * r * t * hb
    else:
        src_bytes = dst_bytes = r * t * n * hb
    gather = staged_map(src, sp, g0, n, token_start, token_end, fmt, src_base)
    scatter = staged_map(dst, dp, g0, n, token_start, token_end, fmt, dst_base)
    return StagedPairPlan(
        src_rank=src.tp_rank,
        dst_rank=dst.tp_rank,
        format=fmt,
        head_start=g0,
        num_heads=n,
        token_start=int(token_start),
        token_end=int(token_end),
        gather=gather,
        scatter=scatter,
        src_staging_offset=gather.staging_base,
        dst_staging_offset=scatter.staging_base,
        length=r * t * n * hb,
        src_buffer_bytes=src_bytes,
        dst_buffer_bytes=dst_bytes,
    )


def plan_staged_room(
    src_pools: Sequence[PoolGeometry],
    dst_pools: Sequence[PoolGeometry],
    src_pages: object,
    dst_pages: object,
    token_start: int,
    token_end: int,
    fmt: StagingFormat = StagingFormat.HEAD_MAJOR,
) -> StagedRoomPlan:
    """Staged plans of every real rank pair; buffers start at offset 0 of each rank's staging memory.

    LAYER_MAJOR packs the writers of one decode rank back to back in link order, the way a ring
    allocation for the chunk would hold them.
    """
    check_pools(src_pools, "prefill")
    check_pools(dst_pools, "decode")
    check_room(src_pools[0], dst_pools[0], src_pages, dst_pages, token_start, token_end)
    fmt = StagingFormat(fmt)
    all_links = links(src_pools[0].model, len(src_pools), len(dst_pools))
    next_dst: dict[int, int] = {}
    pairs: list[StagedPairPlan] = []
    for x in all_links:
        if x.is_dummy:
            continue
        base = next_dst.get(x.decode_rank, 0) if fmt is StagingFormat.LAYER_MAJOR else 0
        pair = plan_staged_pair(
            src_pools[x.prefill_rank],
            dst_pools[x.decode_rank],
            src_pages,
            dst_pages,
            token_start,
            token_end,
            fmt,
            dst_base=base,
        )
        next_dst[x.decode_rank] = base + pair.length
        pairs.append(pair)
    return StagedRoomPlan(all_links, tuple(pairs), fmt, int(token_start), int(token_end))
