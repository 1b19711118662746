"""Head-of-line probe: a small room's latency while a big TP 2->1 post runs on
another worker shard, against the same small room with nothing else in flight (same run).

One process, real runtime over real NIXL (DRAM, loopback UCX): prefill server "P" with 2 ranks
(qwen3-8b KV, NHD pages of 16), decode server "D" with one rank, ``num_queues=2``. A big room of
``--tokens`` tokens (even room id: worker shard 0; its post is 294,912 one-KiB descriptors per
rank at 4096 tokens) is opened; once a prefill worker is inside its post, a 16-token room (odd id:
shard 1) is opened and timed from decode's ``init`` to its Success on decode. Prints the median
latency alone, the median behind the big post, and their ratio; the small room's bytes are
checked, and the time the small room spent inside its own NIXL post calls is printed (where a
remaining wait sits below the driver).
Usage: ``uv run python bench/nixl_hol_probe.py [--reps 5] [--tokens 4096]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgspec
import numpy as np
from kvferry.backends import pattern
from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
from kvferry.core.deadlines import SEC, Timeouts
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.core.messages import decode_note

PAGE = 16


def _start(pre, dec, room, pages, tokens, aux):
    rv = dec.receiver(room, f"t{room}")
    rv.init(pages, tokens, aux)
    senders = []
    for p in pre:
        s = p.sender(room, f"t{room}")
        s.write_aux(aux, room.to_bytes(8, "little"))
        s.init(aux)
        s.send(pages, tokens, is_last=True)
        senders.append(s)
    return rv, senders


def _done(rv, senders):
    assert rv.wait(120) is KVPoll.Success and all(s.wait(120) is KVPoll.Success for s in senders)
    for h in [rv, *senders]:
        h.clear()


def _posting(ep) -> bool:
    """True while some worker of ``ep`` is inside a post (new driver), or holds the driver lock
    with a write emitted but not yet in flight (old driver: it posts under the lock)."""
    drv = ep.driver
    if hasattr(drv, "posting"):
        return drv.posting > 0
    return ep.lock.locked() and ep.transport.agent.inflight() == 0 and bool(ep.engine.writes)


def _time_posts(ep, out: dict[int, float]) -> None:
    real = ep.transport.post_write

    def timed(peer, *args):
        room = decode_note(args[-1]).room
        t0 = time.perf_counter()
        try:
            return real(peer, *args)
        finally:
            if room % 2:
                out[room] = max(out.get(room, 0.0), time.perf_counter() - t0)

    ep.transport.post_write = timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ucx-workers", type=int, default=1, help="RuntimeConfig.nixl_ucx_workers")
    args = ap.parse_args()
    model = ModelGeometry.preset("qwen3-8b")
    big_pages = -(-args.tokens // PAGE)
    pages = big_pages + 1
    t = Timeouts(
        bootstrap_ns=120 * SEC, waiting_ns=120 * SEC, transfer_ns=120 * SEC, heartbeat_timeout_ns=60 * SEC
    )
    cfg = RuntimeConfig(num_queues=2, aux_rows=8, timeouts=t, idle_max_s=2e-4)
    if "control_keys" in RuntimeConfig.__struct_fields__:  # both ends live here: a fresh key
        from kvferry.backends.runtime.security import ephemeral_key

        cfg = msgspec.structs.replace(cfg, control_keys=(ephemeral_key(),))
    if args.ucx_workers != 1:  # older trees (the pre-fix comparison) lack the field
        cfg = msgspec.structs.replace(cfg, nixl_ucx_workers=args.ucx_workers)
    pre = [PrefillEndpoint("P", PoolGeometry(model, 2, r, PAGE, pages), config=cfg) for r in range(2)]
    dec = DecodeEndpoint(
        "D",
        PoolGeometry(model, 1, 0, PAGE, pages),
        prefill_server="P",
        prefill_addresses=[p.address for p in pre],
        config=cfg,
    )
    for e in [*pre, dec]:
        e.start()
    post_s: dict[int, float] = {}  # small room -> its slowest post_write call (where it waited)
    for p in pre:
        _time_posts(p, post_s)
    small = np.array([big_pages])
    for p in pre:
        pattern.fill(p.pool, p.transport.region, 1, small, 0, PAGE)
    alone, behind, big_s, in_post = [], [], [], []
    try:
        for k in range(args.reps + 1):  # the first of each is a warm-up
            small_room = 2 * k + 1
            for p in pre:
                pattern.fill(p.pool, p.transport.region, small_room, small, 0, PAGE)
            t0 = time.perf_counter()
            _done(*_start(pre, dec, small_room, small, PAGE, 1))
            if k:
                alone.append(time.perf_counter() - t0)
            tb = time.perf_counter()
            big = _start(pre, dec, 2 * k, np.arange(big_pages), args.tokens, 0)
            while not any(_posting(p) for p in pre):
                time.sleep(1e-4)
            small_room += 1000
            for p in pre:
                pattern.fill(p.pool, p.transport.region, small_room, small, 0, PAGE)
            t0 = time.perf_counter()
            _done(*_start(pre, dec, small_room, small, PAGE, 1))
            if k:
                behind.append(time.perf_counter() - t0)
                in_post.append(post_s.get(small_room, 0.0))
            assert pattern.mismatches(dec.pool, dec.transport.region, small_room, small, PAGE)[0] == 0
            _done(*big)
            if k:
                big_s.append(time.perf_counter() - tb)
    finally:
        for e in [*pre, dec]:
            e.close()
    a, b = statistics.median(alone), statistics.median(behind)
    print(
        f"small room alone {a * 1e3:.1f} ms (range {min(alone) * 1e3:.1f}-{max(alone) * 1e3:.1f}), "
        f"behind a {args.tokens}-token TP 2->1 post {b * 1e3:.1f} ms "
        f"(range {min(behind) * 1e3:.1f}-{max(behind) * 1e3:.1f}), ratio {b / a:.1f}; "
        f"big room {statistics.median(big_s) * 1e3:.0f} ms; {args.reps} reps; behind, the small "
        f"room's slowest NIXL post call took {', '.join(f'{v * 1e3:.1f}' for v in in_post)} ms"
    )


if __name__ == "__main__":
    main()
