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

import ctypes
import functools
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from kvferry.backends.copy_exec import CopyExecutor, CudaCopyExecutor, HostCopyExecutor
from kvferry.backends.nixl.agent import MAX_PREP_DESCS, ListKey, NixlAgent, PreparedXfer, XferTicket
from kvferry.backends.nixl.errors import DescriptorError, NixlPeerError
from kvferry.backends.nixl.memory import MemRegion, RegionError, regions_from
from kvferry.backends.staging_copy import copy_maps
from kvferry.backends.transport import AUX_ROOM_BYTES, XferState
from kvferry.backends.zmqctl import ControlPlane
from kvferry.core.errors import WireError
from kvferry.core.flows.regions import is_staging_region
from kvferry.core.geometry import Layout, PoolGeometry
from kvferry.core.messages import Endpoint, GeometryWire, RegionAddr, Register
from kvferry.core.planner import find_link

log = logging.getLogger(__name__)
ENGINES = ("python", "native")

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
    # (region id, mem, dev) of each staging region (core.flows.regions) this rank registered.
    staging: tuple[tuple[int, str, int], ...] = ()


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
        or any(mem not in ("DRAM", "VRAM") for _, mem, _ in blob.staging)
    ):
        raise WireError(f"agent metadata: unsupported version {blob.v} or memory type")
    return blob


DIRECT_POSTS = ("auto", "prepped", "oneshot")
# "auto" posts one-shot when the prepared path would hand NIXL at least this many indices per
# run: on an H100 (cuda_ipc) a 4096-token TP 1 -> 1 room's 72 runs as 18,432 page indices cost
# NIXL 0.80 of a raw write, as 72 one-shot rows 0.95-1.03; per-token runs (one index each, TP
# 2 -> 1) posted 15% slower one-shot (docs/benchmarks.md, "What NIXL charges for a room's
# descriptors, and one-shot posting").
ONESHOT_INDICES_PER_RUN = 8


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
    kv: ListKey | None  # the fine list: every planned descriptor is a run of it (None: too big)
    coarse: ListKey | None  # a page-granule list, used when a write is page-aligned
    aux: ListKey
    registration: Register
    staging: Mapping[int, MemRegion]  # the peer's staging regions, for staged flows' one-block writes
    no_fine: str = ""  # why there is no fine list (a direct write needing it is refused)

    def key_for(self, *arrays: npt.NDArray[np.int64]) -> ListKey:
        """The coarsest prepared list that can express these descriptors exactly: fewer indices
        to build and for NIXL to merge back (18x fewer for 16-token pages)."""
        if self.coarse is not None:
            g = self.coarse[1]
            if g & (g - 1) == 0:  # a power of two: x % g == x & (g - 1), so one test for all
                bits = functools.reduce(np.bitwise_or, [np.asarray(a, dtype=np.int64) for a in arrays])
                if not (bits & (g - 1)).any():
                    return self.coarse
            elif not any((np.asarray(a) % g).any() for a in arrays):
                return self.coarse
        if self.kv is None:
            raise DescriptorError(self.no_fine)
        return self.kv


def _np_view(buf: Any) -> np.ndarray | None:
    """A uint8 numpy view of a DRAM buffer (array, CPU tensor, or raw (addr, nbytes[, "DRAM"])
    tuple), or None for device memory."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    if isinstance(buf, tuple):
        addr, nbytes, mem = int(buf[0]), int(buf[1]), (buf[2] if len(buf) > 2 else "DRAM")
        if mem != "DRAM":
            return None
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
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
        direct_post: str = "auto",
        engine: str = "python",
        engine_poll_s: float = 0.0,
        engine_idle_max_s: float = 200e-6,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError("role must be prefill or decode")
        if direct_post not in DIRECT_POSTS:
            raise ValueError(f"direct_post must be one of {DIRECT_POSTS}, not {direct_post!r}")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
        self._endpoint = endpoint
        self.role = role
        self.pool = pool
        self.agent = agent or _make_agent(
            f"{endpoint.server}-{endpoint.rank}-{_suffix()}",
            engine,
            sync=sync,
            progress_thread=progress_thread,
            ucx_workers=ucx_workers,
            poll_s=engine_poll_s,
            idle_max_s=engine_idle_max_s,
        )
        self.control = control or ControlPlane(str(endpoint))
        self._direct_post = direct_post
        self._buffers = dict(buffers) if buffers is not None else None
        # More memory to register before the metadata is taken (a benchmark's covering region).
        self._extra = dict(extra_groups or {})
        self._aux = aux
        self._lock = threading.Lock()
        self._peers: dict[Endpoint, _PeerEntry] = {}
        self._views: dict[int, np.ndarray | None] = {}
        self._registration: Register | None = None
        self._kv_regions: list[MemRegion] = []
        self._aux_region: MemRegion | None = None
        self.aux_rows = 0
        self.aux_row_bytes = 0
        self.control_failures = 0
        # Staging memory of the staged flows (core.flows.regions ids), once register_staging ran.
        self._staging: dict[int, MemRegion] = {}
        self._staging_bufs: dict[int, Any] = {}
        self.ring_bytes = 0
        self.pinned_bytes = 0
        self.copies: CopyExecutor | None = None

    # ---- identity and local memory -----------------------------------------------------------
    @property
    def endpoint(self) -> Endpoint:
        return self._endpoint

    @property
    def agent_name(self) -> str:
        return self.agent.name

    def agent_metadata(self) -> bytes:
        kv = [r for r in self.agent.regions() if r.region_id in self._buffers_ids()]
        aux = [r for r in self.agent.regions() if r.region_id == AUX_REGION_ID]
        mem, dev = (kv[0].mem, kv[0].dev) if kv else ("DRAM", 0)
        aux_mem, aux_dev = (aux[0].mem, aux[0].dev) if aux else ("DRAM", 0)
        staging = tuple((r.region_id, r.mem, r.dev) for _, r in sorted(self._staging.items()))
        return msgspec.msgpack.encode(
            AgentBlob(AGENT_BLOB_VERSION, self.agent.metadata(), mem, dev, aux_mem, aux_dev, staging)
        )

    def _buffers_ids(self) -> set[int]:
        return set(self._buffers or ())

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
        self._kv_regions = kv
        self._aux_region = aux
        self._registration = self._build_registration()

    def _build_registration(self) -> Register:
        kv, aux = self._kv_regions, self._aux_region
        assert aux is not None
        regions = [RegionAddr(region_id=r.region_id, addr=r.addr, nbytes=r.nbytes) for r in kv]
        regions += [
            RegionAddr(region_id=r.region_id, addr=r.addr, nbytes=r.nbytes)
            for _, r in sorted(self._staging.items())
        ]
        return Register(
            src=self._endpoint,
            agent_name=self.agent.name,
            agent_meta=self.agent_metadata(),
            geometry=GeometryWire.from_pool(self.pool),
            regions=regions,
            aux_addr=aux.addr,
            aux_row_bytes=self.aux_row_bytes,
            aux_rows=self.aux_rows,
            ring_bytes=self.ring_bytes,
            pinned_bytes=self.pinned_bytes,
        )

    def register_staging(
        self, buffers: Mapping[int, Any], ring_bytes: int = 0, pinned_bytes: int = 0
    ) -> None:
        """Register the staged flows' memory (region id of ``core.flows.regions`` -> buffer: numpy
        array, or torch tensor on the pool's GPU or in pinned host memory) and start the copy
        executor. ``ring_bytes``/``pinned_bytes``: what a decode rank offers its peers in its
        Register (0: not offered). Call once, after ``register_regions`` and before peers connect:
        the agent metadata sent to peers must carry these registrations."""
        if self._registration is None:
            raise RegionError("register_regions() first")
        if self._staging:
            raise RegionError("staging memory is registered once per endpoint")
        for rid in buffers:
            if not is_staging_region(rid):
                raise RegionError(f"region {rid} is not a staging region id (core.flows.regions)")
        regs = regions_from(dict(buffers))
        if not regs:
            return  # no staged flow on this rank: it offers none and the policy picks direct
        self.copies = self._make_executor(dict(buffers))
        self.agent.register(regs, group="staging")
        self._staging = {r.region_id: r for r in regs}
        self._staging_bufs = dict(buffers)
        self.ring_bytes, self.pinned_bytes = int(ring_bytes), int(pinned_bytes)
        self._registration = self._build_registration()

    def _make_executor(self, buffers: Mapping[int, Any]) -> CopyExecutor:
        views = {rid: self._views.get(rid) for rid in self._buffers or ()}
        if all(v is not None for v in views.values()):
            staging = {rid: _np_view(b) for rid, b in buffers.items()}
            host = {rid: v for rid, v in staging.items() if v is not None}
            if len(host) != len(staging):
                raise RegionError("a DRAM pool needs DRAM staging buffers (its copies run on the CPU)")
            pool = {k: v for k, v in views.items() if v is not None}
            return HostCopyExecutor(
                pool, host, str(self._endpoint), copy=self._host_copy(), fences=self.agent.fence_engine()
            )
        if not all(hasattr(b, "data_ptr") for b in [*(self._buffers or {}).values(), *buffers.values()]):
            raise RegionError(
                "staged flows on a VRAM pool need torch tensors for the pool and staging buffers "
                "(the kernels run on them); pass tensors, or set RuntimeConfig.staging sizes to 0"
            )
        return CudaCopyExecutor(
            kernel_pool(self.pool, self._buffers or {}), buffers, self.pool, fences=self.agent.fence_engine()
        )

    def _host_copy(self) -> Any:
        """A native-engine rank copies host memory in C (off the GIL); the Python executor, or a
        build without the library, with numpy (the reference)."""
        if self.executor == "native":
            from kvferry.backends.native import hostcopy

            why = hostcopy.available()
            if not why:
                return hostcopy.copy_maps
            log.warning("%s: host copies on numpy (%s)", self._endpoint, why)
        return copy_maps

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

    def staging_view(self, region_id: int) -> np.ndarray:
        """Host view of a registered DRAM staging region (tests read bytes through it)."""
        view = _np_view(self._staging_bufs[region_id]) if region_id in self._staging_bufs else None
        if view is None:
            raise RegionError(f"staging region {region_id} is not a registered DRAM region")
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
        kv = [
            MemRegion(r.region_id, r.addr, r.nbytes, blob.mem, blob.dev)
            for r in registration.regions
            if not is_staging_region(r.region_id)
        ]
        kinds = {rid: (mem, dev) for rid, mem, dev in blob.staging}
        staging = {
            r.region_id: MemRegion(
                r.region_id, r.addr, r.nbytes, *kinds.get(r.region_id, (blob.mem, blob.dev))
            )
            for r in registration.regions
            if is_staging_region(r.region_id)
        }
        aux_bytes = registration.aux_rows * registration.aux_row_bytes
        aux = [MemRegion(AUX_REGION_ID, registration.aux_addr, aux_bytes, blob.aux_mem, blob.aux_dev)]
        ag = math.gcd(self.aux_row_bytes, registration.aux_row_bytes)
        # A fine list of a big pool (head slices of a long context) can exceed what NIXL can
        # prepare; the peer is still registered (staged flows and page-aligned writes need no fine
        # list), and a direct write that would need it is refused with the reason.
        fine_ok = all(_descs(side, g) <= MAX_PREP_DESCS for side in (kv, self._kv_regions))
        granules = ([g] if fine_ok else []) + ([coarse] if coarse is not None else [])
        if old is not None:
            self.agent.remove_peer(old.agent, settle_s=0.2)  # a restarted peer: old writes are moot
        groups = {"aux": (aux, [ag])}
        if granules:
            groups["kv"] = (kv, granules)
        name = self.agent.add_peer(blob.nixl_md, groups)
        entry = _PeerEntry(
            name,
            ("kv", g) if fine_ok else None,
            None if coarse is None else ("kv", coarse),
            ("aux", ag),
            registration,
            staging,
            ""
            if fine_ok
            else (
                f"a direct write to {peer} needs {g}-byte descriptors, and its pool would take "
                f"{max(_descs(kv, g), _descs(self._kv_regions, g)):,} of them "
                f"(NIXL limit {MAX_PREP_DESCS:,}): "
                "use a staged flow (ring or pinned), or fewer pages per pool"
            ),
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
        if len(dst_region) == 1 and is_staging_region(int(dst_region[0])):
            return self._post_block(
                "WRITE", entry, src_region, src_offset, dst_region, dst_offset, length, notif
            )
        return self._post_runs(
            "WRITE",
            entry.agent,
            entry.key_for(src_offset, dst_offset, length),
            (src_region, src_offset),
            (dst_region, dst_offset),
            length,
            notif,
        )

    def prepare_write(
        self,
        peer: Endpoint,
        src_region: npt.NDArray[np.int64],
        src_offset: npt.NDArray[np.int64],
        dst_region: npt.NDArray[np.int64],
        dst_offset: npt.NDArray[np.int64],
        length: npt.NDArray[np.int64],
        notif: bytes,
    ) -> PreparedXfer | tuple[Any, ...]:
        """``post_write``'s checks, and the transfer made ready (``NixlAgent.prepare``); a staged
        block (one descriptor, no prepared list) is only remembered and posted as a write."""
        entry = self._peer(peer)
        args = (peer, src_region, src_offset, dst_region, dst_offset, length, notif)
        if len(dst_region) == 1 and is_staging_region(int(dst_region[0])):
            return args
        key = entry.key_for(src_offset, dst_offset, length)
        how = self._how(key, length)
        local, remote = (src_region, src_offset), (dst_region, dst_offset)
        oneshot = how == "oneshot"
        return self.agent.prepare("WRITE", entry.agent, key, local, remote, length, notif, oneshot=oneshot)

    def post_prepared(self, prepared: PreparedXfer | tuple[Any, ...]) -> XferTicket:
        if isinstance(prepared, tuple):
            return self.post_write(*prepared)
        return self.agent.post_prepared(prepared)

    def release_prepared(self, prepared: PreparedXfer | tuple[Any, ...]) -> None:
        if not isinstance(prepared, tuple):
            self.agent.release_prepared(prepared)

    def _how(self, key: ListKey, length: npt.NDArray[np.int64]) -> str:
        how = self._direct_post
        if how == "auto":
            runs = len(length)
            indices = int((np.asarray(length, dtype=np.int64) // key[1]).sum())
            how = "oneshot" if runs and indices >= ONESHOT_INDICES_PER_RUN * runs else "prepped"
        return how

    def _post_runs(
        self,
        op: str,
        agent: str,
        key: ListKey,
        local: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]],
        remote: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]],
        length: npt.NDArray[np.int64],
        notif: bytes,
    ) -> XferTicket:
        how = self._how(key, length)
        return self.agent.post(op, agent, key, local, remote, length, notif, oneshot=how == "oneshot")

    def _post_block(
        self,
        op: str,
        entry: _PeerEntry,
        src_region: npt.NDArray[np.int64],
        src_offset: npt.NDArray[np.int64],
        dst_region: npt.NDArray[np.int64],
        dst_offset: npt.NDArray[np.int64],
        length: npt.NDArray[np.int64],
        notif: bytes,
    ) -> XferTicket:
        """A staged flow's one-block write: local staging range -> the peer's staging range, both
        checked inside the registered region before NIXL sees them."""
        if not (len(src_region) == len(src_offset) == len(dst_offset) == len(length) == 1):
            raise DescriptorError("a staged write is exactly one descriptor")
        local = _sub_range(self._staging, int(src_region[0]), int(src_offset[0]), int(length[0]), "local")
        remote = _sub_range(entry.staging, int(dst_region[0]), int(dst_offset[0]), int(length[0]), "peer")
        return self.agent.post_single(op, entry.agent, local, remote, notif)

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
        return self._post_runs(
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
        return self._post_runs("WRITE", *self._aux_runs(peer, src_aux_index, dst_aux_index), notif)

    def prepare_aux_write(
        self, peer: Endpoint, src_aux_index: int, dst_aux_index: int, notif: bytes
    ) -> PreparedXfer:
        """``post_aux_write``'s checks, and the transfer made ready (posted by ``post_prepared``)."""
        agent, key, local, remote, length = self._aux_runs(peer, src_aux_index, dst_aux_index)
        oneshot = self._how(key, length) == "oneshot"
        return self.agent.prepare("WRITE", agent, key, local, remote, length, notif, oneshot=oneshot)

    def _aux_runs(self, peer: Endpoint, src_aux_index: int, dst_aux_index: int) -> tuple[Any, ...]:
        """Agent, list key, local and remote runs and length of an aux row's write, checked."""
        entry = self._peer(peer)
        row = self.aux_row_bytes
        if not 0 <= src_aux_index < self.aux_rows:
            raise DescriptorError(f"local aux row {src_aux_index} out of range ({self.aux_rows} rows)")
        if not 0 <= dst_aux_index < entry.registration.aux_rows or row > entry.registration.aux_row_bytes:
            raise DescriptorError(f"peer aux row {dst_aux_index} out of range or too small")
        one = np.array([AUX_REGION_ID], dtype=np.int64)
        return (
            entry.agent,
            entry.aux,
            (one, np.array([src_aux_index * row], dtype=np.int64)),
            (one, np.array([dst_aux_index * entry.registration.aux_row_bytes], dtype=np.int64)),
            np.array([row], dtype=np.int64),
        )

    def check_xfer(self, handle: XferTicket) -> XferState:
        return XferState(self.agent.poll(handle))

    @property
    def executor(self) -> str:
        """Which executor drives NIXL here: "native" (the C engine) or "python"."""
        return self.agent.executor

    def settled_handles(self) -> set[XferTicket] | None:
        """The native engine's thread says which transfers finished; with the Python executor
        NIXL reports completion only when asked (None: every handle is checked)."""
        return self.agent.settled()

    def wait_events(self, timeout_s: float, hot: bool | None = None, fd: int = -1) -> int | None:
        """Sleep on the native engine's wake-up until it has news (None: no such wake-up);
        ``fd`` readable (``control_fd``) ends the sleep too."""
        return self.agent.wait_events(timeout_s, hot, fd)

    def control_fd(self) -> int:
        """An fd readable once control messages wait (``ControlPlane.inbox_fd``)."""
        return self.control.inbox_fd()

    def release_xfer(self, handle: XferTicket) -> None:
        # poll() already released the NIXL handle on DONE/ERR; nothing is left to free.
        if handle.final is None:
            raise DescriptorError("release_xfer on a transfer still in flight (cannot be cancelled)")

    def send_notif(self, peer: Endpoint, notif: bytes) -> None:
        self.agent.send_notif(self._peer(peer).agent, notif)

    def drain_notifs(self) -> list[bytes]:
        return [payload for _, payload in self.agent.notifs()]

    # ---- gather / scatter of the staged flows ----------------------------------------------------
    def post_copy(self, kind: str, staging_region: int, maps: Any) -> int:
        if self.copies is None:
            raise DescriptorError(
                f"{kind} into staging region {staging_region}: this endpoint registered no staging memory"
            )
        return self.copies.submit(kind, staging_region, maps)

    def check_copy(self, handle: int) -> XferState:
        if self.copies is None:
            raise DescriptorError(f"unknown copy handle {handle!r}")
        return self.copies.state(handle)

    def release_copy(self, handle: int) -> None:
        if self.copies is not None:
            self.copies.release(handle)

    def settled_copies(self) -> set[int] | None:
        """On a native-engine rank the engine's fences say which copies finished; else None
        (every copy is checked)."""
        return self.copies.settled() if self.copies is not None else None

    @property
    def copies_fenced(self) -> bool:
        """Copy completions come through the native engine's events (and its wake-up)."""
        return self.copies is not None and self.agent.fence_engine() is not None

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
        if self.copies is not None:
            self.copies.close()
        self.agent.close()


def _descs(regions: Sequence[MemRegion], granule: int) -> int:
    return sum(r.nbytes // granule for r in regions)


def _sub_range(regions: Mapping[int, MemRegion], rid: int, offset: int, length: int, side: str) -> MemRegion:
    region = regions.get(rid)
    if region is None:
        raise DescriptorError(f"{side}: no staging region {rid} registered")
    if offset < 0 or length <= 0 or offset + length > region.nbytes:
        raise DescriptorError(
            f"{side}: bytes [{offset}, {offset + length}) outside staging region {rid} of {region.nbytes} B"
        )
    return MemRegion(rid, region.addr + offset, length, region.mem, region.dev)


def kernel_pool(pool: PoolGeometry, buffers: Mapping[int, Any]) -> Any:
    """The pool's VRAM regions as the kernels' ``KVPool`` (plane i = region i, NHD rows)."""
    import torch
    from kvferry.backends.kernels.api import KVPool

    if pool.layout is Layout.VLLM_HND:
        raise RegionError("the gather/scatter kernels need an NHD pool; this one is HND")
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[pool.model.dtype.itemsize]
    slots = pool.num_pages * pool.page_size
    planes = []
    for rid in range(pool.model.num_regions):
        flat = buffers[rid].reshape(-1).view(torch.uint8)[: pool.region_bytes].view(width)
        planes.append(flat.view(slots, pool.heads_per_rank, -1))
    return KVPool(planes, pool.page_size)


def _make_agent(
    name: str,
    engine: str,
    *,
    sync: str,
    progress_thread: bool,
    ucx_workers: int,
    poll_s: float,
    idle_max_s: float,
) -> NixlAgent:
    """The agent on the asked executor; "native" falls back to Python with one line saying why."""
    if engine == "native":
        from kvferry.backends.nixl import native

        try:
            agent = NixlAgent(
                name,
                sync=sync,
                ucx_workers=ucx_workers,
                factory=functools.partial(native.make_native_agent, poll_s=poll_s, idle_max_s=idle_max_s),
            )
        except native.NativeUnavailable as exc:
            log.warning("%s: executor python (native asked, unavailable: %s)", name, exc)
        else:
            log.info("%s: executor native (nixl %s)", name, native.nixl_version())
            return agent
    return NixlAgent(name, sync=sync, progress_thread=progress_thread, ucx_workers=ucx_workers)


def _suffix() -> str:
    import uuid

    return uuid.uuid4().hex[:8]
