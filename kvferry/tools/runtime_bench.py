"""``kvferry bench nixl``: kvferry end to end vs a raw single-descriptor NIXL WRITE, same processes.

Two processes on 127.0.0.1: a prefill server (``prefill_tp`` ranks) and a decode server
(``decode_tp`` ranks), each rank's pool one contiguous buffer (regions are views into it) so the
whole room can also be moved as one descriptor. Each configuration runs one transfer flow
(``direct``, ``ring``, ``pinned``, or ``policy``: the runtime's own choice), with staging memory
sized for ``max(2, inflight)`` chunks. For each configuration:

1. kvferry end to end: batches of ``inflight`` rooms of ``tokens`` tokens of a preset model's KV
   (``model``, qwen3-8b by default), one batch after the other, through the threaded runtime
   (TransferInfo, chunk writes with notifications, aux row, Success on both sides). Timed on
   decode from the first ``KVReceiver.init`` of a batch to its last Success; GB/s = batch bytes
   / that time.
2. Raw: from every prefill rank, one NIXL WRITE per room of the same byte count as a single
   descriptor into a decode rank's buffer (the first decode rank that prefill rank sends to;
   prepared lists, no notification), all posted at once, timed
   from the first post to the last DONE. Each timed batch is followed by its raw batch (paired,
   interleaved), so both see the same load on a shared machine; each side reports its median.

Every timed room is checked on decode before the raw writes: every byte of the room's pages holds
the value its source rank filled in.

``engine`` picks the executor of both processes (RuntimeConfig.nixl_engine: python or native); the
result says which one really ran. ``handoff`` times what serving feels instead: prefill waits until
decode's TransferInfo reached every sender (the usual case: it arrives while prefill computes),
then the clock runs from ``send(last chunk)`` of the batch to decode's last Success (one host,
so both processes read the same monotonic clock).

Child processes speak JSON lines on stdout/stdin (``python -m kvferry.tools.runtime_bench``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvferry.backends.nixl.transport import DIRECT_POSTS
from kvferry.core.flows import FLOW_NAMES

RAW_ID = (1 << 20) + 1  # a covering region over the whole pool, in its own group "raw"
FIRST_ROOM = 1000  # batch b's room k is FIRST_ROOM + b * inflight + k on both sides


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
    inflight: int = 1  # rooms opened at once per batch (throughput rather than one room's latency)
    worker_chunks: int = 1  # RuntimeConfig.worker_chunks_in_flight (1: a worker's writes one at a time)
    idle_max_s: float = 2e-4  # progress threads' longest idle sleep (latency of the control path)
    # NIXL's per-transfer telemetry of the timed batches (JSON): prefill's writes, decode's READs (pull)
    telemetry_path: str = ""
    mem: str = "DRAM"  # VRAM: pools are torch CUDA tensors (one GPU shared by both processes)
    flow: str = "policy"  # direct, ring, pinned, or policy (the runtime chooses per room)
    # GPU placement (VRAM): CUDA_VISIBLE_DEVICES of each process, e.g. "0" and "1"; rank r of a
    # side uses visible GPU r mod count. Empty: both processes see every GPU and use GPU 0.
    prefill_gpus: str = ""
    decode_gpus: str = ""
    # Record every engine event and command of both processes here (runtime.tracing): the
    # rooms' hop timeline in the result, a Perfetto trace in trace.json.
    trace_dir: str = ""
    # sys.setswitchinterval of both bench processes, in microseconds (0: Python's 5 ms default).
    # A thread woken by a hop waits up to this long for the GIL when another thread is running
    # Python: a knob for measuring that wait, not something the runtime sets in a host process.
    switch_interval_us: float = 0.0
    direct_post: str = "auto"  # RuntimeConfig.nixl_direct_post (and the planned baseline's path)
    # RuntimeConfig.active_idle_max_s in microseconds: how often the data thread and a waiting
    # worker poll NIXL while a room is in flight (0: they spin; measured far slower on the H100
    # machine, docs/benchmarks.md, the section on three probes of "it is the threads" and the poll
    # interval: the spinning threads take the GIL from the others).
    active_poll_us: float = 200.0
    engine: str = "python"  # RuntimeConfig.nixl_engine of both processes
    handoff: bool = False  # time send(last chunk) -> decode Success, TransferInfo already at prefill
    ahead: bool = False  # name each chunk's pages before its send (KVSender.plan_ahead)
    # Each TP rank in its own process, as SGLang and vLLM run them. False: one process a side holds
    # every rank of it, so its ranks share one interpreter (and its lock) and one CUDA context: a
    # different-TP ring room took 1.3-2.3x as long that way on an H200 (bench/calibration/h200-ranks/).
    process_per_rank: bool = True


DEFAULT_CONFIGS = (
    BenchConfig("tp1->1 nhd", 1, 1),
    BenchConfig("tp2->1 nhd", 2, 1, rooms=2),
    BenchConfig("tp1->2 nhd", 1, 2, rooms=2),
    BenchConfig("tp2->2 nhd", 2, 2, rooms=2),  # TP > 1 on both sides, as one node deploys it
    BenchConfig("tp4->2 nhd", 4, 2, rooms=2),
)
FLOWS = (*FLOW_NAMES, "policy")
ENGINES = ("python", "native")


# ---- child side ----------------------------------------------------------------------------------
def _say(**msg: Any) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def _hear() -> dict[str, Any]:
    line = sys.stdin.readline()
    if not line:
        sys.exit(3)
    return json.loads(line)


def _start_trace(cfg: BenchConfig, eps: list[Any], role: str) -> list[Any]:
    if not cfg.trace_dir:
        return []
    from kvferry.backends.runtime.tracing import DriverTrace

    traces = [DriverTrace(f"{role}{ep.pool.tp_rank}") for ep in eps]
    for ep, tr in zip(eps, traces, strict=True):
        ep.driver.trace = tr
    return traces


def _save_trace(cfg: BenchConfig, traces: list[Any], role: str, rank: int | None) -> None:
    if traces:
        rows = [r for tr in traces for r in tr.rows()]
        with open(os.path.join(cfg.trace_dir, f"{_proc_name(role, rank)}.rows.json"), "w") as f:
            json.dump(rows, f)


def _pools(cfg: BenchConfig, role: str, rank: int | None = None) -> list[Any]:
    """A side's rank pools: every rank, or only ``rank`` (a process of its own)."""
    return [p for p in _side_pools(cfg, role) if rank is None or p.tp_rank == rank]


def _side_pools(cfg: BenchConfig, role: str) -> list[Any]:
    from kvferry.core.geometry import ModelGeometry, PoolGeometry

    model = ModelGeometry.preset(cfg.model)
    pages = -(-cfg.tokens // cfg.page_size) * cfg.inflight
    if role == "prefill":
        return [
            PoolGeometry(model, cfg.prefill_tp, r, cfg.page_size, pages, cfg.layout)
            for r in range(cfg.prefill_tp)
        ]
    # Two batches' worth on decode: consecutive batches land in different pages.
    return [
        PoolGeometry(model, cfg.decode_tp, r, cfg.page_size, 2 * pages, cfg.layout)
        for r in range(cfg.decode_tp)
    ]


def _room_bytes(pools: list[Any], tokens: int) -> int:
    """The bytes of one room over ``pools`` (a side's ranks)."""
    return sum(pool.token_bytes for pool in pools) * tokens * pools[0].model.num_regions


def _buffers(pool: Any, fill: int, mem: str) -> tuple[Any, dict[int, Any], Any]:
    """One contiguous buffer per rank (regions are views), and its covering MemRegion."""
    from kvferry.backends.nixl.memory import MemRegion

    per = pool.region_bytes
    if mem in ("VRAM", "TORCH_DRAM"):  # TORCH_DRAM: the tensor path on a machine without a GPU
        import torch

        device = f"cuda:{pool.tp_rank % torch.cuda.device_count()}" if mem == "VRAM" else "cpu"
        buf = torch.full((pool.total_bytes,), fill, dtype=torch.uint8, device=device)
        kind = "VRAM" if mem == "VRAM" else "DRAM"
        cover = MemRegion(RAW_ID, buf.data_ptr(), buf.numel(), kind, max(buf.get_device(), 0))
    else:
        buf = np.full(pool.total_bytes, fill, dtype=np.uint8)  # touched: no page faults in timing
        cover = MemRegion(RAW_ID, buf.ctypes.data, buf.nbytes)
    return buf, {r.region_id: buf[i * per : (i + 1) * per] for i, r in enumerate(pool.regions)}, cover


def _slot(region: Any, slots: int, slot: int) -> Any:
    """The bytes of room slot ``slot`` of a region cut into ``slots`` equal room-sized slots."""
    return region.reshape(slots, -1)[slot]


def _counts(regions: dict[int, Any], slots: int, slot: int) -> dict[int, int]:
    if not all(isinstance(r, np.ndarray) for r in regions.values()):  # torch tensors
        import torch

        total = sum(torch.bincount(_slot(r, slots, slot), minlength=256) for r in regions.values())
        total = total.cpu().numpy()
    else:
        total = sum(np.bincount(_slot(r, slots, slot), minlength=256) for r in regions.values())
    return {int(v): int(c) for v, c in enumerate(total) if c}


def _expect_zeros(want: dict[int, int], regions: dict[int, Any], slots: int) -> None:
    """A room whose last page is partly filled leaves the rest of it zero: zeros are expected too,
    exactly the slot's bytes that no rank writes (a write past the room's tokens would eat them).
    ``len()``: a slot is one flat row of a numpy array or a torch tensor (whose ``.size`` is a
    method)."""
    untouched = sum(len(_slot(r, slots, 0)) for r in regions.values()) - sum(want.values())
    if untouched:
        want[0] = untouched


def staging_bytes(cfg: BenchConfig) -> dict[str, int]:
    """Staging sizes for ``max(2, inflight)`` chunks per rank (one chunk per worker buffer slot)."""
    from kvferry.core.geometry import ModelGeometry

    if cfg.flow in ("direct", "pull", "push"):  # no staging memory
        return {"worker_buffer_bytes": 0, "ring_bytes": 0, "pinned_bytes": 0, "prefill_pinned_bytes": 0}
    model = ModelGeometry.preset(cfg.model)
    chunk = cfg.chunk_tokens or cfg.tokens
    per_token = model.num_regions * model.head_bytes * model.num_kv_heads  # every head, one token
    pre = per_token * chunk // min(cfg.prefill_tp, model.num_kv_heads)  # one prefill rank's heads
    dec = per_token * chunk // min(cfg.decode_tp, model.num_kv_heads)
    targets = max(1, cfg.decode_tp // cfg.prefill_tp)
    depth = max(2, cfg.inflight)
    ring, pinned = cfg.flow in ("ring", "policy"), cfg.flow in ("pinned", "policy")
    return {
        "worker_buffer_bytes": pre * targets if ring else 0,
        "ring_bytes": dec * depth if ring else 0,
        "pinned_bytes": dec * depth if pinned else 0,
        "prefill_pinned_bytes": pre * depth if pinned else 0,
    }


def _config(cfg: BenchConfig) -> Any:
    from kvferry.backends.runtime import RuntimeConfig
    from kvferry.backends.runtime.staging import StagingConfig
    from kvferry.core.deadlines import SEC, Timeouts

    t = Timeouts(
        bootstrap_ns=120 * SEC,
        waiting_ns=120 * SEC,
        transfer_ns=120 * SEC,
        heartbeat_timeout_ns=60 * SEC,
        fence_ns=120 * SEC,
    )
    staging = StagingConfig(**staging_bytes(cfg), flow=None if cfg.flow == "policy" else cfg.flow)
    return RuntimeConfig(
        num_queues=2,
        aux_rows=64,
        timeouts=t,
        idle_max_s=max(cfg.idle_max_s, cfg.active_poll_us / 1e6),
        active_idle_max_s=cfg.active_poll_us / 1e6,
        staging=staging,
        worker_chunks_in_flight=cfg.worker_chunks,
        nixl_direct_post=cfg.direct_post,
        nixl_engine=cfg.engine,
    )


def _proc_name(role: str, rank: int | None) -> str:
    """A bench process's name in its file names: the side, and its rank when it has only one."""
    return role if rank is None else f"{role}{rank}"


def _telemetry_file(cfg: BenchConfig, rank: int | None) -> str:
    """Where a prefill process writes its telemetry: one process per rank writes its own, and
    ``run_config`` merges them into ``cfg.telemetry_path``."""
    return cfg.telemetry_path if rank is None else f"{cfg.telemetry_path}.rank{rank}"


def child_prefill(cfg: BenchConfig, rank: int | None = None) -> None:
    eps, _bufs = _prefill_endpoints(cfg, rank)  # _bufs: the rank buffers, kept alive to the end
    traces = _start_trace(cfg, eps, "prefill")
    for ep in eps:
        ep.start()
    _say(event="ready", addresses=[ep.address for ep in eps])
    _hear()  # go
    run = _PrefillRun(cfg, eps)
    for b in range(cfg.warmup + cfg.rooms):
        run.batch(b)
    if cfg.telemetry_path:  # for calibrating the simulator's cost model from real writes
        import msgspec

        with open(_telemetry_file(cfg, rank), "wb") as f:
            f.write(msgspec.json.encode({"config": asdict(cfg), "writes": run.kv_posts}))
    _save_trace(cfg, traces, "prefill", rank)
    _say(event="done", **run.summary())
    _hear()
    for ep in eps:
        ep.close()


def _prefill_endpoints(cfg: BenchConfig, rank: int | None = None) -> tuple[list[Any], list[Any]]:
    """Prefill's ranks (or only ``rank``), each on one buffer filled with its rank + 1 (and a
    covering raw region)."""
    from kvferry.backends.runtime import PrefillEndpoint

    eps, bufs = [], []
    for pool in _pools(cfg, "prefill", rank):
        buf, regions, cover = _buffers(pool, 1 + pool.tp_rank, cfg.mem)
        raw = {"raw": [cover]}
        eps.append(PrefillEndpoint("prefill", pool, buffers=regions, config=_config(cfg), extra_groups=raw))
        bufs.append(buf)
    return eps, bufs


class _PrefillRun:
    """Prefill's batches: each one's rooms through kvferry, then its paired raw writes, with the
    times and NIXL's telemetry of the timed (post warm-up) batches."""

    def __init__(self, cfg: BenchConfig, eps: list[Any]) -> None:
        self.cfg, self.eps = cfg, eps
        self.n_pages = -(-cfg.tokens // cfg.page_size)
        cuts = list(range(cfg.chunk_tokens, cfg.tokens, cfg.chunk_tokens)) if cfg.chunk_tokens else []
        self.cuts = [*cuts, cfg.tokens]
        self.room_bytes = eps[0].pool.total_bytes // cfg.inflight  # a rank's share of one room
        self.raw_times: list[float] = []
        self.planned_times: list[float] = []
        self.kv_posts: list[Any] = []
        self.raw_posts: list[Any] = []

    def batch(self, b: int) -> None:
        from kvferry.core.kvpoll import KVPoll

        cfg, eps = self.cfg, self.eps
        for ep in eps:  # keep only this batch's writes (not the warm-up's, not the raw ones)
            ep.transport.agent.telemetry.clear()
        batch = self._open(b)
        if cfg.handoff:  # decode's TransferInfo first: the clock starts at the chunk, not the open
            _wait_status(senders_of(batch), KVPoll.WaitingForInput)
        t_send = time.monotonic_ns()
        self._send(batch)
        if b >= cfg.warmup:  # NIXL's own per-write telemetry of this batch's KV writes (no aux)
            self.kv_posts += [
                r for ep in eps for r in ep.transport.agent.telemetry.records() if r.nbytes > 4096
            ]
        _say(event="batch_sent", index=b, t_send=t_send)
        # Raw, paired with this batch: one descriptor per (room, prefill rank), all posted at once,
        # the same bytes. Only after decode checked the batch: they land in the same decode buffer.
        covers = _hear()["raw"]  # per decode rank: (addr, bytes, dev) of its whole pool
        self._raw(b, covers)
        if cfg.flow == "direct":
            self.planned_times.append(_planned_raw(cfg, eps, b, self.n_pages))
        _say(event="raw_done", index=b)

    def _open(self, b: int) -> list[tuple[list[Any], Any]]:
        """Batch ``b``'s rooms opened on every rank (aux row written), and their first chunk's
        pages named ahead where ``cfg.ahead``."""
        from kvferry.core.topology import receiver_endpoints

        cfg, eps, n_pages = self.cfg, self.eps, self.n_pages
        batch = []
        for k in range(cfg.inflight):
            room, aux = FIRST_ROOM + b * cfg.inflight + k, k
            pages = np.arange(n_pages, dtype=np.int64) + k * n_pages
            senders = [ep.sender(room, f"b{room}") for ep in eps]
            for s, ep in zip(senders, eps, strict=True):
                s.write_aux(aux, room.to_bytes(8, "little"))
                s.init(
                    aux,
                    receivers=receiver_endpoints(
                        ep.pool.model, cfg.prefill_tp, cfg.decode_tp, ep.pool.tp_rank
                    ),
                )
            batch.append((senders, pages))
        if cfg.ahead:  # the scheduler knows a chunk's pages before its forward: named first
            for senders, pages in batch:
                for s in senders:
                    s.plan_ahead(pages, self.cuts[0], is_last=len(self.cuts) == 1)
        return batch

    def _send(self, batch: list[tuple[list[Any], Any]]) -> None:
        """Every chunk of every room handed over, then each room waited for to Success."""
        from kvferry.core.kvpoll import KVPoll

        cfg, cuts = self.cfg, self.cuts
        for c, end in enumerate(cuts):
            for senders, pages in batch:
                for s in senders:
                    s.send(pages, end, is_last=c == len(cuts) - 1)
                    if cfg.ahead and c + 1 < len(cuts):  # the next chunk's pages, before its forward
                        s.plan_ahead(pages, cuts[c + 1], is_last=c + 2 == len(cuts))
                    if cfg.flow == "layerwise":  # no forward here: every layer is computed already
                        s.layers_ready(0, self.eps[0].pool.model.num_layers)
        for senders, _ in batch:
            for s in senders:
                if s.wait(600) is not KVPoll.Success:
                    s.failure_exception()
                s.clear()

    def _raw(self, b: int, covers: list[Any]) -> None:
        """The raw writes paired with batch ``b``, timed from the first post to the last DONE."""
        from kvferry.core.topology import receiver_endpoints

        cfg, eps = self.cfg, self.eps
        # Each prefill rank writes its raw bytes to the first decode rank it really sends to.
        raw_to = [
            receiver_endpoints(ep.pool.model, cfg.prefill_tp, cfg.decode_tp, ep.pool.tp_rank)[0].rank
            for ep in eps
        ]
        self._raw_lists(covers, raw_to)
        seen = [len(ep.transport.agent.telemetry.records()) for ep in eps]
        t0 = time.perf_counter()
        tickets = self._post_raw(covers, raw_to)
        states = [ep.transport.agent.wait(t, 600.0) for ep, t in tickets]
        self.raw_times.append(time.perf_counter() - t0)
        if any(s != "DONE" for s in states):
            raise RuntimeError(f"raw write ended {states}")
        if b >= cfg.warmup:  # the executor's own view of the raw writes (post call, completion seen)
            self.raw_posts += [
                r
                for ep, n in zip(eps, seen, strict=True)
                for r in ep.transport.agent.telemetry.records()[n:]
                if r.nbytes == self.room_bytes
            ]

    def _raw_lists(self, covers: list[Any], raw_to: list[int]) -> None:
        """Each rank's prepared list of one room-sized descriptor into its decode rank's pool."""
        from kvferry.backends.nixl.memory import MemRegion
        from kvferry.core.messages import Endpoint

        kind = "VRAM" if self.cfg.mem == "VRAM" else "DRAM"
        room_bytes = self.room_bytes
        for ep, d in zip(self.eps, raw_to, strict=True):
            d_addr, d_bytes, d_dev = covers[d]
            agent = ep.transport.peer_agent(Endpoint(server="decode", rank=d))
            if ("raw", room_bytes) not in ep.transport.agent._peers[agent].prepped:
                ep.transport.agent.add_lists(
                    agent, {"raw": ([MemRegion(RAW_ID, d_addr, d_bytes, kind, d_dev)], [room_bytes])}
                )

    def _post_raw(self, covers: list[Any], raw_to: list[int]) -> list[tuple[Any, Any]]:
        """One raw WRITE per (room, rank), all posted at once: (endpoint, ticket) of each."""
        from kvferry.core.messages import Endpoint

        eps, room_bytes = self.eps, self.room_bytes
        one = np.array([RAW_ID], dtype=np.int64)
        tickets = []
        for k in range(self.cfg.inflight):
            for r, ep in enumerate(eps):
                decode = Endpoint(server="decode", rank=raw_to[r])
                slots = max(1, covers[raw_to[r]][1] // room_bytes)
                # By the global rank: with a process a rank, each still lands in its own slot.
                dst = ((k * self.cfg.prefill_tp + ep.pool.tp_rank) % slots) * room_bytes
                tickets.append(
                    (
                        ep,
                        ep.transport.agent.post(
                            "WRITE",
                            ep.transport.peer_agent(decode),
                            ("raw", room_bytes),
                            (one, np.array([k * room_bytes], dtype=np.int64)),
                            (one, np.array([dst], dtype=np.int64)),
                            np.array([room_bytes], dtype=np.int64),
                        ),
                    )
                )
        return tickets

    def summary(self) -> dict[str, Any]:
        """What a prefill process reports at the end: the timed batches' raw times and its write
        telemetry, unreduced (``_prefill_summary`` reduces every process's together)."""
        cfg, kv_posts, raw_posts = self.cfg, self.kv_posts, self.raw_posts
        return {
            "executor": [ep.transport.executor for ep in self.eps],
            "raw_times": self.raw_times[cfg.warmup :],
            "planned_times": self.planned_times[cfg.warmup :],
            "raw_bytes": self.room_bytes * len(self.eps) * cfg.inflight,
            "descs_requested": [r.descs_requested for r in kv_posts],
            "descs_posted": [r.descs_posted for r in kv_posts],
            "post_us": [r.post_us for r in kv_posts],
            "xfer_us": [r.xfer_us for r in kv_posts],
            "wall_us": [r.wall_ns / 1e3 for r in kv_posts],
            "raw_post_us": [r.post_us for r in raw_posts],
            "raw_xfer_us": [r.xfer_us for r in raw_posts],
            "raw_wall_us": [r.wall_ns / 1e3 for r in raw_posts],
        }


def _prefill_summary(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Every prefill process's summary as one: a batch's raw (and planned) time is its slowest
    process's (they post at once, each timing its own), telemetry medians over every write."""

    def every(key: str) -> list[Any]:
        return [v for p in parts for v in p[key]]

    def median(key: str) -> float:
        return statistics.median(every(key)) if every(key) else 0

    return {
        "executor": every("executor"),
        "raw_times": [max(ts) for ts in zip(*(p["raw_times"] for p in parts), strict=True)],
        "planned_times": [max(ts) for ts in zip(*(p["planned_times"] for p in parts), strict=True)],
        "raw_bytes": sum(p["raw_bytes"] for p in parts),
        "descs_requested": max(every("descs_requested"), default=0),
        "descs_posted": max(every("descs_posted"), default=0),
        **{
            k: median(k)
            for k in ("post_us", "xfer_us", "wall_us", "raw_post_us", "raw_xfer_us", "raw_wall_us")
        },
    }


def senders_of(batch: list[tuple[list[Any], Any]]) -> list[Any]:
    return [s for senders, _ in batch for s in senders]


def _wait_status(handles: list[Any], status: Any, timeout_s: float = 600.0) -> None:
    """Until every room handle reports ``status`` (or later); polled, before the clock starts."""
    from kvferry.core.kvpoll import KVPoll

    end = time.monotonic() + timeout_s
    while any((st := h.poll()) < status for h in handles):
        if st is KVPoll.Failed:
            for h in handles:
                h.failure_exception()
        if time.monotonic() > end:
            raise RuntimeError(f"rooms did not reach {status!r} in {timeout_s} s")
        time.sleep(50e-6)


def _planned_raw(cfg: BenchConfig, eps: list[Any], batch: int, n_pages: int) -> float:
    """Seconds for the direct flow's own descriptors posted straight to NIXL: per room and rank
    pair, the planner's descriptors of the whole room as one WRITE posted the way the runtime
    posts them (``cfg.direct_post``), all at once from this thread, no notification, no control
    message, planned before the clock starts. What NIXL itself charges for the descriptors a
    direct room posts, beside the single-descriptor raw write. Each room moves between the pages
    its direct room of this batch used."""
    from kvferry.core.messages import Endpoint
    from kvferry.core.planner import plan_rank_pair

    dst_pools = _pools(cfg, "decode")
    work = []
    for k in range(cfg.inflight):
        src = np.arange(n_pages, dtype=np.int64) + k * n_pages
        dst = np.arange(n_pages, dtype=np.int64) + ((batch % 2) * cfg.inflight + k) * n_pages
        for ep in eps:
            for pool in dst_pools:
                plan = plan_rank_pair(ep.pool, pool, src, dst, 0, cfg.tokens)
                if plan.count:
                    work.append((ep, Endpoint(server="decode", rank=pool.tp_rank), plan))
    t0 = time.perf_counter()
    tickets = [
        (
            ep,
            ep.transport.post_write(
                peer, p.src_region, p.src_offset, p.dst_region, p.dst_offset, p.length, b""
            ),
        )
        for ep, peer, p in work
    ]
    states = [ep.transport.agent.wait(t, 600.0) for ep, t in tickets]
    took = time.perf_counter() - t0
    if any(s != "DONE" for s in states):
        raise RuntimeError(f"planned raw write ended {states}")
    return took


def _expected_counts(pool: Any, prefill_tp: int, tokens: int) -> dict[int, int]:
    """Bytes each prefill rank (value r + 1) writes into this decode rank for one room."""
    from kvferry.core.geometry import senders_for

    want: dict[int, int] = {}
    per_head = pool.model.num_regions * pool.head_bytes * tokens
    for link in senders_for(pool.model, prefill_tp, pool.tp_size, pool.tp_rank):
        if not link.is_dummy:
            want[link.prefill_rank + 1] = want.get(link.prefill_rank + 1, 0) + link.num_heads * per_head
    return want


def child_decode(cfg: BenchConfig, rank: int | None = None) -> None:
    made = _decode_buffers(cfg, rank)
    eps, all_regions, covers, _bufs = _decode_endpoints(cfg, made, _hear()["addresses"])
    traces = _start_trace(cfg, eps, "decode")
    for ep in eps:
        ep.start()
    _say(event="ready", raw=covers)
    _hear()
    slots = 2 * cfg.inflight
    durations, checks = [], []
    room_bytes = _room_bytes([ep.pool for ep in eps], cfg.tokens)
    wants = [_expected_counts(ep.pool, cfg.prefill_tp, cfg.tokens) for ep in eps]
    for want, regions in zip(wants, all_regions, strict=True):
        _expect_zeros(want, regions, slots)
    reads: list[dict[str, Any]] = []  # NIXL's telemetry of the timed batches' KV READs (pull)
    for b in range(cfg.warmup + cfg.rooms):
        half = b % 2
        for ep in eps:
            ep.transport.agent.telemetry.clear()
        dt, t_start, t_done = _receive_batch(cfg, eps, all_regions, b)
        if b >= cfg.warmup:
            durations.append(dt)
            if cfg.telemetry_path:  # run_config adds them to prefill's file (its writes)
                reads += _kv_reads(eps)
            # Prefill rank r filled its pool with r + 1; each wrote its heads of every token.
            checks += [
                _counts(regions, slots, half * cfg.inflight + k) == want
                for k in range(cfg.inflight)
                for regions, want in zip(all_regions, wants, strict=True)
            ]
        _say(event="batch", index=b, t_start=t_start, t_done=t_done)
        _hear()  # next: the paired raw writes are done
    check = {"ok": bool(checks) and all(checks), "rooms_checked": len(checks)}
    _save_trace(cfg, traces, "decode", rank)
    counters: dict[str, int] = {}
    for ep in eps:
        with ep.lock:
            for k, v in ep.engine.counters.items():
                counters[k] = counters.get(k, 0) + v
    _say(
        event="done",
        executor=[ep.transport.executor for ep in eps],
        durations=durations,
        room_bytes=room_bytes * cfg.inflight,
        check=check,
        counters=counters,
        reads=reads,
    )
    _hear()
    for ep in eps:
        ep.close()


def _kv_reads(eps: list[Any]) -> list[dict[str, Any]]:
    """Decode's KV READs since the telemetry was last cleared (a pull room's; the aux row's are
    small), as JSON-ready dicts."""
    import msgspec

    return [
        msgspec.to_builtins(r)
        for ep in eps
        for r in ep.transport.agent.telemetry.records()
        if r.op == "READ" and r.nbytes > 4096
    ]


def _decode_buffers(cfg: BenchConfig, rank: int | None = None) -> list[tuple[Any, Any, dict[int, Any], Any]]:
    """Decode's pools (or only ``rank``'s) on zeroed buffers, made before prefill's addresses are
    known (the GPU's start-up overlaps prefill's): (pool, buffer, regions, raw cover) per rank."""
    return [(pool, *_buffers(pool, 0, cfg.mem)) for pool in _pools(cfg, "decode", rank)]


def _decode_endpoints(
    cfg: BenchConfig, made: list[tuple[Any, Any, dict[int, Any], Any]], prefill: list[str]
) -> tuple[list[Any], list[dict[int, Any]], list[list[Any]], list[Any]]:
    """Decode's ranks on the buffers ``_decode_buffers`` made: (endpoints, each rank's regions,
    each rank's raw cover as (addr, bytes, dev) for prefill's raw writes, the buffers)."""
    from kvferry.backends.runtime import DecodeEndpoint

    eps, all_regions, covers, keep = [], [], [], []
    for pool, buf, regions, cover in made:
        keep.append(buf)  # the views keep it alive anyway; explicit is clearer
        eps.append(
            DecodeEndpoint(
                "decode",
                pool,
                prefill_server="prefill",
                prefill_addresses=prefill,
                buffers=regions,
                config=_config(cfg),
                extra_groups={"raw": [cover]},
            )
        )
        all_regions.append(regions)
        covers.append([cover.addr, cover.nbytes, cover.dev])
    return eps, all_regions, covers, keep


def _receive_batch(
    cfg: BenchConfig, eps: list[Any], all_regions: list[dict[int, Any]], b: int
) -> tuple[float, int, int]:
    """Batch ``b`` received into its half of the pages (zeroed first, so the check means
    something): (seconds from the first init to the last Success, monotonic ns at the first init
    and at the end; the harness spans several decode processes' batches with them)."""
    from kvferry.core.kvpoll import KVPoll

    n_pages = -(-cfg.tokens // cfg.page_size)
    slots = 2 * cfg.inflight
    half = b % 2
    for k in range(cfg.inflight):
        for regions in all_regions:
            for r in regions.values():
                _slot(r, slots, half * cfg.inflight + k)[:] = 0
    rvs = []
    t_start = time.monotonic_ns()
    t0 = time.perf_counter()
    for k in range(cfg.inflight):
        room, slot = FIRST_ROOM + b * cfg.inflight + k, half * cfg.inflight + k
        for ep in eps:
            rv = ep.receiver(room, f"b{room}")
            rv.init(np.arange(n_pages, dtype=np.int64) + slot * n_pages, cfg.tokens, k)
            rvs.append(rv)
    sts = [rv.wait(600) for rv in rvs]
    dt = time.perf_counter() - t0
    t_done = time.monotonic_ns()
    for rv, st in zip(rvs, sts, strict=True):
        if st is not KVPoll.Success:
            rv.failure_exception()
        rv.clear()
    return dt, t_start, t_done


# ---- harness side --------------------------------------------------------------------------------
class _Proc:
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (the child's stderr, kept for errors)
        self.p = subprocess.Popen(
            [sys.executable, "-m", "kvferry.tools.runtime_bench", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
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
        while True:
            line = self.q.get(timeout=timeout_s)
            if line is None:
                self.log.seek(0)
                raise RuntimeError(f"bench child exited with {self.p.wait()}: {self.log.read()[-2000:]}")
            if line.startswith("{"):  # NIXL/UCX may print their own lines on stdout
                return json.loads(line)

    def put(self, **msg: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


# Input bounds (check_config): the pools are allocated whole in both processes up front.
MAX_TOKENS = 131_072  # the presets' longest context (with YaRN); the memory check below bounds the rest
MAX_ROOMS = 1000  # timed batches; each also moves its raw twin, so this is already many minutes
MAX_INFLIGHT = 64  # one aux row per room in flight, and _config gives the runtime 64 of them
MEM_KINDS = ("DRAM", "VRAM", "TORCH_DRAM")


def check_config(cfg: BenchConfig) -> None:
    """Raise ValueError naming the field if ``cfg`` cannot run, before any process starts."""
    from kvferry.core.geometry import PRESETS, ModelGeometry

    for name, value, lo, hi in (
        ("tokens", cfg.tokens, 1, MAX_TOKENS),
        ("rooms", cfg.rooms, 1, MAX_ROOMS),
        ("inflight", cfg.inflight, 1, MAX_INFLIGHT),
        ("worker_chunks", cfg.worker_chunks, 1, MAX_INFLIGHT),
        ("chunk_tokens", cfg.chunk_tokens, 0, None),
        ("warmup", cfg.warmup, 0, None),
        ("page_size", cfg.page_size, 1, None),
        ("raw_reps", cfg.raw_reps, 1, None),
        ("switch_interval_us", cfg.switch_interval_us, 0, 1_000_000),
        ("active_poll_us", cfg.active_poll_us, 0, 1_000_000),
    ):
        if value < lo or (hi is not None and value > hi):
            bounds = f"in [{lo}, {hi:,}]" if hi is not None else f">= {lo}"
            raise ValueError(f"{name} must be {bounds}, got {value}")
    if cfg.model not in PRESETS:
        raise ValueError(f"model must be one of {', '.join(sorted(PRESETS))}, got {cfg.model!r}")
    if cfg.mem not in MEM_KINDS:
        raise ValueError(f"mem must be one of {', '.join(MEM_KINDS)}, got {cfg.mem!r}")
    if cfg.flow not in FLOWS:
        raise ValueError(f"flow must be one of {', '.join(FLOWS)}, got {cfg.flow!r}")
    if cfg.direct_post not in DIRECT_POSTS:
        raise ValueError(f"direct_post must be one of {', '.join(DIRECT_POSTS)}, got {cfg.direct_post!r}")
    if cfg.engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {cfg.engine!r}")
    # Prefill holds one batch of rooms, decode two (summed over ranks): all allocated up front,
    # and the staging memory of every rank.
    model = ModelGeometry.preset(cfg.model)
    need = 3 * cfg.inflight * -(-cfg.tokens // cfg.page_size) * cfg.page_size * model.token_bytes
    st = staging_bytes(cfg)
    need += cfg.prefill_tp * (2 * st["worker_buffer_bytes"] + st["prefill_pinned_bytes"])
    need += cfg.decode_tp * (st["ring_bytes"] + st["pinned_bytes"])
    if cfg.mem == "VRAM":
        try:
            import torch
        except ImportError:
            raise ValueError("mem VRAM needs torch (pip install 'kvferry[real]')") from None
        if not torch.cuda.is_available():
            raise ValueError("mem VRAM needs a CUDA GPU, and torch sees none (use DRAM)")
        have, where = torch.cuda.get_device_properties(0).total_memory, "GPU 0 has"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine has"
    if need > have:
        raise ValueError(
            f"{cfg.inflight} room(s) of {cfg.tokens:,} tokens need {need / 2**30:.1f} GiB of {cfg.mem} "
            f"pools; {where} {have / 2**30:.1f} GiB"
        )


def run_config(
    cfg: BenchConfig, env: dict[str, str] | None = None, timeout_s: float = 900.0
) -> dict[str, Any]:
    check_config(cfg)
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", **(env or {})}
    if not any(env.get(k) for k in ("KVFERRY_CONTROL_KEY", "KVFERRY_CONTROL_KEY_FILE")):
        from kvferry.backends.runtime.security import ephemeral_key

        env["KVFERRY_CONTROL_KEY"] = ephemeral_key()  # the children share a fresh key
    phases: dict[str, float] = {}
    p, d, handoffs, p2p = _drive(cfg, env, timeout_s, phases)
    if cfg.telemetry_path and (cfg.process_per_rank or d["reads"]):
        _finish_telemetry(cfg, d["reads"])
    row = _row(cfg, env, p, d, handoffs, p2p)
    # Where a row's wall time went (start-ups dominate a device row; the timed batches are ms).
    row["phase_s"] = phases
    return row


def _finish_telemetry(cfg: BenchConfig, reads: list[dict[str, Any]]) -> None:
    """The one telemetry file ``cfg.telemetry_path`` names, written once every child is done: the
    writes of every prefill process (one file each with a process a rank), and decode's READs,
    which `kvferry calibrate --flow-telemetry` fits a READ's cost a descriptor from."""
    ranks = range(cfg.prefill_tp) if cfg.process_per_rank else (None,)
    paths = [_telemetry_file(cfg, rank) for rank in ranks]
    data: dict[str, Any] = {"config": asdict(cfg), "writes": []}
    for path in paths:
        with open(path) as f:
            data["writes"] += json.load(f)["writes"]
    if reads:
        data["reads"] = reads
    for path in paths:
        if path != cfg.telemetry_path:
            os.remove(path)
    with open(cfg.telemetry_path, "w") as f:
        json.dump(data, f)


def _drive(
    cfg: BenchConfig, env: dict[str, str], timeout_s: float, phases: dict[str, float]
) -> tuple[dict[str, Any], dict[str, Any], list[float], float | None]:
    """Every child through every batch: (prefill's summary, decode's, the timed batches'
    send-to-Success seconds, the link probe's GB/s). ``phases`` gets the seconds each stage took."""
    clock = [time.monotonic()]

    def mark(name: str) -> None:
        now = time.monotonic()
        phases[name] = round(now - clock[0], 2)
        clock[0] = now

    blob = json.dumps(asdict(cfg))
    pre_env, dec_env = dict(env), dict(env)
    if cfg.prefill_gpus:
        pre_env["CUDA_VISIBLE_DEVICES"] = cfg.prefill_gpus
    if cfg.decode_gpus:
        dec_env["CUDA_VISIBLE_DEVICES"] = cfg.decode_gpus
    # Every child and the link probe start at once: their start-ups (interpreter, CUDA, NIXL)
    # are most of a row's wall time; decode hears prefill's addresses once it has its buffers.
    probe = _P2pProbe(cfg, env) if cfg.mem == "VRAM" else None
    pres: list[_Proc] = []
    decs: list[_Proc] = []
    try:
        pres += [_Proc(["prefill", blob, *a], pre_env) for a in _rank_args(cfg, cfg.prefill_tp)]
        decs += [_Proc(["decode", blob, *a], dec_env) for a in _rank_args(cfg, cfg.decode_tp)]
        addresses = [a for pre in pres for a in pre.get(timeout_s)["addresses"]]  # in rank order
        for dec in decs:
            dec.put(addresses=addresses)
        raw = [cover for dec in decs for cover in dec.get(timeout_s)["raw"]]
        mark("children_up")
        # The probe's copies must not overlap the timed batches.
        p2p = probe.result() if probe is not None else None
        mark("probe_wait")
        for child in (*pres, *decs):
            child.put(go=True)
        handoffs, spans = [], []
        for b in range(cfg.warmup + cfg.rooms):
            got = [dec.get(timeout_s) for dec in decs]  # batch: timed and checked on decode
            t_send = min(pre.get(timeout_s)["t_send"] for pre in pres)  # batch_sent
            t_done = max(g["t_done"] for g in got)
            if b >= cfg.warmup:
                handoffs.append((t_done - t_send) / 1e9)
                spans.append((t_done - min(g["t_start"] for g in got)) / 1e9)
            for pre in pres:
                pre.put(raw=raw)
            for pre in pres:
                pre.get(timeout_s)  # raw_done
            for dec in decs:
                dec.put(next=True)
        mark("batches")
        d = _decode_summary([dec.get(timeout_s) for dec in decs], spans)
        p = _prefill_summary([pre.get(timeout_s) for pre in pres])
        mark("summaries")
        for child in (*pres, *decs):
            child.put(exit=True)
    finally:
        for child in (*pres, *decs):
            child.kill()
        if probe is not None:
            probe.kill()
    mark("teardown")
    return p, d, handoffs, p2p


def _rank_args(cfg: BenchConfig, tp: int) -> list[list[str]]:
    """The extra arguments of each child of a side: one child with every rank, or one a rank."""
    return [["--rank", str(r)] for r in range(tp)] if cfg.process_per_rank else [[]]


def _decode_summary(parts: list[dict[str, Any]], spans: list[float]) -> dict[str, Any]:
    """Every decode process's summary as one. A batch's time is its one process's own, or with
    several, ``spans``: from the first process's first init to the last one's last Success."""
    counters: dict[str, int] = {}
    for part in parts:
        for k, v in part["counters"].items():
            counters[k] = counters.get(k, 0) + v
    return {
        "executor": [e for part in parts for e in part["executor"]],
        "durations": parts[0]["durations"] if len(parts) == 1 else spans,
        "room_bytes": sum(part["room_bytes"] for part in parts),
        "check": {
            "ok": all(part["check"]["ok"] for part in parts),
            "rooms_checked": sum(part["check"]["rooms_checked"] for part in parts),
        },
        "counters": counters,
        "reads": [r for part in parts for r in part["reads"]],
    }


def _row(
    cfg: BenchConfig,
    env: dict[str, str],
    p: dict[str, Any],
    d: dict[str, Any],
    handoffs: list[float],
    p2p: float | None,
) -> dict[str, Any]:
    """The result row: the configuration, the times (medians), the write telemetry, the placement."""
    room_bytes = d["room_bytes"]
    return {
        "config": cfg.name,
        "model": cfg.model,
        "tokens": cfg.tokens,
        "tp": f"{cfg.prefill_tp}->{cfg.decode_tp}",
        "layout": cfg.layout,
        "room_mb": room_bytes / cfg.inflight / 1e6,
        "rooms": cfg.rooms,
        "inflight": cfg.inflight,
        "worker_chunks": cfg.worker_chunks,
        "switch_interval_us": cfg.switch_interval_us,
        "direct_post": cfg.direct_post,
        "active_poll_us": cfg.active_poll_us,
        "engine": cfg.engine,
        # What really ran in each process (native falls back to python when it cannot load).
        "executor": sorted(set(p["executor"]) | set(d["executor"])),
        "handoff": cfg.handoff,
        "ahead": cfg.ahead,
        "process_per_rank": cfg.process_per_rank,
        **_row_times(cfg, p, d, handoffs),
        "descs_requested": p["descs_requested"],
        "descs_posted": p["descs_posted"],
        "write_post_us": p["post_us"],  # NIXL telemetry, median per kvferry write
        "write_xfer_us": p["xfer_us"],
        "write_wall_us": p["wall_us"],  # post to DONE seen by our poll
        # The raw writes the same way: NIXL's (python) or the engine's (native) post time and
        # completion time, and post to DONE as the waiting Python thread saw it.
        "raw_post_us": p["raw_post_us"],
        "raw_xfer_us": p["raw_xfer_us"],
        "raw_wall_us": p["raw_wall_us"],
        "bytes_ok": d["check"].get("ok", False),
        "ucx_tls": env.get("UCX_TLS", "(default)"),
        "mem": cfg.mem,
        "flow": cfg.flow,
        "gpus": f"{cfg.prefill_gpus or '0'}->{cfg.decode_gpus or '0'}",
        # torch copy of one room's bytes from prefill's first GPU to decode's (the link's limit)
        "p2p_gbps": p2p,
        # Chunks decode scattered per flow (the flow really ran): from decode's counters.
        "scattered": {f: d["counters"].get(f"scattered_{f}", 0) for f in ("ring", "pinned")},
        **({"hops": _trace_hops(cfg)} if cfg.trace_dir else {}),
    }


def _row_times(
    cfg: BenchConfig, p: dict[str, Any], d: dict[str, Any], handoffs: list[float]
) -> dict[str, Any]:
    """The medians of kvferry's batches and of the raw writes, seconds and GB/s, and their ratios."""
    e2e_s = statistics.median(d["durations"])
    e2e = d["room_bytes"] / e2e_s / 1e9
    raw_s = statistics.median(p["raw_times"])
    raw = p["raw_bytes"] / raw_s / 1e9
    # Direct flow only: NIXL alone with the room's own descriptors (see _planned_raw).
    planned_s = statistics.median(p["planned_times"]) if p["planned_times"] else None
    planned = p["raw_bytes"] / planned_s / 1e9 if planned_s else None
    handoff_s = statistics.median(handoffs) if cfg.handoff else None
    return {
        # send(last chunk) -> decode Success of a batch (TransferInfo already at prefill), and the
        # raw write of the same bytes over that time (None unless ``handoff``).
        "handoff_s": handoff_s,
        "handoff_ratio": raw_s / handoff_s if handoff_s else None,
        "kvferry_s": e2e_s,
        "kvferry_batches_s": d["durations"],  # every timed batch: the spread within one row
        "kvferry_gbps": e2e,
        "raw_s": raw_s,
        "raw_gbps": raw,
        "ratio": e2e / raw,
        "planned_raw_s": planned_s,
        "planned_raw_gbps": planned,
        "planned_of_raw": planned / raw if planned else None,  # NIXL's cost of the descriptors
        "ratio_to_planned": e2e / planned if planned else None,  # our runtime's cost on top
    }


def trace_rows(trace_dir: str) -> list[dict[str, Any]]:
    """Every bench process's trace rows in a ``--trace`` run's folder: one file a side, or one a
    rank (``prefill0.rows.json``, ...)."""
    rows: list[dict[str, Any]] = []
    for role in ("prefill", "decode"):
        for path in sorted(glob.glob(os.path.join(trace_dir, f"{role}*.rows.json"))):
            with open(path) as f:
                rows += json.load(f)
    return rows


def _trace_hops(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Merge both children's rows: trace.json (Perfetto) beside them, the timed rooms' hops back."""
    from kvferry.backends.runtime.tracing import chrome, hops

    rows = trace_rows(cfg.trace_dir)
    with open(os.path.join(cfg.trace_dir, "trace.json"), "w") as f:
        json.dump({"traceEvents": chrome(rows)}, f)
    warm = frozenset(range(FIRST_ROOM, FIRST_ROOM + cfg.warmup * cfg.inflight))
    return hops(rows, skip_rooms=warm)


_P2P = """
import sys, torch
a, b, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
src = torch.ones(n, dtype=torch.uint8, device=f"cuda:{a}")
dst = torch.empty(n, dtype=torch.uint8, device=f"cuda:{b}")
for _ in range(2):
    dst.copy_(src)
torch.cuda.synchronize(a), torch.cuda.synchronize(b)
best = []
for _ in range(5):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(torch.cuda.current_stream(a))
    dst.copy_(src)
    e.record(torch.cuda.current_stream(a))
    torch.cuda.synchronize(a), torch.cuda.synchronize(b)
    best.append(s.elapsed_time(e) / 1e3)
print(n / sorted(best)[len(best) // 2] / 1e9)
"""


class _P2pProbe:
    """GB/s of a torch device-to-device copy of one room's bytes from prefill's first GPU to
    decode's first GPU (peer-to-peer over NVLink or PCIe when they differ): what the link can do.
    Its own process, started beside the children; ``result`` waits for it (None if it failed)."""

    def __init__(self, cfg: BenchConfig, env: dict[str, str]) -> None:
        a = (cfg.prefill_gpus or "0").split(",")[0]
        b = (cfg.decode_gpus or "0").split(",")[0]
        visible = ",".join(dict.fromkeys([a, b]))
        idx = {g: i for i, g in enumerate(visible.split(","))}
        nbytes = _room_bytes(_pools(cfg, "decode"), cfg.tokens)
        self.p = subprocess.Popen(
            [sys.executable, "-c", _P2P, str(idx[a]), str(idx[b]), str(nbytes)],
            env={**env, "CUDA_VISIBLE_DEVICES": visible},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def result(self, timeout_s: float = 120.0) -> float | None:
        try:
            out, _ = self.p.communicate(timeout=timeout_s)
            return float(out.strip().splitlines()[-1])
        except (subprocess.SubprocessError, ValueError, IndexError):
            self.kill()
            return None

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


def run(
    configs: tuple[BenchConfig, ...] = DEFAULT_CONFIGS, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    return [run_config(c, env) for c in configs]


def _child_main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("config")
    ap.add_argument("--rank", type=int, default=None, help="only this rank of the side (default: every rank)")
    a = ap.parse_args()
    cfg = BenchConfig(**json.loads(a.config))
    if cfg.switch_interval_us > 0:
        sys.setswitchinterval(cfg.switch_interval_us / 1e6)
    if a.role == "prefill":
        child_prefill(cfg, a.rank)
    else:
        child_decode(cfg, a.rank)


if __name__ == "__main__":
    _child_main()
