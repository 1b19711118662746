"""What each flow posts and needs for one room: descriptors, staging space, the policy's pick.

Pure arithmetic over the same functions the flows run (``staged_tx.writer_bytes`` for a lane's
WRITE, ``staged_tx.decode_alloc_bytes`` for a chunk's staging allocation on decode), so that
``kvferry plan`` reports what the flows really do. The direct flow's count comes from the planner
itself (the caller passes it: it depends on the page ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvferry.core.flows.policy import Flow, FlowPolicy
from kvferry.core.flows.staged_tx import decode_alloc_bytes, writer_bytes
from kvferry.core.geometry import PoolGeometry, links

__all__ = ["chunk_lengths", "staged_summary"]


def chunk_lengths(tokens: int, chunk_tokens: int) -> list[int]:
    if chunk_tokens <= 0 or chunk_tokens >= tokens:
        return [tokens]
    out = [chunk_tokens] * (tokens // chunk_tokens)
    if tokens % chunk_tokens:
        out.append(tokens % chunk_tokens)
    return out


def staged_summary(
    src: Sequence[PoolGeometry], dst: Sequence[PoolGeometry], tokens: int, chunk_tokens: int = 0
) -> dict[str, Any]:
    """Per staged flow: WRITEs (one descriptor each) per room, and the staging space the largest
    chunk needs on each side; plus the flow the default policy picks with both offered."""
    chunks = chunk_lengths(tokens, chunk_tokens)
    biggest = max(chunks)
    real = [x for x in links(src[0].model, len(src), len(dst)) if not x.is_dummy]
    lanes_per_chunk = len(real)
    out: dict[str, Any] = {}
    for flow in (Flow.RING, Flow.PINNED):
        per_prefill: dict[int, int] = {}
        for x in real:
            b = writer_bytes(src[x.prefill_rank], dst[x.decode_rank], biggest)
            # Ring: one slot per decode rank in each worker's buffer; pinned: a reservation per lane.
            per_prefill[x.prefill_rank] = per_prefill.get(x.prefill_rank, 0) + b
        out[flow.value] = {
            "descriptors": lanes_per_chunk * len(chunks),
            "writes_per_chunk": lanes_per_chunk,
            "chunks": len(chunks),
            "decode_space_per_chunk_bytes": max(decode_alloc_bytes(d, biggest) for d in dst),
            "prefill_space_per_chunk_bytes": max(per_prefill.values(), default=0),
        }
    out["policy_choice"] = FlowPolicy().choose(src[0], dst[0], 1, 1).value
    return out
