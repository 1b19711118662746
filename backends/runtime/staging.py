"""Staging memory of a real endpoint: sizes (in ``RuntimeConfig``) and allocation.

What each side registers (``core.flows.regions`` ids; DESIGN section 9):

- prefill: a private buffer per transfer worker (``worker_buffer_bytes`` each; the ring flow
  gathers a chunk's heads into it and WRITEs one block per decode rank), and optionally a pinned
  host pool (``prefill_pinned_bytes``, the pinned flow's bounce buffer);
- decode: the staging ring (``ring_bytes``, which every writer's block lands in) and optionally
  a pinned host pool (``pinned_bytes``); both are offered to peers in the ``Register``.

Memory follows the pool: a VRAM pool gets VRAM worker buffers and ring on its GPU and page-locked
host memory for the pinned pools; a DRAM pool (CPU tests, CPU-only deployments) gets DRAM for
everything. A chunk that cannot fit fails its room with a message naming the knob to raise
(``core.flows.staged_sender``), unless ``fallback_direct`` sends it direct instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
import numpy as np
from kvferry.core.flows import Flow, FlowPolicy
from kvferry.core.flows.regions import PINNED_REGION, RING_REGION, worker_region

__all__ = ["StagingConfig", "allocate_staging", "pool_device"]

MiB = 1 << 20
_Size = Annotated[int, msgspec.Meta(ge=0, lt=1 << 44)]


class StagingConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Sizes in bytes (0: not registered). ``flow``: force one flow for every room ("direct",
    "ring", "pinned"); None lets the policy choose per room (direct for equal TP, else ring if
    decode offers one, else pinned if it offers that, else direct)."""

    worker_buffer_bytes: _Size = 256 * MiB
    ring_bytes: _Size = 1024 * MiB
    pinned_bytes: _Size = 0
    prefill_pinned_bytes: _Size = 0
    flow: str | None = None
    fallback_direct: bool = False

    def policy(self) -> FlowPolicy:
        return FlowPolicy(
            override=None if self.flow is None else Flow.parse(self.flow),
            fallback_direct=self.fallback_direct,
        )


def pool_device(buffers: Mapping[int, Any]) -> Any:
    """The torch device of a pool held in tensors on a GPU, else None (DRAM)."""
    first = next(iter(buffers.values()), None)
    if first is None or isinstance(first, np.ndarray):
        return None
    if isinstance(first, tuple):  # raw (addr, nbytes[, mem, dev])
        if len(first) > 2 and first[2] == "VRAM":
            import torch

            return torch.device("cuda", int(first[3]) if len(first) > 3 else 0)
        return None
    get = getattr(first, "get_device", None)  # a torch tensor: -1 on the CPU
    if get is None or get() < 0:
        return None
    return first.device


def _alloc(nbytes: int, device: Any, pinned: bool) -> Any:
    if device is None:
        return np.zeros(nbytes, dtype=np.uint8)
    import torch

    if pinned:
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def allocate_staging(role: str, cfg: StagingConfig, num_workers: int, device: Any) -> dict[int, Any]:
    """Region id -> buffer for one endpoint (empty: no staging memory)."""
    out: dict[int, Any] = {}
    if role == "prefill":
        if cfg.worker_buffer_bytes:
            for w in range(num_workers):
                out[worker_region(w)] = _alloc(cfg.worker_buffer_bytes, device, pinned=False)
        if cfg.prefill_pinned_bytes:
            out[PINNED_REGION] = _alloc(cfg.prefill_pinned_bytes, device, pinned=True)
    else:
        if cfg.ring_bytes:
            out[RING_REGION] = _alloc(cfg.ring_bytes, device, pinned=False)
        if cfg.pinned_bytes:
            out[PINNED_REGION] = _alloc(cfg.pinned_bytes, device, pinned=True)
    return out
