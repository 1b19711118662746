"""Admission of arriving requests to memory, as a real scheduler does it: first come, first served
per (prefill server, decode server) pair, so a request waits only behind requests that need the
same servers' memory; the head of each line waits until enough is free for it.

``World._request`` takes a ticket for its lane, waits for its turn, then waits on ``changed``
(fired by ``memory_freed``) until its pages and aux rows fit; ``admitted`` hands the turn on.
"""

from __future__ import annotations

import simpy

__all__ = ["Admission"]

Lane = tuple[int, int]  # (prefill server, decode server)


class Admission:
    """The tickets of every lane and the event the head of each line waits on for memory."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self._next: dict[Lane, int] = {}  # the ticket the next arrival of a lane gets
        self._now: dict[Lane, int] = {}  # the ticket whose turn it is
        self._turns: dict[tuple[Lane, int], simpy.Event] = {}
        self.changed = env.event()

    def ticket(self, lane: Lane) -> simpy.Event | None:
        """A ticket for ``lane``: None if it is this arrival's turn now, else the event of its turn."""
        ticket = self._next.get(lane, 0)
        self._next[lane] = ticket + 1
        if ticket == self._now.get(lane, 0):
            return None
        ev = self._turns[lane, ticket] = self.env.event()
        return ev

    def admitted(self, lane: Lane) -> None:
        """The head of ``lane`` got its memory: the next ticket's turn."""
        self._now[lane] = turn = self._now.get(lane, 0) + 1
        nxt = self._turns.pop((lane, turn), None)
        if nxt is not None:
            nxt.succeed()

    def memory_freed(self) -> None:
        """Wake the requests waiting for memory (their tickets keep the admission order).

        With none waiting, ``changed`` stays as it is: firing it would be a SimPy step that
        resumes nobody (two a room), and a later waiter finds the same untriggered event a fresh
        one would be. Skipping it takes no event id, so every other event keeps its order."""
        if not self.changed.callbacks:
            return
        ev, self.changed = self.changed, self.env.event()
        ev.succeed()
