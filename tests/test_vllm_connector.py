"""KvferryConnector inside vLLM 0.33's own Scheduler, prefill and decode in two processes.

Real parts: vLLM's ``Scheduler`` (chunked prefill, async loads, recompute on load failure), its
``KVConnectorFactory`` loading the connector by module path, its KV cache planner and allocator
(``allocate_kv_cache`` on the CPU, the LBNHC layout the connector asks for), its worker-side
connector driver (``KVConnectorModelRunnerMixin._get_kv_connector_output``), and kvferry's real
endpoints over NIXL (UCX on 127.0.0.1) with an authenticated ZMQ control plane. Stand-in: the
model's forward, which writes a known pattern (a function of token id, position, layer and byte)
into every scheduled token's KV row layer by layer, each layer through vLLM's own
``maybe_transfer_kv_layer`` (which calls the connector's ``save_kv_layer``), so decode can check
every byte it received.

Needs vLLM: run in the vLLM environment (README, Tests; docs/vllm.md). Prefill runs as
``python tests/test_vllm_connector.py prefill``, a decode a test kills as ``... decode`` (JSON
lines on stdin/stdout).
"""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

if __name__ != "__main__":
    pytest.importorskip("vllm", reason="the vLLM integration tests run in the vLLM environment")

import torch

from kvferry.integrations.vllm.config import FLOWS

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, VOCAB = 2, 16, 16, 128, 1000  # blocks: every prompt of a test at once
# Staging memory for the ring and pinned flows (a chunk of 32 tokens of all heads is 4 KiB): a
# ring of a few chunks, so its rooms go round it and wait for its watermark.
STAGING_PREFILL = {"worker_buffer_bytes": 16384, "prefill_pinned_bytes": 32768}
STAGING_DECODE = {"ring_bytes": 16384, "pinned_bytes": 32768}
MARK = "@kvferry-test "  # prefixes the prefill process's protocol lines
KEY = "kvferry-vllm-test-key-0123456789"
FAST = {
    "heartbeat_timeout_s": 1.0,
    "bootstrap_timeout_s": 20.0,
    "fence_timeout_s": 3.0,
    "transfer_timeout_s": 20.0,
    "num_queues": 2,  # threads per prefill rank: the tests run several ranks on 2 cores
}


def pattern(token: int, pos: int, layer: int, heads: range, content: int) -> torch.Tensor:
    """What the stand-in forward writes into one token's KV row on a rank holding ``heads``
    (``[heads, content]``): a function of the global head, so a head landing in another head's
    place, or on a rank that does not hold it, would not match."""
    head = torch.tensor(list(heads), dtype=torch.int64)[:, None]
    elem = torch.arange(content, dtype=torch.int64)[None, :]
    return ((elem * 13 + head * 29 + token * 7 + pos * 3 + layer * 11) % 251).to(torch.float16)


class Engine:
    """vLLM's scheduler and a worker connector per TP rank, stepped the way vLLM's engine core
    and its executor step them (each rank's connector output merged by vLLM's aggregator)."""

    def __init__(
        self,
        role: str,
        name: str,
        extra: dict[str, Any],
        max_batched: int = 32,
        block: int = BLOCK,
        tp: int = 1,
        layout: str | None = None,
    ) -> None:
        from unittest import mock

        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        model_dir = tempfile.mkdtemp(prefix="kvferry-vllm-model-")
        hf = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": HEADS, "head_dim": HEAD_DIM,
            "num_hidden_layers": len(LAYERS), "intermediate_size": 128, "vocab_size": VOCAB,
            "max_position_embeddings": 2048, "torch_dtype": "float16",
        }  # fmt: skip
        Path(model_dir, "config.json").write_text(json.dumps(hf))
        from kvferry.integrations.vllm import KvferryConnector

        self.block = block
        cache = CacheConfig(block_size=block, enable_prefix_caching=False)
        # As the engine core resolves it (a test may force another, as VLLM_KV_CACHE_LAYOUT would).
        cache.kv_cache_layout = layout or KvferryConnector.get_required_kvcache_layout(None)
        self.config = VllmConfig(
            model_config=ModelConfig(
                model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=1024
            ),
            cache_config=cache,
            scheduler_config=SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=max_batched, max_model_len=1024,
                enable_chunked_prefill=True, is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvferryConnector", kv_connector_module_path="kvferry.integrations.vllm",
                kv_role=role, engine_id=name, kv_connector_extra_config=extra,
                kv_load_failure_policy="recompute",  # vLLM's default, "fail", ends the request
            ),
            device_config=DeviceConfig("cpu"),
            parallel_config=ParallelConfig(tensor_parallel_size=tp),
        )  # fmt: skip
        spec = FullAttentionSpec(
            block_size=block, num_kv_heads=HEADS // tp, head_size=HEAD_DIM, dtype=torch.float16
        )
        groups = [KVCacheGroupSpec(LAYERS, spec)]
        kv_config = get_kv_cache_config_from_groups(
            self.config, groups, NUM_BLOCKS * BLOCK // block * spec.page_size_bytes * len(LAYERS)
        )
        self.config.cache_config.num_gpu_blocks = kv_config.num_blocks  # the engine core sets it so
        self.scheduler = Scheduler(
            self.config, kv_config, StructuredOutputManager(self.config), block_size=block, log_stats=True
        )
        # One worker connector per rank, each over its own KV tensors (its heads). Without
        # torch.distributed, the rank a worker process would read from vLLM's parallel state is
        # handed to the connector here.
        self.workers, self.rows, self.layers = [], [], []
        self.attn_metadata = {n: SimpleNamespace() for n in LAYERS}  # the connector reads none of it
        for rank in range(tp):
            with mock.patch("kvferry.integrations.vllm.connector._tp_rank", lambda _, r=rank: r):
                worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, kv_config)
            kv_transfer_state._KV_CONNECTOR_AGENT = worker  # what ensure_kv_transfer_initialized sets
            kv = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout[cache.kv_cache_layout])
            self.rows.append({n: t.permute(0, 2, 1, 3) for n, t in kv.items()})  # [B, N, H, C]
            # Stand-ins for the rank's attention layers, as vLLM's forward context finds them.
            self.layers.append({n: SimpleNamespace(kv_cache=t) for n, t in kv.items()})
            worker.register_kv_caches(kv)
            self.workers.append(worker)
        self.worker = self.workers[0]
        self.aggregator = KVOutputAggregator.from_connector(self.worker, tp)
        handshakes = {(0, r): w.get_handshake_metadata() for r, w in enumerate(self.workers)}
        if handshakes[0, 0] is not None:
            self.scheduler.connector.set_xfer_handshake_metadata_pp_aware(handshakes)
        self.free_blocks_at_start = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        self.first_scheduled: dict[str, tuple[int, int]] = {}  # request -> (start, tokens) of its first step
        self.loaded_ok: dict[str, bool] = {}  # request -> its loaded rows held prefill's bytes
        self.stats = self.worker.build_kv_connector_stats()  # what vLLM's stats loggers were handed

    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = dict(params) if params else None  # each request its own, as vLLM deserialises them
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params})
        req = Request(req_id, prompt, sp, None)
        req.kv_transfer_params = params
        self.scheduler.add_request(req)

    def blocks_of(self, req_id: str) -> list[int]:
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]

    def heads(self, rank: int) -> range:
        """The model's KV heads TP rank ``rank`` holds."""
        per_rank = HEADS // len(self.workers)
        return range(rank * per_rank, (rank + 1) * per_rank)

    def rows_match(self, req_id: str, tokens: list[int], upto: int) -> bool:
        blocks = self.blocks_of(req_id)
        for rank, layers in enumerate(self.rows):
            for layer, rows in enumerate(layers.values()):
                for pos in range(upto):
                    row = rows[blocks[pos // self.block], pos % self.block]
                    if not torch.equal(row, pattern(tokens[pos], pos, layer, self.heads(rank), row.shape[1])):
                        return False
        return True

    def forward(self, out: Any, rank: int) -> list[list[int]]:
        """The stand-in model on one rank, layer by layer as a model's attention layers run: each
        scheduled token's known row of the layer, then vLLM's own ``maybe_transfer_kv_layer``
        (the wrapper of every attention layer's KV write) hands the layer to the connector; one
        sampled token for each request whose prompt is complete."""
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer

        spans = {}  # request -> (first position of this step, tokens)
        for req_id, n in out.num_scheduled_tokens.items():
            spans[req_id] = (self.scheduler.requests[req_id].num_computed_tokens - n, n)  # already advanced

        @maybe_transfer_kv_layer
        def attention(layer: int, layer_name: str) -> None:
            rows = self.rows[rank][layer_name]
            for req_id, (start, n) in spans.items():
                req, blocks = self.scheduler.requests[req_id], self.blocks_of(req_id)
                for pos in range(start, start + n):
                    row = rows[blocks[pos // self.block], pos % self.block]
                    row.copy_(pattern(req.all_token_ids[pos], pos, layer, self.heads(rank), row.shape[1]))

        for layer, name in enumerate(LAYERS):
            attention(layer, name)
        return [
            [1 + (start + n - 1) % (VOCAB - 1)] if start + n >= self.scheduler.requests[r].num_tokens else []
            for r, (start, n) in spans.items()
        ]

    def failures(self) -> dict[str, str]:
        """Request -> why its room failed, on any rank."""
        return {r: why for w in self.workers for r, why in w.worker_half.failures.items()}

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()

    def step(self) -> list[Any]:
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        out = self.scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        for req_id, n in out.num_scheduled_tokens.items():
            if req_id not in self.first_scheduled:
                req = self.scheduler.requests[req_id]
                start = req.num_computed_tokens - n
                self.first_scheduled[req_id] = (start, n)
                if start > 0:  # rows [0, start) came through the connector: check them first
                    self.loaded_ok[req_id] = self.rows_match(req_id, req.all_token_ids, start)
        outputs = []
        for rank, worker in enumerate(self.workers):
            kv_transfer_state._KV_CONNECTOR_AGENT = worker  # this rank's (a test steps several engines)
            self.config.compilation_config.static_forward_context.update(self.layers[rank])
            with (
                set_forward_context(self.attn_metadata, self.config),
                KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_out,
            ):
                sampled = self.forward(out, rank)
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                    kv_connector_output=kv_out,
                )
            )
        mro = self.aggregator.aggregate(outputs)
        outputs = self.scheduler.update_from_output(out, mro)
        for eco in outputs.values():
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.stats.aggregate(
                    self.worker.build_kv_connector_stats(eco.scheduler_stats.kv_connector_stats)
                )
        return [o for eco in outputs.values() for o in eco.outputs]

    def idle(self) -> bool:
        return not self.scheduler.requests

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def served(role: str, name: str) -> tuple[Engine, Callable[..., None], Callable[[], dict[str, Any]]]:
    """A process's engine (its settings from the environment), how it emits a protocol line, and
    its next command from stdin (waiting a little only while the engine is idle)."""
    extra = {**FAST, "control_key_file": os.environ["KEYFILE"], **json.loads(os.environ["EXTRA"])}
    engine = Engine(role, name, extra, tp=int(os.environ["TP"]))

    def emit(**fields: Any) -> None:
        print(MARK + json.dumps(fields), flush=True)

    emit(event="ready")
    commands: queue.Queue[dict[str, Any]] = queue.Queue()
    threading.Thread(
        target=lambda: [commands.put(json.loads(line)) for line in sys.stdin], daemon=True
    ).start()

    def next_command() -> dict[str, Any]:
        try:
            return commands.get(timeout=0.05) if engine.idle() else commands.get_nowait()
        except queue.Empty:
            return {"op": "none"}

    return engine, emit, next_command


def serve_prefill() -> None:
    """The prefill process: requests in on stdin, their kv_transfer_params out on stdout."""
    engine, emit, next_command = served("kv_producer", "prefill")
    abort_after: dict[str, int] = {}
    while True:
        cmd = next_command()
        if cmd["op"] == "add":
            flow = {"kvferry_flow": cmd["flow"]} if "flow" in cmd else {}
            engine.add(cmd["id"], cmd["prompt"], 1, {"do_remote_decode": True, **flow})
            if "abort_after_steps" in cmd:
                abort_after[cmd["id"]] = cmd["abort_after_steps"]
        elif cmd["op"] == "exit":
            break
        elif cmd["op"] == "status":  # for a failing test's message: what prefill still holds
            held = {
                r: [str(w.worker_half._open[r].handle.poll()) if r in w.worker_half._open else "-"
                    for w in engine.workers]
                for r in engine.scheduler.requests
            }  # fmt: skip
            emit(event="status", held=held, failures=engine.failures())
        if engine.idle():
            continue
        time.sleep(0.002)  # as an engine's loop leaves the GIL to kvferry's threads between steps
        for o in engine.step():
            if o.finish_reason is not None:
                emit(event="finished", id=o.request_id, params=o.kv_transfer_params)
        for req_id in list(abort_after):
            abort_after[req_id] -= 1
            if abort_after[req_id] == 0:
                from vllm.v1.request import RequestStatus

                del abort_after[req_id]
                engine.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
                emit(event="finished", id=req_id, params=None)  # an abort yields no output here
        if engine.idle():
            refused = engine.scheduler.connector.scheduler_half.refused_flows
            layer_reports = sum((w.worker_half.layer_reports for w in engine.workers), Counter())
            emit(
                event="idle", free_blocks=engine.free_blocks(), at_start=engine.free_blocks_at_start,
                stats=engine.stats.data, refused_flows=refused, layer_reports=layer_reports,
                failures=engine.failures(),
            )  # fmt: skip
    engine.shutdown()


def serve_decode() -> None:
    """A decode process (one a test can stop or kill): requests with prefill's kv_transfer_params
    in on stdin; "opened" once a request's room is open on every rank, "idle" with what vLLM's
    scheduler did with each request once none is left."""
    engine, emit, next_command = served("kv_consumer", "decode-proc")
    opening: set[str] = set()
    while True:
        cmd = next_command()
        if cmd["op"] == "add":
            engine.add(cmd["id"], cmd["prompt"], 2, cmd["params"])
            opening.add(cmd["id"])
        elif cmd["op"] == "exit":
            break
        if engine.idle():
            continue
        engine.step()
        for req_id in sorted(opening):
            if all(req_id in w.worker_half._open for w in engine.workers):
                opening.discard(req_id)
                emit(event="opened", id=req_id)
        if engine.idle():
            emit(
                event="idle", free_blocks=engine.free_blocks(), at_start=engine.free_blocks_at_start,
                first_scheduled=engine.first_scheduled, failures=engine.failures(),
            )  # fmt: skip
    engine.shutdown()


class Prefill:
    """A prefill engine (``role="prefill"``) or a decode engine (``role="decode"``) in a process
    of its own, driven by JSON lines."""

    def __init__(self, keyfile: str, tp: int = 1, role: str = "prefill", **extra: Any) -> None:
        env = {
            **os.environ, "KEYFILE": keyfile, "PYTHONUNBUFFERED": "1", "EXTRA": json.dumps(extra),
            "TP": str(tp),
        }  # fmt: skip
        # The process's stderr (vLLM's and kvferry's logs): a file when debugging.
        log = os.environ.get(f"KVFERRY_TEST_{role.upper()}_LOG", os.devnull)
        self.log = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, __file__, role], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, stderr=self.log,
        )  # fmt: skip
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):  # NIXL's own log lines share stdout
                self.lines.put(json.loads(line[len(MARK) :]))
        self.lines.put(None)

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if msg is None:
                raise AssertionError(f"prefill process ended (rc {self.proc.poll()}) before {event!r}")
            if msg["event"] == event:
                return msg
        raise AssertionError(f"no {event!r} from prefill within {timeout} s")

    def finished(self, n: int) -> dict[str, Any]:
        """The kv_transfer_params of the next ``n`` requests prefill finishes, by request."""
        return {msg["id"]: msg["params"] for msg in (self.expect("finished", 120) for _ in range(n))}

    def expect_idle(self, timeout: float) -> dict[str, Any]:
        try:
            return self.expect("idle", timeout)
        except AssertionError as exc:
            self.send(op="status")
            raise AssertionError(f"{exc}; prefill holds {self.expect('status', 10)}") from None

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.log.close()
        if self.proc.poll() is None:
            self.resume()
            self.send(op="exit")
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
def keyfile(tmp_path: Path) -> str:
    path = tmp_path / "control.key"
    path.write_text(KEY)
    return str(path)


def run_decode(*engines: Engine, timeout: float = 120) -> None:
    """Step the decode engines until none has a request left."""
    deadline = time.monotonic() + timeout
    while not all(e.idle() for e in engines):
        assert time.monotonic() < deadline, "decode did not get there in time"
        for engine in engines:
            engine.step()
        time.sleep(0.002)


def prompt(seed: int, n: int) -> list[int]:
    return [1 + (seed * 31 + i * 17) % (VOCAB - 1) for i in range(n)]


def test_prefill_to_decode_through_vllm_scheduler(keyfile: str) -> None:
    """Chunked prompts (up to 3 chunks of 32 tokens) move through kvferry by every flow (direct,
    pull, push, the ring and pinned staged flows, layer-wise) from a prefill of TP 2 into a decode
    engine of TP 1 (each prefill rank sends its heads) of prefill's block size and layout (NHD
    blocks), and one of TP 2 with blocks twice as large in HND that runs the native executor;
    decode's scheduler then computes only the last token, over rows that hold prefill's exact
    bytes; every block is freed on both sides, and vLLM's stats hooks carry the counts. Layer-wise
    layers leave as vLLM's attention wrapper saves each one (save_kv_layer), none at wait_for_save.
    A ring room into the decode that registered no ring fails and is recomputed. A prefill request
    aborted mid-prompt frees its blocks and returns no params, as does one naming an unknown flow;
    decode requests aborted while their loads run (one per flow) are never computed and their
    blocks come back on both sides. Then a decode process dies after asking
    (``decode_killed_after_asking``)."""
    from vllm.v1.request import RequestStatus

    tp = 2
    # No peer dies here and every request is asked for: longer timeouts keep a starved 2-core
    # host (prefill computes all 22 requests before decode asks for the first) from losing one.
    steady = {**FAST, "heartbeat_timeout_s": 5.0, "bootstrap_timeout_s": 60.0}
    prefill = Prefill(keyfile, tp=tp, **steady, **STAGING_PREFILL)
    doomed = Prefill(keyfile, role="decode", **steady)  # starts while the rest runs
    try:
        decode = Engine("kv_consumer", "decode", {**steady, "control_key_file": keyfile, **STAGING_DECODE})
        native = {**steady, "control_key_file": keyfile, "nixl_engine": "native"}
        wide = Engine("kv_consumer", "decode-hnd", native, block=2 * BLOCK, tp=tp, layout="LBHNC")
        prefill.expect("ready", 300)
        moves = {  # request -> (prompt, flow, decode engine)
            "r0": (prompt(0, 70), "direct", decode),
            "r1": (prompt(1, 16), "pull", decode),
            "r2": (prompt(2, 33), "push", decode),
            "r3": (prompt(3, 70), "pull", decode),
            "r4": (prompt(4, 50), "push", decode),
            "r5": (prompt(5, 70), "ring", decode),
            "r6": (prompt(6, 45), "pinned", decode),
            "r7": (prompt(7, 70), "layerwise", decode),
            "r8": (prompt(8, 90), "ring", decode),
            "w0": (prompt(10, 45), "direct", wide),
            "w1": (prompt(11, 70), "pull", wide),
            "w2": (prompt(12, 40), "push", wide),
            "w3": (prompt(13, 50), "layerwise", wide),
        }
        refused = {"w-ring": prompt(14, 40)}  # a ring room into the decode with no ring
        decode_aborts = {f"abort-{flow}": (prompt(20 + i, 50), flow) for i, flow in enumerate(FLOWS)}
        # First, so that prefill's first step computes its first chunk (a room) before the abort.
        prefill.send(op="add", id="aborted", prompt=prompt(9, 90), abort_after_steps=1)
        for req_id, (tokens, flow, _) in moves.items():
            prefill.send(op="add", id=req_id, prompt=tokens, flow=flow)
        for req_id, (tokens, flow) in decode_aborts.items():
            prefill.send(op="add", id=req_id, prompt=tokens, flow=flow)
        for req_id, tokens in refused.items():
            prefill.send(op="add", id=req_id, prompt=tokens, flow="ring")
        prefill.send(op="add", id="typo", prompt=prompt(8, 20), flow="pul")
        params = prefill.finished(len(moves) + len(decode_aborts) + len(refused) + 2)
        assert params["aborted"] is None and params["typo"] is None
        for req_id, (tokens, _, engine) in moves.items():
            assert params[req_id]["do_remote_prefill"] is True
            engine.add(req_id, tokens, 2, params[req_id])
        for req_id, tokens in refused.items():
            wide.add(req_id, tokens, 2, params[req_id])
        for req_id, (tokens, _) in decode_aborts.items():
            decode.add(req_id, tokens, 2, params[req_id])
        decode.step()  # their rooms open in this step's start_load_kv
        for req_id in decode_aborts:
            decode.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        run_decode(decode, wide)
        idle = prefill.expect_idle(60)
        for req_id, (tokens, flow, engine) in moves.items():
            assert engine.first_scheduled[req_id] == (len(tokens) - 1, 1), (
                f"{req_id} ({flow}) was recomputed: {engine.failures()}; prefill: {idle['failures']}"
            )
            assert engine.loaded_ok[req_id], f"{req_id} ({flow}): decode's rows differ from prefill's"
        assert not set(decode_aborts) & set(decode.first_scheduled)
        for req_id in refused:
            assert wide.first_scheduled[req_id][0] == 0, f"{req_id} was not recomputed"
            assert "registered no ring region" in wide.failures()[req_id]
        assert idle["free_blocks"] == idle["at_start"]
        assert idle["refused_flows"] == 1
        # Every layer of every layer-wise chunk left at its save_kv_layer, on every prefill rank.
        assert idle["layer_reports"].get("wait_for_save", 0) == 0
        assert idle["layer_reports"]["save_kv_layer"] >= tp * len(LAYERS) * 5  # r7: 3 chunks, w3: 2
        for engine in (decode, wide):
            assert engine.free_blocks() == engine.free_blocks_at_start
        assert {ep.transport.executor for w in wide.workers for ep in w.worker_half.decode.values()} == {
            "native"
        }
        # Staging memory only where its sizes were given: decode's ring and pinned pool.
        assert [len(ep.staging_buffers) for ep in decode.worker.worker_half.decode.values()] == [2]
        assert not [ep for w in wide.workers for ep in w.worker_half.decode.values() if ep.staging_buffers]
        # vLLM's stats hooks: every room (one per rank) and byte, as vLLM's scheduler reported them.
        token_bytes = decode.worker.worker_half.pool.model.token_bytes  # all heads, all layers
        sent = idle["stats"]
        assert sent["rooms_sent"] >= tp * len(moves)
        assert sent["rooms_sent"] + sent["rooms_send_failed"] == tp * (
            len(moves) + len(decode_aborts) + len(refused) + 1
        )
        assert sent["bytes_sent"] >= token_bytes * sum(len(t) for t, _, _ in moves.values())
        for engine, aborted, failed in ((decode, len(decode_aborts), 0), (wide, 0, len(refused))):
            mine = [len(t) for t, _, e in moves.values() if e is engine]
            got, ranks = engine.stats.data, len(engine.workers)
            # An aborted request's room counts once: failed, or received if its load beat the abort.
            assert got["rooms_received"] + got["rooms_recv_failed"] == ranks * (len(mine) + aborted + failed)
            assert ranks * len(mine) <= got["rooms_received"] == len(got["transfer_s"])
            extra = got["bytes_received"] - token_bytes * sum(mine)
            assert extra in range(0, token_bytes * 50 * aborted + 1)
        wide.shutdown()
        decode_killed_after_asking(prefill, doomed, decode, idle, tp)
        decode.shutdown()
    finally:
        doomed.close()
        prefill.close()


def decode_killed_after_asking(
    prefill: Prefill, doomed: Prefill, fresh: Engine, before: dict[str, Any], tp: int
) -> None:
    """A decode process dies after its rooms opened (its push registration and its pull ask
    reached a prefill it already knows), before prefill wrote or offered a byte (prefill is held
    stopped meanwhile): prefill's rooms fail, vLLM frees every block through finished_sending, and
    prefill goes on serving: a request after the kill moves into another decode, bytes checked.
    ``before``: prefill's last idle report."""
    doomed.expect("ready", 300)
    tokens = {"warm": prompt(43, 20), "killed-push": prompt(40, 50), "killed-pull": prompt(41, 40)}
    for req_id, tok in tokens.items():
        prefill.send(op="add", id=req_id, prompt=tok, flow="pull" if req_id == "killed-pull" else "push")
    params = prefill.finished(len(tokens))
    # A first request makes the two known to each other (decode's endpoint, its registration).
    doomed.send(op="add", id="warm", prompt=tokens["warm"], params=params["warm"])
    assert doomed.expect("idle", 60)["first_scheduled"]["warm"] == [19, 1]
    prefill.pause()  # decode's registration and ask wait in its socket, unanswered
    try:
        for req_id in ("killed-push", "killed-pull"):
            doomed.send(op="add", id=req_id, prompt=tokens[req_id], params=params[req_id])
        for _ in range(2):
            doomed.expect("opened", 60)
        time.sleep(0.5)  # decode's control thread sends what its rooms' opens queued
        doomed.proc.kill()
        doomed.proc.wait(30)
    finally:
        prefill.resume()
    idle = prefill.expect_idle(60)
    assert idle["free_blocks"] == idle["at_start"]
    # Decode had asked (no bootstrap deadline): the push write and the pull offer found the peer
    # gone (NIXL: remote disconnect), and only the warm-up room was sent (a room per prefill rank).
    failed = {r: why for r, why in idle["failures"].items() if r not in before["failures"]}
    assert set(failed) == {"killed-push", "killed-pull"}, failed
    assert "bootstrapping" not in str(failed), failed
    sent = {k: idle["stats"][k] - before["stats"][k] for k in ("rooms_sent", "rooms_send_failed")}
    assert sent == {"rooms_sent": tp, "rooms_send_failed": 2 * tp}, sent
    prefill.send(op="add", id="after", prompt=prompt(42, 40), flow="push")
    after = prefill.expect("finished", 120)["params"]
    fresh.add("after", prompt(42, 40), 2, after)
    run_decode(fresh)
    assert fresh.first_scheduled["after"] == (39, 1), fresh.failures()
    assert fresh.loaded_ok["after"]
    assert prefill.expect_idle(60)["free_blocks"] == idle["at_start"]


def test_failed_rooms_end_in_recompute(keyfile: str, tmp_path: Path) -> None:
    """Every way a room fails ends in vLLM's recompute, never an exception in a step: prefill
    frees the blocks of requests decode never asks for (bootstrap deadline, direct and pull);
    decode with another control key is refused by prefill; decode asked for a prefill whose TP
    size cannot split the model's heads refuses the request itself; prefill dies after answering
    (peer lost, direct and pull). Each failed request is recomputed from token 0 and every block
    comes back."""
    stranger_key = tmp_path / "stranger.key"
    stranger_key.write_text("another-kvferry-test-key-987654321")
    prefill = Prefill(keyfile, bootstrap_timeout_s=4.0)
    try:
        decode = Engine("kv_consumer", "decode", {**FAST, "control_key_file": keyfile})
        stranger = Engine("kv_consumer", "stranger", {**FAST, "control_key_file": str(stranger_key)})
        prefill.expect("ready", 300)
        for req_id, flow in (("orphan", "direct"), ("orphan-pull", "pull")):
            prefill.send(op="add", id=req_id, prompt=prompt(30, 40), flow=flow)
            assert prefill.expect("finished", 120)["params"] is not None
        idle = prefill.expect("idle", 60)  # by the bootstrap deadline: nobody asked
        assert idle["free_blocks"] == idle["at_start"]
        assert idle["stats"]["rooms_send_failed"] == 2 and idle["stats"]["rooms_sent"] == 0
        tokens = {"r": prompt(5, 40), "r-pull": prompt(6, 40), "r-key": prompt(7, 40)}
        for req_id, tok in tokens.items():
            prefill.send(op="add", id=req_id, prompt=tok, flow="pull" if req_id == "r-pull" else "direct")
        params = prefill.finished(len(tokens))
        stranger.add("r-key", tokens["r-key"], 2, params["r-key"])
        run_decode(stranger)  # while prefill lives: refused, not lost
        # A prefill of 3 ranks over the model's 2 KV heads cannot exist: the open is refused.
        three_ranks = {**params["r-key"], "kvferry_addresses": params["r-key"]["kvferry_addresses"] * 3}
        decode.add("tp", tokens["r-key"], 2, three_ranks)
        run_decode(decode)
    finally:
        prefill.proc.kill()
        prefill.proc.wait(30)
        prefill.close()
    for req_id in ("r", "r-pull"):
        decode.add(req_id, tokens[req_id], 2, params[req_id])
    run_decode(decode)
    for engine, req_ids in ((stranger, ["r-key"]), (decode, ["tp", "r", "r-pull"])):
        for req_id in req_ids:
            assert engine.first_scheduled[req_id][0] == 0, f"{req_id}: the prompt was not recomputed"
            assert req_id in engine.failures()
        assert engine.free_blocks() == engine.free_blocks_at_start
        assert engine.stats.data["rooms_recv_failed"] == len(req_ids)
        assert engine.stats.data["rooms_received"] == 0
        print({r: engine.failures()[r] for r in req_ids})
        engine.shutdown()


def test_a_kv_layout_kvferry_cannot_describe_is_refused_with_the_shape_seen() -> None:
    """A layout whose blocks are not one byte run each (LHBNC: a head's blocks together) is
    refused at start-up, in register_kv_caches, instead of moving bytes wrong."""
    with pytest.raises(ValueError, match=r"LBNHC or LBHNC layout .* got shape \(\d+, 2, 16, 32\)"):
        Engine("kv_consumer", "lhbnc", {**FAST, "control_insecure": True}, layout="LHBNC")


def test_bad_extra_config_names_the_key() -> None:
    from kvferry.integrations.vllm.config import KNOBS, parse_extra_config

    doc = (Path(__file__).parent.parent / "docs" / "vllm.md").read_text()
    assert not [key for key in KNOBS if f"| `{key}` |" not in doc], "docs/vllm.md's knob table lacks a key"

    with pytest.raises(ValueError, match="'bootstrap_timeout'"):
        parse_extra_config({"bootstrap_timeout": 3}, "e")
    with pytest.raises(ValueError, match="'num_queues'"):
        parse_extra_config({"num_queues": "4"}, "e")
    with pytest.raises(ValueError, match="'fence_timeout_s'"):
        parse_extra_config({"fence_timeout_s": -1}, "e")
    with pytest.raises(ValueError, match=r"'flow'.*direct, pull, push, ring, pinned, layerwise"):
        parse_extra_config({"flow": "rings"}, "e")
    # A staged flow names the staging size it lacks; sizes are bytes, 0 allowed.
    with pytest.raises(ValueError, match=r"\['worker_buffer_bytes'\]: flow 'ring' needs it > 0"):
        parse_extra_config({"flow": "ring"}, "e")
    with pytest.raises(ValueError, match=r"\['prefill_pinned_bytes'\]: flow 'pinned' needs it > 0"):
        parse_extra_config({"flow": "pinned", "worker_buffer_bytes": 1 << 20}, "e")
    with pytest.raises(ValueError, match=r"'ring_bytes'.*got -1"):
        parse_extra_config({"ring_bytes": -1}, "e")
    with pytest.raises(ValueError, match=r"'pinned_bytes'.*expected int"):
        parse_extra_config({"pinned_bytes": 1.5}, "e")
    # The flows a server offers: a staged one only with its prefill staging memory.
    plain = parse_extra_config({"flow": "layerwise"}, "e")
    assert plain.runnable_flows() == ("direct", "pull", "push", "layerwise")
    assert plain.runtime_config(0).staging.ring_bytes == 0  # no staging memory unless asked
    ring = parse_extra_config({"flow": "ring", "worker_buffer_bytes": 1 << 20, "ring_bytes": 1 << 22}, "e")
    assert ring.runnable_flows() == ("direct", "pull", "push", "ring", "layerwise")
    assert ring.runtime_config(0).staging.worker_buffer_bytes == 1 << 20
    assert ring.runtime_config(0).staging.ring_bytes == 1 << 22
    with pytest.raises(ValueError, match="'nixl_engine'"):
        parse_extra_config({"nixl_engine": "c"}, "e")
    assert parse_extra_config({"port": 7000}, "e").runtime_config(2).port == 7002
    assert parse_extra_config({"nixl_engine": "native"}, "e").runtime_config(0).nixl_engine == "native"


def test_the_late_write_bounds_reach_the_runtime() -> None:
    """write_quarantine_s and lost_peer_drain_s pass through to RuntimeConfig as given."""
    from kvferry.integrations.vllm.config import parse_extra_config

    rt = parse_extra_config({"write_quarantine_s": 924, "lost_peer_drain_s": 1200.5}, "e").runtime_config(1)
    assert (rt.write_quarantine_s, rt.lost_peer_drain_s) == (924.0, 1200.5)
    assert (rt.write_quarantine(), rt.lost_peer_drain()) == (924.0, 1200.5)
    assert parse_extra_config({"write_quarantine_s": 0}, "e").runtime_config(0).write_quarantine() == 0.0


@pytest.mark.parametrize("extra", [{}, {"write_quarantine_s": None, "lost_peer_drain_s": None}])
def test_left_out_or_null_they_derive_from_the_fence(extra: dict) -> None:
    from kvferry.integrations.vllm.config import parse_extra_config

    rt = parse_extra_config({"fence_timeout_s": 30, **extra}, "e").runtime_config(0)
    assert rt.write_quarantine_s is None and rt.lost_peer_drain_s is None
    assert rt.write_quarantine() == 30.0 and rt.lost_peer_drain() == 60.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"write_quarantine_s": -1}, r"\['write_quarantine_s'\]: must be in \[0, 604800\] s, got -1.0"),
        ({"write_quarantine_s": math.nan}, r"\['write_quarantine_s'\]: must be in \[0, 604800\] s, got nan"),
        ({"write_quarantine_s": 7 * 86400.0 + 1}, r"\['write_quarantine_s'\]: must be in"),
        ({"write_quarantine_s": "900"}, r"\['write_quarantine_s'\]: expected float, got '900'"),
        ({"lost_peer_drain_s": 0}, r"\['lost_peer_drain_s'\]: must be in \[0.001, 604800\] s, got 0.0"),
        ({"lost_peer_drain_s": True}, r"\['lost_peer_drain_s'\]: expected float, got True"),
    ],
)
def test_a_bad_late_write_bound_is_a_one_line_error_naming_the_key(extra: dict, message: str) -> None:
    from kvferry.integrations.vllm.config import parse_extra_config

    with pytest.raises(ValueError, match=message) as e:
        parse_extra_config(extra, "e")
    assert "\n" not in str(e.value)


def test_layers_reach_kvferry_once_each_in_any_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's layer-wise bookkeeping alone (the vLLM run above drives every layer through
    save_kv_layer): each saved layer is reported once, in the order vLLM saves them; the layers no
    save_kv_layer named go at wait_for_save as runs; a failed room gets no layer at all."""
    from kvferry.core.kvpoll import KVPoll

    from kvferry.integrations.vllm.config import parse_extra_config
    from kvferry.integrations.vllm.meta import KvferryConnectorMetadata, SendMeta
    from kvferry.integrations.vllm.worker import WorkerHalf

    class Room:  # records what the worker reports; a real sender needs a peer to report to
        def __init__(self, status: KVPoll) -> None:
            self.status, self.layers, self.room = status, [], 7

        def poll(self) -> KVPoll:
            return self.status

        def layers_ready(self, first: int, end: int) -> None:
            self.layers.append((first, end))

    half = WorkerHalf(parse_extra_config({}, "e"), is_producer=True)
    half.pool = SimpleNamespace(model=SimpleNamespace(num_layers=6))
    half._layer_index = {f"l{i}": i for i in range(6)}
    rooms = iter([Room(KVPoll.Transferring), Room(KVPoll.Failed)])
    monkeypatch.setattr(half, "_send_chunk", lambda m: next(rooms))
    chunk = SendMeta("r", 7, "t", (0,), 16, 16, "layerwise")
    meta = KvferryConnectorMetadata(reqs_to_send=[chunk, chunk])
    for name in ("l3", "l1", "l3", "l4"):
        half.layer_saved(meta, name)
    live, failed = list(half._layer_step)
    half.save(meta)
    assert live.layers == [(3, 4), (1, 2), (4, 5), (0, 1), (2, 3), (5, 6)]
    assert failed.layers == []
    assert half.layer_reports == {"save_kv_layer": 3, "wait_for_save": 3}
    assert half._layer_step == {}


def test_stats_reach_prometheus_through_vllms_metrics_classes() -> None:
    """The payload a worker hands vLLM, summed over two workers by the connector's stats class
    (as vLLM's output aggregator does), and observed by vLLM's own ``KVConnectorProm``, which
    finds kvferry's metrics through the connector class it loads by module path."""
    from prometheus_client import REGISTRY
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    from kvferry.integrations.vllm import KvferryConnector

    transfer = KVTransferConfig(
        kv_connector="KvferryConnector", kv_connector_module_path="kvferry.integrations.vllm",
        kv_role="kv_consumer",
    )  # fmt: skip
    rank0 = {"rooms_received": 2, "bytes_received": 4096, "transfer_s": [0.002, 0.004]}
    rank1 = {"rooms_received": 2, "rooms_recv_failed": 1, "bytes_received": 4096, "transfer_s": [0.003, 0.2]}
    both = KvferryConnector.build_kv_connector_stats(rank0).aggregate(
        KvferryConnector.build_kv_connector_stats(rank1)
    )
    assert both.reduce() == {
        "rooms_sent": 0, "rooms_received": 4, "rooms_send_failed": 0, "rooms_recv_failed": 1,
        "bytes_sent": 0, "bytes_received": 8192, "avg_transfer_ms": 52.25,
    }  # fmt: skip
    logging = KVConnectorLogging(transfer)
    logging.observe(both.to_dict())
    lines: list[str] = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines and "rooms_recv_failed=1" in lines[0]

    vllm_config = SimpleNamespace(kv_transfer_config=transfer)  # all KVConnectorProm reads of it
    prom = KVConnectorProm(vllm_config, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(both.to_dict(), 0)
    labels = {"model_name": "m", "engine": "0"}
    assert REGISTRY.get_sample_value("vllm:kvferry_rooms_received_total", labels) == 4
    assert REGISTRY.get_sample_value("vllm:kvferry_rooms_recv_failed_total", labels) == 1
    assert REGISTRY.get_sample_value("vllm:kvferry_bytes_received_total", labels) == 8192
    assert REGISTRY.get_sample_value("vllm:kvferry_transfer_seconds_count", labels) == 4
    assert REGISTRY.get_sample_value("vllm:kvferry_transfer_seconds_bucket", {**labels, "le": "0.005"}) == 3


if __name__ == "__main__" and sys.argv[1:] == ["prefill"]:
    serve_prefill()
if __name__ == "__main__" and sys.argv[1:] == ["decode"]:
    serve_decode()
