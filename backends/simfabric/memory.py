"""Fake registered memory: one numpy byte array per region id.

Registration mirrors NIXL: a transfer may only touch bytes inside a registered region, and a
descriptor that does not is refused before anything moves.
"""

from __future__ import annotations

import numpy as np
from kvferry.backends.simfabric.descriptors import SMALL, DescList, RegionSizes
from kvferry.backends.simfabric.errors import RegionAccessError


class FakeMemory:
    """The registered regions of one node. Region ids are the planner's region ids."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._regions: dict[int, np.ndarray] = {}
        self._bounds: RegionSizes | None = None  # rebuilt lazily after (de)registration

    def register(self, region_id: int, nbytes: int) -> np.ndarray:
        if region_id in self._regions:
            raise RegionAccessError(f"{self.node}: region {region_id} registered twice")
        if nbytes <= 0:
            raise RegionAccessError(f"{self.node}: region {region_id} has size {nbytes}")
        buf = np.zeros(nbytes, dtype=np.uint8)
        self._regions[region_id] = buf
        self._bounds = None
        return buf

    def deregister(self, region_id: int) -> None:
        if self._regions.pop(region_id, None) is None:
            raise RegionAccessError(f"{self.node}: region {region_id} is not registered")
        self._bounds = None

    def wipe(self) -> None:
        """A crash: every registration and every byte is gone."""
        self._regions.clear()
        self._bounds = None

    def region(self, region_id: int) -> np.ndarray:
        try:
            return self._regions[region_id]
        except KeyError:
            raise RegionAccessError(f"{self.node}: region {region_id} is not registered") from None

    @property
    def by_id(self) -> dict[int, np.ndarray]:
        """Region id -> buffer, to read (not change) where a call per lookup costs too much."""
        return self._regions

    def sizes(self) -> dict[int, int]:
        return {rid: int(buf.size) for rid, buf in sorted(self._regions.items())}

    @property
    def registered(self) -> int:
        return len(self._regions)

    def check_descs(self, descs: DescList, dst: bool) -> None:
        """``check`` of one side of ``descs`` (the destination's if ``dst``); a few descriptors
        are checked from their cached rows, the rest (and any refusal's message) by ``check``."""
        if descs.count <= SMALL:
            if self._bounds is None:
                self._bounds = RegionSizes({rid: int(buf.size) for rid, buf in self._regions.items()})
            if self._bounds.first_violation_rows(descs.rows(), 2 if dst else 0) < 0:
                return
        if dst:
            self.check(descs.dst_region, descs.dst_offset, descs.length)
        else:
            self.check(descs.src_region, descs.src_offset, descs.length)

    def check(self, region: np.ndarray, offset: np.ndarray, length: np.ndarray) -> None:
        """Refuse descriptors that are negative, empty or run past the end of their region."""
        if self._bounds is None:
            self._bounds = RegionSizes({rid: int(buf.size) for rid, buf in self._regions.items()})
        bad = self._bounds.first_violation(region, offset, length)
        if bad >= 0:
            rid = int(region[bad])
            buf = self._regions.get(rid)
            what = "an unregistered region" if buf is None else f"region {rid} of {buf.size} bytes"
            raise RegionAccessError(
                f"{self.node}: descriptor {bad} (region {rid}, offset {int(offset[bad])}, length "
                f"{int(length[bad])}) falls outside {what}"
            )
