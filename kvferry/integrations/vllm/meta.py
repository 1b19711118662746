"""What the scheduler half tells the worker half each step, and what the workers tell back.

Plain dataclasses of ints and strings: vLLM ships the metadata from the scheduler process to
every worker itself (its own serialisation), kvferry puts nothing of its own on that path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

# Keys kvferry adds to a request's kv_transfer_params (the router passes them from prefill's
# response to decode's request unchanged, as it does for vLLM's own NIXL connector).
ROOM, TRANSFER_ID, SERVER, ADDRESSES = (
    "kvferry_room",
    "kvferry_transfer_id",
    "kvferry_server",
    "kvferry_addresses",
)
# A key the router may put in prefill's request: this request's flow (else the server's ``flow``).
FLOW = "kvferry_flow"


@dataclass(frozen=True)
class RecvMeta:
    """Decode: open a room for this request; prefill ``server`` (its ranks at ``addresses``)
    writes the prompt's KV into ``block_ids`` (from token 0)."""

    request_id: str
    room: int
    transfer_id: str
    server: str
    addresses: tuple[str, ...]
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class SendMeta:
    """Prefill: this step computed the request's prompt up to ``token_end``; its KV is in
    ``block_ids`` (from token 0)."""

    request_id: str
    room: int
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    token_end: int
    flow: str = "direct"


@dataclass
class KvferryConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: list[RecvMeta] = field(default_factory=list)
    reqs_to_send: list[SendMeta] = field(default_factory=list)


@dataclass
class KvferryHandshake(KVConnectorHandshakeMetadata):
    """One prefill worker's control-plane address, gathered by vLLM after ``register_kv_caches``
    and handed to the scheduler half, which puts every rank's address in ``kv_transfer_params``."""

    server: str
    tp_rank: int
    address: str
