"""What a ring room costs the data threads on the native engine: their wake-ups (loop passes),
copy-state checks and CPU, with the copies' ends watched by the engine's fences ("fenced", the
default) or polled by the data thread as before ("polled": the executors are not given the
engine, so the driver checks every copy and the data thread keeps its fast pace while copies are
in flight).

One process, a prefill and a decode endpoint (TP 1 -> 1, real NIXL over UCX on DRAM, the native
engine), rooms one after another, each in ``--chunks`` chunks through the staging ring. Counts are
per room, both endpoints' data threads together; compare the two modes alternately on a quiet host.

    python bench/ring_wakeups.py --mode fenced|polled [--rooms 100] [--tokens 256] [--chunks 4]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import numpy as np
from kvferry.backends import pattern
from kvferry.backends.nixl.agent import NixlAgent
from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
from kvferry.backends.runtime.interference import _thread_cpu_s
from kvferry.backends.runtime.staging import StagingConfig
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll

MODEL = ModelGeometry("ring-bench", num_layers=8, num_kv_heads=8, head_dim=128)
PAGE = 16


def _count_data_loop(ep: Any, counts: dict[str, int]) -> None:
    """Count the data loop's passes and sleeps and the transport's copy checks."""
    loop = next(lp for lp in ep._loops if lp.name.endswith("-data"))
    step, wait, check = loop._step, loop._wait, ep.transport.check_copy

    def counted_step() -> bool:
        counts["passes"] += 1
        counts.setdefault("tid", set()).add(threading.get_native_id())
        return step()

    def counted_wait(timeout_s: float) -> object:
        counts["sleeps"] += 1
        return wait(timeout_s) if wait is not None else loop.stop_event.wait(timeout_s)

    def counted_check(handle: Any) -> Any:
        counts["copy_checks"] += 1
        return check(handle)

    loop._step, loop._wait, ep.transport.check_copy = counted_step, counted_wait, counted_check


def _endpoints(tokens: int) -> tuple[PrefillEndpoint, DecodeEndpoint]:
    """A prefill and a decode endpoint of one ring room's size, not started."""
    pages_per_room = -(-tokens // PAGE)
    room_bytes = MODEL.num_regions * PAGE * MODEL.num_kv_heads * MODEL.head_dim * 2 * pages_per_room
    cfg = RuntimeConfig(
        num_queues=1,
        aux_rows=8,
        nixl_engine="native",
        control_insecure=True,
        staging=StagingConfig(worker_buffer_bytes=room_bytes, ring_bytes=4 * room_bytes, flow="ring"),
    )
    pool = PoolGeometry(MODEL, 1, 0, PAGE, 2 * pages_per_room)
    pre = PrefillEndpoint("P", pool, config=cfg)
    dec = DecodeEndpoint("D", pool, prefill_server="P", prefill_addresses=[pre.address], config=cfg)
    return pre, dec


def _move_room(pre: PrefillEndpoint, dec: DecodeEndpoint, room: int, tokens: int, chunks: int) -> float:
    """One room of ``tokens`` in ``chunks`` sends; returns its wall time (seconds)."""
    pages = np.arange(-(-tokens // PAGE))
    t0 = time.perf_counter()
    rv = dec.receiver(room, f"r{room}")
    rv.init(pages, tokens, 0)
    pattern.fill(pre.pool, pre.transport.region, room, pages, 0, tokens)
    s = pre.sender(room, f"r{room}")
    s.write_aux(0, room.to_bytes(8, "little"))
    s.init(0)
    for c in range(chunks):
        s.send(pages, tokens * (c + 1) // chunks, is_last=c + 1 == chunks)
    if rv.wait(30) is not KVPoll.Success or s.wait(30) is not KVPoll.Success:
        raise SystemExit(f"room {room} did not succeed")
    wall = time.perf_counter() - t0
    rv.clear()
    s.clear()
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="fenced", choices=("fenced", "polled"))
    ap.add_argument("--rooms", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=4)
    a = ap.parse_args()
    engine_of = NixlAgent.fence_engine
    if a.mode == "polled":  # the executors are built without the engine: the copies polled
        NixlAgent.fence_engine = lambda self: None  # type: ignore[method-assign]
    pre, dec = _endpoints(a.tokens)
    counts: dict[str, Any] = {"passes": 0, "sleeps": 0, "copy_checks": 0}
    for ep in (pre, dec):
        _count_data_loop(ep, counts)
        ep.start()
    try:
        _move_room(pre, dec, 0, a.tokens, a.chunks)  # connect and warm up first
        base = {k: counts[k] for k in ("passes", "sleeps", "copy_checks")}
        cpu0 = _thread_cpu_s(counts["tid"])
        walls = [_move_room(pre, dec, i, a.tokens, a.chunks) for i in range(1, a.rooms + 1)]
        cpu = _thread_cpu_s(counts["tid"]) - cpu0
        out = {k: round((counts[k] - base[k]) / a.rooms, 1) for k in base}
        out.update(
            mode=a.mode,
            rooms=a.rooms,
            chunks=a.chunks,
            room_ms_p50=round(float(np.median(walls)) * 1e3, 2),
            data_cpu_ms_per_room=round(cpu / a.rooms * 1e3, 2),
            fence_events=sum(engine_of(ep.transport.agent).counters()["fence_events"] for ep in (pre, dec)),
        )
        print(json.dumps(out))
    finally:
        for ep in (pre, dec):
            ep.close()


if __name__ == "__main__":
    main()
