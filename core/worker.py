"""The transfer worker's per-chunk step (SGLang PR 20680's queue + worker design, minus the threads).

Rooms are sharded over N queues by room id, so every chunk of a room is handled in order by one
worker. The step for one chunk is pure: given the chunk, the running token offset and what is
known about the room's destinations, it returns the writes to post. ``SenderEngine.run_chunk``
wraps it with the room state: a Failed room's remaining chunks are skipped, and an exception
raised here fails that room only, kept with its original type and message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
from kvferry.core.messages import Endpoint

__all__ = ["ChunkWrite", "Destination", "plan_chunk", "shard_of"]


def shard_of(room: int, num_shards: int) -> int:
    """The queue (and so the worker) that owns every chunk of ``room``."""
    return room % num_shards


# gc=False: plain data that never forms a reference cycle, so the cycle collector need not
# track the many short-lived instances (fewer collections on the hot path).
class Destination(msgspec.Struct, frozen=True, gc=False):
    """One decode rank a chunk goes to: its pool geometry and the room's pages there."""

    peer: Endpoint
    pool: Any  # core.geometry.PoolGeometry
    dst_pages: Any  # int64 array
    dummy: bool


class ChunkWrite(msgspec.Struct, frozen=True, gc=False):
    """Descriptors for one (chunk, destination); an empty plan still needs its notification."""

    peer: Endpoint
    src_region: Any
    src_offset: Any
    dst_region: Any
    dst_offset: Any
    length: Any

    @property
    def count(self) -> int:
        return len(self.length)


Planner = Callable[..., Any]


def plan_chunk(
    planner: Planner,
    src_pool: Any,
    src_pages: Any,
    destinations: Sequence[Destination],
    token_start: int,
    token_end: int,
) -> list[ChunkWrite]:
    """The writes of tokens ``[token_start, token_end)`` to every non-dummy destination.

    ``token_start`` is the room's running total (never derived from this chunk's length), and the
    page arrays cover the room from token 0: the planner places the chunk after its predecessors.
    """
    src = np.asarray(src_pages)
    out = []
    for d in destinations:
        if d.dummy:
            continue
        plan = planner(src_pool, d.pool, src, d.dst_pages, token_start, token_end)
        out.append(
            ChunkWrite(
                d.peer, plan.src_region, plan.src_offset, plan.dst_region, plan.dst_offset, plan.length
            )
        )
    return out
