"""Bandwidth of the head-slice gather/scatter kernels against the copy engine, on one GPU.

For each model shape, token count and page size it moves half of an 8-head pool's heads (the
P=1 -> D=2 case: each decode rank needs half) for every layer's K and V, in the head-major
staging layout, and times in the same run:

- gather to pinned host memory   vs  a pinned D2H memcpy of the same bytes
- scatter from pinned memory     vs  a pinned H2D memcpy of the same bytes
- gather to GPU memory           vs  a D2D copy of the same bytes
- the torch fallback's gather to pinned memory (what one writes without a kernel)

GB/s count the payload once (bytes of the moved heads). Every timing is the median of CUDA-event
timed repetitions after warm-up. Each configuration is also checked bit-exact: Triton and torch
gathers agree, and a scatter into a fresh pool followed by a gather gives the same bytes back.

    PYTHONPATH=... python3 bench/kernel_bench.py [--quick] [--sweep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
from kvferry.backends.kernels import KVPool, StagingLayout, gather, scatter
from kvferry.backends.kernels import triton_gather_scatter as tk
from kvferry.core.geometry import ModelGeometry

HEADS = 8


def timed(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, timed with CUDA events on the current stream.

    All runs are queued before the first wait, so the host's launch work overlaps the previous
    run on the device (as in a serving loop) instead of showing up as idle device time.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)


class Setup:
    """A pool with random data, its room's random pages, and the staging buffers."""

    def __init__(self, model: ModelGeometry, tokens: int, page_size: int, bufs: dict, seed: int = 0):
        self.model, self.tokens, self.page_size = model, tokens, page_size
        need = -(-tokens // page_size)
        num_pages = need + need // 4 + 1
        slots = num_pages * page_size
        g = torch.Generator(device="cuda").manual_seed(seed)
        planes = [
            torch.randint(
                -(2**15), 2**15, (slots, HEADS, model.head_dim), dtype=torch.int16, device="cuda", generator=g
            ).view(torch.bfloat16)
            for _ in range(2 * model.num_layers)
        ]
        self.pool = KVPool(planes, page_size)
        rng = np.random.default_rng(seed)
        self.pages = rng.permutation(num_pages)[:need].astype(np.int64)
        self.pages_dev = torch.from_numpy(self.pages).cuda()
        self.nh = HEADS // 2
        self.head_start = HEADS // 2
        self.layout = StagingLayout.head_major(self.nh, 2 * model.num_layers, tokens, model.head_dim)
        self.nbytes = self.layout.numel * 2
        n = self.layout.numel
        self.pinned = bufs["pinned"][:n]
        self.gpu = bufs["gpu"][:n]
        self.gpu2 = bufs["gpu2"][:n]

    def op(self, kind: str, where: str, backend: str = "triton"):
        staging = self.pinned if where == "pinned" else self.gpu
        fn = gather if kind == "gather" else scatter
        return lambda: fn(
            self.pool, staging, self.layout, self.pages_dev,
            token_start=0, token_end=self.tokens, head_start=self.head_start, backend=backend,
        )  # fmt: skip


def check(s: Setup) -> str:
    """Bit-exact checks on the benchmark's own data; returns 'ok' or what differed."""
    s.op("gather", "gpu")()
    ref = s.gpu.clone()
    s.gpu.fill_(0)
    s.op("gather", "gpu", "torch")()
    if not torch.equal(ref.view(torch.int16), s.gpu.view(torch.int16)):
        return "torch gather != triton gather"
    s.pinned.fill_(0)
    s.op("gather", "pinned")()
    torch.cuda.synchronize()
    if not torch.equal(ref.view(torch.int16), s.pinned.cuda().view(torch.int16)):
        return "pinned gather != gpu gather"
    # Scatter into a fresh pool, gather back from it: the round trip must reproduce the bytes.
    fresh = KVPool([torch.zeros_like(p) for p in s.pool.planes], s.page_size)
    scatter(
        fresh, s.pinned, s.layout, s.pages_dev, token_start=0, token_end=s.tokens, head_start=s.head_start
    )
    s.gpu.fill_(0)
    gather(fresh, s.gpu, s.layout, s.pages_dev, token_start=0, token_end=s.tokens, head_start=s.head_start)
    torch.cuda.synchronize()
    ok = torch.equal(ref.view(torch.int16), s.gpu.view(torch.int16))
    del fresh
    return "ok" if ok else "scatter round trip differs"


def bench_one(s: Setup, reps: int, fallback_reps: int) -> dict:
    n = s.layout.numel
    r = {"model": s.model.name, "tokens": s.tokens, "page_size": s.page_size, "MB": s.nbytes / 1e6}
    r["d2h"] = timed(lambda: s.pinned.copy_(s.gpu, non_blocking=True), reps)
    r["h2d"] = timed(lambda: s.gpu.copy_(s.pinned, non_blocking=True), reps)
    r["d2d"] = timed(lambda: s.gpu2.copy_(s.gpu), reps)
    r["gather_pinned"] = timed(s.op("gather", "pinned"), reps)
    r["scatter_pinned"] = timed(s.op("scatter", "pinned"), reps)
    r["gather_gpu"] = timed(s.op("gather", "gpu"), reps)
    r["scatter_gpu"] = timed(s.op("scatter", "gpu"), reps)
    r["torch_gather_pinned"] = timed(s.op("gather", "pinned", "torch"), fallback_reps, warmup=1)
    assert n == s.pinned.numel()
    return r


def gbps(r: dict, key: str) -> float:
    return r["MB"] / 1e3 / r[key]


def print_table(rows: list[dict]) -> None:
    hdr = (
        "| model | tokens | page | MB | D2H | gather->pinned | % | H2D | scatter<-pinned | % | "
        "D2D | gather->GPU | % | scatter<-GPU | torch gather->pinned | kernel/torch | check |"
    )
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in rows:
        g = {k: gbps(r, k) for k in r if isinstance(r[k], float) and k != "MB"}
        print(
            f"| {r['model']} | {r['tokens']} | {r['page_size']} | {r['MB']:.0f} | {g['d2h']:.1f} | "
            f"{g['gather_pinned']:.1f} | {100 * g['gather_pinned'] / g['d2h']:.1f} | {g['h2d']:.1f} | "
            f"{g['scatter_pinned']:.1f} | {100 * g['scatter_pinned'] / g['h2d']:.1f} | {g['d2d']:.0f} | "
            f"{g['gather_gpu']:.0f} | {100 * g['gather_gpu'] / g['d2d']:.1f} | {g['scatter_gpu']:.0f} | "
            f"{g['torch_gather_pinned']:.2f} | {g['gather_pinned'] / g['torch_gather_pinned']:.1f}x | "
            f"{r['check']} |"
        )


def sweep(s: Setup, reps: int) -> dict:
    """Try tile sizes and warp counts per (kind, staging place); keep the fastest in tk.TUNING."""
    best = {}
    for kind in ("gather", "scatter"):
        for where in ("pinned", "gpu"):
            key = (kind, where == "pinned")
            results = []
            for hb in (1, 2, 0):
                for tile in (8192, 16384, 32768):
                    for warps in (4, 8):
                        tk.TUNING[key] = (tile, warps, hb)
                        t = timed(s.op(kind, where), reps, warmup=1)
                        results.append((t, tile, warps, hb))
                        print(
                            f"sweep {kind:7s} {where:6s} heads/prog={hb} tile={tile:6d} warps={warps:2d} "
                            f"{s.nbytes / 1e9 / t:7.1f} GB/s",
                            flush=True,
                        )
            t, tile, warps, hb = min(results)
            tk.TUNING[key] = (tile, warps, hb)
            best[f"{kind}_{where}"] = {"tile": tile, "warps": warps, "heads": hb, "GBps": s.nbytes / 1e9 / t}
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen3-8b", "llama-3.1-70b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 32768])
    ap.add_argument("--page-sizes", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fallback-reps", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="tune tile/warps on the first config first")
    ap.add_argument("--sweep-reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    models = [ModelGeometry.preset(m) for m in args.models]
    max_numel = max(HEADS // 2 * 2 * m.num_layers * t * m.head_dim for m in models for t in args.tokens)
    t0 = time.time()
    bufs = {
        "pinned": torch.empty(max_numel, dtype=torch.bfloat16, pin_memory=True),
        "gpu": torch.empty(max_numel, dtype=torch.bfloat16, device="cuda"),
        "gpu2": torch.empty(max_numel, dtype=torch.bfloat16, device="cuda"),
    }
    bufs["gpu"].view(torch.int16).random_()
    print(f"buffers: {max_numel * 2 / 1e9:.2f} GB each, {time.time() - t0:.1f}s", flush=True)
    out = {"device": torch.cuda.get_device_name(), "rows": [], "tuning": None}
    if args.sweep:
        s = Setup(models[0], args.tokens[-1], args.page_sizes[0], bufs)
        out["tuning"] = sweep(s, args.sweep_reps)
        print("tuning:", out["tuning"], flush=True)
        del s
    for m in models:
        for t in args.tokens:
            for ps in args.page_sizes:
                s = Setup(m, t, ps, bufs)
                r = bench_one(s, args.reps, args.fallback_reps)
                r["check"] = check(s)
                out["rows"].append(r)
                print(r, flush=True)
                del s
                torch.cuda.empty_cache()
    print_table(out["rows"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
