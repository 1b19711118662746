"""``SimTransport``: one rank's view of the simulated fabric, implementing ``backends.transport.Transport``.

Mirrors what a NIXL agent does: local regions are registered buffers; a peer's regions are known
only from the ``Register`` it sent (``add_peer``), and a descriptor outside them is refused before
anything moves. The agent metadata carries the node's incarnation, so writes aimed at a peer that
restarted since its metadata was loaded end in ERR, as they would against a stale remote agent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from kvferry.backends.simfabric.calls import call_after
from kvferry.backends.simfabric.descriptors import SMALL, DescList, RegionSizes
from kvferry.backends.simfabric.errors import RegionAccessError, UnknownPeerError
from kvferry.backends.simfabric.fabric import Fabric
from kvferry.backends.simfabric.fabric import XferState as FabricState
from kvferry.backends.staging_copy import copy_maps, map_bytes
from kvferry.backends.transport import XferHandle, XferState, aux_room_of
from kvferry.core.errors import KvferryError
from kvferry.core.flows.regions import PINNED_REGION, is_staging_region
from kvferry.core.geometry import PoolGeometry
from kvferry.core.messages import Endpoint, GeometryWire, RegionAddr, Register

# The aux buffer lives in the fake memory under an id no planner region can have.
AUX_REGION = (1 << 20) + 1
# By member (identity hash): ``.value`` is a Python-level property, and this runs per poll.
_STATE = {FabricState.PROC: XferState.PROC, FabricState.DONE: XferState.DONE, FabricState.ERR: XferState.ERR}
# The copy states as plain module names (under Python 3.11 ``XferState.DONE`` is a slow metaclass
# attribute hook, ten times a global's cost), read per gather and scatter.
_PROC, _DONE, _ERR = XferState.PROC, XferState.DONE, XferState.ERR


def node_name(ep: Endpoint) -> str:
    return f"{ep.server}{ep.rank}"


def _meta(node: str, incarnation: int) -> bytes:
    return f"sim:{node}:{incarnation}".encode()


def _parse_meta(blob: bytes) -> tuple[str, int]:
    try:
        kind, node, inc = blob.decode().split(":")
        if kind != "sim":
            raise ValueError(kind)
        return node, int(inc)
    except ValueError:
        raise UnknownPeerError(f"agent metadata {blob[:40]!r} is not a simulated agent") from None


class _Peer:
    __slots__ = ("aux_row_bytes", "aux_rows", "bounds", "incarnation", "node", "region_bytes", "registration")

    def __init__(self, registration: Register) -> None:
        self.registration = registration
        self.node, self.incarnation = _parse_meta(registration.agent_meta)
        self.region_bytes = {r.region_id: r.nbytes for r in registration.regions}
        self.bounds = RegionSizes(self.region_bytes)
        self.aux_rows = registration.aux_rows
        self.aux_row_bytes = registration.aux_row_bytes


class SimTransport:
    """Not thread-safe and needs not be: SimPy processes never run concurrently."""

    def __init__(self, fabric: Fabric, endpoint: Endpoint, pool: PoolGeometry) -> None:
        self.fabric = fabric
        self._endpoint = endpoint
        self.node = node_name(endpoint)
        self.pool = pool
        # The fabric's record of this node: it outlives crashes and restarts (asked at every poll).
        self._fnode = fabric.node(self.node)
        # Its node's memory (kept through crashes, wiped in place): ``memory.region`` spares the
        # pattern fills and checks a frame per region.
        self.memory = self._fnode.memory
        self.incarnation = self._fnode.incarnation
        self.peers: dict[Endpoint, _Peer] = {}
        self._names: dict[Endpoint, str] = {}
        self.aux_rows = 0
        self.aux_row_bytes = 0
        self._regions: tuple[Any, ...] = ()
        # Writes the driver has not released yet; the world checks this is empty at quiescence.
        self.handles: set[int] = set()
        self.refused = 0
        # Staging memory (core.flows.regions) and the gathers/scatters running on it.
        self.ring_bytes = 0
        self.pinned_bytes = 0
        self._staging: dict[int, int] = {}
        self.copies: dict[int, XferState] = {}
        # Copies that left PROC and are not released yet: the driver checks only these
        # (``settled_copies``), so a poll while kernels run does not check each of them.
        self._settled_copies: set[int] = set()
        self._next_copy = 1
        self._stream_free_at = 0  # this node's kernels run one after another
        self.kernel_rng: Any = None  # a named random stream for the GPU's busy waits (world sets it)

    # --- identity and local memory ---------------------------------------------------------------
    @property
    def endpoint(self) -> Endpoint:
        return self._endpoint

    @property
    def agent_name(self) -> str:
        return f"{self.node}@{self.incarnation}"

    def agent_metadata(self) -> bytes:
        return _meta(self.node, self.incarnation)

    def register_regions(self, regions: Sequence[Any], aux_rows: int, aux_row_bytes: int) -> None:
        for r in regions:
            self.fabric.register(self.node, int(r.region_id), int(r.nbytes))
        self.fabric.register(self.node, AUX_REGION, aux_rows * aux_row_bytes)
        self._regions = tuple(regions)
        self.aux_rows, self.aux_row_bytes = aux_rows, aux_row_bytes

    def register_staging(self, regions: dict[int, int], ring_bytes: int = 0, pinned_bytes: int = 0) -> None:
        """Staging buffers (region id -> bytes); ``ring_bytes``/``pinned_bytes``: what this rank
        offers its peers in its Register (decode)."""
        for rid, n in regions.items():
            if n > 0:
                self.fabric.register(self.node, rid, n)
                self._staging[rid] = n
        self.ring_bytes, self.pinned_bytes = ring_bytes, pinned_bytes

    def region(self, region_id: int) -> np.ndarray:
        return self._fnode.memory.region(region_id)

    def aux_row(self, index: int) -> np.ndarray:
        if not 0 <= index < self.aux_rows:
            raise RegionAccessError(f"{self.node}: aux row {index} out of range ({self.aux_rows} rows)")
        start = index * self.aux_row_bytes
        return self.region(AUX_REGION)[start : start + self.aux_row_bytes]

    def registration(self) -> Register:
        # Fake base addresses: distinct, stable, and never used to move bytes here.
        base = (hash_node(self.node) << 36) & ((1 << 62) - 1)
        regions = [
            RegionAddr(
                region_id=int(r.region_id), addr=base + int(r.region_id) * (1 << 30), nbytes=int(r.nbytes)
            )
            for r in self._regions
        ]
        regions += [
            RegionAddr(region_id=rid, addr=base + (rid % 4096 + 4096) * (1 << 30), nbytes=n)
            for rid, n in sorted(self._staging.items())
        ]
        return Register(
            src=self._endpoint,
            agent_name=self.agent_name,
            agent_meta=self.agent_metadata(),
            geometry=GeometryWire.from_pool(self.pool),
            regions=regions,
            aux_addr=base + AUX_REGION * (1 << 10),
            aux_row_bytes=self.aux_row_bytes,
            aux_rows=self.aux_rows,
            ring_bytes=self.ring_bytes,
            pinned_bytes=self.pinned_bytes,
        )

    # --- peers -------------------------------------------------------------------------------------
    def add_peer(self, peer: Endpoint, registration: Register) -> None:
        self.peers[peer] = _Peer(registration)

    def drop_peer(self, peer: Endpoint) -> None:
        self.peers.pop(peer, None)

    def _peer(self, peer: Endpoint) -> _Peer:
        p = self.peers.get(peer)
        if p is None:
            raise UnknownPeerError(f"{self.node}: no metadata loaded for peer {peer}")
        return p

    # --- data plane ----------------------------------------------------------------------------------
    def post_write(
        self,
        peer: Endpoint,
        src_region: npt.NDArray[np.int64],
        src_offset: npt.NDArray[np.int64],
        dst_region: npt.NDArray[np.int64],
        dst_offset: npt.NDArray[np.int64],
        length: npt.NDArray[np.int64],
        notif: bytes,
        tag: Any = None,
    ) -> XferHandle:
        p = self._peer(peer)
        d = DescList.of(src_region, src_offset, dst_region, dst_offset, length)
        self._check_remote(p, d)
        return self._post(p, d, notif, tag)

    def post_read(
        self,
        peer: Endpoint,
        src_region: npt.NDArray[np.int64],
        src_offset: npt.NDArray[np.int64],
        dst_region: npt.NDArray[np.int64],
        dst_offset: npt.NDArray[np.int64],
        length: npt.NDArray[np.int64],
        notif: bytes | None = None,
        tag: Any = None,
    ) -> XferHandle:
        """READ (the pull flow): planner descriptors from ``peer``'s registered memory (src) into
        ours (dst), NixlTransport.post_read's signature; ``notif`` reaches the peer once the bytes
        are read. Same cost model as a write: the initiator pays the post and per-descriptor cost,
        the bytes share the NICs' bandwidth."""
        p = self._peer(peer)
        d = DescList.of(src_region, src_offset, dst_region, dst_offset, length)
        bad = p.bounds.first_violation(d.src_region, d.src_offset, d.length)
        if bad >= 0:
            self.refused += 1
            raise RegionAccessError(
                f"{self.node}: read descriptor {bad} (region {int(d.src_region[bad])}, offset "
                f"{int(d.src_offset[bad])}, length {int(d.length[bad])}) outside {p.node}'s regions"
            )
        try:
            xid = self.fabric.post(
                self.node, p.node, self.node, d, notif, tag=tag, dst_incarnation=p.incarnation
            )
        except RegionAccessError:
            self.refused += 1
            raise
        self.handles.add(xid)
        return xid

    def post_aux_write(
        self, peer: Endpoint, src_aux_index: int, dst_aux_index: int, notif: bytes, tag: Any = None
    ) -> XferHandle:
        p = self._peer(peer)
        if not 0 <= dst_aux_index < p.aux_rows:
            self.refused += 1
            raise RegionAccessError(
                f"{self.node}: aux row {dst_aux_index} outside {peer}'s {p.aux_rows} rows"
            )
        if not 0 <= src_aux_index < self.aux_rows:
            self.refused += 1
            raise RegionAccessError(f"{self.node}: local aux row {src_aux_index} out of range")
        n = min(self.aux_row_bytes, p.aux_row_bytes)
        d = DescList.of(
            [AUX_REGION],
            [src_aux_index * self.aux_row_bytes],
            [AUX_REGION],
            [dst_aux_index * p.aux_row_bytes],
            [n],
        )
        return self._post(p, d, notif, tag)

    def _check_remote(self, p: _Peer, d: DescList) -> None:
        if d.count <= SMALL and p.bounds.first_violation_rows(d.rows(), 2) < 0:
            return  # a few descriptors, inside (a refusal's index comes from the arrays below)
        bad = p.bounds.first_violation(d.dst_region, d.dst_offset, d.length)
        if bad >= 0:
            self.refused += 1
            raise RegionAccessError(
                f"{self.node}: descriptor {bad} (region {int(d.dst_region[bad])}, offset "
                f"{int(d.dst_offset[bad])}, length {int(d.length[bad])}) outside {p.node}'s regions"
            )

    def _post(self, p: _Peer, d: DescList, notif: bytes, tag: Any) -> int:
        try:
            xid = self.fabric.post(
                self.node, self.node, p.node, d, notif, tag=tag, dst_incarnation=p.incarnation
            )
        except RegionAccessError:
            self.refused += 1
            raise
        self.handles.add(xid)
        return xid

    def check_xfer(self, handle: XferHandle) -> XferState:
        if handle not in self.handles:
            raise UnknownPeerError(f"{self.node}: unknown transfer handle {handle!r}")
        return _STATE[self.fabric.state(self.node, handle)]

    def settled_handles(self) -> set[int]:
        """Handles whose check_xfer may no longer say PROC (finished, not yet released): a poll
        need only check these (``Driver.poll_writes``). Every other held handle is PROC."""
        return self._fnode.settled

    def release_xfer(self, handle: XferHandle) -> None:
        self.handles.discard(handle)
        self.fabric.release(self.node, handle)

    def send_notif(self, peer: Endpoint, notif: bytes, tag: Any = None) -> None:
        p = self._peer(peer)
        self.fabric.send_notif(self.node, p.node, notif, tag=tag)

    def drain_notifs(self) -> list[bytes]:
        node = self._fnode  # Fabric.drain_notifs without the lookup by name (asked at every poll)
        got = node.notifs
        if not got:
            return []  # most polls: no new list for the node, no comprehension
        node.notifs = []
        return [payload for _src, payload in got]

    def read_aux_room(self, aux_index: int) -> int:
        return aux_room_of(self.aux_row(aux_index))

    # --- gather / scatter (staged flows) -----------------------------------------------------------
    def post_copy(self, kind: str, staging_region: int, maps: Any) -> int:
        """A kernel on this node's stream: it costs launch + bytes / rate of virtual time, then
        moves the bytes (numpy, the same maps the Triton kernels run); a crash before then loses it."""
        if staging_region not in self._staging or not is_staging_region(staging_region):
            raise RegionAccessError(f"{self.node}: no staging region {staging_region}")
        cid = self._next_copy
        self._next_copy += 1
        self.copies[cid] = _PROC
        k = self.fabric.spec.kernel
        now = int(self.fabric.env._now)
        busy = 0
        if k.busy_mean_ns and self.kernel_rng is not None:
            busy = int(self.kernel_rng.expovariate(1.0 / k.busy_mean_ns))
        ready = now
        if k.submit_ns:  # the submit holds the rank's runtime thread first (KernelSpec.submit_ns)
            node = self._fnode
            node.host_busy_until = ready = max(now, node.host_busy_until) + k.submit_ns
        start = max(ready + busy, self._stream_free_at)
        nbytes = map_bytes(maps)  # its cost now, its record at the end: summed once
        self._stream_free_at = start + k.cost_ns(nbytes, pinned=staging_region == PINNED_REGION)
        call_after(
            self.fabric.env,
            self._stream_free_at - now,
            self._copy_done,
            cid,
            kind,
            staging_region,
            tuple(maps),
            nbytes,
        )
        return cid

    def _copy_done(
        self, cid: int, kind: str, staging_region: int, maps: tuple[Any, ...], nbytes: int
    ) -> None:
        node = self._fnode
        if not node.up or node.incarnation != self.incarnation or cid not in self.copies:
            return  # the process that launched it is gone
        mem = node.memory
        try:
            regions = {int(r.region_id): mem.region(int(r.region_id)) for r in self._regions}
            copy_maps(kind, regions, mem.region(staging_region), maps)
            self._settle_copy(cid, _DONE)
        except KvferryError as exc:
            self._settle_copy(cid, _ERR)
            self.fabric.record("copy_err", self.node, reason=str(exc))
        self.fabric.record(kind, self.node, bytes=nbytes)
        self.fabric.wake(self.node, ("copy", cid))

    def _settle_copy(self, cid: int, state: XferState) -> None:
        self.copies[cid] = state
        self._settled_copies.add(cid)

    def check_copy(self, handle: int) -> XferState:
        return self.copies[handle]

    def release_copy(self, handle: int) -> None:
        self.copies.pop(handle, None)
        self._settled_copies.discard(handle)

    def settled_copies(self) -> set[int]:
        """The copies that left PROC. The driver still feeds them in its own (post) order, the
        order the behaviour digests recorded; every other copy it holds is PROC here, so
        checking it would only be skipped."""
        return self._settled_copies

    # --- control plane ----------------------------------------------------------------------------------
    def send_control(self, peer: Endpoint, data: bytes, tag: Any = None) -> None:
        name = self._names.get(peer)  # a peer's node name, made once (a message or more a room)
        if name is None:
            name = self._names[peer] = node_name(peer)
        self.fabric.send_control(self.node, name, data, tag=tag)

    def recv_control(self) -> list[bytes]:
        node = self._fnode  # Fabric.drain_control without the lookup by name (asked at every poll)
        got = node.control
        if not got:
            return []  # most polls: no new list for the node, no comprehension
        node.control = []
        return [payload for _src, payload in got]


def hash_node(name: str) -> int:
    """A small stable number per node name (no Python hash(): it is salted per process)."""
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) & 0xFFFF
    return h + 1
