"""What the tests of the threaded runtime over real NIXL share: a small model and wall-clock
timeouts long enough for a loaded 2-core CI machine (seconds, where the harness's are ticks)."""

from __future__ import annotations

from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
from kvferry.core.deadlines import MS, SEC, Timeouts
from kvferry.core.geometry import ModelGeometry, PoolGeometry

MODEL = ModelGeometry("rt", num_layers=2, num_kv_heads=4, head_dim=8)
TIMEOUTS = Timeouts(
    bootstrap_ns=10 * SEC,
    waiting_ns=10 * SEC,
    transfer_ns=10 * SEC,
    heartbeat_interval_ns=200 * MS,
    heartbeat_timeout_ns=5 * SEC,
    fence_ns=40 * SEC,
    tombstone_ns=60 * SEC,
)


def two_to_one(cfg: RuntimeConfig, pages: int) -> tuple[list[PrefillEndpoint], DecodeEndpoint]:
    """Two prefill ranks and one decode rank of MODEL (4-token pages), not started."""
    pre = [PrefillEndpoint("P", PoolGeometry(MODEL, 2, r, 4, pages), config=cfg) for r in range(2)]
    dec = DecodeEndpoint(
        "D",
        PoolGeometry(MODEL, 1, 0, 4, pages),
        prefill_server="P",
        prefill_addresses=[p.address for p in pre],
        config=cfg,
    )
    return pre, dec
