"""Control-path CPU cost of the protocol core: µs per chunk and per room.

Runs N rooms of C chunks each through the in-memory harness (tests/harness.py): the real
SenderEngine/ReceiverEngine behind the real backends.driver.Driver, over MemTransport with KV byte
copying switched off (memory=False: descriptors are still bounds-checked, the aux row still moves,
no KV byte is allocated or copied). Rooms run in waves so the pools stay small.

Figures:
- core: time spent inside engine.handle / engine.run_chunk on every rank (the sans-IO machines,
  including planning, msgpack encode/decode of control messages and notifications);
- control path: the whole loop (core + driver + fake transport + harness bookkeeping), byte
  copying excluded since it never happens.
- stopwatch cost: the timers' own share of "core minus planning" (two process-clock reads per
  engine call, and the planner's wrapper inside it), measured on no-op calls in the same run and
  shown as its own row; the rows above it include it.
Times are process CPU time (time.process_time_ns), so a busy shared machine inflates them less.
Baseline measured in the same run: plan_rank_pair alone for the same chunks (what any transfer
must compute), so the ratio says what the protocol adds on top of planning.

    uv run python bench/core_bench.py                       # 10,000 rooms x 4 chunks, qwen3-8b, TP 1->1
    uv run python bench/core_bench.py --prefill-tp 2 --decode-tp 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import harness as H
from kvferry.core.deadlines import Timeouts
from kvferry.core.geometry import ModelGeometry, make_pools
from kvferry.core.kvpoll import is_terminal
from kvferry.core.planner import plan_rank_pair


class Timer:
    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0

    def wrap(self, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t = time.process_time_ns()
            try:
                return fn(*a, **k)
            finally:
                self.ns += time.process_time_ns() - t
                self.calls += 1

        return timed


def stopwatch_cost(n: int = 50_000) -> tuple[float, float]:
    """What the timers themselves add to ``core`` minus ``planning``, in ns: per timed engine call
    (the part of the two clock reads inside the window), and per planner call timed inside an
    engine call (the inner wrapper, less its own window). Measured on no-op calls, this run."""
    outer, inner = Timer(), Timer()
    noop = outer.wrap(lambda *a: None)
    for _ in range(n):
        noop(None, 0)
    per_call = outer.ns / outer.calls
    outer, inner = Timer(), Timer()
    planned = inner.wrap(lambda: None)
    nested = outer.wrap(lambda *a: planned())
    for _ in range(n):
        nested(None, 0)
    per_plan = (outer.ns - inner.ns) / n - per_call
    return per_call, per_plan


def batch_flush(w: H.World) -> None:
    """Deliver everything, pump every rank once, run every worker, complete every write; repeat."""
    now = w.fabric.now
    while True:
        n = 0
        pending, w.fabric.pending = w.fabric.pending, []
        for msg in pending:
            t = w.fabric.transports[msg.dst]
            (t.notes if msg.note else t.inbox).append(msg.data)
            n += 1
        for r in w.ranks:
            n += r.driver.pump(now)
        for r in w.prefill:
            for s in range(len(r.driver.queues)):
                while r.driver.worker_step(s, now) is not None:
                    n += 1
        while w.fabric.writes:
            w.fabric.complete(len(w.fabric.writes) - 1)
            n += 1
        if n == 0:
            return


def run(args: argparse.Namespace) -> dict[str, float]:
    model = ModelGeometry.preset(args.model) if args.model != "tiny" else H.TINY
    tokens = args.chunks * args.tokens_per_chunk
    pages_per_room = -(-tokens // args.page_size)
    num_pages = 2 * args.wave * pages_per_room
    aux_rows = H.AUX_ROWS
    wave = min(args.wave, aux_rows)
    w = H.World(
        model,
        args.prefill_tp,
        args.decode_tp,
        page_size=args.page_size,
        num_pages=num_pages,
        num_shards=args.shards,
        timeouts=Timeouts(),
        memory=False,
        seed=args.seed,
    )
    core, planning = Timer(), Timer()
    for r in w.ranks:
        r.engine.handle = core.wrap(r.engine.handle)
        if r.side == "prefill":
            r.engine.run_chunk = core.wrap(r.engine.run_chunk)
            r.engine.planner = planning.wrap(r.engine.planner)
    cuts = [args.tokens_per_chunk * (i + 1) for i in range(args.chunks)]
    done = ok = 0
    room = 1
    t0 = time.process_time_ns()
    while done < args.rooms:
        reqs = []
        for _ in range(min(wave, args.rooms - done)):
            req = w.open_room(room, f"r{room}", tokens, cuts)
            assert req is not None, "pool too small for the wave"
            reqs.append(req)
            room += 1
        batch_flush(w)
        for req in reqs:
            for p in range(w.P):
                while w.chunk_ready(req, p):
                    pass
        batch_flush(w)
        for req in reqs:
            for side, ranks in (("prefill", w.prefill), ("decode", w.decode)):
                for rank in ranks:
                    st = w.rank_status(rank, req)
                    assert st is not None and is_terminal(st), (req.room, side, st)
                    ok += st.value == 4
                    w.release(req, side, rank.index)
            del w.requests[(req.room, req.tid)]
        batch_flush(w)
        done += len(reqs)
    total = time.process_time_ns() - t0
    assert ok == args.rooms * (w.P + w.D), f"only {ok} rank-rooms succeeded"

    # Baseline: the planner alone, for the same rank pairs and chunks.
    src = make_pools(model, args.prefill_tp, args.page_size, num_pages)
    dst = make_pools(model, args.decode_tp, args.page_size, num_pages)
    rng = np.random.default_rng(args.seed)
    n_base = min(args.rooms, 1000)
    plans = 0
    t = time.process_time_ns()
    for _ in range(n_base):
        sp = rng.choice(num_pages, pages_per_room, replace=False)
        dp = rng.choice(num_pages, pages_per_room, replace=False)
        start = 0
        for end in cuts:
            for s in src:
                for d in dst:
                    plan_rank_pair(s, d, sp, dp, start, end)
                    plans += 1
            start = end
    base_ns = (time.process_time_ns() - t) / n_base
    chunks = args.rooms * args.chunks
    per_call, per_plan = stopwatch_cost()
    watch_ns = core.calls * per_call + planning.calls * per_plan
    return {
        "rooms": args.rooms,
        "chunks": chunks,
        "core_us_per_chunk": core.ns / chunks / 1e3,
        "core_us_per_room": core.ns / args.rooms / 1e3,
        "path_us_per_chunk": total / chunks / 1e3,
        "path_us_per_room": total / args.rooms / 1e3,
        "core_calls": core.calls,
        "protocol_us_per_chunk": (core.ns - planning.ns) / chunks / 1e3,
        "protocol_us_per_room": (core.ns - planning.ns) / args.rooms / 1e3,
        "protocol_net_us_per_chunk": (core.ns - planning.ns - watch_ns) / chunks / 1e3,
        "protocol_net_us_per_room": (core.ns - planning.ns - watch_ns) / args.rooms / 1e3,
        "stopwatch_ns_per_call": per_call,
        "stopwatch_ns_per_plan": per_plan,
        "in_engine_planner_us_per_room": planning.ns / args.rooms / 1e3,
        "planner_us_per_room": base_ns / 1e3,
        "core_over_planner": core.ns / args.rooms / base_ns,
        "path_over_planner": total / args.rooms / base_ns,
        "total_s": total / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rooms", type=int, default=10_000)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--tokens-per-chunk", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--wave", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    r = run(args)
    print(
        f"{args.model} TP {args.prefill_tp}->{args.decode_tp}, {r['rooms']} rooms x {args.chunks} chunks "
        f"of {args.tokens_per_chunk} tokens, page {args.page_size}, {args.shards} worker queues"
    )
    rows = [
        ("core (engines, planning included)", r["core_us_per_chunk"], r["core_us_per_room"]),
        ("core minus planning", r["protocol_us_per_chunk"], r["protocol_us_per_room"]),
        ("  the same, stopwatch cost removed", r["protocol_net_us_per_chunk"], r["protocol_net_us_per_room"]),
        ("control path (no byte copies)", r["path_us_per_chunk"], r["path_us_per_room"]),
    ]
    for name, per_chunk, per_room in rows:
        print(f"  {name:36s} {per_chunk:8.1f} us/chunk {per_room:9.1f} us/room")
    print(
        f"  stopwatch: {r['stopwatch_ns_per_call']:.0f} ns per timed engine call, "
        f"{r['stopwatch_ns_per_plan']:.0f} ns per timed planner call (no-op calls, this run)"
    )
    print(
        f"  baseline: planner alone {r['planner_us_per_room']:.1f} us/room "
        f"(inside the engines: {r['in_engine_planner_us_per_room']:.1f})"
    )
    print(f"  ratios: core/planner {r['core_over_planner']:.2f}x, path/planner {r['path_over_planner']:.2f}x")
    print(f"  engine calls: {r['core_calls']}, wall {r['total_s']:.2f} s")


if __name__ == "__main__":
    main()
