"""Hand-off latency on the real backend: "prefill's forward pass finished" -> "decode holds the KV".

vLLM PR 35264's measure, taken over real NIXL (DRAM, UCX loopback, one process) for the three flows
that move the KV without staging: register-then-write (``direct``: decode's TransferInfo is the
registration, prefill writes as soon as the chunk is computed), ``push`` (decode's registration
is a lease, matched by transfer id) and ``pull`` (prefill offers its pages, decode READs them and
says when it is done). For every room decode opens first and prefill's ranks wait until they have
heard from every decode rank (WaitingForInput), as in a deployment where decode allocated while
prefill computed; then the clock starts at prefill's last ``send`` (the forward pass finished)
and stops when every decode rank reports Success. Pages contiguous (one run) or fragmented (a
random permutation of the pool's pages on both sides, so every page is its own descriptor).
Every Success room's bytes are checked against what prefill holds.

    uv run python bench/handoff_latency.py                      # TP 1->1 and 2->1, 256 tokens
    uv run python bench/handoff_latency.py --tokens 1024 --tp 1:1 --json

Medians over ``--rooms`` rooms (after 2 warm-up rooms); the ratio column is each flow's median
over push's in the same run (vLLM PR 35264 reports push 1.2-3x faster than pull in TTFT).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

FLOWS = ("direct", "push", "pull")
WARMUP = 2


def _parse_tp(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want PREFILL:DECODE, e.g. 2:1") from None
    if not (1 <= p <= 8 and 1 <= d <= 8):
        raise argparse.ArgumentTypeError(f"{text!r}: TP sizes must be 1..8")
    return p, d


def run_pair(model: Any, ptp: int, dtp: int, tokens: int, rooms: int, seed: int) -> list[dict[str, Any]]:
    from kvferry.backends.loopback.plan import timeouts
    from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
    from kvferry.backends.runtime.staging import StagingConfig
    from kvferry.core.geometry import PoolGeometry
    from kvferry.core.kvpoll import KVPoll
    from kvferry.core.topology import receiver_endpoints

    page = 16
    room_pages = -(-tokens // page)
    pool_pages = 2 * room_pages  # two slots: fragmented rooms draw from the whole pool
    cfg = RuntimeConfig(
        num_queues=2,
        aux_rows=16,
        timeouts=timeouts(),
        idle_max_s=2e-4,
        staging=StagingConfig(worker_buffer_bytes=0, ring_bytes=0),
    )
    pre = [
        PrefillEndpoint("P", PoolGeometry(model, ptp, r, page, pool_pages), config=cfg) for r in range(ptp)
    ]
    dec = [
        DecodeEndpoint(
            "D",
            PoolGeometry(model, dtp, r, page, pool_pages),
            prefill_server="P",
            prefill_addresses=[p.address for p in pre],
            config=cfg,
        )
        for r in range(dtp)
    ]
    for ep in (*pre, *dec):
        ep.start()
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    room_id = 100
    try:
        for pages_kind in ("contiguous", "fragmented"):
            for flow in FLOWS:
                times: list[float] = []
                for i in range(WARMUP + rooms):
                    room_id += 1
                    if pages_kind == "contiguous":
                        src = dst = np.arange(room_pages, dtype=np.int64) + (i % 2) * room_pages
                    else:
                        src = rng.permutation(pool_pages)[:room_pages].astype(np.int64)
                        dst = rng.permutation(pool_pages)[:room_pages].astype(np.int64)
                    for p in pre:  # a recognisable pattern per room, so a check means something
                        for r in p.pool.regions:
                            view = p.transport.region(r.region_id)
                            view[:] = (room_id + r.region_id + 7 * p.pool.tp_rank) % 251
                    tid = f"h{room_id}"
                    rvs = [d.receiver(room_id, tid) for d in dec]
                    for rv in rvs:
                        rv.init(dst, tokens, i % 16)
                    txs = []
                    for p in pre:
                        tx = p.sender(room_id, tid)
                        tx.write_aux(i % 16, room_id.to_bytes(8, "little"))
                        recv = receiver_endpoints(model, ptp, dtp, p.pool.tp_rank)
                        tx.init(i % 16, flow=flow, receivers=recv)
                        txs.append(tx)
                    for p in pre:  # decode allocated and registered while prefill computed
                        st = p.board.wait_for(room_id, tid, {KVPoll.WaitingForInput, KVPoll.Failed}, 10.0)
                        if st is not KVPoll.WaitingForInput:
                            raise SystemExit(f"error: room {room_id} ({flow}) never reached WaitingForInput")
                    t0 = time.perf_counter()
                    for tx in txs:
                        tx.send(src, tokens, is_last=True)
                    sts = [rv.wait(30.0) for rv in rvs]
                    dt = time.perf_counter() - t0
                    if any(s is not KVPoll.Success for s in sts):
                        rvs[0].failure_exception()
                        raise SystemExit(f"error: room {room_id} ({flow}, {pages_kind}) ended {sts}")
                    for tx in txs:
                        tx.wait(30.0)
                    bad = _mismatches(pre, dec, src, dst, tokens)
                    if bad:
                        raise SystemExit(f"error: room {room_id} ({flow}, {pages_kind}): {bad} bytes wrong")
                    for h in (*txs, *rvs):
                        h.clear()
                    if i >= WARMUP:
                        times.append(dt)
                rows.append(
                    {
                        "tp": f"{ptp}->{dtp}",
                        "pages": pages_kind,
                        "flow": flow,
                        "rooms": len(times),
                        "p50_us": statistics.median(times) * 1e6,
                        "min_us": min(times) * 1e6,
                    }
                )
                print(
                    f"  {ptp}->{dtp} {pages_kind:10s} {flow:6s} p50 {rows[-1]['p50_us']:9.0f} us",
                    file=sys.stderr,
                )
    finally:
        for ep in (*pre, *dec):
            ep.close()
    return rows


def _mismatches(pre: list[Any], dec: list[Any], src: np.ndarray, dst: np.ndarray, tokens: int) -> int:
    """Bytes of the room on decode that differ from prefill's, head by head (any TP pair)."""
    model = pre[0].pool.model
    heads, hd = model.num_kv_heads, model.head_dim
    bad = 0
    for r in pre[0].pool.regions:
        full = []
        for p in pre:  # the room's tokens of this region, all heads, from the prefill ranks
            a = p.transport.region(r.region_id).reshape(p.pool.num_pages, p.pool.page_size, -1, hd)
            full.append(a[src].reshape(-1, a.shape[2], hd)[:tokens])
        want = _dedup_heads(full, heads)
        got = [
            d.transport.region(r.region_id).reshape(d.pool.num_pages, d.pool.page_size, -1, hd)[dst]
            for d in dec
        ]
        have = _dedup_heads([g.reshape(-1, g.shape[2], hd)[:tokens] for g in got], heads)
        bad += int(np.count_nonzero(want != have))
    return bad


def _dedup_heads(parts: list[np.ndarray], heads: int) -> np.ndarray:
    """Concatenate the ranks' head slices; replicated heads (more ranks than heads) appear once."""
    cat = np.concatenate(parts, axis=1)
    if cat.shape[1] > heads:
        step = cat.shape[1] // heads
        cat = cat[:, ::step]
    return cat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b", help="a preset name")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rooms", type=int, default=8)
    ap.add_argument("--tp", type=_parse_tp, action="append", help="PREFILL:DECODE (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not 1 <= a.tokens <= 32768:
        ap.error("--tokens must be 1..32768")
    if not 1 <= a.rooms <= 1000:
        ap.error("--rooms must be 1..1000")
    os.environ.setdefault("KVFERRY_CONTROL_KEY", os.urandom(32).hex())
    from kvferry.core.geometry import ModelGeometry

    try:
        model = ModelGeometry.preset(a.model)
    except (KeyError, ValueError) as exc:
        ap.error(f"--model: {exc}")
    rows: list[dict[str, Any]] = []
    for ptp, dtp in a.tp or [(1, 1), (2, 1)]:
        rows += run_pair(model, ptp, dtp, a.tokens, a.rooms, a.seed)
    push = {(r["tp"], r["pages"]): r["p50_us"] for r in rows if r["flow"] == "push"}
    for r in rows:
        r["over_push"] = r["p50_us"] / push[(r["tp"], r["pages"])]
    if a.json:
        print(json.dumps({"model": a.model, "tokens": a.tokens, "rows": rows}))
        return
    print(f"{a.model}, {a.tokens} tokens, forward finished -> decode holds the KV (median of {a.rooms})")
    print(f"{'TP':6s} {'pages':11s} {'flow':7s} {'p50 us':>10s} {'min us':>10s} {'/ push':>7s}")
    for r in rows:
        print(
            f"{r['tp']:6s} {r['pages']:11s} {r['flow']:7s} {r['p50_us']:10.0f} {r['min_us']:10.0f} "
            f"{r['over_push']:7.2f}"
        )


if __name__ == "__main__":
    main()
