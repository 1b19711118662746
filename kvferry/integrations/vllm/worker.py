"""The connector's worker half: vLLM's KV tensors registered with kvferry's real endpoints.

Prefill ranks own one ``PrefillEndpoint`` each (created in ``register_kv_caches``, so vLLM can
gather its address as handshake metadata). Decode ranks open one ``DecodeEndpoint`` per prefill
instance the first time a request names it (its addresses come in ``kv_transfer_params``, as
vLLM's NIXL connector learns its peers).

Failure becomes recompute: any room that fails (peer lost, deadline passed, a refused open, an
endpoint that cannot start) is reported as finished receiving, with its blocks in
``get_block_ids_with_load_errors`` and its request in ``failed_recving``; vLLM then recomputes the
prompt. Nothing here raises into vLLM's step. A failed room is reported only once its blocks are
fenced (no prefill write can still land in them), so vLLM never reuses blocks under a write.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvferry.backends.runtime import DecodeEndpoint, KVReceiver, KVSender, PrefillEndpoint
from kvferry.core.geometry import DType, KVKind, Layout, ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.integrations.vllm.config import ConnectorSettings
from kvferry.integrations.vllm.meta import KvferryConnectorMetadata, KvferryHandshake, RecvMeta, SendMeta

log = logging.getLogger(__name__)
TERMINAL = (KVPoll.Success, KVPoll.Failed)
LAYERWISE = "layerwise"
_DTYPES = {"torch.float16": DType.FP16, "torch.bfloat16": DType.BF16, "torch.float32": DType.FP32}


def new_stats() -> dict[str, Any]:
    """One interval's counts: rooms and bytes by side and outcome, and each successful room's
    seconds from its open to its last byte (plain types: vLLM ships them between processes)."""
    return {
        "rooms_sent": 0, "rooms_received": 0, "rooms_send_failed": 0, "rooms_recv_failed": 0,
        "bytes_sent": 0, "bytes_received": 0, "transfer_s": [],
    }  # fmt: skip


def pool_from_kv_caches(
    kv_caches: dict[str, Any], tp_size: int = 1, tp_rank: int = 0, total_kv_heads: int = 0
) -> tuple[PoolGeometry, dict[int, Any]]:
    """kvferry's pool geometry and region buffers for vLLM's per-layer KV views.

    vLLM 0.33 views each layer as ``[blocks, heads, block_size, content]`` (content: the K and V
    elements of one head and token) over one backing allocation, strided by its KV cache layout.
    kvferry describes each layer as one region of fused K and V heads (``fused_kv``: a head is
    ``content`` wide), in either of vLLM's layer-compact block layouts: ``LBNHC`` (NHD blocks, a
    token's heads together) or ``LBHNC`` (HND blocks, a head's tokens together); the planner maps
    tokens between the two sides' layouts and block sizes. The pool is rank ``tp_rank`` of
    ``tp_size`` over the model's ``total_kv_heads`` (0: this rank's heads times ``tp_size``), so
    each decode rank pairs with the prefill ranks holding its heads, whatever the two TP sizes.
    Any other layout is refused with what was seen."""
    first = next(iter(kv_caches.values()))
    shape = tuple(first.shape)
    if first.dim() == 4 and first.permute(0, 2, 1, 3).is_contiguous():
        layout = Layout.VLLM_NHD
    elif first.dim() == 4 and first.is_contiguous():
        layout = Layout.VLLM_HND
    else:
        raise ValueError(
            "kvferry needs vLLM's KV cache in the LBNHC or LBHNC layout (VLLM_KV_CACHE_LAYOUT): each"
            f" layer [blocks, heads, block_size, content] with a block's bytes together; got shape"
            f" {shape}, strides {tuple(first.stride())}"
        )
    if str(first.dtype) not in _DTYPES:
        raise ValueError(f"kvferry: KV cache dtype {first.dtype} is not supported")
    num_blocks, heads, block_size, content = shape
    model = ModelGeometry(
        "vllm", num_layers=len(kv_caches), num_kv_heads=total_kv_heads or heads * tp_size,
        head_dim=content, dtype=_DTYPES[str(first.dtype)], fused_kv=True,
    )  # fmt: skip
    pool = PoolGeometry(model, tp_size, tp_rank, block_size, num_blocks, layout)
    if pool.heads_per_rank != heads:
        raise ValueError(
            f"kvferry: TP rank {tp_rank} of {tp_size} over {model.num_kv_heads} KV heads should hold"
            f" {pool.heads_per_rank} heads; vLLM's KV cache holds {heads}"
        )
    buffers: dict[int, Any] = {}
    for layer, kv in enumerate(kv_caches.values()):
        if tuple(kv.shape) != shape or kv.dtype != first.dtype or kv.stride() != first.stride():
            raise ValueError(
                f"kvferry: layers differ in KV shape, strides or dtype ({tuple(kv.shape)} vs {shape})"
            )
        view = kv.permute(0, 2, 1, 3) if layout is Layout.VLLM_NHD else kv  # memory order
        buffers[pool.region_id(layer, KVKind.LATENT)] = view
    return pool, buffers


@dataclass
class _Open:
    handle: KVSender | KVReceiver
    endpoint: PrefillEndpoint | DecodeEndpoint
    aux_index: int
    block_ids: tuple[int, ...] = ()
    last_sent: bool = False
    num_tokens: int = 0
    opened: float = field(default_factory=time.monotonic)


@dataclass
class _AuxRows:
    free: list[int]

    @classmethod
    def of(cls, n: int) -> _AuxRows:
        return cls(list(range(n - 1, -1, -1)))


@dataclass
class WorkerHalf:
    settings: ConnectorSettings
    is_producer: bool
    tp_size: int = 1
    tp_rank: int = 0
    total_kv_heads: int = 0  # the model's (0: this rank's times tp_size)
    pool: PoolGeometry | None = None
    buffers: dict[int, Any] = field(default_factory=dict)
    prefill: PrefillEndpoint | None = None
    decode: dict[tuple[str, tuple[str, ...]], DecodeEndpoint] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # request id -> why its room failed
    _aux: dict[int, _AuxRows] = field(default_factory=dict)  # id(endpoint) -> its free aux rows
    _open: dict[str, _Open] = field(default_factory=dict)
    _delegated: set[str] = field(default_factory=set)  # prefill: requests a chunk went out for
    _finished: set[str] = field(default_factory=set)  # prefill: requests the scheduler finished
    _load_errors: set[int] = field(default_factory=set)
    _layer_index: dict[str, int] = field(default_factory=dict)  # vLLM's layer name -> kvferry's layer
    _layer_meta: KvferryConnectorMetadata | None = None  # the step whose layerwise chunks went out
    _layer_step: dict[KVSender, set[int]] = field(default_factory=dict)  # their senders -> layers reported
    # Layers of layerwise chunks reported, by who reported them (save_kv_layer as each layer's
    # attention finishes; wait_for_save for layers no save_kv_layer call named).
    layer_reports: Counter[str] = field(default_factory=Counter)
    _failed_recving: set[str] = field(default_factory=set)
    _done_recving: set[str] = field(default_factory=set)
    # What get_kv_connector_stats reports since its last call (connector/stats.py reads the keys).
    stats: dict[str, Any] = field(default_factory=lambda: new_stats())

    def register(self, kv_caches: dict[str, Any]) -> None:
        self.pool, self.buffers = pool_from_kv_caches(
            kv_caches, self.tp_size, self.tp_rank, self.total_kv_heads
        )
        self._layer_index = {name: layer for layer, name in enumerate(kv_caches)}  # the pool's order
        if self.is_producer:
            # One server of tp_size ranks (its control-plane identity: server name, TP rank).
            self.prefill = PrefillEndpoint(
                self.settings.server, self.pool, buffers=self.buffers,
                config=self.settings.runtime_config(self.tp_rank),
            )  # fmt: skip
            self.prefill.start()

    def handshake(self) -> KvferryHandshake | None:
        if self.prefill is None:
            return None
        return KvferryHandshake(self.settings.server, self.tp_rank, self.prefill.address)

    def _aux_of(self, endpoint: Any) -> _AuxRows:
        return self._aux.setdefault(id(endpoint), _AuxRows.of(self.settings.aux_rows))

    def _decode_endpoint(self, m: RecvMeta) -> DecodeEndpoint:
        key = (m.server, m.addresses)
        ep = self.decode.get(key)
        if ep is None:
            assert self.pool is not None, "register_kv_caches was not called"
            # This rank asks the prefill ranks that hold its heads (core.topology); decode's ranks
            # are one server of tp_size ranks towards each prefill server, as prefill's are.
            ep = DecodeEndpoint(
                f"{self.settings.server}>{m.server}", self.pool, prefill_server=m.server,
                prefill_addresses=list(m.addresses), buffers=self.buffers,
                config=self.settings.runtime_config(self.tp_rank),
            )  # fmt: skip
            ep.start()
            self.decode[key] = ep
        return ep

    # ---- decode -------------------------------------------------------------------------------
    def start_loads(self, meta: KvferryConnectorMetadata) -> None:
        for m in meta.reqs_to_recv:
            try:
                ep = self._decode_endpoint(m)
                aux = self._aux_of(ep).free.pop()
                rx = ep.receiver(m.room, m.transfer_id)
                self._open[m.request_id] = _Open(rx, ep, aux, m.block_ids, num_tokens=m.num_tokens)
                rx.init(np.asarray(m.block_ids, dtype=np.int64), m.num_tokens, aux)
            except Exception as exc:  # a refused open is a load failure, never a dead engine
                log.warning("kvferry: request %s: load not started: %s", m.request_id, exc)
                entry = self._open.pop(m.request_id, None)
                if entry is not None:
                    self._drop(m.request_id, entry, clear=True)
                self.stats["rooms_recv_failed"] += 1
                self._fail_recv(m.request_id, m.block_ids, f"{type(exc).__name__}: {exc}")

    def _fail_recv(self, req_id: str, block_ids: tuple[int, ...], why: str) -> None:
        self.failures[req_id] = why
        self._load_errors.update(block_ids)
        self._failed_recving.add(req_id)
        self._done_recving.add(req_id)

    # ---- prefill ------------------------------------------------------------------------------
    def save(self, meta: KvferryConnectorMetadata) -> None:
        """The step's forward is done: hand over its chunks. A layerwise room's chunk went out at
        the step's first ``save_kv_layer``; the layers no ``save_kv_layer`` named go now."""
        self._start_layerwise(meta)
        for tx, reported in self._layer_step.items():
            layer, n = 0, self.pool.model.num_layers if self.pool else 0
            while layer < n:  # each run of layers not yet reported, as one range
                if layer in reported:
                    layer += 1
                    continue
                end = next((i for i in range(layer, n) if i in reported), n)
                self._report_layers(tx, layer, end, "wait_for_save")
                layer = end
        self._layer_meta, self._layer_step = None, {}
        for m in meta.reqs_to_send:
            if m.flow != LAYERWISE:
                self._send_chunk(m)

    def layer_saved(self, meta: KvferryConnectorMetadata, layer_name: str) -> None:
        """vLLM's attention wrapper saved a layer of this step: its layerwise rooms' KV of that
        layer leaves now (only that layer: nothing is assumed of the order layers run in)."""
        self._start_layerwise(meta)
        layer = self._layer_index[layer_name]
        for tx, reported in self._layer_step.items():
            if layer not in reported:  # a layer saved twice (a re-run of the layer) is reported once
                self._report_layers(tx, layer, layer + 1, "save_kv_layer")

    def _start_layerwise(self, meta: KvferryConnectorMetadata) -> None:
        """Once per step (vLLM 0.33 calls ``start_load_kv`` after the forward, so the first layer
        saved marks the forward's start): each layerwise room's chunk is handed over, pages and
        token range known, before any of its layers is reported."""
        if self._layer_meta is meta:
            return
        self._layer_meta, self._layer_step = meta, {}
        for m in meta.reqs_to_send:
            if m.flow == LAYERWISE:
                tx = self._send_chunk(m)
                if tx is not None:
                    self._layer_step[tx] = set()  # the layers of its chunk reported so far

    def _report_layers(self, tx: KVSender, start: int, end: int, by: str) -> None:
        """Layers [start, end) of the room's chunk of this step are computed."""
        self._layer_step[tx].update(range(start, end))
        try:
            if tx.poll() is KVPoll.Failed:
                return  # decode gave up (or a write failed): post no more of the room's layers
            tx.layers_ready(start, end)
            self.layer_reports[by] += end - start
        except Exception as exc:  # the room fails; vLLM's step goes on
            log.warning("kvferry: room %s: layers [%d, %d) not reported: %s", tx.room, start, end, exc)
            self._abort(tx, f"layers not reported: {exc}")

    def _send_chunk(self, m: SendMeta) -> KVSender | None:
        """Hand the chunk ``m`` to kvferry (opening the room on its first); its sender, or None
        when nothing was sent (the room failed, or its prompt was all sent)."""
        self._delegated.add(m.request_id)
        entry = self._open.get(m.request_id)
        try:
            if entry is None:
                assert self.prefill is not None, "a send on a connector that is not a producer"
                tx = self.prefill.sender(m.room, m.transfer_id)
                aux = self._aux_of(self.prefill).free.pop()
                entry = self._open[m.request_id] = _Open(tx, self.prefill, aux, num_tokens=m.num_tokens)
                tx.write_aux(aux, m.room.to_bytes(8, "little", signed=True))
                tx.init(aux, flow=m.flow)
            if entry.handle.poll() is KVPoll.Failed or entry.last_sent:
                return None  # decode gave up (or a write failed): nothing more to send
            assert isinstance(entry.handle, KVSender)
            entry.last_sent = m.token_end == m.num_tokens
            entry.handle.send(np.asarray(m.block_ids, dtype=np.int64), m.token_end, entry.last_sent)
            return entry.handle
        except Exception as exc:  # the room fails; vLLM's step goes on
            log.warning("kvferry: request %s: send failed: %s", m.request_id, exc)
            self.failures[m.request_id] = f"{type(exc).__name__}: {exc}"
            if entry is None:
                self.stats["rooms_send_failed"] += 1  # no room to report it later
            elif not entry.last_sent:
                entry.last_sent = True
                self._abort(entry.handle, f"send failed: {exc}")
            return None

    @staticmethod
    def _abort(handle: KVSender | KVReceiver, reason: str) -> None:
        try:
            handle.abort(reason)
        except Exception:
            log.exception("kvferry: abort after a failed send")

    # ---- completions --------------------------------------------------------------------------
    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        sent: set[str] = set()
        self._finished |= finished_req_ids & self._delegated
        for req_id, entry in list(self._open.items()):
            status = entry.handle.poll()
            if isinstance(entry.handle, KVSender):
                if req_id not in self._finished:
                    continue
                if status not in TERMINAL and not entry.last_sent:
                    entry.handle.abort("vLLM finished the request before its prompt was sent")
                    entry.last_sent = True  # abort once
                    continue
            elif req_id in finished_req_ids and status not in TERMINAL:
                entry.handle.abort("vLLM aborted the request")  # it waits for our report
            if status not in TERMINAL:
                continue
            if status is KVPoll.Failed:
                if isinstance(entry.handle, KVReceiver) and not entry.handle.pages_freed():
                    continue  # a prefill write may still land in these blocks
                self._count(entry, ok=False)
                why = self._failure(entry)
                if isinstance(entry.handle, KVReceiver):
                    self._fail_recv(req_id, entry.block_ids, why)
                else:
                    self.failures[req_id] = why
            else:
                self._count(entry, ok=True)
                if isinstance(entry.handle, KVReceiver):
                    self._done_recving.add(req_id)
            del self._open[req_id]
            self._drop(req_id, entry, clear=True)
            if isinstance(entry.handle, KVSender):
                sent.add(req_id)
        # Delegated requests without a room (its open failed) are done as soon as vLLM finished them.
        for req_id in self._finished - self._open.keys():
            sent.add(req_id)
        self._finished -= sent
        self._delegated -= sent
        recving, failed = self._done_recving, self._failed_recving
        self._done_recving, self._failed_recving = set(), set()
        return sent, recving, failed

    def _count(self, entry: _Open, *, ok: bool) -> None:
        side = "sent" if isinstance(entry.handle, KVSender) else "received"
        if not ok:
            self.stats["rooms_send_failed" if side == "sent" else "rooms_recv_failed"] += 1
            return
        assert self.pool is not None
        self.stats[f"rooms_{side}"] += 1
        self.stats[f"bytes_{side}"] += entry.num_tokens * self.pool.token_bytes * self.pool.model.num_regions
        self.stats["transfer_s"].append(time.monotonic() - entry.opened)

    def take_stats(self) -> dict[str, Any]:
        stats, self.stats = self.stats, new_stats()
        return stats

    @staticmethod
    def _failure(entry: _Open) -> str:
        try:
            entry.handle.failure_exception()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "failed"

    def _drop(self, req_id: str, entry: _Open, *, clear: bool) -> None:
        if clear:
            try:
                entry.handle.clear()
            except Exception:
                log.exception("kvferry: clearing request %s", req_id)
        self._aux_of(entry.endpoint).free.append(entry.aux_index)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> list[str]:
        stuck: list[str] = []
        for ep in [self.prefill, *self.decode.values()]:
            if ep is not None:
                stuck += ep.close()
        self.prefill, self.decode = None, {}
        return stuck
