"""Planner benchmark: descriptors and planning time of the direct, merged and staged plans.

For each model, token count, (prefill TP, decode TP) pair and page size, plans one room over every
rank pair three ways and times it (best of ``--repeat``), pinned to one CPU core:

- direct: ``plan_rank_pair(coalesce=False)``, one descriptor per (token, layer, K|V) and pair;
- merged: ``plan_rank_pair()``, coalesced to maximal contiguous runs;
- staged: ``plan_staged_room(HEAD_MAJOR)``, gather/scatter maps and one descriptor per pair.

Baseline, measured in the same run for every row: a naive per-token Python loop that emits the
direct descriptors one by one. It runs on the first ``--naive-tokens`` tokens of every rank pair
and is scaled linearly to the row's direct descriptor count (its cost is linear in descriptors).
Each time is printed with its speed-up over that baseline (``x naive`` = naive time / time).

Pages are fragmented (a seeded random subset of a pool twice the room's size) unless
``--contiguous``. Usage::

    uv run python bench/plan_bench.py            # the full grid (a few minutes)
    uv run python bench/plan_bench.py --quick    # 4096 tokens, qwen3-8b only
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from collections.abc import Callable

import numpy as np
from kvferry.core.geometry import PRESETS, Layout, ModelGeometry, PoolGeometry, links, make_pools
from kvferry.core.planner import plan_rank_pair
from kvferry.core.staging_layout import StagingFormat, plan_staged_room

TP_PAIRS = ((1, 1), (4, 2), (2, 4), (8, 1))
PAGE_SIZES = (1, 16, 64)
TOKENS = (4096, 32768)
MODELS = ("qwen3-8b", "llama-3.1-70b")


def fix_allocator() -> str:
    """Pin glibc's mmap threshold so every large array lands in fresh pages: the worst case.

    By default glibc raises the threshold after each free, so repeated runs may reuse warm heap
    memory or page-fault fresh mmaps depending on history, which made rows of one grid differ by
    up to 10x for the same work. Fixed at 128 KiB, every descriptor array pays its first touch.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "default allocator"
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 128 * 1024)
    return "cold pages (glibc mmap threshold fixed at 128 KiB)"


def best_of(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def naive_pair(
    src: PoolGeometry, dst: PoolGeometry, sp: np.ndarray, dp: np.ndarray, g0: int, n: int, tokens: int
) -> list[tuple[int, int, int, int, int]]:
    """What a user writes without numpy: one Python iteration per (region, token)."""
    out: list[tuple[int, int, int, int, int]] = []
    sps, dps = src.page_size, dst.page_size
    s_head = (g0 - src.head_start) * src.head_stride
    d_head = (g0 - dst.head_start) * dst.head_stride
    length = n * src.head_bytes
    spl, dpl = sp.tolist(), dp.tolist()
    for region in range(src.model.num_regions):
        for t in range(tokens):
            s = spl[t // sps] * src.page_stride + (t % sps) * src.token_stride + s_head
            d = dpl[t // dps] * dst.page_stride + (t % dps) * dst.token_stride + d_head
            out.append((region, s, region, d, length))
    return out


def pages_for(
    tokens: int, page_size: int, contiguous: bool, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    need = -(-tokens // page_size)
    if contiguous:
        return np.arange(need, dtype=np.int64), need
    return rng.permutation(2 * need)[:need].astype(np.int64), 2 * need


def run_row(model: ModelGeometry, tokens: int, ptp: int, dtp: int, ps: int, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng([args.seed, tokens, ptp, dtp, ps])
    sp, sn = pages_for(tokens, ps, args.contiguous, rng)
    dp, dn = pages_for(tokens, ps, args.contiguous, rng)
    src = make_pools(model, ptp, ps, sn, Layout.SGLANG_NHD)
    dst = make_pools(model, dtp, ps, dn, Layout.SGLANG_NHD)
    real = [x for x in links(model, ptp, dtp) if not x.is_dummy]

    def plan_all(coalesce: bool) -> tuple[int, int]:
        # One pair at a time: a whole 32k-token room of llama-3.1-70b direct is 40M descriptors.
        count = unmerged = 0
        for x in real:
            p = plan_rank_pair(src[x.prefill_rank], dst[x.decode_rank], sp, dp, 0, tokens, coalesce=coalesce)
            count += p.count
            unmerged += p.descriptors_unmerged
        return count, unmerged

    direct_count, _ = plan_all(False)
    merged_count, unmerged = plan_all(True)
    assert unmerged == direct_count
    staged = plan_staged_room(src, dst, sp, dp, 0, tokens, StagingFormat.HEAD_MAJOR)
    t_direct = best_of(lambda: plan_all(False), args.repeat)
    t_merged = best_of(lambda: plan_all(True), args.repeat)
    t_staged = best_of(
        lambda: plan_staged_room(src, dst, sp, dp, 0, tokens, StagingFormat.HEAD_MAJOR), args.repeat
    )

    sample = min(tokens, args.naive_tokens)

    def naive() -> int:
        return sum(
            len(
                naive_pair(src[x.prefill_rank], dst[x.decode_rank], sp, dp, x.head_start, x.num_heads, sample)
            )
            for x in real
        )

    naive_count = naive()
    t_naive = best_of(naive, args.naive_repeat) * direct_count / naive_count
    return {
        "model": model.name,
        "tokens": tokens,
        "tp": f"{ptp}->{dtp}",
        "page": ps,
        "direct": direct_count,
        "t_direct": t_direct,
        "merged": merged_count,
        "t_merged": t_merged,
        "staged": staged.count,
        "t_staged": t_staged,
        "t_naive": t_naive,
    }


def fmt_row(r: dict) -> str:
    def cell(t: float) -> str:
        return f"{t * 1e3:.2f} ms ({r['t_naive'] / t:,.0f}x)"

    return (
        f"| {r['model']} | {r['tokens']} | {r['tp']} | {r['page']} "
        f"| {r['direct']:,} | {cell(r['t_direct'])} | {r['direct'] / r['t_direct'] / 1e6:.1f} "
        f"| {r['merged']:,} | {cell(r['t_merged'])} | {r['staged']} | {cell(r['t_staged'])} "
        f"| {r['t_naive'] * 1e3:,.0f} ms |"
    )


HEADER = (
    "| model | tokens | TP P->D | page | direct desc | direct time (x naive) | direct Mdesc/s "
    "| merged desc | merged time (x naive) | staged desc | staged time (x naive) | naive (scaled) |\n"
    "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="qwen3-8b at 4096 tokens only")
    ap.add_argument("--contiguous", action="store_true", help="contiguous page ids instead of fragmented")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--naive-tokens", type=int, default=256)
    ap.add_argument("--naive-repeat", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--core", type=int, default=0, help="CPU core to pin to (Linux)")
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})
    memory = fix_allocator()
    models = MODELS[:1] if args.quick else MODELS
    token_counts = TOKENS[:1] if args.quick else TOKENS
    print(f"# plan_bench: {'contiguous' if args.contiguous else 'fragmented'} pages, one core, {memory}, "
          f"best of {args.repeat}; naive on {args.naive_tokens} tokens per pair, scaled")  # fmt: skip
    print(HEADER)
    rates: list[float] = []
    for name in models:
        model = PRESETS[name]
        for tokens in token_counts:
            for ptp, dtp in TP_PAIRS:
                for ps in PAGE_SIZES:
                    row = run_row(model, tokens, ptp, dtp, ps, args)
                    rates.append(row["direct"] / row["t_direct"])
                    print(fmt_row(row), flush=True)
    print(
        f"\ndirect plan throughput: min {min(rates) / 1e6:.1f}, median {np.median(rates) / 1e6:.1f} "
        f"M descriptors/s (target >= 10)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
