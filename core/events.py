"""Inputs to the protocol machines: what a driver observed, or what the local scheduler asked for.

Every event is a frozen struct. Engines take them through ``handle(event, now)`` (``now`` in
integer ns, read by the driver, never by the core) and answer with a list of commands
(``core/commands.py``). Control messages and notifications arrive as raw bytes: the core decodes
and validates them itself so that a malformed frame is counted and rejected in one place.

Sender side (prefill rank): SenderOpen, ChunkReady, LayersReady, WriteDone, WriteFailed, CopyDone,
CopyFailed, ControlIn, AbortRoom, ReleaseRoom, Tick. The worker step takes a ChunkReady directly
(``SenderEngine.run_chunk``).
Receiver side (decode rank): ReceiverOpen, ControlIn, NotificationIn, AuxChecked, CopyDone,
CopyFailed, AbortRoom, ReleaseRoom, Tick.
"""

from __future__ import annotations

from typing import Any

import msgspec
from kvferry.core.messages import Endpoint

__all__ = [
    "AbortRoom",
    "AuxChecked",
    "ChunkAhead",
    "ChunkReady",
    "ControlIn",
    "CopyDone",
    "CopyFailed",
    "Event",
    "LayersReady",
    "NotificationIn",
    "ReceiverOpen",
    "ReleaseRoom",
    "SenderOpen",
    "SenderSpec",
    "Tick",
    "WriteDone",
    "WriteFailed",
]


# gc=False: plain data that never forms a reference cycle, so the cycle collector need not
# track the many short-lived instances (fewer collections on the hot path).
class _Event(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    pass


# --- both sides ----------------------------------------------------------------------------------


class ControlIn(_Event):
    """Raw bytes of one control message from a peer (the core decodes and validates)."""

    data: bytes


class AbortRoom(_Event):
    """Local abort of a room (scheduler gave up, request cancelled)."""

    room: int
    transfer_id: str
    reason: str = "aborted locally"


class ReleaseRoom(_Event):
    """The local owner is done with a room: drop its tables once it is terminal (and fenced).

    Releasing a room that is not terminal first fails it ("released while <state>").
    """

    room: int
    transfer_id: str


class Tick(_Event):
    """Time passed; fire every deadline at or before ``now`` (heartbeats included)."""


# --- sender side (prefill rank) --------------------------------------------------------------------


class SenderOpen(_Event):
    """The prefill scheduler has a room: pair it by ``transfer_id``; ``aux_index`` is its aux row.

    ``receivers``: the decode ranks this rank will send data to (``core.topology``), when known:
    staging space is then asked for as soon as a chunk is ready, before their TransferInfos.
    ``flow``: an explicit transfer flow for the room (``core.flows.Flow`` value); it overrides
    the policy.
    """

    room: int
    transfer_id: str
    aux_index: int
    receivers: tuple[Endpoint, ...] = ()
    flow: str | None = None


class ChunkReady(_Event):
    """A chunk of the room's KV is computed on this rank.

    ``src_pages``: page ids (int64 numpy array or sequence) covering the room's tokens from token
    0 up to at least ``token_end``. The token start is *not* given: the machine keeps the running
    total, so a chunk can never be written at the previous chunk's offset.
    """

    room: int
    transfer_id: str
    chunk_index: int
    token_end: int
    src_pages: Any
    is_last: bool


class ChunkAhead(_Event):
    """The pages and token range of chunk ``chunk_index`` are known before it is computed (the
    scheduler allocated them): the fields its ChunkReady will carry. A direct room plans the chunk
    now, or once decode's TransferInfo is in, and its executor makes the writes ready
    (PrepareWrite); the ChunkReady that matches then only posts them. Optional: a chunk named
    by no ChunkAhead, or whose ChunkReady differs, is planned when it runs, as ever."""

    room: int
    transfer_id: str
    chunk_index: int
    token_end: int
    src_pages: Any
    is_last: bool


class LayersReady(_Event):
    """Layers ``[first_layer, end_layer)`` of chunk ``chunk_index`` are computed on this rank (the
    layer-wise flow, core/flows/layerwise.py): their KV may leave now, before the forward pass
    ends. For a room opened with that flow the chunk's ChunkReady comes when its forward starts
    (pages and token range known), and every layer of chunk N is reported before chunk N+1's
    ChunkReady. Any other flow counts it and moves nothing (its ChunkReady means computed)."""

    room: int
    transfer_id: str
    chunk_index: int
    first_layer: int
    end_layer: int


class WriteDone(_Event):
    """A posted write reached DONE (remote completion)."""

    write_id: int


class CopyDone(_Event):
    """A Gather or Scatter finished (its bytes are in place)."""

    op_id: int


class CopyFailed(_Event):
    """A Gather or Scatter could not run (kernel error, region out of range)."""

    op_id: int
    reason: str = "copy failed"


class WriteFailed(_Event):
    """A posted write reached ERR (or the backend gave up on it)."""

    write_id: int
    reason: str = "transfer error"


# --- receiver side (decode rank) -------------------------------------------------------------------


class PeerUnusable(_Event):
    """The driver could not load a registered peer (``AddPeer`` raised: its metadata, or memory
    this transport cannot describe). The peer's rooms fail with ``reason`` now, instead of at
    their first write ("no registered peer"); a later Register from it is tried again."""

    peer: Endpoint
    reason: str


class SenderSpec(msgspec.Struct, frozen=True, gc=False):
    """One prefill rank a decode room pairs with (from ``core.geometry.senders_for``).

    ``expected_infos``: ``len(receivers_for(...))`` of that prefill rank, told to it in TransferInfo.
    ``send_aux``: exactly one non-dummy sender per decode rank writes the aux row.
    """

    endpoint: Endpoint
    dummy: bool
    expected_infos: int
    send_aux: bool
    head_start: int = 0  # global heads this sender writes (staged flows scatter them there)
    num_heads: int = 0


class ReceiverOpen(_Event):
    """The decode scheduler allocated ``dst_pages`` for ``num_tokens`` tokens and an aux row."""

    room: int
    transfer_id: str
    dst_pages: Any
    num_tokens: int
    aux_index: int
    senders: tuple[SenderSpec, ...]
    # A partial prefix hit: decode already holds tokens [0, token_start) (its prefix cache) and
    # asks only for the rest; they land at their own slots, never shifted to the front.
    token_start: int = 0


class NotificationIn(_Event):
    """Raw bytes of one notification (payload of a landed write, or a bare notification)."""

    data: bytes


class AuxChecked(_Event):
    """Answer to CheckAux: the room id found in the aux row that just landed."""

    room: int
    transfer_id: str
    found_room: int


Event = (
    ControlIn
    | AbortRoom
    | ReleaseRoom
    | Tick
    | SenderOpen
    | ChunkReady
    | ChunkAhead
    | WriteDone
    | WriteFailed
    | ReceiverOpen
    | NotificationIn
    | AuxChecked
    | CopyDone
    | CopyFailed
)
