"""Prefill side of the staged flows (``ring``, ``pinned``): one ledger entry per chunk.

A staged chunk goes ASKING (StagingReq sent to every decode rank it writes to) -> GRANTED (every
StagingRsp in) -> GATHERING (the worker gathered its heads into a staging buffer it owns) ->
WRITING (one WRITE per decode rank, from the buffer into decode's ring or pinned region) ->
LANDED (every write DONE: the buffer is free again). The room machine (``core.sender``) asks
the ledger whether the head chunk can start (``blocker``), starts it, and hears back only that a
chunk landed or failed. Sizes and offsets come from ``core.staging_layout.staged_map``, the same
function decode uses for its scatter, so both sides agree on every staging byte.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from kvferry.core import messages as m
from kvferry.core.flows.machine import Step
from kvferry.core.flows.policy import Flow, staging_format
from kvferry.core.geometry import PoolGeometry
from kvferry.core.planner import find_link
from kvferry.core.staging_layout import StagingFormat, StagingMap, staged_map

__all__ = ["TX_TABLE", "TxChunk", "TxIn", "TxState", "decode_alloc_bytes", "writer_bytes"]


class TxState(Enum):
    ASKING = "asking"
    GRANTED = "granted"
    GATHERING = "gathering"
    WRITING = "writing"
    LANDED = "landed"


class TxIn(Enum):
    GRANT = "grant"
    START = "start"
    GATHERED = "gathered"
    WRITTEN = "written"


class TxChunk:
    """One staged chunk of one room on one prefill rank."""

    __slots__ = (
        "asked",
        "blocks",
        "buffer",
        "flow",
        "grants",
        "index",
        "is_last",
        "op_id",
        "state",
        "targets",
        "token_end",
        "token_start",
        "writes",
    )

    def __init__(
        self, index: int, token_start: int, token_end: int, flow: Flow, targets: tuple[m.Endpoint, ...]
    ):
        self.index = index
        self.token_start = token_start
        self.token_end = token_end
        self.flow = flow
        self.targets = targets
        self.state = TxState.ASKING
        self.grants: dict[m.Endpoint, m.StagingRsp] = {}
        self.asked: set[m.Endpoint] = set()
        self.buffer: tuple[str, int] | None = None  # ("worker", shard) or ("pinned", reservation id)
        self.op_id = -1
        self.is_last = False
        self.writes: set[int] = set()
        self.blocks: dict[m.Endpoint, tuple[int, int]] = {}  # decode rank -> (buffer offset, length)

    @property
    def ungranted(self) -> list[m.Endpoint]:
        return [p for p in self.targets if p not in self.grants]


def _grant(ch: TxChunk, rsp: m.StagingRsp) -> str:
    if rsp.src in ch.grants:
        return "duplicate"
    ch.grants[rsp.src] = rsp
    return "more" if ch.ungranted else "all"


def _duplicate_grant(ch: TxChunk, rsp: m.StagingRsp) -> str:
    return "duplicate"


def _start(ch: TxChunk, op_id: int, buffer: tuple[str, int]) -> str:
    ch.op_id, ch.buffer = op_id, buffer
    return "started"


def _gathered(ch: TxChunk, write_ids: tuple[int, ...]) -> str:
    ch.writes.update(write_ids)
    return "writing" if write_ids else "landed"


def _written(ch: TxChunk, write_id: int) -> str:
    ch.writes.discard(write_id)
    return "more" if ch.writes else "landed"


_A, _G, _GA, _W, _L = TxState.ASKING, TxState.GRANTED, TxState.GATHERING, TxState.WRITING, TxState.LANDED
_DUP = Step(_duplicate_grant, {"duplicate": _G})

TX_TABLE: dict[TxState, dict[TxIn, Step]] = {
    _A: {TxIn.GRANT: Step(_grant, {"more": _A, "all": _G, "duplicate": _A})},
    _G: {TxIn.GRANT: _DUP, TxIn.START: Step(_start, {"started": _GA})},
    _GA: {
        TxIn.GRANT: Step(_duplicate_grant, {"duplicate": _GA}),
        TxIn.GATHERED: Step(_gathered, {"writing": _W, "landed": _L}),
    },
    _W: {
        TxIn.GRANT: Step(_duplicate_grant, {"duplicate": _W}),
        TxIn.WRITTEN: Step(_written, {"more": _W, "landed": _L}),
    },
    _L: {TxIn.GRANT: Step(_duplicate_grant, {"duplicate": _L})},
}


# --- sizes ------------------------------------------------------------------------------------------


def writer_bytes(src: PoolGeometry, dst: PoolGeometry, tokens: int) -> int:
    """Bytes one prefill rank sends one decode rank for ``tokens`` tokens (its heads, every region)."""
    link = find_link(src, dst)
    n = link.num_heads if link else 0
    return src.model.num_regions * tokens * n * src.head_bytes


def decode_alloc_bytes(dst: PoolGeometry, tokens: int) -> int:
    """Staging space one chunk takes on a decode rank: every head it holds (its writers together)."""
    return dst.model.num_regions * tokens * dst.heads_per_rank * dst.head_bytes


def gather_bytes(flow: Flow, src: PoolGeometry, dsts: list[PoolGeometry], tokens: int) -> int:
    """Prefill staging a chunk needs: one block per decode rank (ring) or the rank's head-major
    buffer (pinned)."""
    if flow is Flow.RING:
        return sum(writer_bytes(src, d, tokens) for d in dsts)
    return src.model.num_regions * tokens * src.heads_per_rank * src.head_bytes


def gather_plan(
    flow: Flow,
    src: PoolGeometry,
    src_pages: Any,
    dsts: list[tuple[m.Endpoint, PoolGeometry]],
    token_start: int,
    token_end: int,
    base: int,
) -> tuple[list[StagingMap], dict[m.Endpoint, tuple[int, int]]]:
    """The gather maps of a chunk and, per decode rank, the (source offset, length) of its WRITE."""
    fmt = staging_format(flow)
    maps: list[StagingMap] = []
    blocks: dict[m.Endpoint, tuple[int, int]] = {}
    offset = base
    for peer, dst in dsts:
        link = find_link(src, dst)
        if link is None or link.num_heads == 0:
            continue
        block = offset if fmt is StagingFormat.LAYER_MAJOR else base
        smap = staged_map(src, src_pages, link.head_start, link.num_heads, token_start, token_end, fmt, block)
        maps.append(smap)
        blocks[peer] = (smap.staging_base, smap.nbytes)
        offset += smap.nbytes
    return maps, blocks
