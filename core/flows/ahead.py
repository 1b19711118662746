"""Chunks planned ahead of their compute: the direct flow's writes made ready before the chunk is.

The scheduler may name a chunk's pages and token range before computing it (``ChunkAhead``: it
allocated them). Once the room is ready (every TransferInfo in, its flow direct) the chunk is
planned at once: one ``PrepareWrite`` per decode rank with bytes to receive, carrying the
descriptors and the chunk's note (and for the last chunk a ``PrepareAuxWrite`` per aux row), so
the executor checks them and makes each transfer ready (the native engine makes NIXL's request
then) while the chunk computes. When the chunk is handed over
(``ChunkReady``) and runs, a plan that matches it exactly (the same index, pages, token range and
last flag, the same start, the same decode registrations) is posted as it is (``PostPrepared``):
no planning, no checks, no descriptor work between "chunk ready" and the post.

A shortcut, never a second rule: the run still goes through the room's checks (the flow's
``chunk_bounds``, its bookkeeping, its last-chunk notes); any difference drops the prepared writes
(``DropPrepared``) and the chunk is planned as ever; a plan the planner refuses is not made (the
run reports the error, failing the room the usual way). A chunk is planned ahead only while it
is the next one the scheduler hands over (its start is then known: where the chunks handed over
so far end); a room keeps the plans of several chunks, and gives them back when it goes away.

A flow that does not plan ahead may still work ahead on a named chunk: the staged flows (ring,
pinned) ask decode for its staging space as soon as it is named (the flow half's
``named_ahead``; their later prefetches read ``ctx.named_ahead`` too), not when it is handed
over, so the chunk's run finds its space granted; the flow half's ``ready_ahead`` then says so,
and the chunk is handed over as prepared (the native runtime steps it, launching its gathers, on
the caller's thread). Decode holds the space for the named token range: a staged chunk handed
over with another range fails its room.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from kvferry.core.commands import DropPrepared, PrepareAuxWrite
from kvferry.core.events import ChunkAhead, ChunkReady
from kvferry.core.flows import registry
from kvferry.core.flows.direct import prepare_command
from kvferry.core.worker import plan_chunk

__all__ = ["AheadPlan", "AheadPlans"]


class AheadPlan:
    """One chunk's writes, prepared: what its ChunkReady must carry for them to be posted."""

    __slots__ = ("aux", "chunk", "end", "note", "peers", "start", "writes")

    def __init__(
        self,
        chunk: ChunkReady,
        start: int,
        end: int,
        peers: tuple[Any, ...],
        writes: tuple[tuple[Any, int], ...],
        note: bytes,
        aux: dict[Any, int],
    ) -> None:
        self.chunk = chunk
        self.start, self.end = start, end
        self.peers = peers  # the decode ranks' registration records the plan used (by identity)
        self.writes = writes  # (decode rank, prep id); prep id 0: nothing to move, a bare note
        self.note = note
        self.aux = aux  # the last chunk's aux row writes: decode rank -> prep id

    def prep_ids(self) -> list[int]:
        return [pid for _, pid in self.writes if pid] + list(self.aux.values())

    def matches(self, c: ChunkReady, start: int, end: int, peers: tuple[Any, ...]) -> bool:
        a = self.chunk
        return (
            a.token_end == c.token_end
            and a.is_last == c.is_last
            and (self.start, self.end) == (start, end)
            and len(peers) == len(self.peers)
            and all(x is y for x, y in zip(peers, self.peers, strict=True))
            and np.array_equal(np.asarray(a.src_pages), np.asarray(c.src_pages))
        )


class AheadPlans:
    """Per prefill rank: the chunks named ahead (waiting for their room to be ready) and the plans
    made of them, by room key. ``ctx`` is the rank's ``SenderFlowContext``."""

    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        # By room key, then chunk index: named and waiting for the room to be ready; planned.
        self.named: dict[tuple[int, str], dict[int, ChunkAhead]] = {}
        self.plans: dict[tuple[int, str], dict[int, AheadPlan]] = {}
        self._next_prep = 1

    def name(self, ctx: Any, r: Any, ev: ChunkAhead) -> None:
        """The scheduler named a chunk ahead: plan it now if the room is ready, else once it is."""
        if ev.chunk_index != r.next_enqueue:
            self.counters["ahead_not_next_chunk"] += 1
            return
        old = self.plans.get(r.key, {}).pop(ev.chunk_index, None)  # named again: the last wins
        if old is not None:
            self._give_back(ctx, r.room, old)
        named = self.named.setdefault(r.key, {})
        for i in [i for i in named if i < ev.chunk_index]:  # handed over since (a flow not planning)
            del named[i]
        named[ev.chunk_index] = ev
        self.plan(ctx, r)
        if r.key in self.named and r.flow is not None:  # not planned: its flow may work ahead
            named_ahead = getattr(registry.halves(r.flow).sender, "named_ahead", None)
            if named_ahead is not None:
                named_ahead(ctx, r)

    def plan(self, ctx: Any, r: Any) -> None:
        """Plan the room's named chunks if the room can take them now (ready, direct)."""
        named = self.named.get(r.key)
        if not named or not ctx.plans_ahead(r):
            return
        del self.named[r.key]
        for ev in named.values():
            self._plan_one(ctx, r, ev)

    def _plan_one(self, ctx: Any, r: Any, ev: ChunkAhead) -> None:
        if ev.chunk_index != r.next_enqueue:  # handed over meanwhile: planned when it runs
            self.counters["ahead_not_next_chunk"] += 1
            return
        start, end = max(r.enqueue_end, r.token_start), max(int(ev.token_end), r.token_start)
        if end < start or end > r.num_tokens or (ev.is_last and end != r.num_tokens):
            self.counters["ahead_out_of_range"] += 1  # the run raises the room's own error
            return
        c = ChunkReady(
            room=ev.room,
            transfer_id=ev.transfer_id,
            chunk_index=ev.chunk_index,
            token_end=ev.token_end,
            src_pages=ev.src_pages,
            is_last=ev.is_last,
        )
        try:
            writes = plan_chunk(ctx.planner, ctx.pool, c.src_pages, ctx.destinations(r), start, end)
        except Exception:  # the run plans again and fails the room with the planner's reason
            self.counters["ahead_unplannable"] += 1
            return
        note = ctx.chunk_note(r, c, start, end)
        made: list[tuple[Any, int]] = []
        for w in writes:
            if not len(w.length):
                made.append((w.peer, 0))
                continue
            pid = self._next_prep
            self._next_prep += 1
            ctx.emit(prepare_command(pid, r.room, w, note))
            made.append((w.peer, pid))
        aux: dict[Any, int] = {}
        if ev.is_last:  # the aux row's write rides after the last chunk's (the flow's finish_run)
            aux_note = ctx.chunk_note(r, c, start, end, aux=True)
            for p, info in ctx.infos_sorted(r):
                if info.send_aux:
                    aux[p] = pid = self._next_prep
                    self._next_prep += 1
                    ctx.emit(
                        PrepareAuxWrite(
                            prep_id=pid,
                            peer=p,
                            room=r.room,
                            src_aux_index=r.aux_index,
                            dst_aux_index=info.aux_index,
                            notif=aux_note,
                        )
                    )
        plan = AheadPlan(c, start, end, ctx.decode_peers(r), tuple(made), note, aux)
        self.plans.setdefault(r.key, {})[ev.chunk_index] = plan
        self.counters["ahead_planned"] += 1

    def take(self, ctx: Any, r: Any, c: ChunkReady, start: int, end: int) -> AheadPlan | None:
        """The plan of the chunk about to run, if it matches the chunk exactly; a plan that does
        not is given back (the chunk is planned as ever)."""
        plans = self.plans.get(r.key)
        p = None if plans is None else plans.pop(c.chunk_index, None)
        if p is None:
            return None
        if not plans:
            del self.plans[r.key]
        if p.matches(c, start, end, ctx.decode_peers(r)):
            self.counters["ahead_posted"] += 1
            return p
        self.counters["ahead_mismatch"] += 1
        self._give_back(ctx, r.room, p)
        return None

    def forget(self, ctx: Any, key: tuple[int, str]) -> None:
        """The room goes: its named chunks and prepared writes go too."""
        self.named.pop(key, None)
        for p in self.plans.pop(key, {}).values():
            self._give_back(ctx, key[0], p)

    def _give_back(self, ctx: Any, room: int, p: AheadPlan) -> None:
        for pid in p.prep_ids():
            ctx.emit(DropPrepared(prep_id=pid, room=room))

    def ready(self, ctx: Any, r: Any, c: ChunkReady) -> bool:
        """The chunk just handed over runs from what was made ready ahead: a plan of it (whether
        it matches is checked when it runs), or its flow half says so (``ready_ahead``: a staged
        chunk's space granted)."""
        if c.chunk_index in self.plans.get(r.key, ()):
            return True
        if r.flow is None:
            return False
        ready_ahead = getattr(registry.halves(r.flow).sender, "ready_ahead", None)
        return ready_ahead is not None and bool(ready_ahead(ctx, r, c))

    def mentions(self, room: int) -> bool:
        return any(k[0] == room for k in (*self.named, *self.plans))

    def size(self) -> int:
        return sum(map(len, self.named.values())) + sum(map(len, self.plans.values()))
