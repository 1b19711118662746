"""A simulated room's record (what the scheduler and the checkers know of it), a checker's finding,
and the room layout constants every part of the simulated deployment shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from kvferry.core.kvpoll import KVPoll
from kvferry.sim.scenario_schema import RoomSpec

__all__ = ["AUX_ROW_BYTES", "Findings", "Progress", "Request", "RoomTable", "Violation", "split_chunks"]

AUX_ROW_BYTES = 64


@dataclass(slots=True)
class Request:
    key: int
    room: int
    tid: str
    spec: RoomSpec
    chunks: tuple[int, ...]
    arrival_ns: int
    dec_pages: np.ndarray | None = None
    pre_pages: np.ndarray | None = None
    dec_aux: np.ndarray | None = None
    pre_aux: np.ndarray | None = None
    inc: dict[str, int] = field(default_factory=dict)  # incarnation of each node the room was opened on
    status: dict[str, KVPoll] = field(default_factory=dict)
    reason: dict[str, str] = field(default_factory=dict)
    terminal_ns: dict[str, int] = field(default_factory=dict)
    freed: set[str] = field(default_factory=set)  # decode nodes that said FreePages (or died)
    removed: set[str] = field(default_factory=set)  # prefill nodes whose engine dropped the room
    aborted: set[str] = field(default_factory=set)
    dec_released: bool = False
    pre_released: bool = False
    dec_pages_freed: bool = False
    pre_pages_freed: bool = False
    outcome: str = ""  # "success" / "failed" once decode is terminal everywhere
    verified_bad: int = -1
    opened: bool = False
    # Facts for the agreement check. Failure notices (RoomFailed / Abort) per (src, dst, kind):
    # [first sent ns, last sent ns, copies delivered, first delivery ns or -1]; and the nodes
    # whose process died (crash) while the room could still settle (sim/chaos.py).
    notices: dict[tuple[str, str, str], list[int]] = field(default_factory=dict)
    lost_with: set[str] = field(default_factory=set)
    flow: str | None = None  # the room's explicit flow (None: the policy's choice)
    pre_inst: int = 0  # the prefill and decode servers the room runs between (World.servers)
    dec_inst: int = 0
    token_start: int = 0  # decode's prefix hit: tokens [0, token_start) are already in its pages
    success_all_ns: int = -1  # when every rank of both sides was first Success (-1: not yet)

    @property
    def dec_tokens(self) -> int:
        """Tokens decode allocates; differs from ``spec.tokens`` in a length-mismatch room."""
        return self.spec.dec_tokens

    @property
    def mismatched(self) -> bool:
        return self.spec.dec_tokens != self.spec.tokens

    @property
    def done(self) -> bool:
        return self.dec_pages_freed and self.pre_pages_freed


@dataclass(slots=True)
class Violation:
    invariant: str
    detail: str
    t_ns: int
    room: int | None = None


def split_chunks(tokens: int, chunk: int) -> tuple[int, ...]:
    if chunk <= 0 or chunk >= tokens:
        return (tokens,)
    out = [chunk] * (tokens // chunk)
    if tokens % chunk:
        out.append(tokens % chunk)
    return tuple(out)


@dataclass(slots=True)
class RoomTable:
    """Every room of a run, in arrival order (a room's key is its index) and by room id, and the
    rooms released on prefill whose pages wait for an engine still holding the room."""

    requests: list[Request] = field(default_factory=list)
    by_room: dict[int, Request] = field(default_factory=dict)
    awaiting_prefill: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Findings:
    """What the checks found: the violations, the rooms exempt from the agreement check (room key,
    why; sim/checker.py), and the last status each rank incarnation reported per room (what the
    monotonicity checks compare with)."""

    violations: list[Violation] = field(default_factory=list)
    agreement_exempt: list[tuple[int, str]] = field(default_factory=list)
    status_log: dict[tuple[str, int, int, str], KVPoll] = field(default_factory=dict)


@dataclass(slots=True)
class Progress:
    """Where a run stands: its phase ("faults", then "heal", then "liveness"), the rooms that got
    their memory, the instant every room should be done by, and when it went quiet (-1: not yet)."""

    phase: str = "faults"
    rooms_started: int = 0
    deadline_ns: int = 0
    quiesced_ns: int = -1
