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
        """where: 'gpu', 'pinned' (zero-copy kernel) or 'pinned_ce' (kernel + copy engine)."""
        staging = self.gpu if where == "gpu" else self.pinned
        path = "copy_engine" if where == "pinned_ce" else "zero_copy"
        fn = gather if kind == "gather" else scatter
        return lambda: fn(
            self.pool, staging, self.layout, self.pages_dev, token_start=0, token_end=self.tokens,
            head_start=self.head_start, backend=backend, pinned_path=path,
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
    s.pinned.fill_(0)
    s.op("gather", "pinned_ce")()
    torch.cuda.synchronize()
    if not torch.equal(ref.view(torch.int16), s.pinned.cuda().view(torch.int16)):
        return "copy-engine gather != gpu gather"
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
    r["gather_pinned_ce"] = timed(s.op("gather", "pinned_ce"), reps)
    r["scatter_pinned_ce"] = timed(s.op("scatter", "pinned_ce"), reps)
    r["gather_gpu"] = timed(s.op("gather", "gpu"), reps)
    r["scatter_gpu"] = timed(s.op("scatter", "gpu"), reps)
    r["torch_gather_pinned"] = timed(s.op("gather", "pinned", "torch"), fallback_reps, warmup=1)
    # Host time to validate and launch one call (no waiting): when it exceeds the device time of
    # a call, back-to-back calls are launch-bound, not bandwidth-bound.
    op = s.op("gather", "gpu")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        op()
    r["host_us"] = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    assert n == s.pinned.numel()
    return r


def gbps(r: dict, key: str) -> float:
    return r["MB"] / 1e3 / r[key]


def print_table(rows: list[dict]) -> None:
    hdr = (
        "| model | tokens | page | MB | D2H | gather->pinned zero-copy | % | copy-engine | % | H2D | "
        "scatter<-pinned zero-copy | % | copy-engine | % | D2D | gather->GPU | % | scatter<-GPU | % | "
        "torch gather->pinned | best/torch | host us/call | GPU us/call | check |"
    )
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in rows:
        g = {k: gbps(r, k) for k in r if isinstance(r[k], float) and k not in ("MB", "host_us")}
        best = max(g["gather_pinned"], g["gather_pinned_ce"])

        def pct(k: str, base: str, g=g) -> str:
            return f"{g[k]:.1f} | {100 * g[k] / g[base]:.1f}"

        print(
            f"| {r['model']} | {r['tokens']} | {r['page_size']} | {r['MB']:.0f} | {g['d2h']:.1f} | "
            f"{pct('gather_pinned', 'd2h')} | {pct('gather_pinned_ce', 'd2h')} | {g['h2d']:.1f} | "
            f"{pct('scatter_pinned', 'h2d')} | {pct('scatter_pinned_ce', 'h2d')} | {g['d2d']:.0f} | "
            f"{pct('gather_gpu', 'd2d')} | {pct('scatter_gpu', 'd2d')} | "
            f"{g['torch_gather_pinned']:.2f} | {best / g['torch_gather_pinned']:.1f}x | "
            f"{r['host_us']:.0f} | {r['gather_gpu'] * 1e6:.0f} | {r['check']} |"
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


def sweep_chunks(s: Setup, reps: int) -> dict:
    """Copy-engine path: chunk size (scratch = 3 chunks); keeps the fastest for gather+scatter."""
    from kvferry.backends.kernels import bounce

    results = []
    for mb in (8, 16, 32, 64, 128):
        bounce.CHUNK_BYTES = mb << 20
        tg = timed(s.op("gather", "pinned_ce"), reps, warmup=1)
        ts = timed(s.op("scatter", "pinned_ce"), reps, warmup=1)
        print(
            f"chunks {mb:4d} MB: gather {s.nbytes / 1e9 / tg:6.1f} GB/s  "
            f"scatter {s.nbytes / 1e9 / ts:6.1f} GB/s",
            flush=True,
        )
        results.append((tg + ts, mb))
    bounce.CHUNK_BYTES = min(results)[1] << 20
    return {"chunk_MB": min(results)[1]}


def probe(s: Setup, reps: int) -> None:
    """Where does the PCIe ceiling come from? memcpy whole vs in chunks, alone vs beside a kernel."""
    n = s.layout.numel
    mb = s.nbytes / 1e9
    for chunk_mb in (0, 8, 64):
        step = n if not chunk_mb else (chunk_mb << 20) // 2

        def d2h(step=step):
            for i in range(0, n, step):
                s.pinned[i : i + step].copy_(s.gpu[i : i + step], non_blocking=True)

        def h2d(step=step):
            for i in range(0, n, step):
                s.gpu[i : i + step].copy_(s.pinned[i : i + step], non_blocking=True)

        print(
            f"probe memcpy chunks={chunk_mb or 'whole'} MB: D2H {mb / timed(d2h, reps):.1f} GB/s "
            f"H2D {mb / timed(h2d, reps):.1f} GB/s",
            flush=True,
        )
    side = torch.cuda.Stream()

    def d2h_beside_kernel():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            s.pinned.copy_(s.gpu, non_blocking=True)
        s.op("gather", "gpu")()
        torch.cuda.current_stream().wait_stream(side)

    print(f"probe D2H beside GPU gathers: {mb / timed(d2h_beside_kernel, reps):.1f} GB/s", flush=True)
    from kvferry.backends.kernels import bounce

    runs = bounce.STATS["runs"]
    t = timed(s.op("gather", "pinned_ce"), reps)
    print(
        f"probe copy-engine gather {mb / t:.1f} GB/s, bounce runs {bounce.STATS['runs'] - runs}", flush=True
    )


def profile_host(s: Setup, calls: int = 300) -> None:
    """Where the host time of one gather call goes (cProfile over queued calls)."""
    import cProfile
    import pstats

    op = s.op("gather", "gpu")
    for _ in range(20):
        op()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        op()
    prof.disable()
    print(f"host us/call {(time.perf_counter() - t0) / calls * 1e6:.1f} (profiled)")
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen3-8b", "llama-3.1-70b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 32768])
    ap.add_argument("--page-sizes", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fallback-reps", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="tune tile/warps on the first config first")
    ap.add_argument("--sweep-chunks", action="store_true", help="tune the copy-engine chunk size first")
    ap.add_argument("--sweep-reps", type=int, default=5)
    ap.add_argument("--probe", action="store_true", help="memcpy variants on the first config, then exit")
    ap.add_argument("--profile-host", action="store_true", help="profile the host side of a call, then exit")
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
    if args.profile_host:
        profile_host(Setup(models[0], args.tokens[0], args.page_sizes[0], bufs))
        return 0
    if args.probe:
        probe(Setup(models[0], args.tokens[-1], args.page_sizes[0], bufs), args.reps)
        return 0
    if args.sweep or args.sweep_chunks:
        s = Setup(models[0], args.tokens[-1], args.page_sizes[0], bufs)
        out["tuning"] = sweep(s, args.sweep_reps) if args.sweep else {}
        if args.sweep_chunks:
            out["tuning"].update(sweep_chunks(s, args.sweep_reps))
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
