"""Timing-only fabric and transport: every cost is charged as usual, but no KV byte is copied.

Deployment-sized models move gigabytes per room; copying and checking them would take the whole
machine. These subclasses keep the fabric's and the kernels' timing, state and notifications
exactly as the byte-moving ones and skip the copies of KV bytes (aux rows, a few bytes that
decode reads the room id from, still move). Registrations stay
(lazily zeroed arrays: untouched pages cost no memory), so descriptor bounds are still checked.

One layer for all (``LayerPlanner``, ``TimingFabric.layers``): every KV region of a pool has the
same layout and region ``r`` maps to region ``r`` (core/planner.py), so a chunk's descriptors are
one layer's pattern repeated for every layer, and descriptors never merge across regions. A
deployment run plans and posts one layer's descriptors and the fabric charges that post for every
layer: posting cost (dense runs merged, then times the layers), bytes on the wire and the bytes
counted land exactly as the full list's would. Bounds and ownership are still checked on the
layer posted, which covers the others (same offsets, same pages).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from kvferry.backends.simfabric.descriptors import SMALL, DescList
from kvferry.backends.simfabric.fabric import Fabric, Xfer
from kvferry.backends.simfabric.fabric import XferState as FabricState
from kvferry.backends.simfabric.transport import AUX_REGION, SimTransport
from kvferry.backends.transport import XferState
from kvferry.core.errors import WireError
from kvferry.core.geometry import PoolGeometry
from kvferry.core.messages import decode_note
from kvferry.core.planner import RankPlan, plan_rank_pair

__all__ = ["LayerPlanner", "TimingFabric", "TimingTransport"]

# Plain module names for the members (Python 3.11's EnumType attribute hook is slow): per write.
_DONE, _FABRIC_DONE = XferState.DONE, FabricState.DONE


class LayerPlanner:
    """The core's planner over the first layer of each pool: the descriptors of one layer, which
    ``TimingFabric`` charges for every layer (see the module's docstring)."""

    def __init__(self) -> None:
        self._one: dict[int, tuple[PoolGeometry, PoolGeometry]] = {}  # id(pool) -> (pool, one layer)

    def _layer(self, pool: PoolGeometry) -> PoolGeometry:
        got = self._one.get(id(pool))
        if got is None:
            one = replace(pool, model=replace(pool.model, num_layers=1))
            got = self._one[id(pool)] = (pool, one)  # the pool kept alive: its id stays its own
        return got[1]

    def __call__(
        self, src: PoolGeometry, dst: PoolGeometry, src_pages: Any, dst_pages: Any, start: int, end: int
    ) -> RankPlan:
        return plan_rank_pair(self._layer(src), self._layer(dst), src_pages, dst_pages, start, end)


class TimingFabric(Fabric):
    # Set to a list to log every DONE write as (room, posted, started, landed, done) ns.
    xfer_log: list[tuple[int, int, int, int, int]] | None = None
    # Set by a world whose engines plan with ``LayerPlanner``: the model's layers and KV regions
    # per layer. A post whose descriptors all lie in the first layer's regions stands for every
    # layer; a full plan (regions past the first layer) is charged as it is.
    layers: int = 1
    kinds: int = 1

    def _weight(self, descs: DescList) -> int:
        n = descs.count
        if self.layers == 1 or not n:
            return 1
        if n <= SMALL:  # a few descriptors: Python's min and max, not four numpy reductions
            regions = descs.src_region.tolist() + descs.dst_region.tolist()
            lo, hi = min(regions), max(regions)
        else:
            lo = min(int(descs.src_region.min()), int(descs.dst_region.min()))
            hi = max(int(descs.src_region.max()), int(descs.dst_region.max()))
        return self.layers if lo >= 0 and hi < self.kinds else 1

    def register(self, name: str, region_id: int, nbytes: int) -> np.ndarray:
        """Aux rows are real memory; a KV or staging region is a read-only view of one byte with
        the region's size: bounds checks see the real size, and no memory (not even address
        space: a deployment's pools are tens of GB per rank) is taken."""
        if region_id == AUX_REGION:
            return super().register(name, region_id, nbytes)
        mem = self.node(name).memory
        mem.register(region_id, 1)  # the checks a registration gets, on a 1-byte stand-in
        view = np.broadcast_to(np.zeros(1, dtype=np.uint8), (nbytes,))
        mem._regions[region_id] = view  # the stand-in takes the real size
        return view

    def _retire(self, x: Xfer, state: FabricState, reason: str, silent: bool = False) -> None:
        super()._retire(x, state, reason, silent)
        if self.xfer_log is not None and x.state is _FABRIC_DONE and x.notif is not None:
            try:
                room = decode_note(x.notif).room
            except WireError:
                return
            self.xfer_log.append((room, x.posted_ns, x.started_ns, x.landed_ns, x.done_ns))

    def _copy(self, x: Xfer, descs: DescList) -> None:
        # Aux rows are copied: decode reads the room id back from them to accept a room.
        if descs.count <= SMALL:  # without numpy's per-call cost
            regions = descs.dst_region.tolist()
            if AUX_REGION not in regions:
                return  # the usual KV write
            if regions.count(AUX_REGION) == len(regions):
                super()._copy(x, descs)  # an aux write alone (every room has one): all of it
                return
        aux = descs.dst_region == AUX_REGION
        if aux.any():
            super()._copy(
                x,
                DescList(
                    descs.src_region[aux],
                    descs.src_offset[aux],
                    descs.dst_region[aux],
                    descs.dst_offset[aux],
                    descs.length[aux],
                ),
            )


class TimingTransport(SimTransport):
    def _copy_done(
        self, cid: int, kind: str, staging_region: int, maps: tuple[Any, ...], nbytes: int
    ) -> None:
        node = self._fnode
        if not node.up or node.incarnation != self.incarnation or cid not in self.copies:
            return  # the process that launched it is gone
        self._settle_copy(cid, _DONE)
        self.fabric.record(kind, self.node, bytes=nbytes)
        self.fabric.wake(self.node, ("copy", cid))
