"""What the tests of the threaded runtime over real NIXL share: a small model and wall-clock
timeouts long enough for a loaded 2-core CI machine (seconds, where the harness's are ticks)."""

from __future__ import annotations

from kvferry.core.deadlines import MS, SEC, Timeouts
from kvferry.core.geometry import ModelGeometry

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
