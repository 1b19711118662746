"""Which Python containers grow with the number of rooms a live endpoint pair has served?

The soak (`kvferry soak`) checks every table it knows of and resident memory; this looks for the
tables nobody knows of. One process, a prefill and a decode endpoint over real NIXL (DRAM, UCX
loopback), tiny rooms of one flow; tombstones live 0.5 s so finished rooms really are forgotten.
After a warm-up batch and again after a larger one (each followed by a pause longer than the
tombstone lifetime), every dict, list, set and deque the garbage collector tracks is counted; a
container that grew by ``--min-growth`` entries or more between the two is printed with its
growth. Expected: only NIXL's per-write telemetry ring (bounded at 4096 records).

    uv run python bench/leak_census.py --flow push --rooms 2000
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flow", default="direct", choices=["direct", "ring", "pinned", "push", "pull"])
    ap.add_argument("--rooms", type=int, default=2000)
    ap.add_argument("--min-growth", type=int, default=100)
    a = ap.parse_args()
    if not 100 <= a.rooms <= 1_000_000:
        ap.error("--rooms must be 100..1000000")
    os.environ.setdefault("KVFERRY_CONTROL_KEY", os.urandom(32).hex())

    import msgspec
    import numpy as np
    from kvferry.backends.loopback.plan import timeouts as loopback_timeouts
    from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
    from kvferry.backends.runtime.staging import StagingConfig
    from kvferry.core.deadlines import MS
    from kvferry.core.geometry import ModelGeometry, PoolGeometry
    from kvferry.core.kvpoll import KVPoll

    model = ModelGeometry("census", num_layers=2, num_kv_heads=4, head_dim=8)
    # The soak's deadlines, with tombstones short enough that finished rooms are really forgotten.
    t = msgspec.structs.replace(loopback_timeouts(), tombstone_ns=500 * MS)
    staging = StagingConfig(
        worker_buffer_bytes=32 << 10,
        ring_bytes=64 << 10,
        pinned_bytes=64 << 10,
        prefill_pinned_bytes=64 << 10,
        flow=a.flow,
    )
    cfg = RuntimeConfig(num_queues=2, aux_rows=16, timeouts=t, staging=staging)
    pre = PrefillEndpoint("P", PoolGeometry(model, 1, 0, 4, 64), config=cfg)
    dec = DecodeEndpoint(
        "D", PoolGeometry(model, 1, 0, 4, 64), prefill_server="P", prefill_addresses=[pre.address], config=cfg
    )
    for ep in (pre, dec):
        ep.start()

    def serve(first: int, last: int) -> None:
        for i in range(first, last):
            pages = np.arange(4) + (i % 8) * 4
            tx = pre.sender(i, f"t{i}")
            tx.write_aux(i % 16, i.to_bytes(8, "little"))
            tx.init(i % 16)
            rx = dec.receiver(i, f"t{i}")
            rx.init(pages, 8, i % 16)
            tx.send(pages, 8, True)
            if rx.wait(10) is not KVPoll.Success or tx.wait(10) is not KVPoll.Success:
                raise SystemExit(f"error: room {i} did not succeed")
            tx.clear()
            rx.clear()
        time.sleep(1.5)  # past the tombstone lifetime and a few heartbeats

    def census() -> dict[int, tuple[str, int, Any]]:
        gc.collect()
        kinds = (dict, list, set, collections.deque)
        return {id(o): (type(o).__name__, len(o), o) for o in gc.get_objects() if isinstance(o, kinds)}

    warm = max(100, a.rooms // 4)
    try:
        serve(0, warm)
        before = census()
        serve(warm, warm + a.rooms)
        after = census()
    finally:
        for ep in (pre, dec):
            ep.close()
    grew = sorted(
        (
            (n - before[k][1], kind, n, repr(o)[:120])
            for k, (kind, n, o) in after.items()
            if k in before and n - before[k][1] >= a.min_growth
        ),
        reverse=True,
    )
    print(f"{a.flow}: {a.rooms} rooms after {warm} of warm-up; containers grown by >= {a.min_growth}:")
    for growth, kind, n, text in grew:
        print(f"  +{growth} -> {n} {kind}: {text}")
    if not grew:
        print("  none")


if __name__ == "__main__":
    main()
