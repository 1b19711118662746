"""Reliable failure notices, and late messages after a tombstone expired (over the harness).

A prefill rank that fails after its last write already landed leaves decode Success unless decode
hears it: RoomFailed is resent every heartbeat interval until decode answers (FailedAck), for at
most ``fence_ns``. Decode in Success (live or tombstoned) that hears it turns Failed: Failed
overrides and sticks, so both sides end Failed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvferry.core import messages as m
from kvferry.core.kvpoll import KVPoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H

T = H.TEST_TIMEOUTS


def _decoded(msg: H.PendingMsg) -> object:
    return m.decode_note(msg.data) if msg.note else m.decode_control(msg.data)


def _drop(w: H.World, kind: type) -> int:
    """Drop every pending control message of type ``kind``; how many were dropped."""
    keep = [p for p in w.fabric.pending if p.note or type(_decoded(p)) is not kind]
    n = len(w.fabric.pending) - len(keep)
    w.fabric.pending = keep
    return n


def _deliver_all(w: H.World) -> None:
    while w.fabric.pending:
        w.deliver(0)


def _fail_prefill_with_write_in_flight(w: H.World, room: int, tid: str) -> H.Request:
    """Prefill aborts after posting every write; the writes still land afterwards."""
    req = w.open_room(room, tid, 6, [6])
    assert req is not None
    _deliver_all(w)  # Register, TransferInfo, RegisterAck
    assert w.chunk_ready(req, 0)
    assert w.run_worker(0, room % 2)
    assert w.fabric.writes, "the chunk's writes are in flight"
    w.abort(req, "prefill", 0)
    assert w.history[("prefill", 0, room, tid)] is KVPoll.Failed
    assert _drop(w, m.RoomFailed) == 1  # the first notice is lost
    while w.fabric.writes:  # the posted writes cannot be cancelled: they land
        w.fabric.complete(0)
        w.pump()
    _deliver_all(w)  # notes (then the fence, Stopped, which Success ignores)
    assert w.history[("decode", 0, room, tid)] is KVPoll.Success
    return req


def test_lost_room_failed_is_resent_and_decode_success_turns_failed() -> None:
    w = H.World(H.TINY, 1, 1, seed=1)
    req = _fail_prefill_with_write_in_flight(w, 3, "a")
    pre = w.prefill[0].engine
    assert (3, "a") in pre.notices
    w.advance(T.heartbeat_interval_ns)
    assert pre.counters["failure_resent"] == 1
    _deliver_all(w)  # the resent RoomFailed, then decode's FailedAck (and Abort / Stopped)
    _deliver_all(w)
    assert w.history[("decode", 0, 3, "a")] is KVPoll.Failed
    assert pre.notices == {}
    w.heal_and_settle()
    assert w.violations == [] and w.internal_errors() == []
    assert w.history[("prefill", 0, 3, "a")] is KVPoll.Failed
    assert req.freed == {0}
    assert pre.notices == {}


def test_notice_reaches_a_released_success_room_through_its_tombstone() -> None:
    w = H.World(H.TINY, 1, 1, seed=2)
    _fail_prefill_with_write_in_flight(w, 4, "b")
    w.release_terminal()  # decode releases its Success room: only the tombstone is left
    assert 4 not in w.decode[0].engine.rooms
    w.advance(T.heartbeat_interval_ns)
    _deliver_all(w)
    _deliver_all(w)
    dec = w.decode[0].engine
    assert dec.counters["failed_after_release"] == 1
    assert dec.poll(4) is KVPoll.Failed
    assert w.history[("decode", 0, 4, "b")] is KVPoll.Failed
    assert w.prefill[0].engine.notices == {}


def test_resend_gives_up_after_fence_ns_and_cleans_up() -> None:
    w = H.World(H.TINY, 1, 1, seed=3)
    w.fabric.failure_streams = {}
    _fail_prefill_with_write_in_flight(w, 5, "c")
    pre = w.prefill[0].engine
    start = w.fabric.now
    while w.fabric.now <= start + T.fence_ns + T.heartbeat_interval_ns:
        w.advance(T.heartbeat_interval_ns)
        _drop(w, m.RoomFailed)  # a network that loses every copy, however often it is sent
        _deliver_all(w)  # heartbeats still flow: the peer is alive, just deaf to this room
    assert pre.notices == {}
    assert pre.counters["failure_notice_gave_up"] == 1
    assert pre.counters["failure_resent"] >= T.fence_ns // T.heartbeat_interval_ns - 1
    assert all(k[0] in ("hb", "loss", "room") for k in pre.deadlines.live_keys())
    # Two generals: decode never heard, so here (and only here) the outcomes differ. The
    # stateful test exempts exactly this from its agreement check: a stream resent for at least
    # half the window with no copy delivered.
    assert w.history[("decode", 0, 5, "c")] is KVPoll.Success
    first, last, delivered = w.fabric.failure_streams[
        (5, "c", w.prefill[0].endpoint, w.decode[0].endpoint, "RoomFailed")
    ]
    assert not delivered and last - first >= T.fence_ns // 2


def test_unknown_room_is_acked_as_unknown() -> None:
    w = H.World(H.TINY, 1, 1, seed=4)
    dec = w.decode[0].engine
    src = w.prefill[0].endpoint
    rf = m.RoomFailed(src=src, room=77, transfer_id="gone", reason="x")
    w.decode[0].transport.inbox.append(m.encode(rf))
    w.pump()
    acks = [_decoded(p) for p in w.fabric.pending if not p.note]
    acks = [a for a in acks if isinstance(a, m.FailedAck)]
    assert acks == [m.FailedAck(src=dec.endpoint, room=77, transfer_id="gone", known=False)]


def test_late_messages_after_tombstone_expiry_never_touch_a_new_room() -> None:
    """The old incarnation's messages, replayed after every tombstone of it expired, while a new
    request runs under the same room id (same pages: the allocators hand them out again)."""
    w = H.World(H.TINY, 1, 1, seed=5, num_pages=4)
    w.fabric.failure_streams = None
    log: list[H.PendingMsg] = []
    old = w.open_room(8, "old", 6, [2, 6])
    assert old is not None
    for p in range(w.P):
        while w.chunk_ready(old, p):
            pass
    # Run the old room to Success, keeping a copy of everything that crossed the network.
    deliver = w.fabric.deliver

    def logged(i: int) -> m.Endpoint:
        log.append(w.fabric.pending[i])
        return deliver(i)

    w.fabric.deliver = logged  # type: ignore[method-assign]
    w.flush()
    w.fabric.deliver = deliver  # type: ignore[method-assign]
    w.release_terminal()
    assert w.history[("decode", 0, 8, "old")] is KVPoll.Success
    w.advance(w.prefill[0].engine.tombstones.longest + 1)  # expiries fall on a grid past the ttl
    w.advance(1)
    assert len(w.prefill[0].engine.tombstones) == 0 and len(w.decode[0].engine.tombstones) == 0
    assert log and any(x.note for x in log)

    def replay() -> None:
        for x in log:
            t = w.fabric.transports[x.dst]
            (t.notes if x.note else t.inbox).append(x.data)
        w.pump()

    replay()  # before the new request exists: the old TransferInfo makes a ghost room on prefill
    assert w.prefill[0].engine.rooms[8].tid == "old"
    new = w.open_room(8, "new", 6, [6])
    assert new is not None
    assert set(new.dst_pages.tolist()) & set(old.dst_pages.tolist()), "pages reused"
    assert w.prefill[0].engine.counters["ghost_superseded"] == 1  # the ghost never wrote

    replay()  # before the new room's handshake completes
    _deliver_all(w)
    replay()  # during its transfer
    assert w.chunk_ready(new, 0)
    w.flush()
    replay()  # after its Success
    w.heal_and_settle()
    assert w.violations == [] and w.internal_errors() == []  # no write outside the new room's pages
    assert w.history[("decode", 0, 8, "new")] is KVPoll.Success
    assert w.history[("prefill", 0, 8, "new")] is KVPoll.Success
    assert (8, "new", 0) in w.success_checked  # bytes equal to the new room's source
    # The old incarnation's outcome was not rewritten either.
    assert w.history[("decode", 0, 8, "old")] is KVPoll.Success
