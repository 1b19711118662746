"""``Transport`` on real primitives: NIXL (UCX) for bytes and notifications, ZMQ for control.

Metadata exchange: the decode rank puts its NIXL agent metadata in its ``Register`` message
(``agent_meta``), sent over our ZMQ control plane; NIXL's own listener thread is not used. The
prefill rank only initiates transfers, so only it needs the peer's metadata: NIXL notifications
reach the target without the target loading the initiator's metadata (checked by the two-process
tests). ``agent_meta`` is our own versioned msgspec envelope around NIXL's blob, because the
``Register`` region table has no memory type or device: the envelope carries them.

Granule: prepared descriptor lists cut the pool into ``granule``-byte descriptors (see
``agent.py``). For a (prefill pool, decode pool) pair the granule is the gcd of every stride and
head-slice size the planner can emit for that pair, so every planned descriptor is a whole run of
granules on both sides; the local list is built once per granule, the remote once per peer. When
the pair also shares a page granule (same head split), a second, page-sized list is prepared and
used for writes that are page-aligned (whole-page chunks), so a room costs 18x fewer indices.

Threading: safe to call from several threads. The NIXL agent guards its own tables; ``_lock``
guards ``_peers`` (Endpoint -> agent name and list keys); the control plane owns its sockets in
its IO thread.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from kvferry.backends.nixl.agent import ListKey, NixlAgent, XferTicket
from kvferry.backends.nixl.errors import DescriptorError, NixlPeerError
from kvferry.backends.nixl.memory import MemRegion, RegionError, regions_from
from kvferry.backends.transport import AUX_ROOM_BYTES, XferState
from kvferry.backends.zmqctl import ControlPlane
from kvferry.core.errors import WireError
from kvferry.core.geometry import Layout, PoolGeometry
from kvferry.core.messages import Endpoint, GeometryWire, RegionAddr, Register
from kvferry.core.planner import find_link

# Outside RegionAddr's id range (< 2**20), so it can never collide with a pool region.
AUX_REGION_ID = 1 << 20
AGENT_BLOB_VERSION = 1


class AgentBlob(msgspec.Struct, frozen=True):
    """What ``agent_meta`` carries: NIXL's metadata plus what ``Register`` lacks for NIXL."""

    v: int
    nixl_md: bytes
    mem: str  # DRAM or VRAM, of the KV regions
    dev: int
    aux_mem: str
    aux_dev: int


_blob_decoder = msgspec.msgpack.Decoder(AgentBlob)


def decode_blob(data: bytes) -> AgentBlob:
    try:
        blob = _blob_decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise WireError(f"agent metadata: {exc}") from None
    if (
        blob.v != AGENT_BLOB_VERSION
        or blob.mem not in ("DRAM", "VRAM")
        or blob.aux_mem not in ("DRAM", "VRAM")
    ):
        raise WireError(f"agent metadata: unsupported version {blob.v} or memory type")
    return blob


def pair_granule(src: PoolGeometry, dst: PoolGeometry) -> int:
    """Largest descriptor size dividing every offset and length the planner emits for this pair."""
    g = 0
    for pool in (src, dst):
        g = math.gcd(g, pool.token_stride, pool.token_bytes)
        if pool.layout is Layout.VLLM_HND:
            g = math.gcd(g, pool.head_bytes)
    link = find_link(src, dst)
    if link is not None and not link.is_dummy:
        hb = src.head_bytes
        g = math.gcd(g, link.num_heads * hb)
        g = math.gcd(g, (link.head_start - src.head_start) * hb, (link.head_start - dst.head_start) * hb)
    return g


@dataclass(frozen=True)
class _PeerEntry:
    agent: str
    kv: ListKey  # the fine list: every planned descriptor is a run of it
    coarse: ListKey | None  # a page-granule list, used when a write is page-aligned
    aux: ListKey
    registration: Register

    def key_for(self, *arrays: npt.NDArray[np.int64]) -> ListKey:
        """The coarsest prepared list that can express these descriptors exactly: fewer indices
        to build and for NIXL to merge back (18x fewer for 16-token pages)."""
        if self.coarse is not None:
            g = self.coarse[1]
            if not any((np.asarray(a) % g).any() for a in arrays):
                return self.coarse
        return self.kv


def _np_view(buf: Any) -> np.ndarray | None:
    """A uint8 numpy view of a DRAM buffer, or None for device memory."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    if hasattr(buf, "get_device") and buf.get_device() < 0:
        import torch

        return buf.detach().reshape(-1).view(torch.uint8).numpy()
    return None


class NixlTransport:
    """One rank's transport. Owns its NIXL agent and its ZMQ control plane (closes both)."""

    def __init__(
        self,
        endpoint: Endpoint,
        pool: PoolGeometry,
        *,
        role: str = "prefill",
        buffers: Mapping[int, Any] | None = None,
        aux: Any | None = None,
        sync: str = "rw",
        control: ControlPlane | None = None,
        agent: NixlAgent | None = None,
        extra_groups: Mapping[str, Sequence[MemRegion]] | None = None,
        progress_thread: bool = False,
        ucx_workers: int = 1,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError("role must be prefill or decode")
        self._endpoint = endpoint
        self.role = role
        self.pool = pool
        self.agent = agent or NixlAgent(
            f"{endpoint.server}-{endpoint.rank}-{_suffix()}",
            sync=sync,
            progress_thread=progress_thread,
            ucx_workers=ucx_workers,
        )
        self.control = control or ControlPlane(str(endpoint))
        self._buffers = dict(buffers) if buffers is not None else None
        # More memory to register before the metadata is taken (a benchmark's covering region).
        self._extra = dict(extra_groups or {})
        self._aux = aux
        self._lock = threading.Lock()
        self._peers: dict[Endpoint, _PeerEntry] = {}
        self._views: dict[int, np.ndarray | None] = {}
        self._registration: Register | None = None
        self.aux_rows = 0
        self.aux_row_bytes = 0
        self.control_failures = 0

    # ---- identity and local memory -----------------------------------------------------------
    @property
    def endpoint(self) -> Endpoint:
        return self._endpoint

    @property
    def agent_name(self) -> str:
        return self.agent.name

    def agent_metadata(self) -> bytes:
        kv = [r for r in self.agent.regions() if r.region_id < AUX_REGION_ID]
        aux = [r for r in self.agent.regions() if r.region_id == AUX_REGION_ID]
        mem, dev = (kv[0].mem, kv[0].dev) if kv else ("DRAM", 0)
        aux_mem, aux_dev = (aux[0].mem, aux[0].dev) if aux else ("DRAM", 0)
        return msgspec.msgpack.encode(
            AgentBlob(AGENT_BLOB_VERSION, self.agent.metadata(), mem, dev, aux_mem, aux_dev)
        )

    def register_regions(self, regions: Sequence[Any], aux_rows: int, aux_row_bytes: int) -> None:
        if aux_row_bytes < AUX_ROOM_BYTES or aux_rows < 1:
            raise RegionError(f"aux rows must hold at least {AUX_ROOM_BYTES} bytes")
        if self._buffers is None:  # no engine memory given: allocate DRAM ourselves
            self._buffers = {int(r.region_id): np.zeros(int(r.nbytes), dtype=np.uint8) for r in regions}
        if self._aux is None:
            self._aux = np.zeros(aux_rows * aux_row_bytes, dtype=np.uint8)
        kv = regions_from({int(r.region_id): self._buffers[int(r.region_id)] for r in regions})
        sizes = {int(r.region_id): int(r.nbytes) for r in regions}
        for r in kv:
            if r.nbytes < sizes[r.region_id]:
                raise RegionError(f"region {r.region_id}: buffer has {r.nbytes} B, geometry needs more")
        (aux,) = regions_from({AUX_REGION_ID: self._aux})
        if aux.nbytes < aux_rows * aux_row_bytes:
            raise RegionError("aux buffer smaller than aux_rows * aux_row_bytes")
        # Register exactly the bytes the geometry names: nothing past them is reachable.
        kv = [msgspec.structs.replace(r, nbytes=sizes[r.region_id]) for r in kv]
        aux = msgspec.structs.replace(aux, nbytes=aux_rows * aux_row_bytes)
        self.agent.register(kv, group="kv")
        self.agent.register([aux], group="aux")
        for group, extra in self._extra.items():
            self.agent.register(list(extra), group=group)
        self.aux_rows, self.aux_row_bytes = aux_rows, aux_row_bytes
        for rid, buf in {**self._buffers, AUX_REGION_ID: self._aux}.items():
            self._views[rid] = _np_view(buf)
        self._registration = Register(
            src=self._endpoint,
            agent_name=self.agent.name,
            agent_meta=self.agent_metadata(),
            geometry=GeometryWire.from_pool(self.pool),
            regions=[RegionAddr(region_id=r.region_id, addr=r.addr, nbytes=r.nbytes) for r in kv],
            aux_addr=aux.addr,
            aux_row_bytes=aux_row_bytes,
            aux_rows=aux_rows,
        )

    def registration(self) -> Register:
        if self._registration is None:
            raise RegionError("register_regions() first")
        return self._registration

    def region(self, region_id: int) -> np.ndarray:
        """Host view of a registered DRAM region (tests and the bench read bytes through it)."""
        view = self._views.get(region_id)
        if view is None:
            raise RegionError(f"region {region_id} is not a registered DRAM region")
        return view

    # ---- peers --------------------------------------------------------------------------------
    def add_peer(self, peer: Endpoint, registration: Register) -> None:
        with self._lock:
            old = self._peers.get(peer)
            if old is not None and old.registration == registration:
                return  # idempotent for the same registration
        blob = decode_blob(registration.agent_meta)
        remote_pool = registration.geometry.to_pool()
        src, dst = (self.pool, remote_pool) if self.role == "prefill" else (remote_pool, self.pool)
        g = pair_granule(src, dst)
        # Page-aligned writes (whole pages, equal head split) can use page-sized descriptors.
        big = math.gcd(src.page_bytes, dst.page_bytes)
        coarse = big if big > g and big % g == 0 else None
        kv = [MemRegion(r.region_id, r.addr, r.nbytes, blob.mem, blob.dev) for r in registration.regions]
        aux_bytes = registration.aux_rows * registration.aux_row_bytes
        aux = [MemRegion(AUX_REGION_ID, registration.aux_addr, aux_bytes, blob.aux_mem, blob.aux_dev)]
        ag = math.gcd(self.aux_row_bytes, registration.aux_row_bytes)
        granules = [g] if coarse is None else [g, coarse]
        if old is not None:
            self.agent.remove_peer(old.agent, settle_s=0.2)  # a restarted peer: old writes are moot
        name = self.agent.add_peer(blob.nixl_md, {"kv": (kv, granules), "aux": (aux, [ag])})
        entry = _PeerEntry(
            name, ("kv", g), None if coarse is None else ("kv", coarse), ("aux", ag), registration
        )
        with self._lock:
            self._peers[peer] = entry

    def drop_peer(self, peer: Endpoint) -> None:
        with self._lock:
            entry = self._peers.pop(peer, None)
        if entry is not None:
            # Short: the driver's lock is held here, and a lost peer's writes may never finish.
            # (A post running in a worker is waited for, not cut: see agent.py's ticket lock.)
            self.agent.remove_peer(entry.agent, settle_s=0.2)

    def has_peer(self, peer: Endpoint) -> bool:
        with self._lock:
            return peer in self._peers

    def peer_agent(self, peer: Endpoint) -> str:
        """NIXL agent name of a registered peer (for extra lists on the same connection)."""
        return self._peer(peer).agent

    def _peer(self, peer: Endpoint) -> _PeerEntry:
        with self._lock:
            entry = self._peers.get(peer)
        if entry is None:
            raise NixlPeerError(f"no registered peer {peer}")
        return entry

    # ---- data plane ---------------------------------------------------------------------------
    def post_write(
        self,
        peer: Endpoint,
        src_region: npt.NDArray[np.int64],
        src_offset: npt.NDArray[np.int64],
        dst_region: npt.NDArray[np.int64],
        dst_offset: npt.NDArray[np.int64],
        length: npt.NDArray[np.int64],
        notif: bytes,
    ) -> XferTicket:
        entry = self._peer(peer)
        return self.agent.post(
            "WRITE",
            entry.agent,
            entry.key_for(src_offset, dst_offset, length),
            (src_region, src_offset),
            (dst_region, dst_offset),
            length,
            notif,
        )

    def post_read(
        self,
        peer: Endpoint,
        src_region: npt.NDArray[np.int64],
        src_offset: npt.NDArray[np.int64],
        dst_region: npt.NDArray[np.int64],
        dst_offset: npt.NDArray[np.int64],
        length: npt.NDArray[np.int64],
        notif: bytes,
    ) -> XferTicket:
        """Pull: planner descriptors (prefill src -> decode dst) READ by the decode side."""
        entry = self._peer(peer)
        return self.agent.post(
            "READ",
            entry.agent,
            entry.key_for(src_offset, dst_offset, length),
            (dst_region, dst_offset),
            (src_region, src_offset),
            length,
            notif,
        )

    def post_aux_write(
        self, peer: Endpoint, src_aux_index: int, dst_aux_index: int, notif: bytes
    ) -> XferTicket:
        entry = self._peer(peer)
        row = self.aux_row_bytes
        if not 0 <= src_aux_index < self.aux_rows:
            raise DescriptorError(f"local aux row {src_aux_index} out of range ({self.aux_rows} rows)")
        if not 0 <= dst_aux_index < entry.registration.aux_rows or row > entry.registration.aux_row_bytes:
            raise DescriptorError(f"peer aux row {dst_aux_index} out of range or too small")
        one = np.array([AUX_REGION_ID], dtype=np.int64)
        return self.agent.post(
            "WRITE",
            entry.agent,
            entry.aux,
            (one, np.array([src_aux_index * row], dtype=np.int64)),
            (one, np.array([dst_aux_index * entry.registration.aux_row_bytes], dtype=np.int64)),
            np.array([row], dtype=np.int64),
            notif,
        )

    def check_xfer(self, handle: XferTicket) -> XferState:
        return XferState(self.agent.poll(handle))

    def release_xfer(self, handle: XferTicket) -> None:
        # poll() already released the NIXL handle on DONE/ERR; nothing is left to free.
        if handle.final is None:
            raise DescriptorError("release_xfer on a transfer still in flight (cannot be cancelled)")

    def send_notif(self, peer: Endpoint, notif: bytes) -> None:
        self.agent.send_notif(self._peer(peer).agent, notif)

    def drain_notifs(self) -> list[bytes]:
        return [payload for _, payload in self.agent.notifs()]

    # Gather/scatter of the staged flows. This backend registers no staging memory yet (its
    # Register offers no ring and no pinned pool), so the flow policy never picks a staged flow
    # for it; a peer that forces one gets this refusal, which fails only that room.
    def post_copy(self, kind: str, staging_region: int, maps: Any) -> Any:
        raise DescriptorError(
            f"{kind} into staging region {staging_region}: this NIXL endpoint registered no staging "
            "memory (staged flows run in the simulator; the real backend's executors are not built yet)"
        )

    def check_copy(self, handle: Any) -> XferState:
        raise DescriptorError(f"unknown copy handle {handle!r}")

    def release_copy(self, handle: Any) -> None:
        return None

    def read_aux_room(self, aux_index: int) -> int:
        if not 0 <= aux_index < self.aux_rows:
            raise DescriptorError(f"aux row {aux_index} out of range ({self.aux_rows} rows)")
        start = aux_index * self.aux_row_bytes
        view = self._views.get(AUX_REGION_ID)
        if view is not None:
            row = bytes(view[start : start + AUX_ROOM_BYTES])
        else:  # device memory
            import torch

            flat = self._aux.reshape(-1).view(torch.uint8)
            row = flat[start : start + AUX_ROOM_BYTES].cpu().numpy().tobytes()
        return int.from_bytes(row, "little", signed=True)

    def write_aux_row(self, aux_index: int, row: bytes) -> None:
        """Local write of an aux row (the engine's metadata; the first 8 bytes are the room id)."""
        if not 0 <= aux_index < self.aux_rows or len(row) > self.aux_row_bytes:
            raise DescriptorError(f"aux row {aux_index} out of range or row too long")
        start = aux_index * self.aux_row_bytes
        view = self._views.get(AUX_REGION_ID)
        if view is not None:
            view[start : start + len(row)] = np.frombuffer(row, dtype=np.uint8)
        else:
            import torch

            flat = self._aux.reshape(-1).view(torch.uint8)
            flat[start : start + len(row)] = torch.frombuffer(bytearray(row), dtype=torch.uint8).to(
                flat.device
            )

    # ---- control plane ------------------------------------------------------------------------
    def connect(self, peer: Endpoint, address: str) -> None:
        """Where to reach a peer we talk to first (decode -> prefill); replies find us by themselves."""
        self.control.connect(str(peer), address)

    @property
    def control_address(self) -> str:
        return self.control.address

    def send_control(self, peer: Endpoint, data: bytes) -> None:
        self.control.send(str(peer), data)

    def recv_control(self, timeout_s: float = 0.0) -> list[bytes]:
        out: list[bytes] = []
        msg = self.control.recv(timeout_s)
        while msg is not None:
            if msg.failed:
                self.control_failures += 1  # best effort: the core's deadlines cover the loss
            else:
                out.append(msg.payload)
            msg = self.control.recv(0)
        return out

    # ---- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        self.control.close()
        self.agent.close()


def _suffix() -> str:
    import uuid

    return uuid.uuid4().hex[:8]
