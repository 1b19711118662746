"""Gather and scatter rates of the staged flows' host copies: numpy (backends/staging_copy.py,
the reference) against C (backends/native/hostcopy.py), one thread, one qwen3-8b room of
``--tokens`` tokens on fragmented pages, both staging formats, a TP 1 and a TP 2 rank's map; best
of ``--reps``. A plain numpy copy of 150 MB is the memcpy reference of the same run.

    python bench/hostcopy_bench.py --tokens 1024
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import numpy as np
from kvferry.backends.native.hostcopy import copy_maps as c_copy
from kvferry.backends.staging_copy import copy_maps as numpy_copy
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.staging_layout import StagingFormat, staged_map


def best_s(fn: Callable[[], object], reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    model = ModelGeometry.preset("qwen3-8b")
    pages = -(-a.tokens // 16)
    rng = np.random.default_rng(0)
    for tp in (1, 2):
        pool = PoolGeometry(model, tp, 0, 16, pages * 2)
        regions = {r.region_id: rng.integers(0, 256, r.nbytes, dtype=np.uint8) for r in pool.regions}
        page_ids = rng.permutation(pages * 2)[:pages].astype(np.int64)
        for fmt in StagingFormat:
            smap = staged_map(pool, page_ids, pool.head_start, pool.heads_per_rank, 0, a.tokens, fmt, 0)
            staging = np.ones(smap.nbytes, np.uint8)
            row = []
            for name, fn in (("numpy", numpy_copy), ("C", c_copy)):
                for kind in ("gather", "scatter"):
                    s = best_s(functools.partial(fn, kind, regions, staging, [smap]), a.reps)
                    row.append(f"{name} {kind} {smap.nbytes / s / 1e9:.2f}")
            print(f"TP{tp} rank, {fmt.value}, {smap.nbytes / 1e6:.0f} MB: " + ", ".join(row) + " GB/s")
    src = np.ones(150_000_000, np.uint8)
    dst = np.empty_like(src)
    print(f"memcpy of 150 MB: {src.size / best_s(lambda: np.copyto(dst, src), a.reps) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
