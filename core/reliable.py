"""Messages a peer must answer: sent, then resent each heartbeat interval until answered.

One rule for every message whose loss would leave the two sides apart: prefill's ``RoomFailed``
(until ``FailedAck`` or the peer's own failure notice), decode's ``Abort`` (until ``Stopped``) and
decode's ``TransferInfo`` (until ``InfoAck``). Each entry names the peers still owing an answer
and, where the wait is bounded on its own, the time to give up (counted, so runs that gave up are
visible). Sans-IO like the engines: ``start`` and ``fire`` return the messages to send and the
engine sends them; the deadlines live in the engine's heap under ``(kind, key)``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from kvferry.core.deadlines import DeadlineHeap

__all__ = ["Owed", "Resends"]


class Owed:
    """What one entry still owes: the peers, how to build each one's message, when to give up."""

    __slots__ = ("give_up_at", "make", "peers")

    def __init__(self, peers: set[Any], make: Callable[[Any], Any], give_up_at: int | None) -> None:
        self.peers = peers
        self.make = make
        self.give_up_at = give_up_at


class Resends:
    """Entries by key; ``entries`` is a plain dict (empty once everything was answered)."""

    def __init__(
        self,
        kind: str,
        deadlines: DeadlineHeap,
        counters: Counter[str],
        interval_ns: int,
        resent: str,
        gave_up: str = "",
    ) -> None:
        self.kind = kind
        self.deadlines = deadlines
        self.counters = counters
        self.interval_ns = interval_ns
        self.resent, self.gave_up = resent, gave_up
        self.entries: dict[Hashable, Owed] = {}

    def start(
        self,
        key: Hashable,
        peers: Iterable[Any],
        make: Callable[[Any], Any],
        now: int,
        give_up_at: int | None = None,
    ) -> list[tuple[Any, Any]]:
        """Owe ``make(peer)`` to every peer; returns the first copies to send (sorted by peer)."""
        owed = set(peers)
        if not owed:
            return []
        self.entries[key] = Owed(owed, make, give_up_at)
        self.deadlines.set((self.kind, key), now + self.interval_ns)
        return [(p, make(p)) for p in sorted(owed)]

    def answered(self, key: Hashable, peer: Any) -> None:
        e = self.entries.get(key)
        if e is None:
            return
        e.peers.discard(peer)
        if not e.peers:
            self.cancel(key)

    def cancel(self, key: Hashable) -> None:
        if self.entries.pop(key, None) is not None:
            self.deadlines.cancel((self.kind, key))

    def fire(self, key: Hashable, now: int) -> list[tuple[Any, Any]]:
        """The deadline of ``key`` is due: the copies to resend, or none if it gave up."""
        e = self.entries.get(key)
        if e is None:
            return []
        if e.give_up_at is not None and now >= e.give_up_at:
            # A peer silent this long is gone or cut off; the give-up is counted per peer.
            if self.gave_up:
                self.counters[self.gave_up] += len(e.peers)
            del self.entries[key]
            return []
        self.counters[self.resent] += 1
        self.deadlines.set((self.kind, key), now + self.interval_ns)
        return [(p, e.make(p)) for p in sorted(e.peers)]
