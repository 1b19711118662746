"""The lifecycle hooks a rank's flow components implement, so that the room machines call every
component alike instead of naming push, pull or the staged flows.

A flow that keeps per-rank state (the staged flows' ledgers and pools, pull's offers and READs,
push's leases) is a component the room machine composes; what both sides do to every room (is it
quiet, may it go, it failed, it is gone, a peer is lost, time passes) reaches each component
through these hooks. The room machine keeps its components in one fixed order (``parts``) and
calls them in that order, so the commands of a step come out in the same order every run.
Defaults do nothing: a component overrides only what concerns it.

Messages, completions, deadlines and room inputs a flow owns are routed the same way: a component
lists the control message and executor completion types it handles (``routes``), the kinds of
deadline it arms in the rank's heap (``deadline_kinds``) and its own room inputs with their table
(``table``, keyed by the room's status); the room machine looks the handler up by type, kind or
input and names none of them. A component's input reaches the room through ``ctx.flow_input``,
and runs on the room machine's own table engine (core/machine.py): held commands, the failure
funnel, the same counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

from kvferry.core import messages as m
from kvferry.core.events import CopyFailed
from kvferry.core.kvpoll import KVPoll
from kvferry.core.machine import Transition

__all__ = ["FlowTable", "RankFlowPart", "earliest", "ignore", "ignore_failed"]

RoomKey = tuple[int, str]

# A component's own room inputs: the room's status -> input -> Transition. The handler is the
# component's (called with the component, the room, the input and its payload); ``next`` maps each
# outcome to the status the room moves to. The room machine adds these rows to its own table (a
# status is one room state on either side), so a pair absent here fails the room like any other.
FlowTable = Mapping[KVPoll, Mapping[Enum, Transition]]


def ignore(part: Any, r: Any, inp: Enum, payload: Any) -> str:
    """A flow input a room in this status takes without effect (counted: ``ignored_<input>``)."""
    part.ctx.count(f"ignored_{inp.value}")
    return "stay"


def ignore_failed(part: Any, r: Any, inp: Enum, payload: Any) -> str:
    """A flow input a failed room absorbs (counted: ``ignored_failed_<input>``)."""
    part.ctx.count(f"ignored_failed_{inp.value}")
    return "stay"


class RankFlowPart:
    """One flow component of a rank, as the room machine sees it (all hooks optional)."""

    __slots__ = ()

    # --- asked of a room (no side effects) --------------------------------------------------------

    def quiet(self, key: RoomKey) -> bool:
        """Prefill: nothing of the room's is in flight in this component (it may succeed)."""
        return True

    def fenced(self, key: RoomKey) -> bool:
        """Prefill: nothing of this component may still touch a failed room's memory (it may go)."""
        return True

    def blocked(self, key: RoomKey) -> str:
        """Prefill: why the room waits on this component ("" if it does not): for a timeout's
        reason."""
        return ""

    def writing(self, r: Any) -> bool:
        """Decode: this component is writing the room's pages (they stay, and the room is not
        Success yet)."""
        return False

    def note_receiver(self, r: Any, note: m.ChunkNote) -> Any:
        """Decode: the flow's decode half (``FlowReceiver``) that takes a data note naming a
        staging allocation, if this component gave that space (None: not this component's)."""
        return None

    def cut(self, r: Any) -> bool:
        """Decode: a write into the room's pages was cut by a lost peer (only the fence frees)."""
        return False

    # --- what it owns -------------------------------------------------------------------------------

    def routes(self) -> Mapping[type, Callable[[Any], None]]:
        """The control message types and executor completions (a copy or a READ by id) this
        component handles, each with its handler."""
        return {}

    def table(self) -> FlowTable:
        """This component's own room inputs and what a room does with each in each status."""
        return {}

    def deadline_kinds(self) -> Mapping[str, Callable[[Any], None]]:
        """The kinds of deadline this component arms in the rank's heap, each with its handler
        (given the deadline's key without its kind)."""
        return {}

    # --- told about a room --------------------------------------------------------------------------

    def write_finished(self, r: Any, write_id: int, ok: bool) -> None:
        """Prefill: one of the room's writes completed (``ok``) or failed; a write id belongs
        to at most one component."""

    def withdrawn(self, r: Any, command: Any) -> None:
        """A command of the room's step that the table refused never left: if it is this
        component's (a gather, a scatter, a READ), what it reserved goes back."""

    def room_unknown(self, peer: m.Endpoint, room: int, tid: str) -> None:
        """Decode: ``peer``'s RoomFailed names a room that is not live here (released, or never
        known)."""

    def opened(self, r: Any) -> None:
        """The room was opened locally. Prefill: its flow, if asked for, is known now (a
        TransferInfo may have come first); decode: its senders were told (what a component held
        for the room before it opened goes to it now)."""

    def transfer_info(self, r: Any, info: m.TransferInfo) -> None:
        """Prefill: a decode rank's TransferInfo for the room (its pages) is known: at the open
        for those that came before it, then as each arrives."""

    def computed(self, r: Any, parked: bool) -> None:
        """Prefill: the room's first chunk is computed and handed to its worker (``parked``: it
        waited for the room to be ready)."""

    def heard_from(self, r: Any, peer: m.Endpoint) -> None:
        """Prefill: decode rank ``peer``'s heartbeat named the room (it still waits for it)."""

    def room_failed(self, r: Any) -> None:
        """The room failed: nothing not yet started starts, nothing is asked again."""

    def settle(self, r: Any) -> None:
        """Decode: a failed room is looked at again (something of it may have drained)."""

    def reclaim(self, r: Any) -> None:
        """Decode: a failed room's pages go back: so does what this component holds for it."""

    def forget(self, r: Any) -> None:
        """The room is removed: its entries go."""

    # --- told about a peer ----------------------------------------------------------------------------

    def peer_lost(self, peer: m.Endpoint, rooms: Sequence[Any]) -> None:
        """``peer`` is gone (lost or restarted); ``rooms``: the live rooms it served."""

    def peer_replaced(self, r: Any, peer: m.Endpoint) -> None:
        """Prefill: the room's decode rank ``peer`` restarted; what it did for the room died with it."""

    def asked_again(self, r: Any, peer: m.Endpoint) -> bool:
        """Decode: ``peer`` repeats a failed room's RoomFailed (it still holds pages this
        component may be using): True if this component answered it."""
        return False

    def heartbeat(self, peer: m.Endpoint) -> None:
        """A heartbeat goes to ``peer``: anything this component owes it goes along."""

    # --- time ---------------------------------------------------------------------------------------

    def next_deadline(self) -> int | None:
        """The earliest time this component's own clock needs ``tick`` (None: never)."""
        return None

    def tick(self, now: int) -> None:
        """Time is ``now``: this component's own deadlines that passed fire."""


def route_copy(part: Any, ev: Any, finished: Callable[[Any, int], None], done: Enum, failed: Enum) -> None:
    """A staged half's gather or scatter completed (CopyDone/CopyFailed, by op id): ``finished``
    accounts for it in whatever state the room is, before the room's table hears ``done`` or
    ``failed``; an op id the half never issued is counted and dropped."""
    key = part.ops.pop(ev.op_id, None)
    if key is None:
        part.counters["unknown_op"] += 1
        return
    r = part.ctx.room(key[0])
    if r is not None and r.tid == key[1]:
        finished(r, ev.op_id)
    part.ctx.flow_input(key[0], key[1], failed if type(ev) is CopyFailed else done, ev)


def earliest(times: Iterable[int | None]) -> int | None:
    """The smallest of ``times`` that is set (None if none is)."""
    best: int | None = None
    for t in times:
        if t is not None and (best is None or t < best):
            best = t
    return best
