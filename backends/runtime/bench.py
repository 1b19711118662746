"""``kvferry bench nixl``: kvferry end to end vs a raw single-descriptor NIXL WRITE, same processes.

Two processes on 127.0.0.1: a prefill server (``prefill_tp`` ranks) and a decode server (one
rank per ``decode_tp``, here 1), each rank's pool one contiguous buffer (regions are views into
it) so the whole room can also be moved as one descriptor. For each configuration:

1. kvferry end to end: rooms of ``tokens`` tokens of qwen3-8b KV, one after the other, through
   the threaded runtime (TransferInfo, chunk writes with notifications, aux row, Success on both
   sides). Timed on decode from ``KVReceiver.init`` to Success; GB/s = room bytes / that time.
2. Raw: from every prefill rank at once, one NIXL WRITE of the same byte count as one descriptor
   into the decode buffer (prepared lists, no notification), timed from post to DONE on all ranks.
   Each timed room is followed by one raw write (paired, interleaved), so both see the same load
   on a shared machine; each side reports its median.

Every timed room is checked on decode before its raw write: every byte of the room's pages holds
the value its source rank filled in.

Child processes speak JSON lines on stdout/stdin (``python -m kvferry.backends.runtime.bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

RAW_ID = (1 << 20) + 1  # a covering region over the whole pool, in its own group "raw"


@dataclass(frozen=True)
class BenchConfig:
    name: str
    prefill_tp: int
    decode_tp: int
    layout: str = "sglang_nhd"
    model: str = "qwen3-8b"
    tokens: int = 4096
    page_size: int = 16
    rooms: int = 3
    warmup: int = 1
    chunk_tokens: int = 0  # 0: the whole room in one chunk
    raw_reps: int = 3
    mem: str = "DRAM"  # VRAM: pools are torch CUDA tensors (one GPU shared by both processes)


DEFAULT_CONFIGS = (
    BenchConfig("tp1->1 nhd", 1, 1),
    BenchConfig("tp2->1 nhd", 2, 1, rooms=2),
)


# ---- child side ----------------------------------------------------------------------------------
def _say(**msg: Any) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def _hear() -> dict[str, Any]:
    line = sys.stdin.readline()
    if not line:
        sys.exit(3)
    return json.loads(line)


def _pools(cfg: BenchConfig, role: str) -> list[Any]:
    from kvferry.core.geometry import ModelGeometry, PoolGeometry

    model = ModelGeometry.preset(cfg.model)
    pages = -(-cfg.tokens // cfg.page_size)
    if role == "prefill":
        return [
            PoolGeometry(model, cfg.prefill_tp, r, cfg.page_size, pages, cfg.layout)
            for r in range(cfg.prefill_tp)
        ]
    # Two rooms' worth on decode: consecutive rooms land in different pages.
    return [
        PoolGeometry(model, cfg.decode_tp, r, cfg.page_size, 2 * pages, cfg.layout)
        for r in range(cfg.decode_tp)
    ]


def _buffers(pool: Any, fill: int, mem: str) -> tuple[Any, dict[int, Any], Any]:
    """One contiguous buffer per rank (regions are views), and its covering MemRegion."""
    from kvferry.backends.nixl.memory import MemRegion

    per = pool.region_bytes
    if mem in ("VRAM", "TORCH_DRAM"):  # TORCH_DRAM: the tensor path on a machine without a GPU
        import torch

        device = "cuda" if mem == "VRAM" else "cpu"
        buf = torch.full((pool.total_bytes,), fill, dtype=torch.uint8, device=device)
        kind = "VRAM" if mem == "VRAM" else "DRAM"
        cover = MemRegion(RAW_ID, buf.data_ptr(), buf.numel(), kind, max(buf.get_device(), 0))
    else:
        buf = np.full(pool.total_bytes, fill, dtype=np.uint8)  # touched: no page faults in timing
        cover = MemRegion(RAW_ID, buf.ctypes.data, buf.nbytes)
    return buf, {r.region_id: buf[i * per : (i + 1) * per] for i, r in enumerate(pool.regions)}, cover


def _zero(region: Any, half: int) -> None:
    region.reshape(2, -1)[half] = 0


def _counts(regions: dict[int, Any], half: int) -> dict[int, int]:
    if any(hasattr(r, "device") for r in regions.values()):
        import torch

        total = sum(torch.bincount(r.reshape(2, -1)[half], minlength=256) for r in regions.values())
        total = total.cpu().numpy()
    else:
        total = sum(np.bincount(r.reshape(2, -1)[half], minlength=256) for r in regions.values())
    return {int(v): int(c) for v, c in enumerate(total) if c}


def _config(cfg: BenchConfig) -> Any:
    from kvferry.backends.runtime import RuntimeConfig
    from kvferry.core.deadlines import SEC, Timeouts

    t = Timeouts(
        bootstrap_ns=120 * SEC, waiting_ns=120 * SEC, transfer_ns=120 * SEC, heartbeat_timeout_ns=60 * SEC
    )
    return RuntimeConfig(num_queues=2, aux_rows=8, timeouts=t)


def child_prefill(cfg: BenchConfig) -> None:
    from kvferry.backends.nixl.memory import MemRegion
    from kvferry.backends.runtime import PrefillEndpoint
    from kvferry.core.kvpoll import KVPoll
    from kvferry.core.messages import Endpoint

    eps, bufs = [], []
    for pool in _pools(cfg, "prefill"):
        buf, regions, cover = _buffers(pool, 1 + pool.tp_rank, cfg.mem)
        raw = {"raw": [cover]}
        eps.append(PrefillEndpoint("prefill", pool, buffers=regions, config=_config(cfg), extra_groups=raw))
        bufs.append(buf)
    for ep in eps:
        ep.start()
    _say(event="ready", addresses=[ep.address for ep in eps])
    _hear()  # go
    pages = np.arange(-(-cfg.tokens // cfg.page_size), dtype=np.int64)
    cuts = list(range(cfg.chunk_tokens, cfg.tokens, cfg.chunk_tokens)) if cfg.chunk_tokens else []
    cuts.append(cfg.tokens)
    room_bytes = eps[0].pool.total_bytes  # one room fills a prefill rank's pool exactly
    decode = Endpoint(server="decode", rank=0)
    one = np.array([RAW_ID], dtype=np.int64)
    raw_times, kv_posts = [], []
    kind = "VRAM" if cfg.mem == "VRAM" else "DRAM"
    for i in range(cfg.warmup + cfg.rooms):
        senders = [ep.sender(1000 + i, f"b{i}") for ep in eps]
        for s in senders:
            s.write_aux(i % 8, (1000 + i).to_bytes(8, "little"))
            s.init(i % 8)
        for k, end in enumerate(cuts):
            for s in senders:
                s.send(pages, end, is_last=k == len(cuts) - 1)
        for s in senders:
            if s.wait(600) is not KVPoll.Success:
                s.failure_exception()
            s.clear()
        if i == 0:
            kv_posts = [r for ep in eps for r in ep.transport.agent.telemetry.records() if r.nbytes > 4096]
        _say(event="room_sent", index=i)
        # Raw, paired with this room: one descriptor per prefill rank, all ranks at once, the same
        # bytes. Only after decode checked the room: these writes land in the same decode buffer.
        d_addr, d_bytes, d_dev = _hear()["raw"]
        for ep in eps:
            agent = ep.transport.peer_agent(decode)
            if ("raw", room_bytes) not in ep.transport.agent._peers[agent].prepped:
                ep.transport.agent.add_lists(
                    agent, {"raw": ([MemRegion(RAW_ID, d_addr, d_bytes, kind, d_dev)], [room_bytes])}
                )
        t0 = time.perf_counter()
        tickets = []
        for r, ep in enumerate(eps):
            off = np.array([(r % max(1, d_bytes // room_bytes)) * room_bytes], dtype=np.int64)
            tickets.append(
                ep.transport.agent.post(
                    "WRITE",
                    ep.transport.peer_agent(decode),
                    ("raw", room_bytes),
                    (one, np.zeros(1, dtype=np.int64)),
                    (one, off),
                    np.array([room_bytes], dtype=np.int64),
                )
            )
        states = [ep.transport.agent.wait(t, 600.0) for ep, t in zip(eps, tickets, strict=True)]
        raw_times.append(time.perf_counter() - t0)
        if any(s != "DONE" for s in states):
            raise RuntimeError(f"raw write ended {states}")
        _say(event="raw_done", index=i)
    _say(
        event="done",
        raw_times=raw_times[cfg.warmup :],
        raw_bytes=room_bytes * len(eps),
        descs_requested=max((r.descs_requested for r in kv_posts), default=0),
        descs_posted=max((r.descs_posted for r in kv_posts), default=0),
        post_us=max((r.post_us for r in kv_posts), default=0),
    )
    _hear()
    for ep in eps:
        ep.close()


def child_decode(cfg: BenchConfig, prefill: list[str]) -> None:
    from kvferry.backends.runtime import DecodeEndpoint
    from kvferry.core.kvpoll import KVPoll

    (pool,) = _pools(cfg, "decode")
    _buf, regions, cover = _buffers(pool, 0, cfg.mem)  # _buf: the views keep it alive
    raw = {"raw": [cover]}
    ep = DecodeEndpoint(
        "decode",
        pool,
        prefill_server="prefill",
        prefill_addresses=prefill,
        buffers=regions,
        config=_config(cfg),
        extra_groups=raw,
    )
    ep.start()
    _say(event="ready", raw=[cover.addr, cover.nbytes, cover.dev])
    _hear()
    n_pages = -(-cfg.tokens // cfg.page_size)
    durations, checks = [], []
    room_bytes = pool.token_bytes * cfg.tokens * pool.model.num_regions
    for i in range(cfg.warmup + cfg.rooms):
        half = i % 2
        pages = np.arange(n_pages, dtype=np.int64) + half * n_pages
        for r in regions.values():  # clear the room's pages so the check below means something
            _zero(r, half)
        rv = ep.receiver(1000 + i, f"b{i}")
        t0 = time.perf_counter()
        rv.init(pages, cfg.tokens, i % 8)
        st = rv.wait(600)
        dt = time.perf_counter() - t0
        if st is not KVPoll.Success:
            rv.failure_exception()
        rv.clear()
        if i >= cfg.warmup:
            durations.append(dt)
            # Prefill rank r filled its pool with r + 1; each wrote its share of every token.
            want = {v + 1: room_bytes // cfg.prefill_tp for v in range(cfg.prefill_tp)}
            checks.append(_counts(regions, half) == want)
        _say(event="room", index=i)
        _hear()  # next: the paired raw write is done
    check = {"ok": bool(checks) and all(checks), "rooms_checked": len(checks)}
    _say(event="done", durations=durations, room_bytes=room_bytes, check=check)
    _hear()
    ep.close()


# ---- harness side --------------------------------------------------------------------------------
class _Proc:
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "kvferry.backends.runtime.bench", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.q.put(line)
        self.q.put(None)

    def get(self, timeout_s: float) -> dict[str, Any]:
        line = self.q.get(timeout=timeout_s)
        if line is None:
            raise RuntimeError(f"bench child exited with {self.p.wait()}")
        return json.loads(line)

    def put(self, **msg: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


def run_config(
    cfg: BenchConfig, env: dict[str, str] | None = None, timeout_s: float = 900.0
) -> dict[str, Any]:
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", **(env or {})}
    blob = json.dumps(asdict(cfg))
    pre = _Proc(["prefill", blob], env)
    dec = None
    try:
        addresses = pre.get(timeout_s)["addresses"]
        dec = _Proc(["decode", blob, *addresses], env)
        raw = dec.get(timeout_s)["raw"]
        pre.put(go=True)
        dec.put(go=True)
        for _ in range(cfg.warmup + cfg.rooms):
            dec.get(timeout_s)  # room: timed and checked on decode
            pre.get(timeout_s)  # room_sent
            pre.put(raw=raw)
            pre.get(timeout_s)  # raw_done
            dec.put(next=True)
        d = dec.get(timeout_s)
        p = pre.get(timeout_s)
        pre.put(exit=True)
        dec.put(exit=True)
    finally:
        pre.kill()
        if dec is not None:
            dec.kill()
    room_bytes = d["room_bytes"]
    e2e_s = statistics.median(d["durations"])
    e2e = room_bytes / e2e_s / 1e9
    raw_s = statistics.median(p["raw_times"])
    raw = p["raw_bytes"] / raw_s / 1e9
    return {
        "config": cfg.name,
        "model": cfg.model,
        "tokens": cfg.tokens,
        "tp": f"{cfg.prefill_tp}->{cfg.decode_tp}",
        "layout": cfg.layout,
        "room_mb": room_bytes / 1e6,
        "rooms": cfg.rooms,
        "kvferry_s": e2e_s,
        "kvferry_gbps": e2e,
        "raw_s": raw_s,
        "raw_gbps": raw,
        "ratio": e2e / raw,
        "descs_requested": p["descs_requested"],
        "descs_posted": p["descs_posted"],
        "bytes_ok": d["check"].get("ok", False),
        "ucx_tls": env.get("UCX_TLS", "(default)"),
        "mem": cfg.mem,
    }


def run(
    configs: tuple[BenchConfig, ...] = DEFAULT_CONFIGS, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    return [run_config(c, env) for c in configs]


def _child_main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("config")
    ap.add_argument("prefill", nargs="*")
    a = ap.parse_args()
    cfg = BenchConfig(**json.loads(a.config))
    if a.role == "prefill":
        child_prefill(cfg)
    else:
        child_decode(cfg, a.prefill)


if __name__ == "__main__":
    _child_main()
