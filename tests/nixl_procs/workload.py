"""The workload both helper processes derive from one seed: same rooms, same plan, no messages.

A real router would tell prefill and decode about each request; here both sides compute the same
list. ``abort`` says who aborts a room and when:

- ``decode_early``: decode aborts right after opening the room.
- ``decode_mid``: prefill sends the first chunk and holds the rest; decode aborts once that chunk
  landed (Transferring), so the room cannot have succeeded first.
- ``prefill_early``: prefill aborts once the room is WaitingForInput, before any chunk.
- ``prefill_mid``: prefill aborts right after handing over the first chunk (once WaitingForInput).
``hold``: prefill sends the first chunk and then stops (the peer-kill scenarios).

The TP pair (``--prefill-tp``/``--decode-tp``) and the transfer flow (``--flow``) are arguments of
both processes; every rank of a side runs in that side's process.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from kvferry.backends.runtime.staging import StagingConfig
from kvferry.core.deadlines import MS, SEC, Timeouts
from kvferry.core.geometry import Layout, ModelGeometry, PoolGeometry

ABORTS = ("decode_early", "decode_mid", "prefill_early", "prefill_mid")
MODEL = ModelGeometry("e2e", num_layers=2, num_kv_heads=4, head_dim=16)
PREFILL_TP, DECODE_TP = 2, 1  # the default pair
FLOWS = ("policy", "direct", "ring", "pinned", "pull", "push", "layerwise")
PREFILL_PAGE, DECODE_PAGE = 4, 8
PREFILL_PAGES, DECODE_PAGES = 512, 160  # decode pages are reused: the fence is exercised
AUX_ROWS = 64
WINDOW = 16  # rooms in flight per side
MAX_TOKENS = 48
# A controlled stall, not timing luck: a late room's chunks are all computed (and parked) by
# prefill long before decode registers, so push runs in the finish-first order.
LATE_SHARE, LATE_OPEN_S = 0.25, 0.1


def timeouts() -> Timeouts:
    return Timeouts(
        bootstrap_ns=5 * SEC,
        waiting_ns=5 * SEC,
        transfer_ns=30 * SEC,  # a cold Triton cache compiles kernels on first use (GPU runs)
        # Generous for a loaded 2-core CI machine: a missed beat fails every room of the peer.
        heartbeat_interval_ns=200 * MS,
        heartbeat_timeout_ns=3 * SEC,
        fence_ns=20 * SEC,
        tombstone_ns=60 * SEC,
    )


def prefill_pools(tp: int = PREFILL_TP, layout: Layout = Layout.SGLANG_NHD) -> list[PoolGeometry]:
    return [PoolGeometry(MODEL, tp, r, PREFILL_PAGE, PREFILL_PAGES, layout) for r in range(tp)]


def decode_pools(tp: int = DECODE_TP, layout: Layout = Layout.SGLANG_NHD) -> list[PoolGeometry]:
    return [PoolGeometry(MODEL, tp, r, DECODE_PAGE, DECODE_PAGES, layout) for r in range(tp)]


def staging(flow: str) -> StagingConfig:
    """Small staging memory, so the ring wraps and its watermark flow control is exercised: a
    chunk of MAX_TOKENS to one decode rank is at most 4 regions x 48 tokens x 4 heads x 32 B."""
    return StagingConfig(
        worker_buffer_bytes=64 << 10,
        ring_bytes=128 << 10,
        pinned_bytes=128 << 10,
        prefill_pinned_bytes=128 << 10,
        flow=None if flow == "policy" else flow,
    )


@dataclass(frozen=True)
class RoomPlan:
    index: int
    room: int
    tid: str
    tokens: int
    cuts: tuple[int, ...]  # chunk ends, the last one == tokens
    abort: str | None
    hold: bool
    late_open: bool = False  # decode opens the room LATE_OPEN_S after it could: prefill computes first


def rooms(seed: int, n: int, abort_rate: float, hold: bool = False) -> list[RoomPlan]:
    rng = random.Random(seed)
    out = []
    used: set[int] = set()
    for i in range(n):
        room = rng.getrandbits(63)
        while room in used:
            room = rng.getrandbits(63)
        used.add(room)
        tokens = rng.randint(2, MAX_TOKENS)
        k = rng.randint(1, 3)
        cuts = tuple(sorted({rng.randint(1, tokens - 1) for _ in range(k - 1)} | {tokens}))
        abort = rng.choice(ABORTS) if rng.random() < abort_rate else None
        if (hold or abort in ("decode_mid", "prefill_mid")) and len(cuts) < 2:
            cuts = (tokens // 2, tokens)
        out.append(RoomPlan(i, room, f"s{seed}-{i}", tokens, cuts, abort, hold))
    # From a stream of its own, so every other draw of a seed stays as it was.
    # Aborted rooms open on time: their abort kinds are defined against an on-time open.
    late = random.Random(f"late-{seed}")
    return [replace(p, late_open=late.random() < LATE_SHARE and p.abort is None) for p in out]


class Memory:
    """A rank's pool regions: numpy DRAM (the transport's own), or torch CUDA tensors with a host
    mirror the pattern is computed in (``push`` copies it to the GPU, ``pull`` copies back)."""

    def __init__(self, pool: PoolGeometry, mem: str) -> None:
        self.mem = mem
        self.host: dict[int, Any] = {}
        self.device: dict[int, Any] | None = None
        if mem == "VRAM":
            import numpy as np
            import torch

            # Ranks spread over the GPUs this process sees (CUDA_VISIBLE_DEVICES of its side).
            gpu = f"cuda:{pool.tp_rank % torch.cuda.device_count()}"
            self.device = {
                r.region_id: torch.zeros(r.nbytes, dtype=torch.uint8, device=gpu) for r in pool.regions
            }
            self.host = {r.region_id: np.zeros(r.nbytes, dtype=np.uint8) for r in pool.regions}

    def region_fn(self, transport: Any) -> Any:
        return transport.region if self.device is None else self.host.__getitem__

    def push(self) -> None:
        if self.device is not None:
            import torch

            for rid, t in self.device.items():
                t.copy_(torch.from_numpy(self.host[rid]))

    def pull(self) -> None:
        if self.device is not None:
            for rid, t in self.device.items():
                self.host[rid][:] = t.cpu().numpy()


def engine() -> str:
    """The executor both processes run (``KVFERRY_E2E_ENGINE``: python, the default, or native)."""
    import os

    return os.environ.get("KVFERRY_E2E_ENGINE", "python")


def stall_copies_if_asked() -> None:
    """A controlled stall: ``KVFERRY_E2E_COPY_DELAY_S`` makes every gather/scatter of this process
    take that much longer (GPU-like orderings on a CPU: copies finish after the writes and
    notices they race with)."""
    import os
    import time

    delay = float(os.environ.get("KVFERRY_E2E_COPY_DELAY_S", "0") or 0)
    if not delay:
        return
    from kvferry.backends import copy_exec
    from kvferry.backends.native import hostcopy

    def slowed(real: Any) -> Any:
        def slow(*args: Any, **kwargs: Any) -> int:
            time.sleep(delay)
            return real(*args, **kwargs)

        return slow

    copy_exec.copy_maps = slowed(copy_exec.copy_maps)
    hostcopy.copy_maps = slowed(hostcopy.copy_maps)  # a native-engine rank's host copy


def fence_events(ep: Any) -> int:
    """Copy ends the rank's native engine reported through its fences (0 on the Python executor)."""
    engine = ep.transport.agent.fence_engine()
    return engine.counters()["fence_events"] if engine is not None else 0
