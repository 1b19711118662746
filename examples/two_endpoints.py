"""The README's API, runnable: a prefill server and a decode server in one process.

Prefill runs TP 2 (two endpoints, one per rank), decode TP 1, both on 127.0.0.1 with real NIXL
over UCX on host memory (numpy buffers). Three rooms move, one of them in three chunks; decode's
bytes are compared with prefill's, every handle is cleared and every endpoint closed.

    python examples/two_endpoints.py        # exit status 0 when every room arrived intact
"""

from __future__ import annotations

import sys
import time

import numpy as np

from kvferry.commands.extras import require_for_script

require_for_script("real", "examples/two_endpoints.py")  # one line and exit 2 without NIXL/pyzmq

from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig  # noqa: E402
from kvferry.backends.runtime.security import ephemeral_key  # noqa: E402
from kvferry.core.geometry import ModelGeometry, PoolGeometry  # noqa: E402
from kvferry.core.kvpoll import KVPoll, min_status  # noqa: E402

MODEL = ModelGeometry("tiny", num_layers=2, num_kv_heads=4, head_dim=8)  # bf16: 16 bytes a head
PAGE, PAGES, PREFILL_TP = 4, 16, 2
ROOMS = [  # (room, transfer_id, tokens, where prefill's chunks end)
    (101, "req-a", 16, [16]),
    (102, "req-b", 13, [4, 8, 13]),  # chunked prefill: three chunks
    (103, "req-c", 7, [7]),
]


def slots(pool: PoolGeometry, pages: np.ndarray, tokens: int) -> np.ndarray:
    """Slot of each of the room's first ``tokens`` tokens (token t is in page ``pages[t // page]``)."""
    t = np.arange(tokens)
    return pages[t // pool.page_size] * pool.page_size + t % pool.page_size


def heads(pool: PoolGeometry, buf: np.ndarray) -> np.ndarray:
    """A region as [slot, local head, bytes of the head] (the SGLang NHD layout)."""
    return buf.reshape(pool.num_slots, pool.heads_per_rank, pool.head_bytes)


def main() -> int:
    # Both endpoints live in this process: a fresh control-plane key for them (docs/security.md).
    config = RuntimeConfig(num_queues=2, aux_rows=8, control_keys=(ephemeral_key(),))
    rng = np.random.default_rng(0)
    pre_pools = [PoolGeometry(MODEL, PREFILL_TP, r, PAGE, PAGES) for r in range(PREFILL_TP)]
    dec_pool = PoolGeometry(MODEL, 1, 0, PAGE, PAGES)
    # The engines' KV pools: region_id -> one contiguous buffer (here numpy, host memory).
    pre_bufs = [{s.region_id: rng.integers(0, 256, s.nbytes, np.uint8) for s in p.regions} for p in pre_pools]
    dec_bufs = {s.region_id: np.zeros(s.nbytes, np.uint8) for s in dec_pool.regions}

    pre = [PrefillEndpoint("prefill", p, buffers=pre_bufs[p.tp_rank], config=config) for p in pre_pools]
    for ep in pre:
        ep.start()  # control address: ep.address (port chosen at runtime)
    dec = DecodeEndpoint(
        "decode",
        dec_pool,
        prefill_server="prefill",
        prefill_addresses=[ep.address for ep in pre],  # every prefill rank, in rank order
        buffers=dec_bufs,
        config=config,
    )
    dec.start()
    try:
        rooms = []
        for aux, (room, tid, tokens, chunks) in enumerate(ROOMS):
            n = -(-tokens // PAGE)
            src = np.arange(aux * 4, aux * 4 + n)  # prefill's pages for the room
            dst = PAGES - 1 - src  # decode's pages: other ids, on purpose
            rx = dec.receiver(room, tid)
            rx.init(dst, tokens, aux_index=aux)
            txs = [ep.sender(room, tid) for ep in pre]  # every prefill rank takes part
            for tx in txs:
                tx.write_aux(aux, room.to_bytes(8, "little"))  # first 8 bytes: the room id
                tx.init(aux_index=aux)
            for i, end in enumerate(chunks):  # one send per chunk on every rank
                for tx in txs:
                    tx.send(src, end, is_last=i == len(chunks) - 1)
            rooms.append((room, tokens, src, dst, rx, txs))

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            polls = [min_status([rx.poll()] + [tx.poll() for tx in txs]) for *_, rx, txs in rooms]
            if all(s in (KVPoll.Success, KVPoll.Failed) for s in polls):
                break
            time.sleep(0.01)

        ok, wrong = 0, 0
        for room, tokens, src, dst, rx, txs in rooms:
            status = min_status([rx.poll()] + [tx.poll() for tx in txs])
            if status is KVPoll.Success:
                ok += 1
                for p, bufs in zip(pre_pools, pre_bufs, strict=True):  # rank p sent its heads, all regions
                    for rid, buf in bufs.items():
                        want = heads(p, buf)[slots(p, src, tokens)]
                        got = heads(dec_pool, dec_bufs[rid])[slots(dec_pool, dst, tokens)]
                        wrong += int((got[:, p.head_start : p.head_end] != want).sum())
            else:
                try:
                    for h in [rx, *txs]:
                        h.failure_exception()  # raises the cause of a Failed room
                except Exception as exc:
                    print(f"room {room}: {status.name}: {type(exc).__name__}: {exc}")
                while not rx.pages_freed() and time.monotonic() < deadline + 10:
                    time.sleep(0.01)  # a failed room's decode pages are reusable once fenced
            rx.clear()
            for tx in txs:
                tx.clear()

        deadline = time.monotonic() + 10  # the cores drop cleared rooms as their last acks land
        while any(v for ep in [*pre, dec] for v in ep.leaks().values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        leaks = {f"{ep.endpoint}.{k}": v for ep in [*pre, dec] for k, v in ep.leaks().items() if v}
    finally:
        stuck = [name for ep in [*pre, dec] for name in ep.close()]

    print(
        f"two_endpoints: {ok}/{len(ROOMS)} rooms Success, {wrong} wrong bytes, "
        f"leaks {leaks or 'none'}, stuck threads {stuck or 'none'}"
    )
    return 0 if ok == len(ROOMS) and wrong == 0 and not leaks and not stuck else 1


if __name__ == "__main__":
    sys.exit(main())
