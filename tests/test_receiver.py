"""Decode-side room machine: one test per transition of RECEIVER_TABLE, plus every (state, input)
pair under hypothesis (a legal move or Failed with a reason, never an exception escaping)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.core import messages as m
from kvferry.core.commands import CheckAux, DropPeer, FreePages, SendControl, StatusChanged
from kvferry.core.deadlines import Timeouts
from kvferry.core.events import (
    AbortRoom,
    AuxChecked,
    ControlIn,
    CopyDone,
    CopyFailed,
    NotificationIn,
    ReceiverOpen,
    ReleaseRoom,
    SenderSpec,
    Tick,
    WriteDone,
    WriteFailed,
)
from kvferry.core.flows.pull import PullRxIn, ReadInfo
from kvferry.core.flows.staged_receiver import StagedRxIn
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll, advance
from kvferry.core.machine import RoomFailure
from kvferry.core.proto_common import UnknownRoomError
from kvferry.core.receiver import RECEIVER_TABLE, ReceiverEngine, RIn, RState

MODEL = ModelGeometry("tiny", num_layers=2, num_kv_heads=2, head_dim=4)
ME = m.Endpoint("decode", 0)
P0, P1, P2 = m.Endpoint("prefill", 0), m.Endpoint("prefill", 1), m.Endpoint("prefill", 2)
T = Timeouts(
    bootstrap_ns=100,
    waiting_ns=200,
    transfer_ns=300,
    heartbeat_interval_ns=10,
    heartbeat_timeout_ns=5000,
    fence_ns=1000,
    tombstone_ns=5000,
)
ROOM, TID = 7, "req-7"
SPECS = (
    SenderSpec(endpoint=P0, dummy=False, expected_infos=1, send_aux=True),
    SenderSpec(endpoint=P1, dummy=False, expected_infos=1, send_aux=False),
    SenderSpec(endpoint=P2, dummy=True, expected_infos=1, send_aux=False),
)


def registration() -> m.Register:
    pool = PoolGeometry(MODEL, 1, 0, 2, 32)
    return m.Register(
        src=ME,
        agent_name="d0",
        agent_meta=b"meta",
        geometry=m.GeometryWire.from_pool(pool),
        regions=[m.RegionAddr(region_id=r.region_id, addr=0, nbytes=r.nbytes) for r in pool.regions],
        aux_addr=0,
        aux_row_bytes=16,
        aux_rows=8,
    )


def engine(timeouts: Timeouts = T) -> ReceiverEngine:
    return ReceiverEngine(registration(), timeouts=timeouts)


def open_ev(room: int = ROOM, tid: str = TID, n: int = 6, specs: tuple[SenderSpec, ...] = SPECS, **kw: Any):
    fields = dict(
        room=room, transfer_id=tid, dst_pages=np.array([3, 4, 5]), num_tokens=n, aux_index=2, senders=specs
    )
    fields.update(kw)
    return ReceiverOpen(**fields)


def ctl(msg: Any) -> ControlIn:
    return ControlIn(data=m.encode(msg))


def note(src: m.Endpoint, i: int, a: int, b: int, last: bool, aux: bool = False, **kw: Any) -> NotificationIn:
    fields = dict(
        room=ROOM, transfer_id=TID, src=src, chunk_index=i, token_start=a, token_end=b, is_last=last, aux=aux
    )
    fields.update(kw)
    return NotificationIn(data=m.encode(m.ChunkNote(**fields)))


def sent(cmds: list[Any], kind: type) -> list[tuple[m.Endpoint, Any]]:
    return [(c.peer, c.msg) for c in cmds if type(c) is SendControl and type(c.msg) is kind]


def of(cmds: list[Any], kind: type) -> list[Any]:
    return [c for c in cmds if type(c) is kind]


def ack(p: m.Endpoint, ok: bool = True, retry: bool = False) -> ControlIn:
    return ctl(m.RegisterAck(src=p, ok=ok, retry=retry, reason="" if ok else "no"))


def waiting() -> ReceiverEngine:
    e = engine()
    e.handle(open_ev(), 0)
    for p in (P0, P1, P2):
        e.handle(ack(p), 0)
    assert e.state(ROOM) is RState.WAITING
    return e


def deliver_all(e: ReceiverEngine, order: list[NotificationIn]) -> list[Any]:
    out: list[Any] = []
    for n in order:
        out += e.handle(n, 0)
        for c in of(out, CheckAux):
            out += e.handle(AuxChecked(room=c.room, transfer_id=c.transfer_id, found_room=ROOM), 0)
            out.remove(c)
    return out


FULL = [
    note(P0, 0, 0, 2, False),
    note(P0, 1, 2, 6, True),
    note(P0, 1, 2, 6, True, aux=True),
    note(P1, 0, 0, 6, True),
    note(P2, 1, 0, 6, True, dummy=True),  # the dummy sender's "done"
]


def success() -> ReceiverEngine:
    e = waiting()
    deliver_all(e, FULL)
    assert e.state(ROOM) is RState.SUCCESS
    return e


# --- bootstrapping ------------------------------------------------------------------------------------


def test_open_registers_and_sends_transfer_info_to_every_sender() -> None:
    e = engine()
    cmds = e.handle(open_ev(), 0)
    assert of(cmds, StatusChanged)[0].status is KVPoll.Bootstrapping
    assert {p for p, _ in sent(cmds, m.Register)} == {P0, P1, P2}
    infos = dict(sent(cmds, m.TransferInfo))
    assert set(infos) == {P0, P1, P2}
    assert infos[P0].send_aux and not infos[P1].send_aux and infos[P2].dummy
    assert infos[P0].dst_pages == [3, 4, 5] and infos[P0].num_tokens == 6
    # A second room with the same peers registers nothing again.
    cmds = e.handle(open_ev(room=8, tid="b"), 0)
    assert sent(cmds, m.Register) == [] and len(sent(cmds, m.TransferInfo)) == 3


def test_waiting_after_every_sender_acked() -> None:
    e = engine()
    e.handle(open_ev(), 0)
    e.handle(ack(P0), 0)
    e.handle(ack(P1), 0)
    assert e.state(ROOM) is RState.BOOTSTRAPPING
    cmds = e.handle(ack(P2), 0)
    assert of(cmds, StatusChanged)[0].status is KVPoll.WaitingForInput


def test_unacked_register_is_resent_and_retry_nack_reregisters() -> None:
    e = engine()
    e.handle(open_ev(), 0)
    cmds = e.handle(Tick(), 10)
    assert {p for p, _ in sent(cmds, m.Register)} == {P0, P1, P2}
    e.handle(ack(P0), 11)
    cmds = e.handle(ack(P0, ok=False, retry=True), 12)
    assert [p for p, _ in sent(cmds, m.Register)] == [P0]


def test_final_nack_fails_the_rooms_of_that_peer() -> None:
    e = engine()
    e.handle(open_ev(), 0)
    cmds = e.handle(ack(P1, ok=False), 0)
    assert e.state(ROOM) is RState.FAILED and "refused" in e.failure(ROOM).reason
    assert {p for p, _ in sent(cmds, m.Abort)} == {P0, P1, P2}


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        (dict(n=7), "do not fit"),
        (dict(dst_pages=np.array([3, 3, 4])), "twice"),
        (dict(dst_pages=np.array([3, 99])), "out of range"),
        (dict(specs=(SPECS[0], SPECS[0])), "listed twice"),
        (dict(specs=(SPECS[1],)), "aux"),
        (dict(specs=(SPECS[2],)), "dummy"),
        (dict(aux_index=8), "aux row"),
    ],
)
def test_bad_open_fails_at_once_and_frees_pages(kw: dict[str, Any], why: str) -> None:
    e = engine()
    cmds = e.handle(open_ev(**kw), 0)
    assert of(cmds, FreePages) and not sent(cmds, m.TransferInfo) and not sent(cmds, m.Abort)
    assert e.poll(ROOM) is KVPoll.Failed and why in e.failure(ROOM).reason


# --- chunks and Success -----------------------------------------------------------------------------


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [1, 4, 2, 0, 3], [2, 3, 1, 0, 4]])
def test_success_needs_every_chunk_of_every_sender_as_a_set(order: list[int]) -> None:
    e = waiting()
    for k, i in enumerate(order):
        deliver_all(e, [FULL[i]])
        if k < 4:
            assert e.state(ROOM) is RState.TRANSFERRING
    assert e.state(ROOM) is RState.SUCCESS


def test_notification_before_ack_proves_registration() -> None:
    e = engine()
    e.handle(open_ev(), 0)
    e.handle(FULL[0], 0)
    assert e.state(ROOM) is RState.TRANSFERRING


def test_duplicates_are_ignored_and_counted() -> None:
    e = waiting()
    deliver_all(e, [FULL[0], FULL[0], FULL[2], FULL[2]])
    assert e.counters["duplicate_notification"] == 2 and e.state(ROOM) is RState.TRANSFERRING
    e = success()
    deliver_all(e, FULL)
    assert e.state(ROOM) is RState.SUCCESS


@pytest.mark.parametrize(
    ("notes", "why"),
    [
        ([note(P0, 0, 0, 4, True)], "delivered 4 tokens but decode allocated 6"),
        ([note(P0, 0, 0, 2, False), note(P0, 1, 3, 6, True)], "starts at token 3"),
        ([note(P0, 0, 0, 7, True)], "past the 6 allocated"),
        ([note(P0, 0, 0, 2, False), note(P0, 0, 0, 3, False)], "twice with ranges"),
        ([note(P2, 0, 0, 6, True)], "data from dummy sender"),
        ([note(P0, 1, 0, 6, True, dummy=True)], "dummy notification from data sender"),
        ([note(m.Endpoint("prefill", 9), 0, 0, 6, True)], "not a sender"),
        ([note(P1, 0, 0, 6, True, aux=True)], "aux row written by"),
        ([note(P0, 1, 2, 6, True), note(P0, 2, 6, 6, False)], "after its last chunk"),
        ([note(P0, 2, 4, 6, False), note(P0, 1, 2, 4, True)], "later chunk already arrived"),
    ],
)
def test_inconsistent_chunks_fail_with_a_reason(notes: list[NotificationIn], why: str) -> None:
    e = waiting()
    cmds = deliver_all(e, notes)
    assert e.state(ROOM) is RState.FAILED and why in e.failure(ROOM).reason
    assert {p for p, _ in sent(cmds, m.Abort)} == {P0, P1, P2}


def test_aux_row_must_hold_the_room_id() -> None:
    e = waiting()
    [check] = of(e.handle(FULL[2], 0), CheckAux)
    assert check.aux_index == 2
    e.handle(AuxChecked(room=ROOM, transfer_id=TID, found_room=123), 0)
    assert "holds room 123" in e.failure(ROOM).reason


def test_new_chunk_after_success_fails_but_local_abort_is_ignored() -> None:
    e = success()
    e.handle(AbortRoom(room=ROOM, transfer_id=TID), 0)
    assert e.state(ROOM) is RState.SUCCESS
    e.handle(note(P1, 1, 6, 6, False), 0)
    assert e.state(ROOM) is RState.FAILED and "after Success" in e.failure(ROOM).reason


# --- failure, abort and the fence -----------------------------------------------------------------


def test_abort_frees_pages_only_when_every_sender_stopped() -> None:
    e = waiting()
    cmds = e.handle(AbortRoom(room=ROOM, transfer_id=TID, reason="cancel"), 0)
    assert {p for p, _ in sent(cmds, m.Abort)} == {P0, P1, P2}
    assert e.pages_in_use(ROOM)
    for p in (P0, P1):
        assert not of(e.handle(ctl(m.Stopped(src=p, room=ROOM, transfer_id=TID)), 0), FreePages)
    e.handle(ReleaseRoom(room=ROOM, transfer_id=TID), 0)
    assert ROOM in e.rooms  # released, but not yet fenced: the tables stay
    cmds = e.handle(ctl(m.Stopped(src=P2, room=ROOM, transfer_id=TID)), 0)
    [free] = of(cmds, FreePages)
    assert free.reason == "every sender stopped"
    assert ROOM not in e.rooms and e.references(ROOM) == []


def test_fence_deadline_frees_pages_without_stopped() -> None:
    e = waiting()
    e.handle(AbortRoom(room=ROOM, transfer_id=TID), 50)
    assert not of(e.handle(Tick(), 1049), FreePages)
    [free] = of(e.handle(Tick(), 1050), FreePages)
    assert free.reason == "fence expired"


def test_peer_failure_fails_and_aborts_every_sender() -> None:
    e = waiting()
    cmds = e.handle(ctl(m.RoomFailed(src=P1, room=ROOM, transfer_id=TID, reason="write ERR")), 0)
    assert "failed on prefill#1: write ERR" in e.failure(ROOM).reason
    assert {p for p, _ in sent(cmds, m.Abort)} == {P0, P1, P2}


def test_stopped_without_abort_means_a_lost_failure() -> None:
    e = waiting()
    e.handle(ctl(m.Stopped(src=P0, room=ROOM, transfer_id=TID)), 0)
    assert "prefill#0 stopped sending before its failure notice arrived" in e.failure(ROOM).reason
    assert e.counters["illegal_input"] == 0  # a legal (if early) message, not a protocol violation


def test_success_then_peer_failure_agrees_on_failed() -> None:
    e = success()
    e.handle(ctl(m.RoomFailed(src=P0, room=ROOM, transfer_id=TID, reason="late")), 0)
    assert e.state(ROOM) is RState.FAILED


def test_messages_from_strangers_are_ignored() -> None:
    e = waiting()
    stranger = m.Endpoint("prefill", 7)
    e.handle(ctl(m.RoomFailed(src=stranger, room=ROOM, transfer_id=TID, reason="x")), 0)
    assert e.state(ROOM) is RState.WAITING and e.counters["message_from_stranger"] == 1


# --- deadlines --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "deadline", "why"),
    [
        (lambda e: e.handle(open_ev(), 0), 100, "bootstrapping"),
        (lambda e: [e.handle(open_ev(), 0)] + [e.handle(ack(p), 0) for p in (P0, P1, P2)], 200, "waiting"),
    ],
)
def test_each_wait_has_a_deadline(setup: Any, deadline: int, why: str) -> None:
    e = engine()
    setup(e)
    e.handle(Tick(), deadline - 1)
    assert e.poll(ROOM) is not KVPoll.Failed
    cmds = e.handle(Tick(), deadline)
    assert e.poll(ROOM) is KVPoll.Failed and why in e.failure(ROOM).reason
    assert sent(cmds, m.Abort)


def test_transfer_deadline_is_renewed_by_notifications() -> None:
    e = waiting()
    e.handle(FULL[0], 0)
    e.handle(FULL[3], 250)
    e.handle(Tick(), 300)
    assert e.state(ROOM) is RState.TRANSFERRING
    e.handle(Tick(), 550)
    assert "transferring" in e.failure(ROOM).reason


def test_a_resent_note_does_not_renew_the_transfer_deadline() -> None:
    """Only news renews it. A sender resending its notes (a staged writer does, until decode's
    watermark passes them) while the room waits for a sender that never writes (it restarted and
    forgot the room) must not keep the room Transferring past its deadline."""
    e = waiting()
    heard = [FULL[0], FULL[2], FULL[4]]  # a chunk, the aux row, the dummy's "done"
    for n in heard:
        e.handle(n, 0)
    for t in (100, 200, 299):
        for n in heard:
            e.handle(n, t)
    assert e.counters["duplicate_notification"] == 9
    e.handle(Tick(), 300)
    assert e.poll(ROOM) is KVPoll.Failed and "transferring" in e.failure(ROOM).reason


def test_heartbeat_loss_fails_rooms() -> None:
    e = ReceiverEngine(registration(), timeouts=Timeouts(heartbeat_interval_ns=10, heartbeat_timeout_ns=50))
    e.handle(open_ev(), 0)
    for p in (P0, P1, P2):
        e.handle(ack(p), 0)
    cmds = e.handle(Tick(), 10)
    assert {p for p, _ in sent(cmds, m.Heartbeat)} == {P0, P1, P2}
    for p in (P0, P1):
        e.handle(ctl(m.Heartbeat(src=p)), 40)
    cmds = e.handle(Tick(), 60)
    assert [c.peer for c in of(cmds, DropPeer)] == [P2]
    assert "prefill#2 lost" in e.failure(ROOM).reason


# --- release, tombstones, reuse ----------------------------------------------------------------------


def test_release_tombstone_and_reuse() -> None:
    e = success()
    e.handle(ReleaseRoom(room=ROOM, transfer_id=TID), 0)
    assert e.references(ROOM) == [] and e.poll(ROOM) is KVPoll.Success
    assert e.handle(FULL[0], 1) == [] and e.counters["tombstoned"] == 1
    e.handle(open_ev(tid="req-7b"), 2)
    assert e.state(ROOM) is RState.WAITING  # peers already acked
    e.handle(FULL[0], 3)  # the old incarnation's late note
    assert e.state(ROOM) is RState.WAITING and e.counters["tombstoned"] == 2
    # A late failure of the old incarnation is recorded on its tombstone, not on the new room.
    cmds = e.handle(ctl(m.RoomFailed(src=P0, room=ROOM, transfer_id=TID, reason="late")), 4)
    assert e.tombstones.get(ROOM, TID) is KVPoll.Failed and of(cmds, StatusChanged)
    assert e.state(ROOM) is RState.WAITING


def test_open_of_live_or_finished_room() -> None:
    e = waiting()
    e.handle(open_ev(), 0)  # the same room opened twice
    assert "open not allowed" in e.failure(ROOM).reason
    e = success()
    cmds = e.handle(open_ev(tid="other"), 0)
    assert of(cmds, StatusChanged)[0].reason == "room id in use"


def test_unknown_room_poll_and_garbage() -> None:
    e = engine()
    with pytest.raises(UnknownRoomError):
        e.poll(5)
    assert e.handle(NotificationIn(data=b"\xff\x00"), 0) == []
    assert e.handle(ctl(m.Heartbeat(src=P0)), 0) == []
    assert e.handle(ctl(m.Abort(src=P0, room=1, transfer_id="x", reason="")), 0) == []
    assert e.counters["wire_error"] == 1 and e.counters["wrong_side_message"] == 1


# --- every (state, input) pair ------------------------------------------------------------------------


def in_state(state: RState) -> ReceiverEngine:
    if state is RState.BOOTSTRAPPING:
        e = engine()
        e.handle(open_ev(), 0)
        return e
    if state is RState.WAITING:
        return waiting()
    if state is RState.TRANSFERRING:
        e = waiting()
        deliver_all(e, FULL[:2])
        return e
    if state is RState.SUCCESS:
        return success()
    e = waiting()
    e.handle(AbortRoom(room=ROOM, transfer_id=TID), 0)
    return e


endpoints = st.sampled_from([P0, P1, P2, m.Endpoint("prefill", 5)])
notes = st.builds(
    lambda src, i, a, n, last, aux: m.ChunkNote(
        room=ROOM,
        transfer_id=TID,
        src=src,
        chunk_index=i,
        token_start=a,
        token_end=a + n,
        is_last=last,
        aux=aux,
    ),
    endpoints,
    st.integers(0, 3),
    st.integers(0, 8),
    st.integers(0, 8),
    st.booleans(),
    st.booleans(),
)


def prefill_registration(src: m.Endpoint) -> m.Register:
    pool = PoolGeometry(MODEL, 8, src.rank, 2, 32)  # TP 8 over 2 heads: replicated, any rank fits
    return m.Register(
        src=src,
        agent_name=f"p{src.rank}",
        agent_meta=b"meta",
        geometry=m.GeometryWire.from_pool(pool),
        regions=[m.RegionAddr(region_id=r.region_id, addr=0, nbytes=r.nbytes) for r in pool.regions],
        aux_addr=0,
        aux_row_bytes=16,
        aux_rows=8,
    )


offers = st.builds(
    lambda src, i, a, n, last, pages: m.PullOffer(
        src=src,
        room=ROOM,
        transfer_id=TID,
        registration=prefill_registration(src),
        chunk_index=i,
        token_start=a,
        token_end=a + n,
        is_last=last,
        src_pages=pages,
    ),
    endpoints,
    st.integers(0, 3),
    st.integers(0, 8),
    st.integers(0, 8),
    st.booleans(),
    st.lists(st.integers(0, 40), max_size=6),
)
PAYLOADS: dict[Any, Any] = {
    RIn.OPEN: st.just(open_ev()),
    RIn.PEER_READY: endpoints,
    RIn.PEER_REFUSED: st.builds(m.RegisterAck, src=endpoints, ok=st.just(False), reason=st.text(max_size=4)),
    RIn.NOTIFY: notes,
    RIn.AUX_CHECKED: st.builds(
        AuxChecked, room=st.just(ROOM), transfer_id=st.just(TID), found_room=st.sampled_from([ROOM, 0, 9])
    ),
    RIn.PEER_FAILED: st.builds(
        m.RoomFailed, src=endpoints, room=st.just(ROOM), transfer_id=st.just(TID), reason=st.text(max_size=4)
    ),
    RIn.STOPPED: st.builds(m.Stopped, src=endpoints, room=st.just(ROOM), transfer_id=st.just(TID)),
    RIn.ABORT_LOCAL: st.builds(AbortRoom, room=st.just(ROOM), transfer_id=st.just(TID)),
    RIn.TIMEOUT: st.none(),
    RIn.PEER_LOST: endpoints,
    RIn.RELEASE: st.builds(ReleaseRoom, room=st.just(ROOM), transfer_id=st.just(TID)),
    StagedRxIn.STAGING_REQ: st.builds(
        m.StagingReq,
        src=endpoints,
        room=st.just(ROOM),
        transfer_id=st.just(TID),
        flow=st.sampled_from(["ring", "pinned"]),
        chunk_index=st.integers(0, 3),
        token_start=st.integers(0, 4),
        token_end=st.integers(5, 9),
    ),
    StagedRxIn.COPY_DONE: st.builds(CopyDone, op_id=st.integers(0, 5)),
    StagedRxIn.COPY_FAILED: st.builds(CopyFailed, op_id=st.integers(0, 5)),
    PullRxIn.OFFER: offers,
    PullRxIn.READ_DONE: st.tuples(
        st.builds(WriteDone, write_id=st.integers(0, 5)), st.one_of(st.none(), offers.map(ReadInfo))
    ),
    PullRxIn.READ_FAILED: st.tuples(st.builds(WriteFailed, write_id=st.integers(0, 5)), st.none()),
    # The failure funnel's own input (TableEngine.fail): a reason and the side's options.
    RIn.FAIL: st.tuples(st.builds(RoomFailure, st.text(min_size=1, max_size=5)), st.just({})),
}


@settings(max_examples=300)
@given(state=st.sampled_from(list(RState)), inp=st.sampled_from(list(PAYLOADS)), data=st.data())
def test_every_state_input_pair(state: RState, inp: Any, data: st.DataObject) -> None:
    """Every input of the room's table, the flows' own (``StagedRxIn``, ``PullRxIn``) included."""
    e = in_state(state)
    payload = data.draw(PAYLOADS[inp])
    before = e.poll(ROOM)
    e.apply(ROOM, inp, payload, 1)  # must not raise
    if ROOM not in e.rooms:
        assert inp in (RIn.RELEASE, RIn.TIMEOUT, RIn.STOPPED)
        return
    after = e.state(ROOM)
    tr = e.transition(state, inp)
    if tr is None:
        assert after is RState.FAILED and "not allowed" in e.failure(ROOM).reason
    else:
        assert after in tr.targets or after is RState.FAILED
    if after is RState.FAILED:
        assert e.failure(ROOM) is not None and e.failure(ROOM).reason
    assert advance(before, e.poll(ROOM)) is e.poll(ROOM)


def test_table_covers_every_state() -> None:
    assert set(RECEIVER_TABLE) == set(RState)
    assert set(RECEIVER_TABLE[RState.FAILED]) == set(RIn)
    # The engine runs RECEIVER_TABLE with its flow components' own inputs added (core/flows/parts.py).
    e = ReceiverEngine(registration())
    assert all(e.transition(RState.FAILED, i) is not None for i in PAYLOADS)
    assert all(e.transition(st_, i) is tr for st_, row in RECEIVER_TABLE.items() for i, tr in row.items())


def test_abort_is_resent_until_every_sender_stopped() -> None:
    e = waiting()
    e.handle(AbortRoom(room=ROOM, transfer_id=TID), 0)
    e.handle(ctl(m.Stopped(src=P0, room=ROOM, transfer_id=TID)), 5)
    cmds = e.handle(Tick(), 10)  # one heartbeat interval later: the unanswered senders again
    assert {p for p, _ in sent(cmds, m.Abort)} == {P1, P2}
    for p in (P1, P2):
        e.handle(ctl(m.Stopped(src=p, room=ROOM, transfer_id=TID)), 15)
    assert not e.pages_in_use(ROOM)
    assert sent(e.handle(Tick(), 20), m.Abort) == []
    e.handle(ReleaseRoom(room=ROOM, transfer_id=TID), 21)
    assert e.references(ROOM) == []


# --- failure notices -------------------------------------------------------------------------------


def test_every_room_failed_is_answered_with_failed_ack() -> None:
    e = success()
    cmds = e.handle(ctl(m.RoomFailed(src=P0, room=ROOM, transfer_id=TID, reason="late")), 0)
    assert e.state(ROOM) is RState.FAILED  # Failed overrides Success and sticks
    assert sent(cmds, m.FailedAck) == [(P0, m.FailedAck(src=ME, room=ROOM, transfer_id=TID, known=True))]
    cmds = e.handle(ctl(m.RoomFailed(src=P0, room=ROOM, transfer_id=TID, reason="late")), 0)  # resent
    assert e.state(ROOM) is RState.FAILED and len(sent(cmds, m.FailedAck)) == 1
    cmds = e.handle(ctl(m.RoomFailed(src=P0, room=99, transfer_id="gone", reason="x")), 0)
    assert sent(cmds, m.FailedAck) == [(P0, m.FailedAck(src=ME, room=99, transfer_id="gone", known=False))]


def test_room_failed_after_release_turns_the_tombstone_failed_and_is_acked() -> None:
    e = success()
    e.handle(ReleaseRoom(room=ROOM, transfer_id=TID), 0)
    assert ROOM not in e.rooms and e.poll(ROOM) is KVPoll.Success
    cmds = e.handle(ctl(m.RoomFailed(src=P1, room=ROOM, transfer_id=TID, reason="late")), 0)
    assert e.poll(ROOM) is KVPoll.Failed and e.counters["failed_after_release"] == 1
    assert [c.status for c in of(cmds, StatusChanged)] == [KVPoll.Failed]
    assert sent(cmds, m.FailedAck) == [(P1, m.FailedAck(src=ME, room=ROOM, transfer_id=TID, known=True))]
