"""Chunks planned ahead (core/flows/ahead.py): a chunk named before it is computed (ChunkAhead) is
planned once the room is ready (PrepareWrite) and its run posts what was prepared (PostPrepared).

The property: whatever is named ahead (the right pages, other pages, another range, before or
after decode's TransferInfo), the writes that leave, resolved through a reference executor that
remembers each PrepareWrite, are exactly those of the same room run without any ChunkAhead, and
every prepared write is posted or given back (never both) by the time the room is released.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.core.commands import (
    DropPrepared,
    EnqueueChunk,
    PostAuxWrite,
    PostPrepared,
    PostWrite,
    PrepareAuxWrite,
    PrepareWrite,
    SendNotif,
)
from kvferry.core.events import AbortRoom, ChunkAhead, ReleaseRoom, SenderOpen, WriteDone
from kvferry.core.sender import SenderEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sender import D0, ME, PAGES, ROOM, SRC, TID, T, chunk, ctl, info, register


def engine() -> SenderEngine:
    return SenderEngine(ME, SRC, timeouts=T)


def ahead(i: int, end: int, pages: Any = PAGES) -> ChunkAhead:
    return ChunkAhead(
        room=ROOM, transfer_id=TID, chunk_index=i, token_end=end, src_pages=pages, is_last=end == 6
    )


class Executor:
    """The reference executor's view of the contract: PrepareWrite remembered, PostPrepared posted
    as the PostWrite it remembered, DropPrepared forgotten; every write that leaves is recorded."""

    def __init__(self) -> None:
        self.prepared: dict[int, Any] = {}
        self.dropped: set[int] = set()
        self.writes: list[tuple[Any, ...]] = []
        self.ids: list[int] = []
        self.errors: list[str] = []

    def run(self, cmds: list[Any]) -> list[Any]:
        chunks = []
        for c in cmds:
            t = type(c)
            if t is PrepareWrite or t is PrepareAuxWrite:
                if c.prep_id in self.prepared:
                    self.errors.append(f"prep id {c.prep_id} prepared twice")
                self.prepared[c.prep_id] = c
            elif t is DropPrepared:  # of an id gone already: nothing to do (the contract)
                self.prepared.pop(c.prep_id, None)
                self.dropped.add(c.prep_id)
            elif t is PostPrepared:
                p = self.prepared.pop(c.prep_id, None)
                if p is None or c.prep_id in self.dropped:
                    self.errors.append(f"post of unknown or dropped prep id {c.prep_id}")
                    continue
                if type(p) is PrepareAuxWrite:
                    self._aux(c.write_id, p)
                else:
                    self._record(c.write_id, p)
            elif t is PostWrite:
                self._record(c.write_id, c)
            elif t is PostAuxWrite:
                self._aux(c.write_id, c)
            elif t is SendNotif:
                self.writes.append(("notif", c.peer, c.notif))
            elif t is EnqueueChunk:
                chunks.append(c)
        return chunks

    def _aux(self, write_id: int, w: Any) -> None:
        self.ids.append(write_id)
        self.writes.append(("aux", w.peer, w.src_aux_index, w.dst_aux_index, w.notif))

    def _record(self, write_id: int, w: Any) -> None:
        self.ids.append(write_id)
        descs = tuple(
            tuple(np.asarray(a).tolist())
            for a in (w.src_region, w.src_offset, w.dst_region, w.dst_offset, w.length)
        )
        self.writes.append(("write", w.peer, descs, w.notif))


Named = dict[int, tuple[int, int]]


def drive(
    e: SenderEngine, x: Executor, cuts: list[int], named: dict[int, tuple[int, int]], info_after: int
) -> None:
    """Open, register, TransferInfo (after chunk ``info_after`` was named, -1: first), then every
    chunk; ``named[i]`` = (token_end, page shift) of chunk i's ChunkAhead, sent just before chunk
    i-1's ChunkReady is run (chunk 0's: before the TransferInfo, if info_after >= 0)."""
    now = 0
    x.run(e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), now))
    x.run(e.handle(ctl(register(D0)), now))

    def name(i: int) -> None:
        if i in named:
            end, shift = named[i]
            x.run(e.handle(ahead(i, end, PAGES + shift), now))

    if info_after >= 0:
        name(0)
    x.run(e.handle(ctl(info(num_tokens=6)), now))
    if info_after < 0:
        name(0)
    for i, end in enumerate(cuts):
        for q in x.run(e.handle(chunk(i, end, i == len(cuts) - 1), now)):
            name(i + 1)  # the next chunk's pages, known while this one runs
            x.run(e.run_chunk(q.chunk, now))
    for wid in list(x.ids):
        x.run(e.handle(WriteDone(write_id=wid), now))
    x.run(e.handle(ReleaseRoom(room=ROOM, transfer_id=TID), now))


@st.composite
def schedules(draw: Any) -> tuple[list[int], dict[int, tuple[int, int]], int]:
    n = draw(st.integers(1, 3))
    inner = sorted(draw(st.sets(st.integers(1, 5), min_size=n - 1, max_size=n - 1)))
    cuts = [*inner, 6]
    named = {}
    for i, end in enumerate(cuts):
        kind = draw(st.sampled_from(["none", "same", "other_end", "other_pages"]))
        if kind == "same":
            named[i] = (end, 0)
        elif kind == "other_end":
            named[i] = (draw(st.integers(0, 6).filter(lambda v, end=end: v != end)), 0)
        elif kind == "other_pages":
            named[i] = (end, draw(st.integers(1, 3)))
    return cuts, named, draw(st.sampled_from([-1, 0]))


def same_as_plain(cuts: list[int], named: Named, info_after: int) -> SenderEngine:
    plain, planned = Executor(), Executor()
    e_plain, e_ahead = engine(), engine()
    drive(e_plain, plain, cuts, {}, info_after)
    drive(e_ahead, planned, cuts, named, info_after)
    assert planned.errors == []
    assert planned.writes == plain.writes
    assert planned.prepared == {}, "a prepared write was neither posted nor given back"
    assert e_ahead.table_sizes() == e_plain.table_sizes()
    assert e_ahead.counters["internal_error"] == 0
    return e_ahead


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_ahead_moves_exactly_what_the_plain_run_moves(schedule: Any) -> None:
    same_as_plain(*schedule)


def test_every_kind_of_ahead_is_exercised() -> None:
    e = same_as_plain([2, 4, 6], {0: (2, 0), 1: (4, 2), 2: (5, 0)}, -1)
    assert (e.counters["ahead_posted"], e.counters["ahead_mismatch"]) == (1, 2)
    e = same_as_plain([6], {0: (6, 0)}, 0)  # named before decode's TransferInfo
    assert e.counters["ahead_posted"] == 1


def test_planted_plan_that_ignores_the_pages_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan posted for a chunk whose pages moved sends bytes from the wrong pages: caught."""
    from kvferry.core.flows import ahead as module

    def matches(self: Any, c: Any, start: int, end: int, peers: Any) -> bool:
        return (self.start, self.end) == (start, end) and self.chunk.is_last == c.is_last

    monkeypatch.setattr(module.AheadPlan, "matches", matches)
    with pytest.raises(AssertionError):
        same_as_plain([6], {0: (6, 1)}, -1)


def test_a_named_chunk_is_prepared_at_transfer_info_and_only_posted_when_it_runs() -> None:
    e, x = engine(), Executor()
    x.run(e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0))
    x.run(e.handle(ctl(register(D0)), 0))
    assert not any(type(c) is PrepareWrite for c in e.handle(ahead(0, 6), 0))  # decode's pages unknown yet
    cmds = e.handle(ctl(info(num_tokens=6)), 0)
    prepared = [c for c in cmds if type(c) is PrepareWrite]
    assert len(prepared) == 1 and prepared[0].peer == D0
    aux = [c for c in cmds if type(c) is PrepareAuxWrite]  # the last chunk: its aux row's write too
    assert [(c.peer, c.src_aux_index, c.dst_aux_index) for c in aux] == [(D0, 1, 2)]
    x.run(cmds)
    (q,) = x.run(e.handle(chunk(0, 6, True), 0))
    assert q.prepared
    run = e.run_chunk(q.chunk, 0)
    posts = [c for c in run if type(c) in (PostWrite, PostAuxWrite, PostPrepared)]
    assert [(type(c), c.prep_id) for c in posts] == [
        (PostPrepared, prepared[0].prep_id),
        (PostPrepared, aux[0].prep_id),
    ]
    assert e.counters["ahead_posted"] == 1


def test_a_chunk_that_differs_gives_its_prepared_writes_back_and_is_planned_as_ever() -> None:
    e, x = engine(), Executor()
    x.run(e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0))
    x.run(e.handle(ctl(register(D0)), 0))
    x.run(e.handle(ctl(info(num_tokens=6)), 0))
    x.run(e.handle(ahead(0, 6, PAGES + 1), 0))
    (q,) = x.run(e.handle(chunk(0, 6, True), 0))
    kinds = [type(c) for c in e.run_chunk(q.chunk, 0)]
    assert DropPrepared in kinds and PostWrite in kinds and PostPrepared not in kinds
    assert e.counters["ahead_mismatch"] == 1


def test_a_released_room_gives_its_prepared_writes_back() -> None:
    e, x = engine(), Executor()
    x.run(e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0))
    x.run(e.handle(ctl(register(D0)), 0))
    x.run(e.handle(ctl(info(num_tokens=6)), 0))
    x.run(e.handle(ahead(0, 6), 0))
    assert x.prepared and e.table_sizes()["ahead"] == 1
    x.run(e.handle(AbortRoom(room=ROOM, transfer_id=TID, reason="test"), 0))
    x.run(e.handle(ReleaseRoom(room=ROOM, transfer_id=TID), 0))
    assert x.prepared == {} and x.errors == []
    assert e.table_sizes()["ahead"] == 0


class _PlainTransport:
    """A transport that cannot prepare (as the simulated fabric): posts are recorded, done at once."""

    def __init__(self) -> None:
        self.posted: list[tuple[Any, ...]] = []

    def post_write(self, peer: Any, sr: Any, so: Any, dr: Any, do: Any, ln: Any, notif: bytes) -> int:
        self.posted.append((peer, tuple(sr), tuple(so), tuple(dr), tuple(do), tuple(ln), notif))
        return len(self.posted)

    def post_aux_write(self, peer: Any, src: int, dst: int, notif: bytes) -> int:
        self.posted.append((peer, src, dst, notif))
        return len(self.posted)

    def check_xfer(self, handle: Any) -> Any:
        from kvferry.backends.transport import XferState

        return XferState.DONE

    def release_xfer(self, handle: Any) -> None:
        pass

    def settled_handles(self) -> None:
        return None


def test_a_driver_over_a_transport_that_cannot_prepare_posts_what_was_remembered() -> None:
    """The reference executor's fallback (the simulator's path): PrepareWrite remembered,
    PostPrepared posted as that PostWrite, DropPrepared forgotten, an unknown id a WriteFailed."""
    from kvferry.backends.driver import Driver
    from kvferry.core.events import WriteFailed

    class Script:
        def __init__(self) -> None:
            self.heard: list[Any] = []

        def handle(self, ev: Any, now: int) -> list[Any]:
            if isinstance(ev, list):
                return ev
            self.heard.append(ev)
            return []

        def next_deadline(self) -> None:
            return None

    arr = np.array([1], dtype=np.int64)
    prep = {k: arr for k in ("src_region", "src_offset", "dst_region", "dst_offset", "length")}
    t, core = _PlainTransport(), Script()
    d = Driver(core, t)
    d.feed([PrepareWrite(prep_id=1, peer=D0, room=ROOM, notif=b"a", **prep)], 0)
    d.feed([PrepareWrite(prep_id=2, peer=D0, room=ROOM, notif=b"b", **prep)], 0)
    assert t.posted == []  # nothing moves at preparation
    d.feed([DropPrepared(prep_id=2, room=ROOM), PostPrepared(prep_id=1, write_id=10, peer=D0, room=ROOM)], 0)
    d.feed([PostPrepared(prep_id=2, write_id=11, peer=D0, room=ROOM)], 0)
    d.feed([PrepareAuxWrite(prep_id=3, peer=D0, room=ROOM, src_aux_index=1, dst_aux_index=2, notif=b"x")], 0)
    d.feed([PostPrepared(prep_id=3, write_id=12, peer=D0, room=ROOM)], 0)
    d.poll_writes(0)
    assert [p[-1] for p in t.posted] == [b"a", b"x"] and t.posted[1][:3] == (D0, 1, 2)
    assert [(type(e), e.write_id) for e in core.heard] == [
        (WriteFailed, 11),
        (WriteDone, 10),
        (WriteDone, 12),
    ]
    assert d.prepared == {}


def test_a_step_that_fails_after_taking_its_plan_gives_every_prepared_write_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run of a prepared chunk fails midway (the last chunk's finish, after the data post was
    emitted): the room fails, and the data and aux writes prepared for it are all given back."""
    e, x = engine(), Executor()
    x.run(e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0))
    x.run(e.handle(ctl(register(D0)), 0))
    x.run(e.handle(ctl(info(num_tokens=6)), 0))
    x.run(e.handle(ahead(0, 6), 0))
    assert len(x.prepared) == 2  # the data write and the aux row's

    def broken(*args: Any, **kw: Any) -> str:
        raise RuntimeError("planted: the finish of a run breaks")

    monkeypatch.setattr(e, "_finish_run", broken)
    (q,) = x.run(e.handle(chunk(0, 6, True), 0))
    x.run(e.run_chunk(q.chunk, 0))
    assert e.counters["room_exception"] == 1
    assert x.prepared == {} and x.errors == [] and x.writes == []
    x.run(e.handle(ReleaseRoom(room=ROOM, transfer_id=TID), 0))
    assert e.table_sizes()["ahead"] == 0
