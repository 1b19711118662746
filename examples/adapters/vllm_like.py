"""Adapters shaped like vLLM's KV connector v1, over kvferry's runtime endpoints.

vLLM splits a connector (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``) into a
scheduler-side half (one per server) and a worker-side half (one per TP rank). vLLM's own
``NixlConnector`` pulls: decode READs prefill's blocks after prefill finished. kvferry pushes:
decode registers its blocks, prefill WRITEs each chunk as soon as it is computed. The mapping:

Scheduler side, ``KVFerryConnectorScheduler`` (``KVConnectorBase_V1`` in the SCHEDULER role):

- ``get_num_new_matched_tokens(request, num_computed_tokens) -> (int, bool)``: decode
  (``kv_consumer``) answers "the whole prompt, loaded asynchronously" for a request whose
  ``kv_transfer_params`` say ``do_remote_prefill``; prefill answers ``(0, False)``.
- ``update_state_after_alloc(request, blocks, num_external_tokens)``: decode queues a receive into
  ``blocks``; prefill starts tracking a request whose params say ``do_remote_decode``.
- ``build_connector_meta(scheduler_output) -> KVFerryConnectorMetadata``: decode: the receives to
  open; prefill: one chunk per scheduled request (block ids from token 0, where the chunk ends).
- ``request_finished(request, block_ids) -> (bool, dict | None)``: prefill keeps the blocks
  (``True``) until the workers report the request in ``finished_sending``; decode frees at once.

Worker side, ``KVFerryConnectorWorker`` (``KVConnectorBase_V1`` in the WORKER role):

- ``register_kv_caches(kv_caches)``: layer name -> ``[2, num_blocks, block_size, heads, head_dim]``
  (FlashAttention's layout; the i-th layer's K and V become kvferry regions (i, K) and (i, V)).
  Creates and starts the rank's ``PrefillEndpoint`` or ``DecodeEndpoint``.
- ``bind_connector_metadata(meta)`` / ``clear_connector_metadata()``: around every step, as vLLM.
- ``start_load_kv(forward_context)``: decode opens a ``KVReceiver`` per new receive (the
  register that lets prefill write).
- ``wait_for_layer_load(layer_name)``: nothing: a load is a whole request (vLLM does not schedule
  it before ``get_finished`` reports it).
- ``wait_for_save()``: prefill posts this step's chunks (``KVSender.init`` on the first, then
  ``send``). It does not block: the writes run on kvferry's workers.
- Layer-wise (``layerwise=True``, kvferry's "layerwise" flow): prefill hands this step's chunks
  over in ``start_load_kv`` (the forward starts), and ``save_kv_layer(layer_name)`` reports that
  layer of every chunk of the step computed (``KVSender.layers_ready``): its KV leaves while the
  next layers compute, and ``wait_for_save()`` has nothing left to do.
- ``get_finished(finished_req_ids) -> (finished_sending, finished_recving)``: rooms that reached a
  terminal state, cleared. Prefill reports a request only after the scheduler finished it; a
  finished request whose prompt was not all sent is aborted. Decode reports a Failed room only once
  its blocks are fenced (no prefill write can land any more), with its block ids in
  ``get_block_ids_with_load_errors()``.

Simplified, or different from vLLM:

- Plain dataclasses stand in for vLLM's ``Request``, ``SchedulerOutput``, ``KVCacheBlocks`` (here a
  list of block ids) and ``KVConnectorMetadata``; vLLM need not be installed.
- Pairing: the router gives both requests the same ``room`` and ``transfer_id`` in
  ``kv_transfer_params`` and sends both at once (prefill's writes wait until decode registered;
  kvferry's bootstrap deadline bounds that wait). Decode's worker is built with the prefill
  server's name and every prefill rank's control address.
- A decode request loads its whole prompt: local prefix-cache hits are not combined with remote
  prefill (``num_computed_tokens`` must be 0).
- Aux rows (kvferry's landing check, first 8 bytes the room id) are allocated by each worker.
- Per-rank results: vLLM aggregates ``get_finished`` over TP workers; so must the caller.
- No ``update_connector_output``, no host-buffer offload, no MLA layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kvferry.backends.runtime import (
    DecodeEndpoint,
    KVReceiver,
    KVSender,
    PrefillEndpoint,
    RuntimeConfig,
)
from kvferry.core.geometry import KVKind, PoolGeometry
from kvferry.core.kvpoll import KVPoll

__all__ = [
    "KV_CONSUMER",
    "KV_PRODUCER",
    "KVFerryConnectorMetadata",
    "KVFerryConnectorScheduler",
    "KVFerryConnectorWorker",
    "ReqMeta",
    "Request",
    "ScheduledRequest",
    "SchedulerOutput",
]

KV_PRODUCER, KV_CONSUMER = "kv_producer", "kv_consumer"  # vLLM's KVTransferConfig.kv_role
TERMINAL = (KVPoll.Success, KVPoll.Failed)


@dataclass
class Request:
    request_id: str
    num_prompt_tokens: int
    # prefill: {"do_remote_decode": True, "room": int, "transfer_id": str}
    # decode:  {"do_remote_prefill": True, "room": int, "transfer_id": str}
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class ScheduledRequest:
    request_id: str
    new_block_ids: list[int]  # blocks allocated in this step (all of them for a new request)
    num_computed_tokens: int  # before this step


@dataclass
class SchedulerOutput:
    scheduled_reqs: list[ScheduledRequest]
    num_scheduled_tokens: dict[str, int]


@dataclass(frozen=True)
class ReqMeta:
    request_id: str
    room: int
    transfer_id: str
    block_ids: tuple[int, ...]  # from token 0
    num_tokens: int  # the prompt
    token_end: int  # prefill: where this step's chunk ends


@dataclass
class KVFerryConnectorMetadata:
    reqs_to_recv: list[ReqMeta] = field(default_factory=list)
    reqs_to_send: list[ReqMeta] = field(default_factory=list)


@dataclass
class _Send:
    room: int
    transfer_id: str
    num_tokens: int
    block_ids: list[int] = field(default_factory=list)


class KVFerryConnectorScheduler:
    def __init__(self, kv_role: str, block_size: int) -> None:
        assert kv_role in (KV_PRODUCER, KV_CONSUMER)
        self.kv_role, self.block_size = kv_role, block_size
        self._to_recv: list[ReqMeta] = []
        self._sending: dict[str, _Send] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if self.kv_role == KV_CONSUMER and params.get("do_remote_prefill"):
            if num_computed_tokens:
                raise NotImplementedError("local prefix hits combined with remote prefill")
            return request.num_prompt_tokens, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: Sequence[int], num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        if self.kv_role == KV_CONSUMER and params.get("do_remote_prefill") and num_external_tokens:
            params["do_remote_prefill"] = False  # load once, as vLLM's NixlConnector does
            n = request.num_prompt_tokens
            meta = ReqMeta(request.request_id, params["room"], params["transfer_id"], tuple(blocks), n, n)
            self._to_recv.append(meta)
        elif self.kv_role == KV_PRODUCER and params.get("do_remote_decode"):
            self._sending.setdefault(
                request.request_id, _Send(params["room"], params["transfer_id"], request.num_prompt_tokens)
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVFerryConnectorMetadata:
        meta = KVFerryConnectorMetadata(reqs_to_recv=self._to_recv)
        self._to_recv = []
        for req in scheduler_output.scheduled_reqs:
            send = self._sending.get(req.request_id)
            if send is None:
                continue
            send.block_ids.extend(req.new_block_ids)
            end = min(
                req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req.request_id],
                send.num_tokens,
            )
            blocks = tuple(send.block_ids[: -(-end // self.block_size)])
            meta.reqs_to_send.append(
                ReqMeta(req.request_id, send.room, send.transfer_id, blocks, send.num_tokens, end)
            )
            if end == send.num_tokens:
                del self._sending[req.request_id]  # prompt done: no more chunks
        return meta

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params or {}
        if self.kv_role == KV_PRODUCER and params.get("do_remote_decode"):
            self._sending.pop(request.request_id, None)  # finished early (aborted): no more chunks
            return True, {"room": params["room"], "transfer_id": params["transfer_id"]}
        return False, None


@dataclass
class _Open:
    handle: KVSender | KVReceiver
    aux_index: int
    block_ids: tuple[int, ...] = ()
    last_sent: bool = False


class KVFerryConnectorWorker:
    def __init__(
        self,
        kv_role: str,
        pool: PoolGeometry,
        *,
        server: str,
        prefill_server: str = "",
        prefill_addresses: Sequence[str] = (),
        config: RuntimeConfig | None = None,
        layerwise: bool = False,
    ) -> None:
        assert kv_role in (KV_PRODUCER, KV_CONSUMER)
        self.layerwise = layerwise
        self._layer_of: dict[str, int] = {}  # layer name -> index (register_kv_caches' order)
        self._step: list[KVSender] = []  # layer-wise: the senders of this step's chunks
        self.kv_role, self.pool, self.server = kv_role, pool, server
        self.prefill_server, self.prefill_addresses = prefill_server, list(prefill_addresses)
        self.config = config or RuntimeConfig()
        self.endpoint: PrefillEndpoint | DecodeEndpoint | None = None
        self._meta: KVFerryConnectorMetadata | None = None
        self._aux_free = list(range(self.config.aux_rows - 1, -1, -1))
        self._open: dict[str, _Open] = {}
        self._finished: set[str] = set()  # prefill: requests the scheduler finished
        self._load_errors: set[int] = set()
        self.failures: dict[str, BaseException] = {}  # request id -> why its room failed

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if len(kv_caches) != self.pool.model.num_layers:
            raise ValueError(f"expected {self.pool.model.num_layers} layers, got {len(kv_caches)}")
        buffers = {}
        for layer, (name, kv) in enumerate(kv_caches.items()):
            self._layer_of[name] = layer
            buffers[self.pool.region_id(layer, KVKind.K)] = kv[0]
            buffers[self.pool.region_id(layer, KVKind.V)] = kv[1]
        if self.kv_role == KV_PRODUCER:
            self.endpoint = PrefillEndpoint(self.server, self.pool, buffers=buffers, config=self.config)
        else:
            self.endpoint = DecodeEndpoint(
                self.server,
                self.pool,
                prefill_server=self.prefill_server,
                prefill_addresses=self.prefill_addresses,
                buffers=buffers,
                config=self.config,
            )
        self.endpoint.start()

    def bind_connector_metadata(self, meta: KVFerryConnectorMetadata) -> None:
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        assert self._meta is not None
        if self.layerwise and self.kv_role == KV_PRODUCER:
            self._step = self._send_step()  # the forward starts: its layers are reported as they end
        for m in self._meta.reqs_to_recv:
            assert isinstance(self.endpoint, DecodeEndpoint)
            rx = self.endpoint.receiver(m.room, m.transfer_id)
            aux = self._aux_free.pop()
            rx.init(np.asarray(m.block_ids, dtype=np.int64), m.num_tokens, aux)
            self._open[m.request_id] = _Open(rx, aux, m.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self.layerwise and self.kv_role == KV_PRODUCER:
            layer = self._layer_of[layer_name]
            for tx in self._step:
                tx.layers_ready(layer, layer + 1)

    def wait_for_save(self) -> None:
        if not self.layerwise:
            self._send_step()

    def _send_step(self) -> list[KVSender]:
        """Hand this step's chunks over (``init`` on a request's first); their senders."""
        assert self._meta is not None
        sent: list[KVSender] = []
        for m in self._meta.reqs_to_send:
            assert isinstance(self.endpoint, PrefillEndpoint)
            entry = self._open.get(m.request_id)
            if entry is None:
                tx = self.endpoint.sender(m.room, m.transfer_id)
                entry = self._open[m.request_id] = _Open(tx, self._aux_free.pop())
                tx.write_aux(entry.aux_index, m.room.to_bytes(8, "little", signed=True))
                tx.init(entry.aux_index, flow="layerwise" if self.layerwise else None)
            if entry.handle.poll() is KVPoll.Failed:
                continue  # decode gave up (or a write failed): nothing more to send
            assert isinstance(entry.handle, KVSender)
            entry.last_sent = m.token_end == m.num_tokens
            entry.handle.send(np.asarray(m.block_ids, dtype=np.int64), m.token_end, entry.last_sent)
            sent.append(entry.handle)
        return sent

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done: set[str] = set()
        if self.kv_role == KV_PRODUCER:
            self._finished |= finished_req_ids
        for req_id, entry in list(self._open.items()):
            status = entry.handle.poll()
            if self.kv_role == KV_PRODUCER:
                if req_id not in self._finished:
                    continue
                if status not in TERMINAL and not entry.last_sent:
                    entry.handle.abort("request finished before its prompt was sent")
                    entry.last_sent = True  # abort once
                    continue
            if status is KVPoll.Failed and self.kv_role == KV_CONSUMER:
                assert isinstance(entry.handle, KVReceiver)
                if not entry.handle.pages_freed():
                    continue  # a prefill write may still land in these blocks
                self._load_errors.update(entry.block_ids)
            if status not in TERMINAL:
                continue
            if status is KVPoll.Failed:
                try:
                    entry.handle.failure_exception()
                except Exception as exc:
                    self.failures[req_id] = exc
            entry.handle.clear()
            self._aux_free.append(entry.aux_index)
            del self._open[req_id]
            self._finished.discard(req_id)
            done.add(req_id)
        if self.kv_role == KV_PRODUCER:
            return done or None, None
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> list[str]:
        return self.endpoint.close() if self.endpoint is not None else []
