"""The primitives a driver needs from a backend (SimPy fake RDMA, or real NIXL + ZMQ).

A transport is one rank's view of the fabric: its own registered memory, the peers it has loaded,
posted WRITEs it can poll, notifications it can drain, and a control channel. It makes no
protocol decision: ``backends/driver.py`` feeds what it observes into the core machines and
executes their commands through these methods.

Addressing: descriptors name memory as (region_id, byte offset inside that region), with the
region ids of ``core.geometry.PoolGeometry.regions``. The transport maps a peer's region id to the
peer's base address from the ``Register`` message the peer sent (``AddPeer``), and its own region
ids to its own registered buffers. An out-of-range descriptor is rejected with a typed error
(subclass of ``kvferry.core.errors.KvferryError``) and never touches memory outside a region.

Aux rows: each rank has an aux buffer of ``aux_rows`` rows of ``aux_row_bytes``; the first 8 bytes
of a row hold the room id as little-endian int64 (the landing check of the last chunk).

Threading: the driver serialises calls into the core but not into the transport: a worker step's
``post_write``/``post_aux_write``/``send_notif`` run outside the driver lock, concurrently with
other workers' posts and with the progress thread's calls (see driver.py). A transport used with
several worker threads must allow that (NixlTransport does; the SimPy one runs in one thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
from kvferry.core.messages import Endpoint, Register

__all__ = ["AUX_ROOM_BYTES", "Transport", "XferHandle", "XferState", "aux_room_of", "encode_aux_room"]

AUX_ROOM_BYTES = 8


class XferState(Enum):
    """State of a posted WRITE, as NIXL reports it."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


# Opaque to the driver: whatever the backend returns from post_write (a NIXL handle, a SimPy id).
XferHandle = Any


@runtime_checkable
class Transport(Protocol):
    # --- identity and local memory -------------------------------------------------------------

    @property
    def endpoint(self) -> Endpoint:
        """This rank's identity (server name, TP rank)."""
        ...

    @property
    def agent_name(self) -> str: ...

    def agent_metadata(self) -> bytes:
        """This rank's agent metadata blob, sent to peers inside ``Register``."""
        ...

    def register_regions(self, regions: Sequence[Any], aux_rows: int, aux_row_bytes: int) -> None:
        """Register the KV pool regions (``RegionSpec``-like: ``region_id``, ``nbytes``) and aux rows."""
        ...

    def registration(self) -> Register:
        """The ``Register`` message describing this rank (regions, base addresses, geometry, agent)."""
        ...

    # --- peers -----------------------------------------------------------------------------------

    def add_peer(self, peer: Endpoint, registration: Register) -> None:
        """Load a peer's agent metadata and region table (idempotent for the same registration)."""
        ...

    def drop_peer(self, peer: Endpoint) -> None:
        """Forget a peer: its agent, its region table, descriptor lists prepared for it."""
        ...

    # --- data plane --------------------------------------------------------------------------------

    def post_write(
        self,
        peer: Endpoint,
        src_region: npt.NDArray[np.int64],
        src_offset: npt.NDArray[np.int64],
        dst_region: npt.NDArray[np.int64],
        dst_offset: npt.NDArray[np.int64],
        length: npt.NDArray[np.int64],
        notif: bytes,
    ) -> XferHandle:
        """Post one WRITE of these descriptors into ``peer``'s memory; ``notif`` is delivered to the
        peer after the bytes landed. Raises a typed error if a descriptor leaves a region."""
        ...

    def post_aux_write(
        self, peer: Endpoint, src_aux_index: int, dst_aux_index: int, notif: bytes
    ) -> XferHandle:
        """Post the WRITE of one aux row into the peer's aux row ``dst_aux_index``."""
        ...

    def check_xfer(self, handle: XferHandle) -> XferState:
        """Non-blocking: PROC while in flight, then DONE or ERR (sticky)."""
        ...

    def release_xfer(self, handle: XferHandle) -> None:
        """Free the handle once it is DONE or ERR (a posted write cannot be cancelled)."""
        ...

    def settled_handles(self) -> set[XferHandle] | None:
        """The held handles that may have left PROC (every other one is PROC), so a poll checks
        only these; None if this transport cannot tell (then every handle is checked)."""
        ...

    def send_notif(self, peer: Endpoint, notif: bytes) -> None:
        """A notification with no data (a chunk with nothing to move to this peer)."""
        ...

    def drain_notifs(self) -> list[bytes]:
        """Notification payloads that arrived since the last call, in arrival order."""
        ...

    def post_copy(self, kind: str, staging_region: int, maps: Sequence[Any]) -> XferHandle:
        """Start a gather ("gather": KV pool -> local staging region) or a scatter ("scatter":
        staging -> pool) of ``core.staging_layout.StagingMap``s; poll it with ``check_copy``.
        A transport that registered no staging memory raises (the room that asked fails)."""
        ...

    def check_copy(self, handle: XferHandle) -> XferState:
        """Non-blocking state of a copy: PROC, then DONE or ERR (sticky)."""
        ...

    def release_copy(self, handle: XferHandle) -> None: ...

    def settled_copies(self) -> set[XferHandle] | None:
        """The copy handles that may have left PROC (as ``settled_handles`` for writes); None if
        this transport cannot tell (then every copy is checked)."""
        ...

    def read_aux_room(self, aux_index: int) -> int:
        """The room id stored in local aux row ``aux_index`` (first 8 bytes, little-endian)."""
        ...

    # --- control plane -----------------------------------------------------------------------------

    def send_control(self, peer: Endpoint, data: bytes) -> None:
        """Send one encoded control message; best effort (the core survives loss with deadlines)."""
        ...

    def recv_control(self) -> list[bytes]:
        """Encoded control messages that arrived since the last call, in arrival order."""
        ...


def encode_aux_room(room: int) -> bytes:
    return int(room).to_bytes(AUX_ROOM_BYTES, "little", signed=True)


def aux_room_of(row: bytes | bytearray | memoryview | npt.NDArray[np.uint8]) -> int:
    return int.from_bytes(bytes(row[:AUX_ROOM_BYTES]), "little", signed=True)
