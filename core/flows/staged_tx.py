"""Prefill side of the staged flows (``ring``, ``pinned``): one ledger entry per lane.

A *lane* is one chunk of one room going to one decode rank. Lanes are independent on purpose:
a chunk that a prefill rank sends to two decode rings must not wait for both rings at once (two
decode ranks may order their allocations differently, and a chunk holding space on one while
waiting on the other deadlocks against a chunk doing the reverse). A lane goes ASKING
(StagingReq sent, resent until answered) -> GRANTED -> GATHERING (its heads gathered into a
staging slot it now owns: its worker's private buffer, or a pinned reservation) -> WRITING (one
WRITE into decode's ring or pinned region) -> LANDED (the slot is free again). A lane holds a
slot only while gathering and writing, which never wait on anything, so the oldest allocation
on every decode rank can always be written: that is the progress argument of the ring.
"""

from __future__ import annotations

from typing import Any

from kvferry.core import messages as m
from kvferry.core.flows.policy import Flow
from kvferry.core.geometry import PoolGeometry
from kvferry.core.identity_enum import IdentityEnum
from kvferry.core.machine import Transition
from kvferry.core.planner import find_link

__all__ = ["TX_TABLE", "StagedLedger", "TxIn", "TxLane", "TxState", "decode_alloc_bytes", "writer_bytes"]


class TxState(IdentityEnum):
    ASKING = "asking"
    GRANTED = "granted"
    GATHERING = "gathering"
    WRITING = "writing"
    LANDED = "landed"


class TxIn(IdentityEnum):
    GRANT = "grant"
    START = "start"
    GATHERED = "gathered"
    WRITTEN = "written"


class TxLane:
    """One staged chunk of one room to one decode rank, on one prefill rank."""

    __slots__ = (
        "accepted",
        "buffer",
        "bytes_for",
        "flow",
        "grant",
        "head_start",
        "index",
        "is_last",
        "length",
        "nbytes",
        "num_heads",
        "op_id",
        "premap",
        "src_offset",
        "state",
        "target",
        "token_end",
        "token_start",
        "write_id",
    )

    def __init__(
        self,
        index: int,
        target: m.Endpoint,
        token_start: int,
        token_end: int,
        flow: Flow,
        head_start: int,
        num_heads: int,
    ) -> None:
        self.index = index
        self.target = target
        self.token_start = token_start
        self.token_end = token_end
        self.flow = flow
        self.head_start = head_start
        self.num_heads = num_heads
        self.state = TxState.ASKING
        self.grant: m.StagingRsp | None = None
        self.accepted = False  # the worker handed the chunk over (its bounds are checked)
        self.is_last = False
        # ("slot", worker, half[, half]) or ("pinned", reservation id)
        self.buffer: tuple[Any, ...] | None = None
        self.op_id = -1
        # A chunk named ahead: its gather map made before its send, at staging base 0, with the
        # named pages (used only if the chunk's pages are the same): (pages, map).
        self.premap: tuple[Any, Any] | None = None
        self.write_id = -1
        self.src_offset = 0
        self.length = 0
        # ``writer_bytes`` of the lane, for the decode pool it was computed against (asked
        # several times per lane; the target's pool object changes only with its registration).
        self.bytes_for: PoolGeometry | None = None
        self.nbytes = 0

    @property
    def key(self) -> tuple[int, m.Endpoint]:
        return (self.index, self.target)


class StagedLedger:
    """Everything the flow keeps about one room, in the flow's own table (``StagedSender.ledgers``),
    never on the room; the room machine asks the flow, not the ledger."""

    __slots__ = ("asked", "blocked", "deferred", "direct_chunks", "early_grants", "lanes", "ops", "pages",
                 "write_lane")  # fmt: skip

    def __init__(self) -> None:
        self.lanes: dict[tuple[int, m.Endpoint], TxLane] = {}
        self.asked: dict[tuple[int, m.Endpoint], bool] = {}
        self.early_grants: dict[tuple[int, m.Endpoint], list[m.StagingRsp]] = {}
        self.direct_chunks: set[int] = set()  # a staged room's chunks that go direct (fallback, empty)
        self.deferred: set[int] = set()
        self.blocked = ""  # why the first waiting lane waits (for the room's timeout reason)
        self.pages: Any = None
        self.ops: set[int] = set()  # gathers in flight: each owns a staging slot
        # write id -> (lane, its note, the watermark position that confirms its scatter)
        self.write_lane: dict[int, tuple[tuple[int, m.Endpoint], bytes, Any]] = {}

    def quiet(self) -> bool:
        """No gather or write in flight and every accepted lane landed."""
        if not self.lanes:  # every direct room: no generator to build
            return not self.ops
        return not self.ops and all(x.state is TxState.LANDED for x in self.lanes.values() if x.accepted)

    def drop_waiting(self) -> None:
        """The room failed: nothing not yet started will start."""
        self.early_grants.clear()


def _grant(lane: TxLane, rsp: m.StagingRsp) -> str:
    lane.grant = rsp
    return "granted"


def _again(lane: TxLane, rsp: m.StagingRsp) -> str:
    return "duplicate"


def _start(lane: TxLane, op_id: int, buffer: tuple[str, int], src_offset: int, length: int) -> str:
    lane.op_id, lane.buffer, lane.src_offset, lane.length = op_id, buffer, src_offset, length
    return "started"


def _gathered(lane: TxLane, write_id: int) -> str:
    lane.write_id = write_id
    return "writing"


def _written(lane: TxLane) -> str:
    return "landed"


_A, _G, _GA, _W, _L = TxState.ASKING, TxState.GRANTED, TxState.GATHERING, TxState.WRITING, TxState.LANDED


def _dup(state: TxState) -> Transition:
    return Transition(_again, {"duplicate": state})


TX_TABLE: dict[TxState, dict[TxIn, Transition]] = {
    _A: {TxIn.GRANT: Transition(_grant, {"granted": _G})},
    _G: {TxIn.GRANT: _dup(_G), TxIn.START: Transition(_start, {"started": _GA})},
    _GA: {TxIn.GRANT: _dup(_GA), TxIn.GATHERED: Transition(_gathered, {"writing": _W})},
    _W: {TxIn.GRANT: _dup(_W), TxIn.WRITTEN: Transition(_written, {"landed": _L})},
    _L: {TxIn.GRANT: _dup(_L)},
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


def lane_heads(src: PoolGeometry, dst: PoolGeometry) -> tuple[int, int]:
    link = find_link(src, dst)
    return (link.head_start, link.num_heads) if link else (0, 0)


Lanes = dict[tuple[int, m.Endpoint], Any]
