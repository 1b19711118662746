"""Decode's watermarks to its staged writers: sent at once only to a writer the new watermark
unblocks, owed to the others (one control message fewer per writer and chunk).

A writer hears decode's watermark for two reasons (core/flows/staged_sender.py):
- a granted ring lane may start only once ``writable(slot, watermark)``: a writer whose grant was
  not writable under the watermark it was last told, and is under the new one, may be waiting for
  it, so it is told now (the pinned pool grants only free space: no pinned lane waits on it);
- the watermark confirms the writer's staged notes (until then it resends them each heartbeat
  interval). That can wait: every ``StagingRsp`` carries the current watermark, and the writer's
  next chunk usually asks within the interval; what is still owed a quarter interval after the
  free leaves as a ``Watermark`` then, three quarters of an interval before the writer's first
  note resend. Decode's heartbeat repeats the watermark to every writer as before (lost ones).

``told`` is the largest watermark sent to each (writer, pool), so a writer holds at least it
once its messages arrive; a writer that may hold less (a lost message) is covered by the heartbeat.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvferry.core import messages as m
from kvferry.core.flows.staged_rx import RxChunk, RxState
from kvferry.core.resources import Watermark, writable

__all__ = ["WatermarkPacer"]

Key = tuple[m.Endpoint, str]  # (writer, "ring" | "pinned")
OWED = ("wm", "owed")  # the deadline key (what never equals a room id: the deadline table is scanned by room)


class WatermarkPacer:
    def __init__(self, ctx: Any, message: Callable[[str], m.Watermark]) -> None:
        self.ctx = ctx
        self.message = message  # pool -> the Watermark message of its current watermark
        self.told: dict[Key, Watermark] = {}
        self.owed: set[Key] = set()

    def sent(self, key: Key, wm: Watermark) -> None:
        """``wm`` (current) left for ``key`` in a StagingRsp or a Watermark: nothing is owed."""
        old = self.told.get(key)
        if old is None or wm > old:
            self.told[key] = wm
        if key in self.owed:
            self.owed.discard(key)
            if not self.owed:  # no wake-up for nothing
                self.ctx.deadlines.cancel(OWED)

    def moved(self, pool: str, wm: Watermark, writers: Iterable[m.Endpoint], live: Iterable[RxChunk]) -> None:
        """The pool's watermark moved to ``wm``: tell the writers it unblocks, owe the rest."""
        waiting = [ch for ch in live if ch.state is RxState.GRANTED] if pool == "ring" else []
        for p in sorted(writers):
            key = (p, pool)
            told = self.told.get(key)
            if any(
                p in ch.offsets
                and p not in ch.notes
                and (told is None or not writable(ch.alloc, told))
                and writable(ch.alloc, wm)
                for ch in waiting
            ):
                self.ctx.send(p, self.message(pool))
                self.sent(key, wm)
            else:
                self.owed.add(key)
        if self.owed and OWED not in self.ctx.deadlines:
            self.ctx.deadlines.set(OWED, self.ctx.now() + self.ctx.timeouts.heartbeat_interval_ns // 4)

    def fire(self, wm_of: Callable[[str], Watermark]) -> None:
        """The owed deadline: every watermark still owed leaves now (sorted)."""
        for p, pool in sorted(self.owed):
            self.ctx.send(p, self.message(pool))
            self.told[(p, pool)] = max(self.told.get((p, pool), Watermark(0, 0)), wm_of(pool))
        self.owed.clear()

    def forget(self, peer: m.Endpoint) -> None:
        """A writer lost or restarted: what it was told means nothing to its next incarnation."""
        for pool in ("ring", "pinned"):
            self.told.pop((peer, pool), None)
            self.owed.discard((peer, pool))
