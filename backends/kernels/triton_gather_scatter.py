"""Triton kernels that move head slices between a paged KV pool and a staging buffer.

One launch covers every plane (layer K, layer V, or MLA latent) of the pool: plane base addresses
come from a device int64 table, so the pool's per-layer tensors need not be adjacent. Each program
moves a tile of ``BLOCK_T`` tokens x ``NH`` heads x one head row of one plane. Rows are moved as
unsigned integer *words* chosen by the caller (4, 2 or 1 bytes), so any dtype is bit-exact; with
4-byte words and 16-byte aligned rows the loads and stores become 16-byte vector accesses.

Page ids are turned into slots in the kernel (``page * page_size + token % page_size``). A page id
outside ``[0, num_pages)`` masks its token out: the kernel never reads or writes outside the pool,
whatever the caller passed (the API also rejects such ids on the host when it can see them).

Importing this module needs Triton; the API imports it lazily.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.compiler import CompiledKernel

# Counts launches so tests can prove the Triton path ran (not the torch fallback).
LAUNCHES = {"gather": 0, "scatter": 0}


@triton.jit
def _tile_offsets(
    pid_t,
    plane,
    pages_ptr,
    n_tokens,
    token_start,
    page_size,
    num_pages,
    slot_stride,
    pool_head0,
    s_base,
    s_head,
    s_plane,
    s_tok,
    NH: tl.constexpr,
    HB: tl.constexpr,
    ROW: tl.constexpr,
    ROW_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # Token index inside the chunk, its page and slot in the pool.
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < n_tokens
    t_abs = (tok + token_start).to(tl.int64)
    page = tl.load(pages_ptr + t_abs // page_size, mask=tok_ok, other=-1).to(tl.int64)
    tok_ok = tok_ok & (page >= 0) & (page < num_pages)
    slot = page * page_size + t_abs % page_size

    h = tl.program_id(2) * HB + tl.arange(0, HB)
    w = tl.arange(0, ROW_P)
    pool_off = (
        slot[:, None, None] * slot_stride
        + (pool_head0 + h)[None, :, None].to(tl.int64) * ROW
        + w[None, None, :]
    )
    stg_off = (
        s_base
        + plane.to(tl.int64) * s_plane
        + h[None, :, None].to(tl.int64) * s_head
        + tok[:, None, None].to(tl.int64) * s_tok
        + w[None, None, :]
    )
    mask = tok_ok[:, None, None] & (h < NH)[None, :, None] & (w < ROW)[None, None, :]
    return pool_off, stg_off, mask


# The token range, the page count and the first pool head change from call to call but never
# change what the compiler can prove about alignment: specializing on them (value 1, multiple of
# 16) would compile a new variant mid-transfer, seconds on a cold cache, for no speed.
_VARYING = ("n_tokens", "token_start", "num_pages", "pool_head0")


@triton.jit(do_not_specialize=_VARYING)
def _gather_kernel(
    table_ptr,
    pages_ptr,
    stg_ptr,
    n_tokens,
    token_start,
    page_size,
    num_pages,
    slot_stride,
    pool_head0,
    s_base,
    s_head,
    s_plane,
    s_tok,
    NH: tl.constexpr,
    HB: tl.constexpr,
    ROW: tl.constexpr,
    ROW_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    POOL_ALIGN: tl.constexpr,
):
    pid_t = tl.program_id(0)
    plane = tl.program_id(1)
    # The table loses the planes' alignment; the host checked it, so hand it back to the compiler
    # (without it the pool side falls back to one 4-byte access per word).
    pool_ptr = tl.multiple_of(tl.load(table_ptr + plane).to(stg_ptr.dtype, bitcast=True), POOL_ALIGN)
    pool_off, stg_off, mask = _tile_offsets(
        pid_t, plane, pages_ptr, n_tokens, token_start, page_size, num_pages, slot_stride,
        pool_head0, s_base, s_head, s_plane, s_tok, NH, HB, ROW, ROW_P, BLOCK_T,
    )  # fmt: skip
    vals = tl.load(pool_ptr + pool_off, mask=mask)
    tl.store(stg_ptr + stg_off, vals, mask=mask)


@triton.jit(do_not_specialize=_VARYING)
def _scatter_kernel(
    table_ptr,
    pages_ptr,
    stg_ptr,
    n_tokens,
    token_start,
    page_size,
    num_pages,
    slot_stride,
    pool_head0,
    s_base,
    s_head,
    s_plane,
    s_tok,
    NH: tl.constexpr,
    HB: tl.constexpr,
    ROW: tl.constexpr,
    ROW_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    POOL_ALIGN: tl.constexpr,
):
    pid_t = tl.program_id(0)
    plane = tl.program_id(1)
    # The table loses the planes' alignment; the host checked it, so hand it back to the compiler
    # (without it the pool side falls back to one 4-byte access per word).
    pool_ptr = tl.multiple_of(tl.load(table_ptr + plane).to(stg_ptr.dtype, bitcast=True), POOL_ALIGN)
    pool_off, stg_off, mask = _tile_offsets(
        pid_t, plane, pages_ptr, n_tokens, token_start, page_size, num_pages, slot_stride,
        pool_head0, s_base, s_head, s_plane, s_tok, NH, HB, ROW, ROW_P, BLOCK_T,
    )  # fmt: skip
    vals = tl.load(stg_ptr + stg_off, mask=mask)
    tl.store(pool_ptr + pool_off, vals, mask=mask)


# (tile bytes per program, warps per program, heads per program; 0 = all) by (kind, staging in
# host memory): tuned on an H100 with bench/kernel_bench.py --sweep (docs/benchmarks.md).
TUNING: dict[tuple[str, bool], tuple[int, int, int]] = {
    ("gather", True): (16384, 8, 1),
    ("gather", False): (8192, 8, 1),
    ("scatter", True): (16384, 4, 1),
    ("scatter", False): (8192, 8, 1),
}


# A compiled kernel per specialization, launched without Triton's per-call argument binding (its
# Python launcher cost about 200 us a launch on an H100 host, on a ring room's critical path).
# Keyed by everything Triton specializes on (below), so a hit is the kernel Triton would pick.
_COMPILED: dict[tuple, object] = {}
# Off once a direct launch raised (a Triton whose launcher takes arguments differently): from
# then on every launch goes through Triton's own path. KVFERRY_TRITON_DIRECT=0 starts it off (the
# benches' baseline).
_direct_on = os.environ.get("KVFERRY_TRITON_DIRECT", "1") != "0"


def _int_spec(v: int, varying: bool) -> tuple:
    """What Triton's binder derives from an integer argument: its width, and (unless the argument
    is exempt from specialization) whether it is 1 and whether it is a multiple of 16."""
    wide = not -(2**31) <= v < 2**31
    return (wide,) if varying else (wide, v == 1, v % 16 == 0)


def _spec_key(kind: str, ptrs: tuple, ints: tuple, consts: tuple, warps: int) -> tuple:
    ptr_spec = tuple((str(t.dtype), t.data_ptr() % 16 == 0, t.device.index) for t in ptrs)
    int_spec = tuple(_int_spec(v, name in _VARYING) for name, v in ints)
    return (kind, ptr_spec, int_spec, consts, warps)


def _launch_direct(compiled: object, grid: tuple, args: tuple) -> bool:
    """Launch ``compiled`` on the current stream; False if this Triton cannot be driven so."""
    global _direct_on
    import torch

    try:
        compiled[grid](*args, stream=torch.cuda.current_stream().cuda_stream)  # type: ignore[index]
    except (TypeError, ValueError, AttributeError, SystemError):
        _direct_on = False
        return False
    return True


def launch(
    kind: str,
    table,
    pages,
    staging_words,
    *,
    num_planes: int,
    n_tokens: int,
    token_start: int,
    page_size: int,
    num_pages: int,
    slot_stride: int,
    pool_head0: int,
    num_heads: int,
    row_words: int,
    s_base: int,
    s_head: int,
    s_plane: int,
    s_tok: int,
    pool_align: int,
    compile_only: bool = False,
) -> None:
    """Launch one gather or scatter on the current stream; every size and stride is in words.
    ``compile_only``: compile this specialization (or load it from Triton's cache) and launch
    nothing, so a rank can pay for compilation at start-up instead of in a room's deadline."""
    tile, warps, hb = TUNING[(kind, staging_words.device.type == "cpu")]
    hb = triton.next_power_of_2(min(hb, num_heads) if hb else num_heads)
    row_p = triton.next_power_of_2(row_words)
    # Not capped by n_tokens: one tile shape per (kind, heads, row) whatever the chunk's length,
    # so a short chunk reuses the compiled kernel (its extra rows are masked off).
    block_t = triton.next_power_of_2(max(1, tile // (hb * row_p * staging_words.element_size())))
    # x walks the tokens of one (head block, plane), so the programs running together touch
    # neighbouring staging rows: one long sequential stream over PCIe, as a memcpy would.
    grid = (triton.cdiv(n_tokens, block_t), num_planes, triton.cdiv(num_heads, hb))
    kernel = _gather_kernel if kind == "gather" else _scatter_kernel
    ints = (
        ("n_tokens", n_tokens), ("token_start", token_start), ("page_size", page_size),
        ("num_pages", num_pages), ("slot_stride", slot_stride), ("pool_head0", pool_head0),
        ("s_base", s_base), ("s_head", s_head), ("s_plane", s_plane), ("s_tok", s_tok),
    )  # fmt: skip
    consts = (num_heads, hb, row_words, row_p, block_t, pool_align)
    if compile_only:
        kernel.warmup(
            table, pages, staging_words, *(v for _, v in ints),
            NH=num_heads, HB=hb, ROW=row_words, ROW_P=row_p, BLOCK_T=block_t,
            POOL_ALIGN=pool_align, num_warps=warps, grid=grid,
        )  # fmt: skip
        return
    key = _spec_key(kind, (table, pages, staging_words), ints, consts, warps)
    compiled = _COMPILED.get(key) if _direct_on else None
    # Triton's launcher takes every parameter in signature order, constexprs included.
    if compiled is None or not _launch_direct(
        compiled, grid, (table, pages, staging_words, *(v for _, v in ints), *consts)
    ):
        got = kernel[grid](
            table, pages, staging_words, *(v for _, v in ints),
            NH=num_heads, HB=hb, ROW=row_words, ROW_P=row_p, BLOCK_T=block_t,
            POOL_ALIGN=pool_align, num_warps=warps,
        )  # fmt: skip
        # Under TRITON_INTERPRET=1 there is no compiled kernel to keep.
        if _direct_on and isinstance(got, CompiledKernel):
            _COMPILED[key] = got
    LAUNCHES[kind] += 1
