"""Prefill owes its InfoAcks (core/info_acks.py): a note posted to the decode rank answers the
room's TransferInfo; what no note answered within a quarter heartbeat interval leaves in one
InfoAck naming every room owed; a resent TransferInfo is answered at once; decode takes each
room an InfoAck names as answered."""

from __future__ import annotations

from typing import Any

import numpy as np
from kvferry.core import messages as m
from kvferry.core.events import ChunkReady, SenderOpen, Tick

from tests.test_sender import D0, ROOM, TID, T, ctl, engine, info, register, run, sent, waiting


def _open_two_rooms() -> Any:
    e = engine()
    e.handle(ctl(register(D0)), 0)
    for room, tid in ((ROOM, TID), (ROOM + 1, "req-8")):
        e.handle(SenderOpen(room=room, transfer_id=tid, aux_index=1), 0)
        assert sent(e.handle(ctl(info(room=room, transfer_id=tid)), 1), m.InfoAck) == []
    return e


def test_the_rooms_no_note_answered_get_one_info_ack_a_quarter_interval_later() -> None:
    e = _open_two_rooms()
    quarter = 1 + T.heartbeat_interval_ns // 4
    assert e.next_deadline() == quarter
    assert sent(e.handle(Tick(), quarter - 1), m.InfoAck) == []
    [(peer, ack)] = sent(e.handle(Tick(), quarter), m.InfoAck)
    assert peer == D0 and (ack.room, ack.transfer_id) == (ROOM, TID) and ack.more == [(ROOM + 1, "req-8")]
    assert "info_acks_owed" not in e.references(ROOM)
    assert e.counters["info_ack_batched"] == 2


def test_a_note_to_the_decode_rank_answers_its_info() -> None:
    e = waiting()
    cmds = run(
        e,
        ChunkReady(
            room=ROOM,
            transfer_id=TID,
            chunk_index=0,
            token_end=2,
            src_pages=np.arange(5, dtype=np.int64),
            is_last=False,
        ),
    )
    assert sent(cmds, m.InfoAck) == [] and e.counters["info_ack_rode_on_note"] == 1
    assert "info_acks_owed" not in e.references(ROOM)
    # Nothing is owed any more: no deadline is left for it, and no InfoAck ever leaves.
    assert all(k[0] != "info_ack" for k in e.deadlines.live_keys())
    assert sent(e.handle(Tick(), T.heartbeat_interval_ns), m.InfoAck) == []


def test_a_resent_info_is_answered_at_once() -> None:
    e = waiting()
    [(peer, ack)] = sent(e.handle(ctl(info()), 2), m.InfoAck)
    assert peer == D0 and ack.room == ROOM and ack.more == []


def test_decode_takes_every_room_an_info_ack_names() -> None:
    from tests import test_receiver as rx

    e = rx.engine()
    e.handle(rx.open_ev(), 0)
    e.handle(rx.open_ev(room=8, tid="b"), 0)
    e.handle(rx.ctl(m.InfoAck(src=rx.P1, room=ROOM, transfer_id=TID, more=[(8, "b"), (9, "gone")])), 1)
    # Each room still resends its TransferInfo to the senders that did not answer, not to P1.
    resent = rx.sent(e.handle(Tick(), rx.T.heartbeat_interval_ns), m.TransferInfo)
    assert sorted((p.rank, msg.room) for p, msg in resent) == [(0, 7), (0, 8), (2, 7), (2, 8)]
