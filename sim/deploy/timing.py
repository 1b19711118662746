"""Timing-only fabric and transport: every cost is charged as usual, but no KV byte is copied.

Deployment-sized models move gigabytes per room; copying and checking them would take the whole
machine. These subclasses keep the fabric's and the kernels' timing, state and notifications
exactly as the byte-moving ones and skip the copies of KV bytes (aux rows, a few bytes that
decode reads the room id from, still move). Registrations stay
(lazily zeroed arrays: untouched pages cost no memory), so descriptor bounds are still checked.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from kvferry.backends.simfabric.descriptors import DescList
from kvferry.backends.simfabric.fabric import Fabric, Xfer
from kvferry.backends.simfabric.fabric import XferState as FabricState
from kvferry.backends.simfabric.transport import AUX_REGION, SimTransport
from kvferry.backends.staging_copy import map_bytes
from kvferry.backends.transport import XferState
from kvferry.core.errors import WireError
from kvferry.core.messages import decode_note

__all__ = ["TimingFabric", "TimingTransport"]


class TimingFabric(Fabric):
    # Set to a list to log every DONE write as (room, posted, started, landed, done) ns.
    xfer_log: list[tuple[int, int, int, int, int]] | None = None

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
        if self.xfer_log is not None and x.state is FabricState.DONE and x.notif is not None:
            try:
                room = decode_note(x.notif).room
            except WireError:
                return
            self.xfer_log.append((room, x.posted_ns, x.started_ns, x.landed_ns, x.done_ns))

    def _copy(self, x: Xfer, descs: DescList) -> None:
        # Aux rows are copied: decode reads the room id back from them to accept a room.
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
    def _copy_done(self, cid: int, kind: str, staging_region: int, maps: tuple[Any, ...]) -> None:
        node = self.fabric.node(self.node)
        if not node.up or node.incarnation != self.incarnation or cid not in self.copies:
            return  # the process that launched it is gone
        self.copies[cid] = XferState.DONE
        self.fabric.record(kind, self.node, bytes=map_bytes(maps))
        self.fabric.wake(self.node, ("copy", cid))
