"""The staged flows' gather and scatter on CPU memory (numpy, ``backends/staging_copy.py``, what
the real runtime runs for DRAM pools), timed, written in ``bench/kernel_bench.py``'s JSON shape so
``kvferry calibrate --kernels`` fits the copy cost of a machine without a GPU.

For qwen3-8b, prefill TP 2 -> decode TP 1 (prefill rank 1's heads, the ring flow's layer-major
staging), one room of each token count on contiguous pages: the median of ``--reps`` gathers and
scatters. On CPU the "GPU" and "pinned" staging are the same DRAM, so both paths get the same
times; there is no host/device split, so no ``host_us`` (the fit then takes the intercept as the
launch cost).

    uv run python bench/cpu_copy_bench.py --tokens 128 512 2048 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from kvferry.backends.staging_copy import copy_maps
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.staging_layout import StagingFormat, plan_staged_pair


def one(model: ModelGeometry, tokens: int, reps: int) -> dict[str, float]:
    pages = -(-tokens // 16)
    src = PoolGeometry(model, 2, 1, 16, pages, "sglang_nhd")
    dst = PoolGeometry(model, 1, 0, 16, pages, "sglang_nhd")
    ids = np.arange(pages, dtype=np.int64)
    plan = plan_staged_pair(src, dst, ids, ids, 0, tokens, StagingFormat.LAYER_MAJOR)
    src_regions = {r.region_id: np.ones(r.nbytes, dtype=np.uint8) for r in src.regions}
    dst_regions = {r.region_id: np.zeros(r.nbytes, dtype=np.uint8) for r in dst.regions}
    staging = np.zeros(max(plan.src_buffer_bytes, plan.dst_buffer_bytes), dtype=np.uint8)
    out: dict[str, float] = {"MB": plan.length / 1e6, "tokens": tokens}
    for kind, regions, smap in (("gather", src_regions, plan.gather), ("scatter", dst_regions, plan.scatter)):
        times = []
        for _ in range(reps + 1):  # the first touches the pages
            t0 = time.perf_counter()
            copy_maps(kind, regions, staging, [smap])
            times.append(time.perf_counter() - t0)
        t = statistics.median(times[1:])
        out[f"{kind}_gpu"] = out[f"{kind}_pinned"] = t
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = ModelGeometry.preset("qwen3-8b")
    rows = []
    for t in args.tokens:
        r = one(model, t, args.reps)
        rows.append(r)
        print(
            f"{t:>6} tokens {r['MB']:8.1f} MB: gather {r['MB'] / 1e3 / r['gather_gpu']:.2f} GB/s, "
            f"scatter {r['MB'] / 1e3 / r['scatter_gpu']:.2f} GB/s",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": "cpu (numpy staging_copy)", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
