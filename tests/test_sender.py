"""Prefill-side room machine: one test per transition of SENDER_TABLE, plus every (state, input)
pair under hypothesis (a legal move or Failed with a reason, never an exception escaping)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.core import messages as m
from kvferry.core.commands import (
    AddPeer,
    AwaitWrites,
    ChunkSkipped,
    DropPeer,
    EnqueueChunk,
    PostAuxWrite,
    PostWrite,
    SendControl,
    SendNotif,
    StatusChanged,
)
from kvferry.core.deadlines import Timeouts
from kvferry.core.errors import LocalMisuseError, PlanError
from kvferry.core.events import (
    AbortRoom,
    ChunkReady,
    ControlIn,
    CopyDone,
    CopyFailed,
    LayersReady,
    PeerUnusable,
    ReleaseRoom,
    SenderOpen,
    Tick,
    WriteDone,
    WriteFailed,
)
from kvferry.core.flows.pull import PullTxIn
from kvferry.core.flows.staged_sender import StagedTxIn
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll, advance
from kvferry.core.machine import RoomFailure
from kvferry.core.planner import plan_rank_pair
from kvferry.core.sender import SENDER_TABLE, SenderEngine, SIn, SState

MODEL = ModelGeometry("tiny", num_layers=2, num_kv_heads=2, head_dim=4)
SRC = PoolGeometry(MODEL, 1, 0, 2, 32)
ME = m.Endpoint("prefill", 0)
D0, D1, D2 = m.Endpoint("decode", 0), m.Endpoint("decode", 1), m.Endpoint("decode", 2)
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
PAGES = np.arange(5, dtype=np.int64)


def register(ep: m.Endpoint) -> m.Register:
    pool = PoolGeometry(MODEL, 1 if ep.rank == 0 else 4, ep.rank, 2, 32)
    return m.Register(
        src=ep,
        agent_name=str(ep),
        agent_meta=b"meta",
        geometry=m.GeometryWire.from_pool(pool),
        regions=[m.RegionAddr(region_id=r.region_id, addr=0, nbytes=r.nbytes) for r in pool.regions],
        aux_addr=0,
        aux_row_bytes=16,
        aux_rows=8,
    )


def info(src: m.Endpoint = D0, expected: int = 1, num_tokens: int = 6, **kw: Any) -> m.TransferInfo:
    fields = dict(
        src=src,
        room=ROOM,
        transfer_id=TID,
        reg=m.registration_id(register(src)),
        dst_pages=[3, 4, 5],
        num_tokens=num_tokens,
        aux_index=2,
        send_aux=src == D0,
        dummy=False,
        expected_infos=expected,
    )
    fields.update(kw)
    return m.TransferInfo(**fields)


def ctl(msg: Any) -> ControlIn:
    return ControlIn(data=m.encode(msg))


def chunk(i: int, end: int, last: bool, room: int = ROOM, tid: str = TID) -> ChunkReady:
    return ChunkReady(room=room, transfer_id=tid, chunk_index=i, token_end=end, src_pages=PAGES, is_last=last)


def of(cmds: list[Any], kind: type) -> list[Any]:
    return [c for c in cmds if type(c) is kind]


def sent(cmds: list[Any], kind: type) -> list[tuple[m.Endpoint, Any]]:
    return [(c.peer, c.msg) for c in cmds if type(c) is SendControl and type(c.msg) is kind]


def engine(**kw: Any) -> SenderEngine:
    return SenderEngine(ME, SRC, timeouts=T, **kw)


def waiting(e: SenderEngine | None = None, now: int = 0) -> SenderEngine:
    e = e or engine()
    e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), now)
    e.handle(ctl(register(D0)), now)
    e.handle(ctl(info()), now)
    assert e.state(ROOM) is SState.WAITING
    return e


def run(e: SenderEngine, c: ChunkReady, now: int = 0) -> list[Any]:
    [enq] = of(e.handle(c, now), EnqueueChunk)
    return e.run_chunk(enq.chunk, now)


def transferring(now: int = 0) -> tuple[SenderEngine, list[int]]:
    e = waiting(now=now)
    cmds = run(e, chunk(0, 2, False), now)
    assert e.state(ROOM) is SState.TRANSFERRING
    return e, [c.write_id for c in of(cmds, PostWrite)]


def success() -> SenderEngine:
    e, ids = transferring()
    cmds = run(e, chunk(1, 6, True))
    ids += [c.write_id for c in of(cmds, PostWrite) + of(cmds, PostAuxWrite)]
    for i in ids:
        e.handle(WriteDone(write_id=i), 0)
    assert e.state(ROOM) is SState.SUCCESS
    return e


# --- bootstrapping --------------------------------------------------------------------------------


def test_open_then_info_then_register_reaches_waiting() -> None:
    e = engine()
    cmds = e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0)
    assert of(cmds, StatusChanged)[0].status is KVPoll.Bootstrapping
    cmds = e.handle(ctl(info()), 0)
    # The decode rank has not registered: it is asked to (retry), the info is kept.
    [(peer, nack)] = sent(cmds, m.RegisterAck)
    assert peer == D0 and not nack.ok and nack.retry
    assert e.poll(ROOM) is KVPoll.Bootstrapping
    cmds = e.handle(ctl(register(D0)), 0)
    assert of(cmds, AddPeer)[0].peer == D0
    assert sent(cmds, m.RegisterAck)[0][1].ok
    assert [c.status for c in of(cmds, StatusChanged)] == [KVPoll.WaitingForInput]


def test_info_before_open_creates_the_room_and_open_completes_it() -> None:
    e = engine()
    e.handle(ctl(register(D0)), 0)
    e.handle(ctl(info()), 0)
    assert e.state(ROOM) is SState.BOOTSTRAPPING
    e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0)
    assert e.state(ROOM) is SState.WAITING


def test_waiting_needs_every_expected_sender_by_identity() -> None:
    e = engine()
    e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0)
    for d in (D0, D1):
        e.handle(ctl(register(d)), 0)
    e.handle(ctl(info(D0, expected=2)), 0)
    e.handle(ctl(info(D0, expected=2)), 0)  # a duplicate is not a second sender
    assert e.state(ROOM) is SState.BOOTSTRAPPING
    assert e.counters["duplicate_info"] == 1
    e.handle(ctl(info(D1, expected=2)), 0)
    assert e.state(ROOM) is SState.WAITING
    cmds = e.handle(ctl(info(D2, expected=2)), 0)
    assert e.state(ROOM) is SState.FAILED
    assert "after all 2 arrived" in e.failure(ROOM).reason
    assert {p for p, _ in sent(cmds, m.RoomFailed)} == {D0, D1}


def test_disagreeing_infos_fail_the_room() -> None:
    e = engine()
    e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0)
    e.handle(ctl(info(D0, expected=2, num_tokens=6)), 0)
    e.handle(ctl(info(D1, expected=2, num_tokens=8)), 0)
    assert e.state(ROOM) is SState.FAILED
    assert "length" in e.failure(ROOM).reason


def test_chunk_while_bootstrapping_is_parked_then_queued_in_order() -> None:
    e = engine(num_shards=4)
    e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0)
    assert e.handle(chunk(0, 2, False), 0) == []
    assert e.handle(chunk(1, 6, True), 0) == []
    e.handle(ctl(register(D0)), 0)
    cmds = e.handle(ctl(info()), 0)
    enq = of(cmds, EnqueueChunk)
    assert [c.chunk.chunk_index for c in enq] == [0, 1]
    assert {c.shard for c in enq} == {ROOM % 4}


# --- waiting and transferring ---------------------------------------------------------------------


def test_chunks_post_writes_at_the_running_offset() -> None:
    e = waiting()
    cmds0 = run(e, chunk(0, 2, False))
    cmds1 = run(e, chunk(1, 6, True))
    w0, w1 = of(cmds0, PostWrite)[0], of(cmds1, PostWrite)[0]
    n0, n1 = m.decode_note(w0.notif), m.decode_note(w1.notif)
    assert (n0.token_start, n0.token_end, n0.is_last) == (0, 2, False)
    assert (n1.token_start, n1.token_end, n1.is_last) == (2, 6, True)
    dst = PoolGeometry(MODEL, 1, 0, 2, 32)
    want = plan_rank_pair(SRC, dst, PAGES, np.array([3, 4, 5]), 2, 6)
    assert np.array_equal(w1.dst_offset, want.dst_offset) and np.array_equal(w1.length, want.length)
    [aux] = of(cmds1, PostAuxWrite)
    assert (aux.peer, aux.src_aux_index, aux.dst_aux_index) == (D0, 1, 2)
    assert m.decode_note(aux.notif).aux
    assert of(cmds1, AwaitWrites)[0].write_ids == (w1.write_id, aux.write_id)


def test_success_only_when_every_write_is_done() -> None:
    e, ids = transferring()
    cmds = run(e, chunk(1, 6, True))
    last = [c.write_id for c in of(cmds, PostWrite) + of(cmds, PostAuxWrite)]
    for i in ids + last[:-1]:
        e.handle(WriteDone(write_id=i), 0)
        assert e.state(ROOM) is SState.TRANSFERRING
    cmds = e.handle(WriteDone(write_id=last[-1]), 0)
    assert e.state(ROOM) is SState.SUCCESS
    assert of(cmds, StatusChanged)[0].status is KVPoll.Success


def test_empty_chunk_sends_a_bare_notification() -> None:
    e = waiting()
    cmds = run(e, chunk(0, 0, False))
    assert of(cmds, PostWrite) == [] and len(of(cmds, SendNotif)) == 1


def test_dummy_sender_succeeds_without_writing() -> None:
    e = engine()
    e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0)
    e.handle(ctl(register(D0)), 0)
    e.handle(ctl(info(dummy=True, send_aux=False)), 0)
    cmds = run(e, chunk(0, 6, True))
    assert of(cmds, PostWrite) == [] and of(cmds, PostAuxWrite) == []
    [done] = of(cmds, SendNotif)  # the dummy tells decode it finished
    note = m.decode_note(done.notif)
    assert done.peer == D0 and note.dummy and note.is_last
    assert e.state(ROOM) is SState.SUCCESS


def test_sum_of_chunks_must_equal_decode_allocation() -> None:
    e = waiting()
    cmds = run(e, chunk(0, 5, True))  # decode allocated 6
    assert e.state(ROOM) is SState.FAILED
    assert "produced 5 tokens but decode allocated 6" in e.failure(ROOM).reason
    assert sent(cmds, m.RoomFailed)[0][0] == D0
    assert of(cmds, PostWrite) == []


def test_our_schedulers_bad_chunks_raise_to_it_and_leave_the_room_alone() -> None:
    # Local misuse (h11's LocalProtocolError): the caller hears it, the room stays as it was.
    for bad, why in (
        (chunk(0, 7, False), "past the 6 tokens"),
        (chunk(1, 2, False), "before chunk 0"),
    ):
        e = waiting()
        with pytest.raises(LocalMisuseError, match=why):
            e.handle(bad, 0)
        assert e.state(ROOM) is SState.WAITING and e.failure(ROOM) is None
    e = waiting()
    e.handle(chunk(0, 6, True), 0)
    with pytest.raises(LocalMisuseError, match="after the last chunk"):
        e.handle(chunk(1, 6, True), 0)


def test_a_chunk_past_the_allocation_found_at_run_time_fails_the_room() -> None:
    # Handed over before decode's TransferInfo said how long the room is: caught by the worker.
    e = engine()
    e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0)
    e.handle(chunk(0, 7, True), 0)
    assert e.state(ROOM) is SState.BOOTSTRAPPING
    e.handle(ctl(register(D0)), 0)
    [enq] = of(e.handle(ctl(info()), 0), EnqueueChunk)  # the parked chunk goes to its worker
    e.run_chunk(enq.chunk, 0)
    assert "past decode's 6" in e.failure(ROOM).reason


def test_duplicate_chunk_is_skipped_once() -> None:
    e = waiting()
    e.handle(chunk(0, 2, False), 0)
    cmds = e.handle(chunk(0, 2, False), 0)
    assert of(cmds, ChunkSkipped) and e.state(ROOM) is SState.WAITING


def test_planner_exception_fails_that_room_only_and_keeps_the_error() -> None:
    boom = PlanError("page 99 out of range")

    def planner(src: Any, dst: Any, sp: Any, dp: Any, a: int, b: int) -> Any:
        if int(np.asarray(sp)[0]) == 99:
            raise boom
        return plan_rank_pair(src, dst, sp, dp, a, b)

    e = waiting(engine(planner=planner))
    e.handle(SenderOpen(room=8, transfer_id="other", aux_index=3), 0)
    e.handle(ctl(info(room=8, transfer_id="other")), 0)
    bad = ChunkReady(
        room=ROOM, transfer_id=TID, chunk_index=0, token_end=2, src_pages=[99, 1, 2], is_last=False
    )
    [enq] = of(e.handle(bad, 0), EnqueueChunk)
    cmds = e.run_chunk(enq.chunk, 0)
    f = e.failure(ROOM)
    assert f.error is boom and f.error_type == "PlanError" and "page 99" in f.reason
    assert sent(cmds, m.RoomFailed)
    # The worker keeps serving: the other room's chunk goes through, the failed room's are skipped.
    assert of(run(e, chunk(0, 6, True, room=8, tid="other")), PostWrite)
    assert of(e.handle(chunk(1, 6, True), 0), ChunkSkipped)


# --- failure, abort, fence ----------------------------------------------------------------------


def test_write_failure_fails_and_fences_after_the_last_write() -> None:
    e, ids = transferring()
    last = run(e, chunk(1, 6, True))
    ids += [c.write_id for c in of(last, PostWrite) + of(last, PostAuxWrite)]
    assert len(ids) == 3
    cmds = e.handle(WriteFailed(write_id=ids[0], reason="ERR"), 0)
    assert e.state(ROOM) is SState.FAILED
    assert sent(cmds, m.RoomFailed) and not sent(cmds, m.Stopped)  # writes are still in flight
    assert not sent(e.handle(WriteDone(write_id=ids[1]), 0), m.Stopped)
    cmds = e.handle(WriteDone(write_id=ids[2]), 0)
    assert sent(cmds, m.Stopped) == [(D0, m.Stopped(src=ME, room=ROOM, transfer_id=TID))]


def test_abort_from_decode_is_acked_only_when_quiet() -> None:
    e, ids = transferring()
    abort = m.Abort(src=D0, room=ROOM, transfer_id=TID, reason="decode timeout")
    cmds = e.handle(ctl(abort), 0)
    assert e.state(ROOM) is SState.FAILED and not sent(cmds, m.Stopped)
    assert not sent(cmds, m.RoomFailed)  # the decode rank told us; no echo
    cmds = e.handle(WriteDone(write_id=ids[0]), 0)
    assert [p for p, _ in sent(cmds, m.Stopped)] == [D0]
    cmds = e.handle(ctl(abort), 0)  # a retransmitted Abort is acked again at once
    assert [p for p, _ in sent(cmds, m.Stopped)] == [D0]


def test_abort_for_unknown_room_is_acked_at_once() -> None:
    e = engine()
    cmds = e.handle(ctl(m.Abort(src=D0, room=99, transfer_id="x", reason="r")), 0)
    assert sent(cmds, m.Stopped) == [(D0, m.Stopped(src=ME, room=99, transfer_id="x"))]
    assert e.counters["abort_for_unknown_room"] == 1


def test_local_abort_and_peer_failure() -> None:
    e = waiting()
    cmds = e.handle(AbortRoom(room=ROOM, transfer_id=TID), 0)
    assert e.state(ROOM) is SState.FAILED and sent(cmds, m.RoomFailed) and sent(cmds, m.Stopped)
    e = waiting()
    e.handle(ctl(m.RoomFailed(src=D0, room=ROOM, transfer_id=TID, reason="oom")), 0)
    assert "failed on decode#0: oom" in e.failure(ROOM).reason


def test_success_then_peer_abort_agrees_on_failed_and_local_abort_is_ignored() -> None:
    e = success()
    e.handle(AbortRoom(room=ROOM, transfer_id=TID), 0)
    assert e.state(ROOM) is SState.SUCCESS
    cmds = e.handle(ctl(m.Abort(src=D0, room=ROOM, transfer_id=TID, reason="lost note")), 0)
    assert e.state(ROOM) is SState.FAILED and sent(cmds, m.Stopped)


def test_failed_room_skips_queued_chunks() -> None:
    e = waiting()
    [enq] = of(e.handle(chunk(0, 2, False), 0), EnqueueChunk)
    e.handle(AbortRoom(room=ROOM, transfer_id=TID), 0)
    cmds = e.run_chunk(enq.chunk, 0)
    assert of(cmds, ChunkSkipped)[0].reason == "room failed" and not of(cmds, PostWrite)


# --- deadlines ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "deadline", "why"),
    [
        (lambda e: e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0), 100, "bootstrapping"),
        (lambda e: waiting(e), 200, "waiting"),
        (lambda e: run(waiting(e), chunk(0, 2, False)), 300, "transferring"),
    ],
)
def test_each_wait_has_a_deadline(setup: Any, deadline: int, why: str) -> None:
    e = engine()
    setup(e)
    e.handle(Tick(), deadline - 1)
    assert e.poll(ROOM) is not KVPoll.Failed
    e.handle(Tick(), deadline)
    assert e.poll(ROOM) is KVPoll.Failed and why in e.failure(ROOM).reason


def test_transfer_deadline_is_not_renewed_by_progress() -> None:
    e, ids = transferring(now=0)
    run(e, chunk(1, 4, False), 250)
    e.handle(WriteDone(write_id=ids[0]), 290)
    e.handle(Tick(), 300)
    assert e.state(ROOM) is SState.FAILED


def test_heartbeats_and_peer_loss() -> None:
    e = waiting(SenderEngine(ME, SRC, timeouts=Timeouts(heartbeat_interval_ns=10, heartbeat_timeout_ns=50)))
    cmds = e.handle(Tick(), 10)
    assert sent(cmds, m.Heartbeat) == [(D0, m.Heartbeat(src=ME))]
    e.handle(ctl(m.Heartbeat(src=D0)), 30)  # any message renews the peer
    e.handle(Tick(), 60)
    assert e.state(ROOM) is SState.WAITING
    cmds = e.handle(Tick(), 80)
    assert of(cmds, DropPeer) and e.state(ROOM) is SState.FAILED
    assert "lost" in e.failure(ROOM).reason


def test_info_only_room_that_never_opens_is_failed_and_forgotten() -> None:
    e = engine()
    e.handle(ctl(register(D0)), 0)
    e.handle(ctl(info()), 0)
    cmds = e.handle(Tick(), 100)
    assert sent(cmds, m.RoomFailed) and ROOM not in e.rooms
    assert e.poll(ROOM) is KVPoll.Failed  # the tombstone answers
    cmds = e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 101)
    assert of(cmds, StatusChanged)[0].status is KVPoll.Failed and ROOM not in e.rooms


def test_an_open_after_its_room_failed_hears_why() -> None:
    """Decode's TransferInfo made the room, then the driver could not load decode (PeerUnusable):
    the room failed and was forgotten before our own open. The open is told the reason, not only
    that the room finished (the runtime's caller raised "room already finished" and lost it)."""
    e = engine()
    e.handle(ctl(register(D0)), 0)
    e.handle(ctl(info()), 0)
    e.handle(PeerUnusable(peer=D0, reason="RuntimeError: cannot describe this memory"), 1)
    assert ROOM not in e.rooms and e.poll(ROOM) is KVPoll.Failed
    [st_] = of(e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 2), StatusChanged)
    assert st_.status is KVPoll.Failed
    assert st_.reason.startswith("room already finished: ")
    assert "unusable here: RuntimeError: cannot describe this memory" in st_.reason


# --- release, tombstones, reuse ------------------------------------------------------------------


def test_release_clears_every_table_and_tombstone_blocks_late_messages() -> None:
    e = success()
    e.handle(ReleaseRoom(room=ROOM, transfer_id=TID), 0)
    assert e.references(ROOM) == [] and e.poll(ROOM) is KVPoll.Success
    # A late TransferInfo only gets its receipt (so decode stops resending it): no room, no write.
    late = e.handle(ctl(info()), 1)
    assert [type(c.msg) for c in late] == [m.InfoAck] and e.counters["tombstoned"] == 1
    assert ROOM not in e.rooms
    # A new request under the same room id is a new incarnation.
    e.handle(SenderOpen(room=ROOM, transfer_id="req-7b", aux_index=1), 2)
    e.handle(ctl(info(transfer_id="req-7b")), 2)
    assert e.state(ROOM) is SState.WAITING
    # A late Abort of the old incarnation does not touch the new one.
    cmds = e.handle(ctl(m.Abort(src=D0, room=ROOM, transfer_id=TID, reason="late")), 3)
    assert e.state(ROOM) is SState.WAITING and sent(cmds, m.Stopped)
    assert e.poll(ROOM) is KVPoll.WaitingForInput


def test_release_before_terminal_fails_then_waits_for_writes() -> None:
    e, ids = transferring()
    e.handle(ReleaseRoom(room=ROOM, transfer_id=TID), 0)
    assert e.state(ROOM) is SState.FAILED and "release not allowed" in e.failure(ROOM).reason
    assert ROOM in e.rooms  # a write is still in flight
    e.handle(WriteDone(write_id=ids[0]), 0)
    assert ROOM not in e.rooms and e.references(ROOM) == []


def test_tombstones_expire() -> None:
    e = success()
    e.handle(ReleaseRoom(room=ROOM, transfer_id=TID), 0)
    assert e.next_deadline() is not None
    e.handle(Tick(), 10**9)
    assert len(e.tombstones) == 0


def test_garbage_and_wrong_side_messages_are_counted() -> None:
    e = waiting()
    assert e.handle(ControlIn(data=b"\x93\x01\x02"), 0) == []
    assert e.handle(ctl(m.Stopped(src=D0, room=ROOM, transfer_id=TID)), 0) == []
    assert e.counters["wire_error"] == 1 and e.counters["wrong_side_message"] == 1
    assert e.state(ROOM) is SState.WAITING


def test_incompatible_registration_is_refused() -> None:
    e = engine()
    other = ModelGeometry("other", num_layers=3, num_kv_heads=2, head_dim=4)
    pool = PoolGeometry(other, 1, 0, 2, 32)
    reg = register(D0)
    reg = m.Register(
        **{**{f: getattr(reg, f) for f in reg.__struct_fields__}, "geometry": m.GeometryWire.from_pool(pool)}
    )
    [(_peer, ack)] = sent(e.handle(ctl(reg), 0), m.RegisterAck)
    assert not ack.ok and not ack.retry and "num_layers" in ack.reason and D0 not in e.peers


# --- every (state, input) pair ----------------------------------------------------------------------


def in_state(state: SState) -> tuple[SenderEngine, list[int]]:
    if state is SState.BOOTSTRAPPING:
        e = engine()
        e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0)
        return e, []
    if state is SState.WAITING:
        return waiting(), []
    if state is SState.TRANSFERRING:
        return transferring()
    if state is SState.SUCCESS:
        return success(), []
    e, ids = transferring()
    e.handle(AbortRoom(room=ROOM, transfer_id=TID), 0)
    return e, ids


endpoints = st.sampled_from([D0, D1, D2])
chunks = st.builds(
    ChunkReady,
    room=st.just(ROOM),
    transfer_id=st.just(TID),
    chunk_index=st.integers(0, 3),
    token_end=st.integers(0, 10),
    src_pages=st.one_of(
        st.just(PAGES), st.lists(st.integers(-2, 40), max_size=6).map(lambda x: np.array(x, dtype=np.int64))
    ),
    is_last=st.booleans(),
)
infos = st.builds(
    lambda src, pages, n, exp, dummy, aux: info(
        src, exp, n, dst_pages=pages, dummy=dummy, send_aux=aux and not dummy
    ),
    endpoints,
    st.lists(st.integers(0, 40), max_size=6),
    st.integers(0, 10),
    st.integers(1, 3),
    st.booleans(),
    st.booleans(),
)
PAYLOADS: dict[Any, Any] = {
    SIn.OPEN: st.builds(
        SenderOpen, room=st.just(ROOM), transfer_id=st.just(TID), aux_index=st.integers(0, 8)
    ),
    SIn.INFO: infos,
    SIn.PEER_READY: endpoints,
    SIn.CHUNK: chunks,
    SIn.RUN_CHUNK: chunks,
    SIn.LAYERS: st.builds(
        LayersReady,
        room=st.just(ROOM),
        transfer_id=st.just(TID),
        chunk_index=st.integers(0, 3),
        first_layer=st.integers(0, 2),
        end_layer=st.integers(1, 3),
    ),
    SIn.WRITE_DONE: st.builds(WriteDone, write_id=st.integers(0, 5)),
    SIn.WRITE_FAILED: st.builds(WriteFailed, write_id=st.integers(0, 5)),
    SIn.ABORT_LOCAL: st.builds(AbortRoom, room=st.just(ROOM), transfer_id=st.just(TID)),
    SIn.ABORT_PEER: st.builds(
        m.Abort, src=endpoints, room=st.just(ROOM), transfer_id=st.just(TID), reason=st.text(max_size=5)
    ),
    SIn.PEER_FAILED: st.builds(
        m.RoomFailed, src=endpoints, room=st.just(ROOM), transfer_id=st.just(TID), reason=st.text(max_size=5)
    ),
    SIn.TIMEOUT: st.none(),
    SIn.PEER_LOST: endpoints,
    SIn.RELEASE: st.builds(ReleaseRoom, room=st.just(ROOM), transfer_id=st.just(TID)),
    StagedTxIn.STAGING_RSP: st.builds(
        m.StagingRsp,
        src=endpoints,
        room=st.just(ROOM),
        transfer_id=st.just(TID),
        chunk_index=st.integers(0, 3),
        reg=st.integers(0, 3),
        ok=st.booleans(),
        alloc_id=st.integers(0, 3),
        round=st.integers(0, 3),
        start=st.integers(0, 64),
        end=st.integers(0, 64),
        offset=st.integers(0, 64),
    ),
    StagedTxIn.COPY_DONE: st.builds(CopyDone, op_id=st.integers(0, 5)),
    StagedTxIn.COPY_FAILED: st.builds(CopyFailed, op_id=st.integers(0, 5)),
    PullTxIn.PULLED: st.builds(
        m.Pulled, src=endpoints, room=st.just(ROOM), transfer_id=st.just(TID), chunk_index=st.integers(0, 3)
    ),
    PullTxIn.READS_STOPPED: st.builds(
        m.ReadsStopped, src=endpoints, room=st.just(ROOM), transfer_id=st.just(TID)
    ),
    # The failure funnel's own input (TableEngine.fail): a reason and the side's options.
    SIn.FAIL: st.tuples(st.builds(RoomFailure, st.text(min_size=1, max_size=5)), st.just({})),
}


@settings(max_examples=300)
@given(state=st.sampled_from(list(SState)), inp=st.sampled_from(list(PAYLOADS)), data=st.data())
def test_every_state_input_pair(state: SState, inp: Any, data: st.DataObject) -> None:
    """Every input of the room's table, the flows' own (``StagedTxIn``) included."""
    e, _ = in_state(state)
    payload = data.draw(PAYLOADS[inp])
    before = e.poll(ROOM)
    try:
        e.apply(ROOM, inp, payload, 1)  # must not raise, except to a local caller's own mistake
    except LocalMisuseError:
        assert inp in (SIn.CHUNK, SIn.LAYERS) and e.poll(ROOM) is before
        return
    if ROOM not in e.rooms:  # released (a release before terminal fails the room first)
        assert inp is SIn.RELEASE
        assert e.poll(ROOM) is (KVPoll.Success if state is SState.SUCCESS else KVPoll.Failed)
        return
    after = e.state(ROOM)
    tr = e.transition(state, inp)
    if tr is None:
        assert after is SState.FAILED and "not allowed" in e.failure(ROOM).reason
    else:
        assert after in tr.targets or after is SState.FAILED
    if after is SState.FAILED:
        assert e.failure(ROOM) is not None and e.failure(ROOM).reason
    assert advance(before, e.poll(ROOM)) is e.poll(ROOM)  # monotone, Failed absorbing


def test_table_covers_every_state() -> None:
    assert set(SENDER_TABLE) == set(SState)
    assert set(SENDER_TABLE[SState.FAILED]) == set(SIn)  # Failed absorbs every input
    # The engine runs SENDER_TABLE with its flow components' own inputs added (core/flows/parts.py).
    e = engine()
    assert all(e.transition(SState.FAILED, i) is not None for i in PAYLOADS)
    assert all(e.transition(st_, i) is tr for st_, row in SENDER_TABLE.items() for i, tr in row.items())


def test_restarted_decode_rank_fails_rooms_bound_to_its_past_life() -> None:
    """A decode rank that restarts within the heartbeat timeout re-registers with a new agent; rooms
    whose pages it named before must fail, never be written into the new incarnation's pages."""
    e, _ = transferring()
    old = register(D0)
    new = m.Register(**{**{f: getattr(old, f) for f in old.__struct_fields__}, "agent_meta": b"meta-2"})
    cmds = e.handle(ctl(new), 10)
    assert [type(c) for c in cmds if type(c) in (DropPeer, AddPeer)] == [DropPeer, AddPeer]
    assert e.state(ROOM) is SState.FAILED and "restarted" in e.failure(ROOM).reason
    assert [p for p, _ in sent(cmds, m.RoomFailed)] == [D0]
    # The new incarnation's rooms work; a late TransferInfo of the old one never becomes ready.
    e.handle(SenderOpen(room=8, transfer_id="b", aux_index=3), 11)
    e.handle(ctl(info(room=8, transfer_id="b", reg=m.registration_id(new))), 11)
    assert e.state(8) is SState.WAITING
    e.handle(SenderOpen(room=9, transfer_id="c", aux_index=4), 12)
    cmds = e.handle(ctl(info(room=9, transfer_id="c")), 12)
    assert sent(cmds, m.RegisterAck)[0][1].retry and e.state(9) is SState.BOOTSTRAPPING
    # A resent Register of the same incarnation changes nothing.
    assert not [c for c in e.handle(ctl(new), 13) if type(c) in (DropPeer, AddPeer)]
    assert e.state(8) is SState.WAITING


def test_an_engine_bug_on_peer_input_is_counted_not_raised() -> None:
    e = waiting()

    def broken(msg: Any) -> None:
        raise RuntimeError("bug")

    e._on_info = broken  # type: ignore[method-assign]
    assert e.handle(ctl(info(D1, expected=2)), 0) == []
    assert e.counters["internal_error"] == 1 and str(e.last_internal_error) == "bug"
    assert e.state(ROOM) is SState.WAITING


# --- failure notices (RoomFailed resent until answered) -------------------------------------------


def test_room_failed_is_resent_until_failed_ack_then_stops() -> None:
    e = waiting()
    e.handle(AbortRoom(room=ROOM, transfer_id=TID), 0)
    assert (ROOM, TID) in e.notices
    e.handle(ReleaseRoom(room=ROOM, transfer_id=TID), 0)
    assert ROOM not in e.rooms and e.references(ROOM) == []  # the notice outlives the room
    cmds = e.handle(Tick(), T.heartbeat_interval_ns)
    assert [p for p, _ in sent(cmds, m.RoomFailed)] == [D0]
    e.handle(ctl(m.FailedAck(src=D0, room=ROOM, transfer_id=TID, known=True)), 15)
    assert e.notices == {} and ("notice", (ROOM, TID)) not in e.deadlines
    assert not sent(e.handle(Tick(), 10 * T.heartbeat_interval_ns), m.RoomFailed)
    assert e.counters["failure_notice_unknown"] == 0


def test_abort_from_the_peer_answers_the_notice_and_unknown_acks_are_counted() -> None:
    e = waiting()
    e.handle(AbortRoom(room=ROOM, transfer_id=TID), 0)
    e.handle(ctl(m.Abort(src=D0, room=ROOM, transfer_id=TID, reason="r")), 1)
    assert e.notices == {}
    e = waiting()
    e.handle(AbortRoom(room=ROOM, transfer_id=TID), 0)
    e.handle(ctl(m.FailedAck(src=D1, room=ROOM, transfer_id=TID, known=True)), 1)  # not asked
    assert (ROOM, TID) in e.notices
    e.handle(ctl(m.FailedAck(src=D0, room=ROOM, transfer_id=TID, known=False)), 1)
    assert e.notices == {} and e.counters["failure_notice_unknown"] == 1


def test_room_failed_resend_gives_up_after_fence_ns() -> None:
    e = waiting()
    e.handle(AbortRoom(room=ROOM, transfer_id=TID), 0)
    now, resent = 0, 0
    while e.notices:
        now = e.next_deadline()
        resent += len(sent(e.handle(Tick(), now), m.RoomFailed))
    assert now >= T.fence_ns and resent == T.fence_ns // T.heartbeat_interval_ns - 1
    assert e.counters["failure_notice_gave_up"] == 1
    assert all(k[0] in ("hb", "loss", "room") for k in e.deadlines.live_keys())


def test_failure_caused_by_the_peer_needs_no_notice_to_it() -> None:
    e = waiting()
    e.handle(ctl(m.RoomFailed(src=D0, room=ROOM, transfer_id=TID, reason="oom")), 0)
    assert e.state(ROOM) is SState.FAILED and e.notices == {}


def test_open_supersedes_a_room_only_a_stale_transfer_info_made() -> None:
    e = engine()
    e.handle(ctl(register(D0)), 0)
    e.handle(ctl(info(transfer_id="old")), 0)  # e.g. replayed after its tombstone expired
    assert e.rooms[ROOM].tid == "old"
    cmds = e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0)
    assert e.rooms[ROOM].tid == TID and e.counters["ghost_superseded"] == 1
    assert e.tombstones.get(ROOM, "old") is KVPoll.Failed
    assert [(c.transfer_id, c.status) for c in of(cmds, StatusChanged)] == [
        ("old", KVPoll.Failed),
        (TID, KVPoll.Bootstrapping),
    ]
    # A room the local scheduler opened is never displaced that way.
    cmds = e.handle(SenderOpen(room=ROOM, transfer_id="third", aux_index=1), 0)
    assert e.rooms[ROOM].tid == TID
    assert [(c.transfer_id, c.status) for c in of(cmds, StatusChanged)] == [("third", KVPoll.Failed)]


def test_peer_violations_are_counted_apart_from_our_own_late_errors() -> None:
    # A decode rank that contradicts itself is a peer's violation: counted.
    e = waiting()
    e.handle(ctl(info(dst_pages=[5, 6, 7])), 0)
    assert "conflicting TransferInfo" in e.failure(ROOM).reason and e.counters["remote_violation"] == 1
    # Our own chunk found too long at run time fails the room too, but blames no peer.
    e = engine()
    e.handle(SenderOpen(room=ROOM, transfer_id=TID, aux_index=1), 0)
    e.handle(chunk(0, 7, True), 0)
    e.handle(ctl(register(D0)), 0)
    [enq] = of(e.handle(ctl(info()), 0), EnqueueChunk)
    e.run_chunk(enq.chunk, 0)
    assert e.failure(ROOM) is not None and e.counters["remote_violation"] == 0
