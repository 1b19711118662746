"""The connector's scheduler half: which requests move, into and out of which blocks.

Fitted to vLLM's default disaggregated life cycle (a router sends the request to prefill with
``max_tokens=1``, then to decode with the ``kv_transfer_params`` prefill returned), whatever flow
moves the bytes (direct, pull or push: the server's ``flow``, or the request's ``kvferry_flow``):

- Prefill: every step that computes part of a ``do_remote_decode`` request's prompt becomes a
  chunk its worker hands to kvferry (moved to decode once decode has asked for the room).
  ``request_finished`` keeps the blocks (vLLM frees them when the workers report the room done)
  and returns the room, the transfer id and the prefill ranks' addresses.
- Decode: a request carrying those params loads its whole prompt asynchronously;
  ``update_state_after_alloc`` turns the blocks vLLM allocated into a room to open. A request
  with local prefix-cache hits is not loaded (kvferry fills pages from token 0): it is recomputed
  and counted in ``skipped_local_hits``.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvferry.integrations.vllm.config import FLOWS
from kvferry.integrations.vllm.meta import (
    ADDRESSES,
    FLOW,
    ROOM,
    SERVER,
    TRANSFER_ID,
    KvferryConnectorMetadata,
    KvferryHandshake,
    RecvMeta,
    SendMeta,
)

log = logging.getLogger(__name__)
FINISHED_WITH_OUTPUT = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


@dataclass
class _Send:
    request: Any
    room: int
    transfer_id: str
    flow: str
    chunks: int = 0
    done: bool = False  # the prompt's last chunk was handed to the worker


@dataclass
class SchedulerHalf:
    server: str
    block_size: int
    flow: str = "direct"  # the server's default; a request's kv_transfer_params may name another
    flows: tuple[str, ...] = FLOWS  # those this server can send by (staged ones need staging memory)
    kv_cache_manager: Any = None
    addresses: dict[int, str] = field(default_factory=dict)  # prefill: tp rank -> control address
    skipped_local_hits: int = 0
    refused_flows: int = 0  # requests naming an unknown flow: prefilled here, never delegated
    _to_recv: list[RecvMeta] = field(default_factory=list)
    _sending: dict[str, _Send] = field(default_factory=dict)

    def set_handshake(self, metadata: dict[int, KvferryHandshake]) -> None:
        self.addresses = {rank: meta.address for rank, meta in metadata.items()}

    # ---- decode -------------------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not (params.get("do_remote_prefill") and ROOM in params):
            return 0, False
        if num_computed_tokens:
            self.skipped_local_hits += 1
            return 0, False
        return len(request.prompt_token_ids or ()), True

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and ROOM in params:
            params["do_remote_prefill"] = False  # load once, however often vLLM asks again
            if num_external_tokens:
                blocks = self.kv_cache_manager.get_block_ids(request.request_id)[0]
                n = len(request.prompt_token_ids)
                self._to_recv.append(
                    RecvMeta(
                        request.request_id,
                        int(params[ROOM]),
                        str(params[TRANSFER_ID]),
                        str(params[SERVER]),
                        tuple(params[ADDRESSES]),
                        tuple(blocks[: -(-n // self.block_size)]),
                        n,
                    )
                )
        elif params.get("do_remote_decode") and request.request_id not in self._sending:
            # Random room ids: decode meets rooms of many prefill instances, none of which knows
            # the others' counters; 62 bits make a collision negligible.
            flow = params.get(FLOW, self.flow)
            if flow not in self.flows:
                # A router's typo (or a staged flow this server has no staging memory for) must
                # not fail the engine: the request is served without kvferry (no
                # kv_transfer_params back, so decode computes its prompt).
                log.warning("kvferry: request %s names flow %r (this server runs: %s); not delegated",
                            request.request_id, flow, ", ".join(self.flows))  # fmt: skip
                self.refused_flows += 1
                return
            self._sending[request.request_id] = _Send(request, secrets.randbits(62), request.request_id, flow)

    # ---- both ---------------------------------------------------------------------------------
    def build_meta(self, scheduler_output: Any) -> KvferryConnectorMetadata:
        meta = KvferryConnectorMetadata(reqs_to_recv=self._to_recv)
        self._to_recv = []
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
            send = self._sending.get(req_id)
            if send is None or send.done:
                continue
            n = send.request.num_prompt_tokens
            end = min(computed[req_id] + n_scheduled, n)
            blocks = self.kv_cache_manager.get_block_ids(req_id)[0][: -(-end // self.block_size)]
            meta.reqs_to_send.append(
                SendMeta(req_id, send.room, send.transfer_id, tuple(blocks), n, end, send.flow)
            )
            send.chunks += 1
            send.done = end == n
        return meta

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        send = self._sending.pop(request.request_id, None)
        if send is None:
            # Decode: vLLM itself holds the blocks of a request whose load is still running.
            return False, None
        # A room exists on the workers once a chunk went out: its blocks stay until the workers
        # report it done (a write may still read them).
        hold = send.chunks > 0
        if request.status.name not in FINISHED_WITH_OUTPUT or not send.done:
            return hold, None  # aborted: the workers abort the room, decode recomputes
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            ROOM: send.room,
            TRANSFER_ID: send.transfer_id,
            SERVER: self.server,
            ADDRESSES: [self.addresses[r] for r in sorted(self.addresses)],
        }
        return hold, params
