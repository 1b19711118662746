"""Where a small room's time goes: a timeline of the hops of one room through the real runtime.

One process, one prefill and one decode endpoint over real NIXL (DRAM, UCX loopback), TP 1 -> 1,
rooms of a few KB so bytes do not matter (default), or of a preset model's real size
(``--model qwen3-8b --tokens 4096``). ``--mem VRAM`` is not a GPU measurement: with both
endpoints in one process UCX moved 604 MB rooms at 0.4 GB/s on an H100 (no cuda_ipc inside one
process); for GPU rooms use the two-process ``kvferry bench nixl --mem VRAM --trace DIR``.
Prefill opens each room and hands over its only chunk
first (the chunk parks until decode registers); the clock starts when decode opens the room. The
hops are timed by wrapping the functions each one passes through (``time.perf_counter`` after
each): decode sends its TransferInfo, prefill's control thread takes it in and the engine handles
it, a worker starts the chunk, NIXL posts the KV write and the aux write, and decode's status
board turns Success. The median of each hop over the rooms is printed (microseconds from decode's
open), and the room's whole latency beside it.

Run: ``KVFERRY_CONTROL_KEY=... uv run python bench/room_timeline.py [--flow direct|ring]
[--rooms 60] [--idle-max-us 200] [--mem DRAM|VRAM] [--model tiny|PRESET] [--tokens 8]
[--json]``. ``--idle-max-us`` is the data thread's longest idle
sleep (``RuntimeConfig.idle_max_s``): it bounds how late a write completion or a notification is
noticed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

HOPS = (
    ("decode sent TransferInfo", "d.send_control"),
    ("prefill control thread has it", "p.controls_in>"),
    ("prefill engine handled it", "p.controls_in"),
    ("worker starts the chunk", "p.worker_step>"),
    ("the engine planned it (run_chunk returns)", "p.run_chunk"),
    ("NIXL post of the KV write begins", "p.post#1>"),
    ("NIXL post of the KV write returns", "p.post#1"),
    ("NIXL post of the aux write returns", "p.post#2"),
    ("worker done", "p.worker_step"),
    ("prefill sees its KV write DONE", "p.xfer_done"),
    ("decode drains a notification", "d.notif"),
    ("decode Success on its board", "d.success"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flow", default="direct", choices=["direct", "ring"])
    ap.add_argument("--rooms", type=int, default=60)
    ap.add_argument("--idle-max-us", type=float, default=200.0)
    ap.add_argument("--mem", default="DRAM", choices=["DRAM", "VRAM"])
    ap.add_argument("--model", default="tiny", help="tiny (a few KB per room) or a preset name")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.rooms < 11:
        ap.error("--rooms must be >= 11 (the first 10 are warm-up)")
    if not 1 <= a.tokens <= 1 << 17:
        ap.error("--tokens must be 1..131072")
    os.environ.setdefault("KVFERRY_CONTROL_KEY", os.urandom(32).hex())

    from kvferry.backends.loopback.plan import timeouts as loopback_timeouts
    from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
    from kvferry.backends.runtime.staging import StagingConfig
    from kvferry.core.geometry import ModelGeometry, PoolGeometry
    from kvferry.core.kvpoll import KVPoll
    from kvferry.core.messages import TransferInfo, decode_control

    from kvferry.tools.runtime_bench import _buffers

    if a.model == "tiny":
        model = ModelGeometry("timeline", num_layers=2, num_kv_heads=4, head_dim=8)
    else:
        try:
            model = ModelGeometry.preset(a.model)
        except (KeyError, ValueError) as exc:
            raise SystemExit(f"error: --model: {exc}") from None
    page = 4 if a.model == "tiny" else 16
    room_pages = -(-a.tokens // page)
    slots = 8 if a.model == "tiny" else 2  # rooms cycle through these page ranges
    t = loopback_timeouts()  # the soak's: generous for a loaded 2-core machine
    pool = PoolGeometry(model, 1, 0, page, room_pages * slots)
    room_bytes = pool.token_bytes * model.num_regions * a.tokens
    chunk_bytes = max(32 << 10, room_bytes + (64 << 10))
    staging = StagingConfig(worker_buffer_bytes=chunk_bytes, ring_bytes=2 * chunk_bytes, flow=a.flow)
    cfg = RuntimeConfig(
        num_queues=2, aux_rows=16, timeouts=t, staging=staging, idle_max_s=a.idle_max_us * 1e-6
    )
    keep = []
    if a.mem == "VRAM":
        pbuf, pregions, _ = _buffers(pool, 1, "VRAM")
        dbuf, dregions, _ = _buffers(pool, 0, "VRAM")
        keep += [pbuf, dbuf]
    else:
        pregions = dregions = None
    pre = PrefillEndpoint("P", pool, buffers=pregions, config=cfg)
    dec = DecodeEndpoint(
        "D",
        pool,
        prefill_server="P",
        prefill_addresses=[pre.address],
        buffers=dregions,
        config=cfg,
    )
    for ep in (pre, dec):
        ep.start()

    marks: dict[str, float] = {}
    t0 = [0.0]
    posts = [0]

    def mark(tag: str) -> None:
        marks.setdefault(tag, time.perf_counter() - t0[0])  # the first pass of this room

    def wrap(obj: Any, name: str, tag: Callable[..., str | None]) -> None:
        inner = getattr(obj, name)

        def timed(*args: Any, **kw: Any) -> Any:
            name_ = tag(*args, **kw)
            if name_:
                mark(name_ + ">")
            out = inner(*args, **kw)
            if name_:
                mark(name_)
            return out

        setattr(obj, name, timed)

    def post_tag(*_: Any, **__: Any) -> str:
        posts[0] += 1
        return f"p.post#{posts[0]}"

    main_thread = threading.main_thread()

    def carries_info(controls: list[bytes] | None) -> bool:  # not a heartbeat
        return any(isinstance(decode_control(c), TransferInfo) for c in controls or ())

    # Only the room's own messages: heartbeats go through the same calls from the control thread.
    wrap(
        dec.transport,
        "send_control",
        lambda *_a, **_k: "d.send_control" if threading.current_thread() is main_thread else None,
    )
    wrap(pre.driver, "_feed_controls", lambda now, c=None: "p.controls_in" if carries_info(c) else None)
    wrap(pre.driver, "worker_step", lambda *_a, **_k: "p.worker_step")
    wrap(pre.engine, "run_chunk", lambda *_a, **_k: "p.run_chunk")
    wrap(pre.transport.agent, "post", post_tag)
    wrap(pre.transport.agent, "post_single", post_tag)
    drain = dec.transport.drain_notifs

    def on_drain() -> list[bytes]:
        got = drain()
        if got:
            mark("d.notif")
        return got

    dec.transport.drain_notifs = on_drain  # type: ignore[method-assign]
    check_xfer = pre.transport.check_xfer

    def on_check(handle: Any) -> Any:
        state = check_xfer(handle)
        if state.name == "DONE":
            mark("p.xfer_done")
        return state

    pre.transport.check_xfer = on_check  # type: ignore[method-assign]
    board_update = dec.board.update

    def on_update(room: int, tid: str, status: Any, *rest: Any) -> Any:
        if status is KVPoll.Success:
            mark("d.success")
        return board_update(room, tid, status, *rest)

    dec.board.update = on_update  # type: ignore[method-assign]

    rows: list[dict[str, float]] = []
    latencies: list[float] = []
    try:
        for i in range(a.rooms):
            room, tid = 500 + i, f"t{i}"
            pages = np.arange(room_pages, dtype=np.int64) + (i % slots) * room_pages
            s = pre.sender(room, tid)
            s.write_aux(i % 16, room.to_bytes(8, "little"))
            s.init(i % 16)
            s.send(pages, a.tokens, is_last=True)
            time.sleep(0.002)  # the chunk parks: only decode's side is on the clock
            marks.clear()
            posts[0] = 0
            t0[0] = time.perf_counter()
            rv = dec.receiver(room, tid)
            rv.init(pages, a.tokens, i % 16)
            status = rv.wait(10)
            latency = time.perf_counter() - t0[0]
            if status is not KVPoll.Success:
                raise SystemExit(f"error: room {room} ended {status}")
            s.wait(10)
            s.clear()
            rv.clear()
            if i >= 10:
                rows.append(dict(marks))
                latencies.append(latency)
    finally:
        for ep in (pre, dec):
            ep.close()

    def med(tag: str) -> float | None:
        vals = [r[tag] for r in rows if tag in r]
        return statistics.median(vals) * 1e6 if vals else None

    out = {
        "flow": a.flow,
        "mem": a.mem,
        "model": a.model,
        "tokens": a.tokens,
        "room_bytes": room_bytes,
        "rooms": len(rows),
        "idle_max_us": a.idle_max_us,
        "room_latency_us_p50": statistics.median(latencies) * 1e6,
        "room_latency_us_min": min(latencies) * 1e6,
        "hops_us": {label: med(tag) for label, tag in HOPS},
    }
    if a.json:
        print(json.dumps(out))
        return
    print(
        f"{a.flow}, TP 1 -> 1, {a.mem}, {a.model} x {a.tokens} tokens ({room_bytes / 1e6:.1f} MB), "
        f"{len(rows)} rooms, data thread idle sleep <= {a.idle_max_us:.0f} us"
    )
    print(
        f"room latency (decode open -> Success): p50 {out['room_latency_us_p50']:.0f} us, "
        f"min {out['room_latency_us_min']:.0f} us"
    )
    for label, us in out["hops_us"].items():
        print(f"  {'-' if us is None else f'{us:8.0f}'} us  {label}")


if __name__ == "__main__":
    main()
