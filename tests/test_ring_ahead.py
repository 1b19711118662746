"""The ring's critical path (issue 28), over the in-memory harness: the last chunk's gathers leave
before its aux row, and decode takes the aux row's note and the data notes in either order.

Bytes are checked at every decode Success by the harness; every room ends Success on both sides
with every staging buffer, ring and pool empty.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvferry.core import messages as m
from kvferry.core.commands import EnqueueChunk, Gather, PostAuxWrite
from kvferry.core.events import ChunkAhead
from kvferry.core.kvpoll import KVPoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H
from test_flows import TINY4, assert_clean, world


def _trace(w: H.World, p: int = 0) -> list[Any]:
    """Every command prefill rank ``p``'s driver runs, in order."""
    log: list[Any] = []
    w.prefill[p].driver.trace = lambda kind, x: log.append(x) if kind == "run" else None
    return log


def _controls_and_copies(w: H.World) -> None:
    """Deliver every control message, run every worker and every copy; no write completes."""
    progressed = True
    while progressed:
        progressed = False
        for i in reversed(range(len(w.fabric.pending))):
            if not w.fabric.pending[i].note:
                w.deliver(i)
                progressed = True
        for p in range(w.P):
            for s in range(len(w.prefill[p].driver.queues)):
                while w.run_worker(p, s):
                    progressed = True
        while w.fabric.copies:
            w.fabric.run_copy(0)
            w.pump()
            progressed = True


def _status(w: H.World, req: H.Request, side: str) -> KVPoll | None:
    ranks = w.prefill if side == "prefill" else w.decode
    return w.rank_status(ranks[0], req)


def test_the_last_chunks_gathers_leave_before_its_aux_row() -> None:
    w = world(TINY4, 2, 1, "ring", space=4096)
    logs = [_trace(w, p) for p in range(w.P)]
    req = w.open_room(100, "t0", 12, [4, 12])
    assert req is not None
    w.flush()
    for _ in range(2):
        for p in range(w.P):
            w.chunk_ready(req, p)
        w.flush()
    w.heal_and_settle()
    assert_clean(w)
    aux_rank = [log for log in logs if any(type(c) is PostAuxWrite for c in log)]
    assert len(aux_rank) == 1  # one prefill rank carries the aux row
    log = aux_rank[0]
    aux_at = next(i for i, c in enumerate(log) if type(c) is PostAuxWrite)
    gathers = [i for i, c in enumerate(log) if type(c) is Gather]
    assert len(gathers) == 2 and gathers[1] < aux_at, [type(c).__name__ for c in log]


@pytest.mark.parametrize("aux_first", [True, False])
def test_decode_takes_the_aux_row_and_the_data_notes_in_either_order(aux_first: bool) -> None:
    w = world(TINY4, 1, 1, "ring", space=4096)
    req = w.open_room(100, "t0", 8, [8])
    assert req is not None
    _controls_and_copies(w)
    assert w.chunk_ready(req, 0)
    _controls_and_copies(w)
    writes = w.fabric.writes
    assert len(writes) == 2 and sum(x.aux is not None for x in writes) == 1  # aux row and data
    order = sorted(range(2), key=lambda i: (writes[i].aux is None) == aux_first)
    handles = [writes[i].handle for i in order]
    for h in handles:  # both land; their notes wait
        w.fabric.complete(next(i for i, x in enumerate(w.fabric.writes) if x.handle == h))
    notes = [x for x in w.fabric.pending if x.note]
    assert len(notes) == 2
    first = m.decode_layer_note(notes[0].data)
    assert bool(first.aux) == aux_first
    w.fabric.deliver(w.fabric.pending.index(notes[0]))
    w.pump()
    _controls_and_copies(w)
    assert _status(w, req, "decode") is not KVPoll.Success  # one of the two is not in yet
    w.fabric.deliver(w.fabric.pending.index(notes[1]))
    w.pump()
    w.flush()
    assert _status(w, req, "decode") is KVPoll.Success
    w.heal_and_settle()
    assert_clean(w)


def _name(w: H.World, req: H.Request, p: int, i: int, pages: Any = None) -> None:
    """Prefill rank ``p``'s scheduler names the room's chunk ``i`` ahead (its pages and range)."""
    ev = ChunkAhead(
        room=req.room,
        transfer_id=req.tid,
        chunk_index=i,
        token_end=req.cuts[i],
        src_pages=req.src_pages if pages is None else pages,
        is_last=i == len(req.cuts) - 1,
    )
    w.prefill[p].driver.feed(ev, w.fabric.now)


def _staging_reqs(w: H.World) -> list[tuple[int, int, int]]:
    out = []
    for msg in w.fabric.pending:
        if msg.note:
            continue
        obj = m.decode_control(msg.data)
        if type(obj) is m.StagingReq:
            out.append((obj.chunk_index, obj.token_start, obj.token_end))
    return out


@pytest.mark.parametrize(("flow", "p", "d"), [("ring", 2, 1), ("ring", 1, 2), ("pinned", 2, 1)])
def test_staging_space_is_asked_when_a_chunk_is_named_and_its_send_runs_at_once(
    flow: str, p: int, d: int
) -> None:
    w = world(TINY4, p, d, flow, space=4096)
    logs = [_trace(w, k) for k in range(p)]
    req = w.open_room(100, "t0", 12, [4, 8, 12])
    assert req is not None
    w.flush()  # the handshake: every TransferInfo in
    for i in range(len(req.cuts)):
        for k in range(p):
            _name(w, req, k, i)
        asked = _staging_reqs(w)
        assert asked and {a[0] for a in asked} == {i}, asked  # asked when named, before the send
        assert {a[1:] for a in asked} == {(req.cuts[i - 1] if i else 0, req.cuts[i])}
        _controls_and_copies(w)  # decode grants the space
        for k in range(p):
            w.chunk_ready(req, k)
        assert _staging_reqs(w) == []  # the send asks nothing: its space is in
        w.flush()
    w.heal_and_settle()
    assert_clean(w)
    assert all(_status(w, req, side) is KVPoll.Success for side in ("prefill", "decode"))
    for log in logs:
        marks = [c.prepared for c in log if type(c) is EnqueueChunk]
        assert marks == [True] * len(req.cuts), marks
    # Every gather's map was made when its chunk was named (the send only rebased it).
    gathers = sum(type(c) is Gather for log in logs for c in log)
    made_ahead = sum(r.engine.counters["staged_map_ahead"] for r in w.prefill)
    assert gathers >= len(req.cuts) and made_ahead == gathers, (gathers, made_ahead)


def test_a_ring_chunk_not_named_is_not_handed_over_as_prepared() -> None:
    w = world(TINY4, 2, 1, "ring", space=4096)
    logs = [_trace(w, k) for k in range(2)]
    req = w.open_room(100, "t0", 12, [4, 12])
    assert req is not None
    w.flush()
    for _ in range(2):
        for k in range(2):
            w.chunk_ready(req, k)
        w.flush()
    w.heal_and_settle()
    assert_clean(w)
    for log in logs:
        assert [c.prepared for c in log if type(c) is EnqueueChunk] == [False, False]


def test_a_chunk_named_before_decodes_transfer_info_is_asked_for_once_it_is_known() -> None:
    w = world(TINY4, 2, 1, "ring", space=4096)
    req = w.open_room(100, "t0", 12, [12], decode_late=True)
    assert req is not None
    for k in range(2):
        _name(w, req, k, 0)
    w.flush()
    w.open_decode(req)
    w.flush()
    for k in range(2):
        w.chunk_ready(req, k)
    w.heal_and_settle()
    assert_clean(w)
    assert _status(w, req, "decode") is KVPoll.Success


def test_a_staged_chunk_sent_with_another_range_than_named_fails_its_room_with_the_reason() -> None:
    w = world(TINY4, 1, 1, "ring", space=4096)
    req = w.open_room(100, "t0", 12, [4, 12])
    assert req is not None
    w.flush()
    ev = ChunkAhead(
        room=req.room, transfer_id=req.tid, chunk_index=0, token_end=6, src_pages=req.src_pages, is_last=False
    )
    w.prefill[0].driver.feed(ev, w.fabric.now)  # named [0, 6), sent [0, 4)
    w.flush()
    w.chunk_ready(req, 0)
    w.heal_and_settle()
    assert any("named ahead" in r for r in w.failure_reasons), w.failure_reasons
    assert_clean(w)


def test_a_chunk_named_with_other_pages_gathers_from_the_pages_it_is_sent_with() -> None:
    w = world(TINY4, 2, 1, "ring", space=4096)
    req = w.open_room(100, "t0", 12, [4, 12])
    assert req is not None
    w.flush()
    for i in range(2):
        for k in range(2):
            _name(w, req, k, i, pages=np.roll(req.src_pages, 1))  # the send carries others
        _controls_and_copies(w)
        for k in range(2):
            w.chunk_ready(req, k)
        w.flush()
    w.heal_and_settle()
    assert_clean(w)  # the harness checked decode's bytes at Success: from the pages sent
    assert _status(w, req, "decode") is KVPoll.Success
    assert sum(r.engine.counters["staged_map_ahead"] for r in w.prefill) == 0
