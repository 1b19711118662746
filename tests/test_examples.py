"""The examples run, and the SGLang- and vLLM-shaped adapters work when driven the way their engines
call them: real endpoints on 127.0.0.1, real NIXL over UCX on host memory, prefill TP 2 -> decode
TP 1. Every room ends Success with decode's bytes equal to prefill's, and every table is empty
after clear."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from kvferry.backends.runtime import RuntimeConfig
from kvferry.core.geometry import KVKind, ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll, min_status

ROOT = Path(__file__).resolve().parents[1]
MODEL = ModelGeometry("ex", num_layers=2, num_kv_heads=4, head_dim=8)
PAGE, PAGES = 4, 32
CFG = RuntimeConfig(num_queues=2, aux_rows=8)
PRE_POOLS = [PoolGeometry(MODEL, 2, r, PAGE, PAGES) for r in range(2)]
DEC_POOL = PoolGeometry(MODEL, 1, 0, PAGE, PAGES)
TERMINAL = (KVPoll.Success, KVPoll.Failed)


def _load(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sg = _load("kvferry_example_sglang_like", "examples/adapters/sglang_like.py")
vl = _load("kvferry_example_vllm_like", "examples/adapters/vllm_like.py")


# ---- bytes: regions are region_id -> flat uint8 views of one rank's pool ----------------------
def _slots(pool, pages, start, end):
    t = np.arange(start, end)
    return np.asarray(pages)[t // pool.page_size] * pool.page_size + t % pool.page_size


def _heads(pool, buf):
    return buf.reshape(pool.num_slots, pool.heads_per_rank, pool.head_bytes)


def _compute(rng, regions, pages, start, end):
    """The forward pass: the KV of tokens [start, end) lands in every prefill rank's pages."""
    for pool, regs in zip(PRE_POOLS, regions, strict=True):
        for buf in regs.values():
            view = _heads(pool, buf)
            idx = _slots(pool, pages, start, end)
            view[idx] = rng.integers(1, 256, view[idx].shape, dtype=np.uint8)


def _snapshot(regions, pages, tokens):
    """What prefill holds for the room, per rank and region: [token, local head, head bytes]."""
    return [
        {rid: _heads(p, buf)[_slots(p, pages, 0, tokens)].copy() for rid, buf in regs.items()}
        for p, regs in zip(PRE_POOLS, regions, strict=True)
    ]


def _wrong_bytes(snapshot, dec_regions, pages, tokens):
    wrong = 0
    for p, regs in zip(PRE_POOLS, snapshot, strict=True):
        for rid, want in regs.items():
            got = _heads(DEC_POOL, dec_regions[rid])[_slots(DEC_POOL, pages, 0, tokens)]
            wrong += int((got[:, p.head_start : p.head_end] != want).sum())
    return wrong


def _assert_no_leaks(endpoints):
    deadline = time.monotonic() + 10
    while any(v for e in endpoints for v in e.leaks().values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [e.leaks() for e in endpoints] == [dict.fromkeys(e.leaks(), 0) for e in endpoints]


@pytest.fixture
def closer(request):
    """``keep(obj, *memory)`` closes ``obj`` at teardown (last kept first) and checks every thread
    joined. ``memory``: buffers ``obj`` registered by address only (SGLang's ``kv_data_ptrs``),
    held until after the close: NIXL needs registered memory to outlive its registration, and
    the test's own references end when the test function returns, before this teardown."""
    before = set(threading.enumerate())
    kept = []
    held = []

    def finish():
        stuck = [name for obj in reversed(kept) for name in obj.close()]
        held.clear()
        assert stuck == []
        assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []

    def keep(obj, *memory):
        kept.append(obj)
        held.extend(memory)
        return obj

    request.addfinalizer(finish)
    return keep


# ---- (a) the runnable README example ----------------------------------------------------------
def test_two_endpoints_example_runs():
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "two_endpoints.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "two_endpoints: 3/3 rooms Success, 0 wrong bytes, leaks none, stuck threads none" in run.stdout


@pytest.mark.parametrize("mode", [[], ["--layerwise"]], ids=["chunks", "layerwise"])
def test_engine_loop_example_runs(mode):
    """examples/engine_loop.py: a fake prefill engine (scheduler loop, chunked prefill, a client's
    cancel) drives the SGLang-shaped adapter; decode, in a second process, checks every byte.
    ``--layerwise``: each chunk is handed over as its forward starts, each layer reported."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "engine_loop.py"), "--requests", "6", "--seed", "3", *mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "summary: 6 requests, 4 Success with every byte checked by decode" in run.stdout, out
    assert "every room ended as it should; leaks none, stuck threads none" in run.stdout, out
    assert "client cancelled: abort on every prefill rank" in run.stdout
    assert "decode drops room" in run.stdout
    assert run.stdout.count(", 0 wrong bytes, first token") == 4
    if mode:
        streamed = re.search(r"layer-wise: (\d+) layer writes posted", run.stdout)
        assert streamed and int(streamed.group(1)) > 0, out


# ---- (b) SGLang-shaped adapter ------------------------------------------------------------------
def _kv_args(pool, regs):
    layers = range(pool.model.num_layers)
    order = [pool.region_id(i, KVKind.K) for i in layers] + [pool.region_id(i, KVKind.V) for i in layers]
    return sg.KVArgs(
        engine_rank=pool.tp_rank,
        kv_data_ptrs=[regs[r].ctypes.data for r in order],
        kv_data_lens=[regs[r].nbytes for r in order],
        aux_rows=8,
    )


def test_sglang_like_engine_loop(closer):
    pre_regs = [{s.region_id: np.zeros(s.nbytes, np.uint8) for s in p.regions} for p in PRE_POOLS]
    dec_regs = {s.region_id: np.zeros(s.nbytes, np.uint8) for s in DEC_POOL.regions}
    prefill = "prefill-sg"
    pre_mgrs = [
        closer(sg.KVManager(_kv_args(p, r), sg.DisaggregationMode.PREFILL, p, server=prefill, config=CFG), r)
        for p, r in zip(PRE_POOLS, pre_regs, strict=True)
    ]
    dec_mgr = closer(
        sg.KVManager(
            _kv_args(DEC_POOL, dec_regs),
            sg.DisaggregationMode.DECODE,
            DEC_POOL,
            server="decode-sg",
            prefill_server=prefill,
            prefill_addresses=[m.address for m in pre_mgrs],
            config=CFG,
        ),
        dec_regs,
    )
    rng = np.random.default_rng(1)
    # room -> (prompt tokens, chunked-prefill size, pass num_tokens to init)
    reqs = {501: (13, 6, True), 502: (8, 8, False), 503: (5, 5, True)}
    pre_free, dec_free = list(range(PAGES)), list(range(PAGES))
    rooms = {}

    def decode_bootstrap(room):  # decode scheduler: pages allocated, receiver opened
        tokens, _, exact = reqs[room]
        dst = [dec_free.pop() for _ in range(-(-tokens // PAGE))]
        rx = sg.KVReceiver(dec_mgr, prefill, room)
        rx.init(
            np.asarray(dst), aux_index=list(reqs).index(room), **({"num_tokens": tokens} if exact else {})
        )
        rooms[room]["rx"], rooms[room]["dst"] = rx, dst

    for aux, (room, (tokens, _, exact)) in enumerate(reqs.items()):  # prefill scheduler
        src = [pre_free.pop(0) for _ in range(-(-tokens // PAGE))]
        senders = [sg.KVSender(m, prefill, room) for m in pre_mgrs]  # one per TP rank
        for s in senders:
            s.init(len(src), aux_index=aux, **({"num_tokens": tokens} if exact else {}))
        rooms[room] = {"src": src, "tx": senders, "done": 0, "sent_pages": 0}
    for room in (501, 502):
        decode_bootstrap(room)

    step = 0
    while any(r["done"] < reqs[k][0] for k, r in rooms.items()):  # prefill forward passes
        for room, r in rooms.items():
            tokens, chunk, _ = reqs[room]
            if r["done"] == tokens:
                continue
            end = min(r["done"] + chunk, tokens)
            _compute(rng, pre_regs, r["src"], r["done"], end)
            r["done"], last = end, end == tokens
            if last:
                r["want"] = _snapshot(pre_regs, r["src"], tokens)
            # SGLang's send_kv_chunk: full pages only until the last chunk; skip an empty one.
            end_page = len(r["src"]) if last else end // PAGE
            pages, r["sent_pages"] = r["src"][r["sent_pages"] : end_page], end_page
            for s in r["tx"] if pages else []:
                if last:
                    s.aux_payload = (room * 7).to_bytes(4, "little")  # e.g. the first output token
                s.send(np.asarray(pages))
        step += 1
        if step == 1:
            decode_bootstrap(503)  # decode learns of this room after prefill sent it

    deadline = time.monotonic() + 30
    statuses = {}
    while time.monotonic() < deadline:  # both schedulers poll; status over ranks: the minimum
        statuses = {k: (r["rx"].poll(), min_status(s.poll() for s in r["tx"])) for k, r in rooms.items()}
        if all(a in TERMINAL and b in TERMINAL for a, b in statuses.values()):
            break
        time.sleep(0.01)
    assert statuses == dict.fromkeys(reqs, (KVPoll.Success, KVPoll.Success))
    for room, r in rooms.items():
        assert _wrong_bytes(r["want"], dec_regs, r["dst"], reqs[room][0]) == 0
        assert r["rx"].aux_payload()[:4] == (room * 7).to_bytes(4, "little")
        r["rx"].failure_exception()  # not failed: returns quietly
        r["rx"].clear()
        for s in r["tx"]:
            s.clear()
    _assert_no_leaks([m.endpoint for m in [*pre_mgrs, dec_mgr]])


# ---- (b) vLLM-shaped adapter --------------------------------------------------------------------
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(MODEL.num_layers)]


def _kv_caches(pool):
    """vLLM's per-layer cache: [2 (K, V), num_blocks, block_size, heads, head_dim], bf16 as uint16."""
    shape = (2, pool.num_pages, pool.page_size, pool.heads_per_rank, MODEL.head_dim)
    return {name: np.zeros(shape, np.uint16) for name in LAYERS}


def _regions(pool, caches):
    out = {}
    for i, name in enumerate(LAYERS):
        out[pool.region_id(i, KVKind.K)] = caches[name][0].reshape(-1).view(np.uint8)
        out[pool.region_id(i, KVKind.V)] = caches[name][1].reshape(-1).view(np.uint8)
    return out


def _worker_step(worker, caches, meta, finished_req_ids, forward=None):
    """What vLLM's model runner does with the connector around one forward pass."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    if forward is not None:
        forward()
    for name in LAYERS:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, caches[name], None)
    worker.wait_for_save()
    out = worker.get_finished(finished_req_ids)
    worker.clear_connector_metadata()
    return out


class _PrefillEngine:
    """A vLLM-like prefill instance: a token budget per step, chunked prefill, blocks held until
    every worker reported the request sent."""

    def __init__(self, workers, caches, budget, rng):
        self.sched = vl.KVFerryConnectorScheduler(vl.KV_PRODUCER, PAGE)
        self.workers, self.caches, self.budget, self.rng = workers, caches, budget, rng
        self.regions = [_regions(p, c) for p, c in zip(PRE_POOLS, caches, strict=True)]
        self.free = list(range(PAGES))
        self.waiting, self.running, self.held = [], {}, {}
        self.finished_ids: set[str] = set()
        self.sent_reports: dict[str, int] = {}
        self.snapshots, self.released = {}, set()

    def step(self):
        for req in self.waiting:
            assert self.sched.get_num_new_matched_tokens(req, 0) == (0, False)
            self.running[req.request_id] = {"req": req, "blocks": [], "done": 0}
        self.waiting = []
        scheduled, num, budget, work = [], {}, self.budget, []
        for rid, st in self.running.items():
            n = min(budget, st["req"].num_prompt_tokens - st["done"])
            if n <= 0:
                continue
            budget -= n
            new = [self.free.pop(0) for _ in range(-(-(st["done"] + n) // PAGE) - len(st["blocks"]))]
            first = not st["blocks"]
            st["blocks"] += new
            if first:
                self.sched.update_state_after_alloc(st["req"], list(st["blocks"]), 0)
            scheduled.append(vl.ScheduledRequest(rid, new, st["done"]))
            num[rid] = n
            work.append((st, st["done"], st["done"] + n))
        meta = self.sched.build_connector_meta(vl.SchedulerOutput(scheduled, num))

        def forward():
            for st, start, end in work:
                _compute(self.rng, self.regions, st["blocks"], start, end)

        finished, self.finished_ids = self.finished_ids, set()
        for rank, (w, c) in enumerate(zip(self.workers, self.caches, strict=True)):
            sending, recving = _worker_step(w, c, meta, finished, forward if rank == 0 else None)
            assert recving is None
            for rid in sending or ():
                self.sent_reports[rid] = self.sent_reports.get(rid, 0) + 1
        for st, _, end in work:  # the scheduler's update after the step
            st["done"] = end
            req = st["req"]
            if end == req.num_prompt_tokens:
                rid = req.request_id
                self.snapshots[rid] = _snapshot(self.regions, st["blocks"], end)
                delay, params = self.sched.request_finished(req, st["blocks"])
                assert delay and params == {k: req.kv_transfer_params[k] for k in ("room", "transfer_id")}
                self.held[rid] = self.running.pop(rid)["blocks"]
                self.finished_ids.add(rid)
        for rid in [r for r, n in self.sent_reports.items() if n == len(self.workers)]:
            self.free += self.held.pop(rid)  # every rank sent it: the blocks go back
            del self.sent_reports[rid]
            self.released.add(rid)


class _DecodeEngine:
    """A vLLM-like decode instance: remote-prefill requests wait for their KV (async load)."""

    def __init__(self, workers, caches):
        self.sched = vl.KVFerryConnectorScheduler(vl.KV_CONSUMER, PAGE)
        self.workers, self.caches = workers, caches
        self.free = list(range(PAGES))
        self.waiting, self.loading, self.loaded = [], {}, {}
        self.reports: dict[str, int] = {}

    def step(self):
        for req in self.waiting:
            n, load_async = self.sched.get_num_new_matched_tokens(req, 0)
            assert (n, load_async) == (req.num_prompt_tokens, True)
            blocks = [self.free.pop() for _ in range(-(-n // PAGE))]
            self.sched.update_state_after_alloc(req, blocks, n)
            assert self.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # asked once
            self.loading[req.request_id] = (req, blocks)
        self.waiting = []
        meta = self.sched.build_connector_meta(vl.SchedulerOutput([], {}))
        for w, c in zip(self.workers, self.caches, strict=True):
            sending, recving = _worker_step(w, c, meta, set())
            assert sending is None
            for rid in recving or ():
                self.reports[rid] = self.reports.get(rid, 0) + 1
        for rid in [r for r, n in self.reports.items() if n == len(self.workers)]:
            self.loaded[rid] = self.loading.pop(rid)
            del self.reports[rid]


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunks", "layerwise"])
def test_vllm_like_engine_loop(closer, layerwise):
    rng = np.random.default_rng(2)
    prefill = "prefill-vl"
    pre_caches = [_kv_caches(p) for p in PRE_POOLS]
    pre_workers = [
        closer(vl.KVFerryConnectorWorker(vl.KV_PRODUCER, p, server=prefill, config=CFG, layerwise=layerwise))
        for p in PRE_POOLS
    ]
    for w, c in zip(pre_workers, pre_caches, strict=True):
        w.register_kv_caches(c)
    dec_caches = [_kv_caches(DEC_POOL)]
    dec_workers = [
        closer(
            vl.KVFerryConnectorWorker(
                vl.KV_CONSUMER,
                DEC_POOL,
                server="decode-vl",
                prefill_server=prefill,
                prefill_addresses=[w.endpoint.address for w in pre_workers],
                config=CFG,
            )
        )
    ]
    dec_workers[0].register_kv_caches(dec_caches[0])
    pe = _PrefillEngine(pre_workers, pre_caches, budget=8, rng=rng)
    de = _DecodeEngine(dec_workers, dec_caches)

    prompts = {"r1": (601, 13), "r2": (602, 8), "r3": (603, 20)}  # id -> (room, prompt tokens)

    def params(rid, flag):  # the router gives both sides the same pairing
        room, _ = prompts[rid]
        return {flag: True, "room": room, "transfer_id": f"tid-{rid}"}

    for rid, (_, n) in prompts.items():
        pe.waiting.append(vl.Request(rid, n, params(rid, "do_remote_decode")))
        if rid != "r3":
            de.waiting.append(vl.Request(rid, n, params(rid, "do_remote_prefill")))
    deadline, steps = time.monotonic() + 30, 0
    while (len(de.loaded) < len(prompts) or len(pe.released) < len(prompts)) and time.monotonic() < deadline:
        pe.step()
        de.step()
        steps += 1
        if steps == 3:  # r3 reaches decode after prefill already sent some of it
            de.waiting.append(vl.Request("r3", prompts["r3"][1], params("r3", "do_remote_prefill")))
        time.sleep(0.005)
    assert sorted(de.loaded) == sorted(pe.released) == sorted(prompts)
    dec_regions = _regions(DEC_POOL, dec_caches[0])
    for rid, (req, blocks) in de.loaded.items():
        assert _wrong_bytes(pe.snapshots[rid], dec_regions, blocks, req.num_prompt_tokens) == 0
    assert all(w.failures == {} for w in [*pre_workers, *dec_workers])
    assert dec_workers[0].get_block_ids_with_load_errors() == set()
    assert sorted(pe.free) == list(range(PAGES))  # every prefill block came back
    _assert_no_leaks([w.endpoint for w in [*pre_workers, *dec_workers]])
    posted = 0
    for w in pre_workers:
        with w.endpoint.lock:  # the engine only under its endpoint's lock
            posted += w.endpoint.engine.counters["layer_ranges_posted"]
    assert (posted > 0) == layerwise  # save_kv_layer's reports moved the layer-wise rooms' KV
