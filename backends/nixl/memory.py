"""Memory regions a rank registers with NIXL, from numpy arrays, raw addresses or torch tensors.

A region is the backend's view of one ``RegionSpec`` of the pool geometry: the descriptors the
planner emits address memory as (region_id, byte offset), and this is where a region_id gets its
real base address. torch is imported only when a tensor is passed, so DRAM-only users never pay
for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import numpy as np
from kvferry.core.errors import KvferryError

MEM_TYPES = ("DRAM", "VRAM")


class RegionError(KvferryError, ValueError):
    """A region that cannot be registered: not contiguous, empty, unknown memory type."""


class MemRegion(msgspec.Struct, frozen=True):
    """One registered memory range. Sent to peers inside the registration message."""

    region_id: int
    addr: int
    nbytes: int
    mem: str = "DRAM"
    dev: int = 0

    def validate(self) -> None:
        if self.mem not in MEM_TYPES:
            raise RegionError(f"region {self.region_id}: unknown memory type {self.mem!r}")
        if self.nbytes <= 0 or self.addr <= 0 or self.region_id < 0 or self.dev < 0:
            raise RegionError(f"region {self.region_id}: bad range addr={self.addr} nbytes={self.nbytes}")


def region_from_raw(region_id: int, addr: int, nbytes: int, mem: str = "DRAM", dev: int = 0) -> MemRegion:
    region = MemRegion(region_id, int(addr), int(nbytes), mem, dev)
    region.validate()
    return region


def region_from_numpy(region_id: int, array: np.ndarray) -> MemRegion:
    if not array.flags["C_CONTIGUOUS"]:
        raise RegionError(f"region {region_id}: numpy array is not C-contiguous")
    return region_from_raw(region_id, array.ctypes.data, array.nbytes)


def region_from_tensor(region_id: int, tensor: Any) -> MemRegion:
    if not tensor.is_contiguous():
        raise RegionError(f"region {region_id}: tensor is not contiguous")
    dev = tensor.get_device()
    mem = "DRAM" if dev < 0 else "VRAM"
    return region_from_raw(
        region_id, tensor.data_ptr(), tensor.numel() * tensor.element_size(), mem, max(dev, 0)
    )


def regions_from(buffers: Mapping[int, Any]) -> list[MemRegion]:
    """region_id -> numpy array, torch tensor, or (addr, nbytes) tuple."""
    out: list[MemRegion] = []
    for region_id, buf in sorted(buffers.items()):
        if isinstance(buf, np.ndarray):
            out.append(region_from_numpy(region_id, buf))
        elif isinstance(buf, tuple):
            out.append(region_from_raw(region_id, *buf))
        elif hasattr(buf, "data_ptr"):
            out.append(region_from_tensor(region_id, buf))
        else:
            raise RegionError(f"region {region_id}: unsupported buffer type {type(buf).__name__}")
    check_disjoint(out)
    return out


def check_disjoint(regions: Iterable[MemRegion]) -> None:
    """Overlapping regions would let a descriptor of one room land in another's bytes."""
    seen: set[int] = set()
    spans: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for r in regions:
        r.validate()
        if r.region_id in seen:
            raise RegionError(f"region id {r.region_id} given twice")
        seen.add(r.region_id)
        spans.setdefault((r.mem, r.dev), []).append((r.addr, r.addr + r.nbytes, r.region_id))
    for items in spans.values():
        items.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(items):
            if start < end:
                raise RegionError(f"regions {a} and {b} overlap")
