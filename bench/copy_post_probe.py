"""Host time to post one staged copy (gather or scatter of a whole room) on a GPU: what the
copy executor's ``submit`` costs the thread that calls it, before the kernel runs.

The hop timeline (``kvferry bench nixl --trace``) shows a ring room's Gather and Scatter taking
1-2.5 ms from "run" to "posted" on an H100; this splits that time by function (cProfile) for a
qwen3-8b room, both staging formats. Run on a GPU machine: ``python bench/copy_post_probe.py
[--tokens 4096] [--reps 20]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np


def main() -> None:
    import torch
    from kvferry.backends.copy_exec import CudaCopyExecutor
    from kvferry.backends.nixl.transport import kernel_pool
    from kvferry.core.geometry import ModelGeometry, PoolGeometry
    from kvferry.core.staging_layout import StagingFormat, staged_map

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"))
    ap.add_argument("--top", type=int, default=14, help="functions listed per copy kind")
    a = ap.parse_args()
    page = 16
    n_pages = 2 * -(-a.tokens // page)
    geom = PoolGeometry(ModelGeometry.preset(a.model), 1, 0, page, n_pages)
    per = geom.region_bytes
    buf = torch.zeros(geom.total_bytes, dtype=torch.uint8, device="cuda")
    regions = {i: buf[i * per : (i + 1) * per] for i in range(geom.model.num_regions)}
    room = geom.total_bytes // 2
    staging = {7: torch.zeros(room, dtype=torch.uint8, device="cuda")}
    ex = CudaCopyExecutor(kernel_pool(geom, regions), staging, geom)
    pages = np.arange(n_pages // 2, dtype=np.int64) + n_pages // 2
    for fmt in StagingFormat:
        smap = staged_map(geom, pages, geom.head_start, geom.heads_per_rank, 0, a.tokens, fmt, 0)
        for kind in ("gather", "scatter"):
            ex.release(ex.submit(kind, 7, [smap]))  # warm
            torch.cuda.synchronize()
            walls = []
            prof = cProfile.Profile()
            for _ in range(a.reps):
                t0 = time.perf_counter()
                prof.enable()
                h = ex.submit(kind, 7, [smap])
                prof.disable()
                walls.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                ex.release(h)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(a.sort).print_stats(a.top)
            p50 = statistics.median(walls) * 1e6
            print(f"== {kind} {fmt.value} {a.tokens} tokens: submit p50 {p50:.0f} us")
            print("\n".join(s.getvalue().splitlines()[6 : 10 + a.top]))


if __name__ == "__main__":
    main()
