"""Decode side of the staged flows (``ring``, ``pinned``): one ledger entry per (room, chunk).

A chunk's space is allocated on the first StagingReq of any of its writers and shared by all of
them, each at its own offset (ring: per-writer blocks packed in sender order, SGLang PR 22536's layer-major
format; pinned: the rank's head-major buffer, each writer at its heads). The entry goes
WAITING_SPACE (pinned pool full; ring space is handed out at once) -> GRANTED (writers writing)
-> LANDED (every writer's note is in) -> SCATTERING -> DONE (scattered into the room's pages; the
space is freed at once, since no writer of it is left). The room machine (``core.receiver``)
records the chunk only at DONE: Success means scattered, not merely written.
"""

from __future__ import annotations

from typing import Any

from kvferry.core import messages as m
from kvferry.core.flows.policy import Flow
from kvferry.core.identity_enum import IdentityEnum
from kvferry.core.machine import Transition

__all__ = ["RX_TABLE", "RxChunk", "RxIn", "RxState"]


class RxState(IdentityEnum):
    WAITING_SPACE = "waiting_space"
    GRANTED = "granted"
    LANDED = "landed"
    SCATTERING = "scattering"
    DONE = "done"


class RxIn(IdentityEnum):
    ALLOCATED = "allocated"
    NOTE = "note"
    START = "start"
    SCATTERED = "scattered"


class RxChunk:
    __slots__ = (
        "alloc",
        "flow",
        "index",
        "notes",
        "offsets",
        "op_id",
        "seq",
        "state",
        "token_end",
        "token_start",
        "writers",
    )

    def __init__(
        self, index: int, token_start: int, token_end: int, flow: Flow, writers: tuple[m.Endpoint, ...]
    ):
        self.index = index
        self.token_start = token_start
        self.token_end = token_end
        self.flow = flow
        self.writers = writers
        self.state = RxState.WAITING_SPACE
        self.alloc: Any = None  # resources.RingSlot or resources.Reservation
        self.offsets: dict[m.Endpoint, int] = {}  # writer -> its block's offset in the staging region
        self.notes: dict[m.Endpoint, m.ChunkNote] = {}
        self.op_id = -1
        self.seq = 0  # pinned: grant sequence number (what the pinned watermark counts)

    @property
    def alloc_id(self) -> int:
        return self.alloc.alloc_id if self.flow is Flow.RING else self.alloc.res_id


def _allocated(ch: RxChunk, alloc: Any, offsets: dict[m.Endpoint, int]) -> str:
    ch.alloc, ch.offsets = alloc, offsets
    return "granted"


def _note(ch: RxChunk, note: m.ChunkNote) -> str:
    if note.src in ch.notes:
        return "duplicate"
    ch.notes[note.src] = note
    return "landed" if len(ch.notes) == len(ch.writers) else "more"


def _start(ch: RxChunk, op_id: int) -> str:
    ch.op_id = op_id
    return "started"


def _scattered(ch: RxChunk) -> str:
    return "done"


def _late_note(ch: RxChunk, note: m.ChunkNote) -> str:
    return "duplicate"


_WS, _G, _L, _S, _D = RxState.WAITING_SPACE, RxState.GRANTED, RxState.LANDED, RxState.SCATTERING, RxState.DONE

RX_TABLE: dict[RxState, dict[RxIn, Transition]] = {
    _WS: {RxIn.ALLOCATED: Transition(_allocated, {"granted": _G})},
    _G: {RxIn.NOTE: Transition(_note, {"more": _G, "landed": _L, "duplicate": _G})},
    _L: {
        RxIn.NOTE: Transition(_late_note, {"duplicate": _L}),
        RxIn.START: Transition(_start, {"started": _S}),
    },
    _S: {
        RxIn.NOTE: Transition(_late_note, {"duplicate": _S}),
        RxIn.SCATTERED: Transition(_scattered, {"done": _D}),
    },
    _D: {RxIn.NOTE: Transition(_late_note, {"duplicate": _D})},
}
