"""Outputs of the protocol machines: what the driver must do. The driver decides nothing.

Execution contract for a driver (``backends/driver.py`` implements it):

- SendControl: ``transport.send_control(peer, messages.encode(msg))``.
- AddPeer / DropPeer: load or forget a peer's agent metadata and region table.
- EnqueueChunk: append the chunk to worker queue ``shard``; a worker later calls
  ``SenderEngine.run_chunk(chunk, now)``. All chunks of one room go to the same shard, in order.
  ``prepared``: its run only posts writes prepared ahead; the executor may run the queue's step
  on the calling thread (still one step of the shard at a time, in queue order).
- PostWrite / PostAuxWrite / SendNotif: post a WRITE of the descriptors (or of aux row
  ``src_aux_index`` into the peer's row ``dst_aux_index``) with ``notif`` as its notification, or
  send the notification alone. Report DONE/ERR back as WriteDone/WriteFailed(write_id). A
  SendNotif has no write id and no completion.
- PrepareWrite / PrepareAuxWrite / PostPrepared / DropPrepared: a write planned ahead of its
  chunk. PrepareWrite carries a PostWrite's descriptors and notification under ``prep_id``
  (PrepareAuxWrite a PostAuxWrite's rows): the executor checks them
  (the same bounds checks as a post) and makes the transfer ready (the native engine makes NIXL's
  request ahead), moving nothing and answering nothing. PostPrepared(prep_id, write_id) posts it
  and is reported like a PostWrite (WriteDone/WriteFailed(write_id)); a prep_id never prepared,
  refused at PrepareWrite, already posted or dropped (its peer was dropped since) is a
  WriteFailed. DropPrepared gives an unposted one back (an id already posted, dropped or never
  prepared: nothing to do). An executor may implement PrepareWrite
  as "remember" and PostPrepared as the PostWrite it remembered (the simulator does).
- PostRead (pull flow, decode side): ``transport.post_read(peer, src_region, src_offset,
  dst_region, dst_offset, length, notif)``: READ the planner's descriptors (src: the peer's
  pages, dst: ours); the peer gets ``notif`` when the bytes are read. Reported back like a write:
  WriteDone/WriteFailed(write_id=read_id) (the driver tracks every posted transfer by its id).
- AwaitWrites: the worker that ran the chunk should not take its next chunk before these writes
  finished (SGLang PR 20680's per-queue ordering); purely a pacing hint, correctness does not need it.
- CheckAux: read the room id stored in local aux row ``aux_index``; answer with AuxChecked.
- FreePages: decode pages of the room may go back to the allocator (fenced, or fence expired).
- Gather / Scatter: copy the heads the maps name between the local KV pool and local staging
  region ``staging_region`` (``core.staging_layout.StagingMap``, one per writer); asynchronous,
  answered by CopyDone(op_id) or CopyFailed(op_id). A Gather's buffer and a Scatter's staging
  space stay owned by the op until that answer.
- ChunkDeferred: informational, a chunk the worker could not run yet (no staging space); the core
  re-enqueues it itself when space frees.
- StatusChanged: the room's KVPoll moved (for waiters and traces; pollers may also call poll()).
- ChunkSkipped: informational, a chunk the worker did not run (failed room, duplicate, unknown).
"""

from __future__ import annotations

from typing import Any

import msgspec
from kvferry.core.kvpoll import KVPoll
from kvferry.core.messages import Control, Endpoint, Register

__all__ = [
    "AddPeer",
    "AwaitWrites",
    "CheckAux",
    "ChunkDeferred",
    "ChunkSkipped",
    "Command",
    "DropPeer",
    "DropPrepared",
    "EnqueueChunk",
    "FreePages",
    "Gather",
    "PostAuxWrite",
    "PostPrepared",
    "PostRead",
    "PostWrite",
    "PrepareWrite",
    "Scatter",
    "SendControl",
    "SendNotif",
    "StatusChanged",
]


# gc=False: plain data that never forms a reference cycle, so the cycle collector need not
# track the many short-lived instances (fewer collections on the hot path).
class _Cmd(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    pass


class SendControl(_Cmd):
    peer: Endpoint
    msg: Control


class AddPeer(_Cmd):
    """Prefill side: a decode rank registered; load its agent and remember its regions."""

    peer: Endpoint
    registration: Register


class DropPeer(_Cmd):
    """A peer was lost (heartbeat) or refused; forget its agent and prepared descriptors."""

    peer: Endpoint
    reason: str


class EnqueueChunk(_Cmd, omit_defaults=True):  # encoded as before unless ``prepared``
    shard: int
    chunk: Any  # events.ChunkReady (Any: commands must not import events for a cycle's sake)
    # The chunk's writes are prepared (core/flows/ahead.py): its run only posts them, so the
    # executor may run it at once on the thread that handed it over instead of waking a worker.
    prepared: bool = False


class PostWrite(_Cmd):
    """WRITE of planner descriptors (equal-length int64 arrays) into ``peer``'s registered regions."""

    write_id: int
    peer: Endpoint
    room: int
    src_region: Any
    src_offset: Any
    dst_region: Any
    dst_offset: Any
    length: Any
    notif: bytes


class PrepareWrite(_Cmd):
    """A PostWrite's descriptors and notification, made ready under ``prep_id``; nothing moves."""

    prep_id: int
    peer: Endpoint
    room: int
    src_region: Any
    src_offset: Any
    dst_region: Any
    dst_offset: Any
    length: Any
    notif: bytes


class PrepareAuxWrite(_Cmd):
    """A PostAuxWrite's rows and notification, made ready under ``prep_id``; nothing moves."""

    prep_id: int
    peer: Endpoint
    room: int
    src_aux_index: int
    dst_aux_index: int
    notif: bytes


class PostPrepared(_Cmd):
    """Post the write prepared under ``prep_id`` (a PrepareWrite's or a PrepareAuxWrite's);
    reported as WriteDone/WriteFailed(write_id)."""

    prep_id: int
    write_id: int
    peer: Endpoint
    room: int


class DropPrepared(_Cmd):
    """Give back a write prepared under ``prep_id`` that will not be posted."""

    prep_id: int
    room: int


class PostRead(_Cmd):
    """READ of planner descriptors (src: ``peer``'s registered regions, dst: ours)."""

    read_id: int
    peer: Endpoint
    room: int
    src_region: Any
    src_offset: Any
    dst_region: Any
    dst_offset: Any
    length: Any
    notif: bytes


class PostAuxWrite(_Cmd):
    write_id: int
    peer: Endpoint
    room: int
    src_aux_index: int
    dst_aux_index: int
    notif: bytes


class SendNotif(_Cmd):
    """A notification with no bytes to move (a chunk whose plan for this peer is empty)."""

    peer: Endpoint
    room: int
    notif: bytes


class AwaitWrites(_Cmd):
    room: int
    write_ids: tuple[int, ...]


class CheckAux(_Cmd):
    room: int
    transfer_id: str
    aux_index: int


class FreePages(_Cmd):
    room: int
    transfer_id: str
    reason: str


class Gather(_Cmd):
    """Copy pool -> staging: the chunk's heads for every writer into the local staging region."""

    op_id: int
    room: int
    staging_region: int
    maps: tuple[Any, ...]  # core.staging_layout.StagingMap


class Scatter(_Cmd):
    """Copy staging -> pool: every writer's block of a landed chunk into the room's pages."""

    op_id: int
    room: int
    staging_region: int
    maps: tuple[Any, ...]


class ChunkDeferred(_Cmd):
    room: int
    chunk_index: int
    reason: str


class StatusChanged(_Cmd):
    room: int
    transfer_id: str
    status: KVPoll
    reason: str = ""


class ChunkSkipped(_Cmd):
    room: int
    chunk_index: int
    reason: str


Command = (
    SendControl
    | AddPeer
    | DropPeer
    | EnqueueChunk
    | PostWrite
    | PostAuxWrite
    | PrepareWrite
    | PrepareAuxWrite
    | PostPrepared
    | DropPrepared
    | PostRead
    | SendNotif
    | AwaitWrites
    | CheckAux
    | FreePages
    | StatusChanged
    | ChunkSkipped
    | Gather
    | Scatter
    | ChunkDeferred
)
