"""Region ids of staging memory, next to the KV pool's ``0 .. num_regions-1``.

They travel in ``Register.regions`` like the pool's, so the same descriptor checks (a write must
stay inside a region the peer registered) cover staging memory too. The wire allows ids below
2**20; a pool never has that many regions.
"""

from __future__ import annotations

__all__ = ["PINNED_REGION", "RING_REGION", "WORKER_STAGING_BASE", "is_staging_region", "worker_region"]

RING_REGION = (1 << 20) - 1  # decode: the GPU staging ring (SGLang PR 22536)
PINNED_REGION = (1 << 20) - 2  # either side: the rank's pinned bounce pool (SGLang PR 18968)
WORKER_STAGING_BASE = (1 << 20) - 256  # prefill: worker i's private staging buffer is base + i
MAX_WORKERS = 250


def worker_region(worker: int) -> int:
    if not 0 <= worker < MAX_WORKERS:
        raise ValueError(f"worker {worker} out of range [0, {MAX_WORKERS})")
    return WORKER_STAGING_BASE + worker


def is_staging_region(region_id: int) -> bool:
    return WORKER_STAGING_BASE <= region_id < 1 << 20
