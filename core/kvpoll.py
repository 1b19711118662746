"""KVPoll: the status of one room on one side, and the rules for combining and moving it.

The numeric order is the contract (docs/design.md section 1): across the TP ranks of one server the
room's status is the MIN over ranks, so one Failed rank fails the room and Success needs every
rank. A status only moves up; Failed overrides everything and sticks.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum

__all__ = ["KVPoll", "advance", "is_terminal", "min_status"]


class KVPoll(IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def advance(current: KVPoll, proposed: KVPoll) -> KVPoll:
    """The status after proposing ``proposed`` while at ``current``.

    Failed is absorbing and overrides anything; otherwise the status never goes down (a late
    "Transferring" after Success is simply not a move).
    """
    if current is KVPoll.Failed or proposed is KVPoll.Failed:
        return KVPoll.Failed
    return proposed if proposed > current else current


def min_status(statuses: Iterable[KVPoll]) -> KVPoll:
    """The room's status across TP ranks: the minimum. An empty view is a caller bug."""
    result: KVPoll | None = None
    for s in statuses:
        if result is None or s < result:
            result = s
    if result is None:
        raise ValueError("min_status of no ranks")
    return KVPoll(result)


def is_terminal(status: KVPoll) -> bool:
    return status is KVPoll.Failed or status is KVPoll.Success
