"""GPU-side limits next to ``kvferry bench nixl --mem VRAM``: what a pinned-DRAM bounce would cost.

Times torch copies of one qwen3-8b 4096-token room (604 MB) VRAM -> pinned DRAM and back (best of
5 after a warm-up), and device-to-device, so the bounce path (D2H, NIXL DRAM -> DRAM, H2D) can be
compared with NIXL VRAM -> VRAM measured by the bench in the same session.

    python bench/nixl_gpu_probe.py
"""

from __future__ import annotations

import json
import time

import torch


def best(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return min(out)


def main() -> None:
    n = 36 * 2 * 4096 * 8 * 128 * 2  # qwen3-8b, 4096 tokens, bf16, all heads
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d2h = best(lambda: pinned.copy_(dev, non_blocking=True))
    h2d = best(lambda: dev.copy_(pinned, non_blocking=True))
    d2d = best(lambda: dev2.copy_(dev))
    print(
        json.dumps(
            {"bytes": n, "d2h_gbps": n / d2h / 1e9, "h2d_gbps": n / h2d / 1e9, "d2d_gbps": n / d2d / 1e9}
        )
    )


if __name__ == "__main__":
    main()
