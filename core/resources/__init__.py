"""Pure, sans-IO resources: the GPU staging ring and the pinned pool (staged flows), and the push
registration lease registry (``leases``, imported from its module).

No threads, clocks or I/O: a flow calls them and turns their answers into commands. Misuse by the
local caller raises ResourceError; a peer-driven size that can never fit is a typed refusal value.
"""

from kvferry.core.resources.pinned import PinnedPool, PinnedRefused, Reservation
from kvferry.core.resources.ring import RingRefused, RingSlot, StagingRing, Watermark, writable

__all__ = [
    "PinnedPool",
    "PinnedRefused",
    "Reservation",
    "RingRefused",
    "RingSlot",
    "StagingRing",
    "Watermark",
    "writable",
]
