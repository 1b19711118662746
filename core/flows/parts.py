"""The lifecycle hooks a rank's flow components implement, so that the room machines call every
component alike instead of naming push, pull or the staged flows.

A flow that keeps per-rank state (the staged flows' ledgers and pools, pull's offers and READs,
push's leases) is a component the room machine composes; what both sides do to every room (is it
quiet, may it go, it failed, it is gone, a peer is lost, time passes) reaches each component
through these hooks. The room machine keeps its components in one fixed order (``parts``) and
calls them in that order, so the commands of a step come out in the same order every run.
Defaults do nothing: a component overrides only what concerns it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvferry.core import messages as m

__all__ = ["RankFlowPart", "earliest"]

RoomKey = tuple[int, str]


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

    def writing(self, r: Any) -> bool:
        """Decode: this component is writing the room's pages (they stay)."""
        return False

    def cut(self, r: Any) -> bool:
        """Decode: a write into the room's pages was cut by a lost peer (only the fence frees)."""
        return False

    # --- told about a room --------------------------------------------------------------------------

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

    def heartbeat(self, peer: m.Endpoint) -> None:
        """A heartbeat goes to ``peer``: anything this component owes it goes along."""

    # --- time ---------------------------------------------------------------------------------------

    def next_deadline(self) -> int | None:
        """The earliest time this component's own clock needs ``tick`` (None: never)."""
        return None

    def tick(self, now: int) -> None:
        """Time is ``now``: this component's own deadlines that passed fire."""


def earliest(times: Iterable[int | None]) -> int | None:
    """The smallest of ``times`` that is set (None if none is)."""
    best: int | None = None
    for t in times:
        if t is not None and (best is None or t < best):
            best = t
    return best
