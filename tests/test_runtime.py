"""Threaded runtime in one process over real NIXL (DRAM): the API, error propagation, shutdown.

The two-process proof is tests/test_nixl_e2e.py; here each case pokes one behaviour: an
exception keeps its type up to ``failure_exception()``, a NIXL error fails one room (and reaches
decode as an explicit failure) while the worker goes on, threads join on close.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.backends import pattern
from kvferry.backends.nixl.errors import NixlXferError
from kvferry.backends.runtime import (
    DecodeEndpoint,
    EndpointClosedError,
    KVTransferError,
    PrefillEndpoint,
    RuntimeConfig,
    sender_specs,
)
from kvferry.backends.runtime.board import StatusBoard
from kvferry.backends.runtime.loops import Loop
from kvferry.backends.runtime.staging import StagingConfig
from kvferry.core.deadlines import MS, SEC, Timeouts
from kvferry.core.errors import LocalMisuseError, ProtocolError
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.core.messages import decode_note

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_setup import MODEL, TIMEOUTS, two_to_one


@pytest.fixture
def servers(request):
    """Two prefill ranks and one decode rank; the flow is ``direct`` unless a test asks for
    another (``indirect`` parametrization)."""
    flow = getattr(request, "param", "direct")
    staging = StagingConfig(
        worker_buffer_bytes=32 << 10,
        ring_bytes=64 << 10,
        pinned_bytes=64 << 10,
        prefill_pinned_bytes=64 << 10,
        flow=flow,
    )
    cfg = RuntimeConfig(num_queues=2, aux_rows=16, timeouts=TIMEOUTS, staging=staging)
    pre, dec = two_to_one(cfg, 32)
    for e in [*pre, dec]:
        e.start()
    yield pre, dec
    for e in [*pre, dec]:
        assert e.close() == []


def _room(pre, dec, room, tid, pages, tokens, chunks, aux=0):
    rv = dec.receiver(room, tid)
    rv.init(pages, tokens, aux)
    senders = []
    for p in pre:
        pattern.fill(p.pool, p.transport.region, room, pages, 0, tokens)
        s = p.sender(room, tid)
        s.write_aux(aux, room.to_bytes(8, "little"))
        s.init(aux)
        senders.append(s)
    for i, end in enumerate(chunks):
        for s in senders:
            s.send(pages, end, is_last=i == len(chunks) - 1)
    return rv, senders


def _settle(rv, senders, timeout_s=20.0):
    return rv.wait(timeout_s), [s.wait(timeout_s) for s in senders]


@pytest.mark.parametrize("servers", ["direct", "ring", "pinned"], indirect=True)
def test_rooms_succeed_and_tables_empty_after_clear(servers):
    pre, dec = servers
    for i in range(6):
        pages = np.arange(i * 4, i * 4 + 4)
        rv, senders = _room(pre, dec, 100 + i, f"t{i}", pages, 13, [5, 13], aux=i)
        assert _settle(rv, senders) == (KVPoll.Success, [KVPoll.Success] * 2)
        assert pattern.mismatches(dec.pool, dec.transport.region, 100 + i, pages, 13)[0] == 0
        rv.failure_exception()  # no failure: returns quietly
        rv.clear()
        for s in senders:
            s.clear()
        with pytest.raises(KVTransferError):
            rv.poll()  # cleared: not tracked any more
        # A cleared handle is our own caller's mistake: a typed local error, nothing sent.
        with pytest.raises(LocalMisuseError, match="cleared"):
            senders[0].send(pages, 13, True)
        with pytest.raises(LocalMisuseError, match="cleared"):
            rv.abort()
    deadline = time.monotonic() + 10
    while any(v for e in [*pre, dec] for v in e.leaks().values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(v == 0 for e in [*pre, dec] for v in e.leaks().values())
    tel = pre[0].transport.agent.telemetry.totals()
    assert tel.transfers >= 12 and tel.errors == 0 and tel.descs_posted <= tel.descs_requested


@pytest.mark.parametrize("flow", ["direct", "ring"])
def test_a_worker_keeps_several_chunks_in_flight_and_every_room_lands(flow):
    """worker_chunks_in_flight=3: one worker (one queue) posts up to three chunks before it waits
    for the oldest; rooms of three chunks each all succeed with their bytes, and every table is
    empty after. Under direct the worker is held until its queue has chunks waiting (a controlled
    start, not timing), and then really posts a second and third chunk before waiting."""
    staging = StagingConfig(worker_buffer_bytes=32 << 10, ring_bytes=128 << 10, flow=flow)
    cfg = RuntimeConfig(
        num_queues=1, aux_rows=16, timeouts=TIMEOUTS, staging=staging, worker_chunks_in_flight=3
    )
    pre, dec = two_to_one(cfg, 64)
    depth: list[int] = []
    go = threading.Event()
    step = pre[0].driver.worker_step

    def counted(shard, now):
        go.wait(10)
        depth.append(len(pre[0]._in_flight[shard]))
        return step(shard, now)

    pre[0].driver.worker_step = counted

    def queued() -> int:
        with pre[0].lock:
            return len(pre[0].driver.queues[0])

    try:
        for e in [*pre, dec]:
            e.start()
        rooms = []
        for i in range(6):
            pages = np.arange(i * 4, i * 4 + 4)
            rooms.append((200 + i, pages, *_room(pre, dec, 200 + i, f"w{i}", pages, 13, [4, 9, 13], aux=i)))
        deadline = time.monotonic() + 10
        while flow == "direct" and queued() < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        go.set()
        for room, pages, rv, senders in rooms:
            assert _settle(rv, senders) == (KVPoll.Success, [KVPoll.Success] * 2)
            assert pattern.mismatches(dec.pool, dec.transport.region, room, pages, 13)[0] == 0
            rv.clear()
            for s in senders:
                s.clear()
        if flow == "direct":  # three chunks were queued when the worker started
            assert depth[:3] == [0, 1, 2]
        assert max(depth) <= 2  # never a fourth chunk before the oldest finished
        deadline = time.monotonic() + 10
        while any(v for e in [*pre, dec] for v in e.leaks().values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(v == 0 for e in [*pre, dec] for v in e.leaks().values())
    finally:
        go.set()
        for e in [*pre, dec]:
            assert e.close() == []


def _one_to_one(cfg: RuntimeConfig, pages: int) -> tuple[list[PrefillEndpoint], DecodeEndpoint]:
    pre = [PrefillEndpoint("P", PoolGeometry(MODEL, 1, 0, 4, pages), config=cfg)]
    dec = DecodeEndpoint(
        "D",
        PoolGeometry(MODEL, 1, 0, 4, pages),
        prefill_server="P",
        prefill_addresses=[pre[0].address],
        config=cfg,
    )
    return pre, dec


@pytest.mark.parametrize("flow", ["direct", "pull"])
@pytest.mark.parametrize("tp", ["1->1", "2->1"])
def test_one_shot_posts_move_the_same_bytes_and_auto_picks_by_run_length(flow, tp):
    """nixl_direct_post: "oneshot" hands NIXL each planner run as one descriptor built per post,
    "prepped" as index runs into lists prepared once, "auto" the first when runs are long (many
    granules each: TP 1 -> 1's page runs), the second when they are not (TP 2 -> 1's per-token
    head slices). Chunked rooms land every byte every way; the telemetry says which way they went."""
    requested = {}
    for how in ("prepped", "oneshot", "auto"):
        staging = StagingConfig(flow=flow)
        cfg = RuntimeConfig(
            num_queues=2, aux_rows=16, timeouts=TIMEOUTS, staging=staging, nixl_direct_post=how
        )
        pre, dec = _one_to_one(cfg, 64) if tp == "1->1" else two_to_one(cfg, 64)
        try:
            for e in [*pre, dec]:
                e.start()
            for i in range(4):
                pages = np.arange(i * 16, i * 16 + 16)
                rv, senders = _room(pre, dec, 300 + i, f"o{i}", pages, 61, [40, 61], aux=i)
                assert _settle(rv, senders) == (KVPoll.Success, [KVPoll.Success] * len(pre))
                assert pattern.mismatches(dec.pool, dec.transport.region, 300 + i, pages, 61)[0] == 0
                rv.clear()
                for s in senders:
                    s.clear()
            mover = dec if flow == "pull" else pre[0]
            tel = mover.transport.agent.telemetry.totals()
            assert tel.transfers > 0 and tel.errors == 0
            requested[how] = (tel.descs_requested, tel.descs_posted)
        finally:
            for e in [*pre, dec]:
                assert e.close() == []
    assert requested["oneshot"][0] == requested["oneshot"][1]  # a row is a descriptor
    if tp == "1->1":  # runs of 10 pages and of 21 tokens: many prepared indices each
        assert requested["prepped"][0] > 8 * requested["oneshot"][0]
        assert requested["auto"] == requested["oneshot"]
    else:  # a token's head slice per run: one index each, so auto keeps the prepared lists
        assert requested["auto"] == requested["prepped"]


def test_an_unknown_direct_post_is_refused():
    cfg = RuntimeConfig(num_queues=1, timeouts=TIMEOUTS, nixl_direct_post="fast")
    with pytest.raises(ValueError, match="direct_post must be one of"):
        PrefillEndpoint("P", PoolGeometry(MODEL, 1, 0, 4, 8), config=cfg)


def test_worker_chunks_in_flight_must_be_positive():
    cfg = RuntimeConfig(num_queues=1, timeouts=TIMEOUTS, worker_chunks_in_flight=0)
    with pytest.raises(ValueError, match="worker_chunks_in_flight must be >= 1"):
        PrefillEndpoint("P", PoolGeometry(MODEL, 1, 0, 4, 8), config=cfg)


def test_core_exception_keeps_its_type_and_reaches_decode(servers):
    pre, dec = servers
    pages = np.arange(8)
    # The chunk claims more tokens than decode will allocate, handed over before decode's
    # TransferInfo could say so (the receiver is opened after the sends): the core finds it in
    # the worker step, and the room fails with the error's type on prefill and a notice on decode.
    senders = []
    for p in pre:
        pattern.fill(p.pool, p.transport.region, 7, pages, 0, 10)
        tx = p.sender(7, "bad")
        tx.write_aux(0, (7).to_bytes(8, "little"))
        tx.init(0)
        tx.send(pages, 20, is_last=True)
        senders.append(tx)
    rv = dec.receiver(7, "bad")
    rv.init(pages, 10, 0)
    assert _settle(rv, senders) == (KVPoll.Failed, [KVPoll.Failed] * 2)
    # The rank whose worker finds the error keeps its type; the other may hear of it from decode
    # first (whichever is faster: both orders were seen, CPU and H100), with the reason.
    raised = []
    for s in senders:
        with pytest.raises((ProtocolError, KVTransferError), match="past decode's 10") as info:
            s.failure_exception()
        raised.append(info.type)
    assert any(issubclass(t, ProtocolError) for t in raised), raised
    with pytest.raises(KVTransferError, match="failed on P#"):
        rv.failure_exception()


def test_a_chunk_past_a_known_allocation_is_raised_to_the_caller(servers):
    pre, dec = servers
    pages = np.arange(8, 16)
    rv, senders = _room(pre, dec, 8, "known", pages, 10, [])
    deadline = time.monotonic() + 20
    while any(s.poll() is not KVPoll.WaitingForInput for s in senders) and time.monotonic() < deadline:
        time.sleep(0.01)  # until every TransferInfo (with the length) is in
    with pytest.raises(LocalMisuseError, match="past the 10 tokens"):
        senders[0].send(pages, 20, is_last=True)
    assert senders[0].poll() is KVPoll.WaitingForInput  # the room is untouched by our mistake
    for s in senders:
        s.send(pages, 10, is_last=True)
    assert _settle(rv, senders) == (KVPoll.Success, [KVPoll.Success] * 2)


def test_nixl_error_fails_one_room_worker_survives(servers, monkeypatch):
    pre, dec = servers
    real = pre[1].transport.post_write
    bad_room = 42
    calls = {"n": 0}

    def flaky(peer, *args):
        calls["n"] += 1
        if calls["n"] == 1:  # the first post of this rank (room 42's only chunk)
            raise NixlXferError("injected: NIXL_ERR_BACKEND")
        return real(peer, *args)

    monkeypatch.setattr(pre[1].transport, "post_write", flaky)
    rv, senders = _room(pre, dec, bad_room, "x", np.arange(4), 8, [8])
    assert _settle(rv, senders)[0] is KVPoll.Failed
    assert senders[1].poll() is KVPoll.Failed
    with pytest.raises(NixlXferError, match="injected"):
        senders[1].failure_exception()  # the original exception, not a text reason
    with pytest.raises(KVTransferError, match="failed on P#1"):
        rv.failure_exception()  # explicit failure from prefill, not a decode timeout
    # Same workers, next room: fine.
    rv2, senders2 = _room(pre, dec, 43, "y", np.arange(4, 8), 8, [4, 8], aux=1)
    assert _settle(rv2, senders2) == (KVPoll.Success, [KVPoll.Success] * 2)
    assert all(lp.thread.is_alive() for lp in pre[1]._loops)


def test_worker_exception_outside_core_keeps_type(servers, monkeypatch):
    pre, dec = servers

    class Boom(RuntimeError):
        pass

    real = pre[0].driver.worker_step
    fired = threading.Event()

    def broken(shard, now):
        if not fired.is_set():
            fired.set()
            pre[0].driver.queues[shard].popleft()  # the chunk is consumed, then the bug hits
            raise Boom("worker bug")
        return real(shard, now)

    monkeypatch.setattr(pre[0].driver, "worker_step", broken)
    rv, senders = _room(pre, dec, 9, "b", np.arange(4), 8, [8])
    assert _settle(rv, senders)[0] is KVPoll.Failed
    assert senders[0].poll() is KVPoll.Failed
    with pytest.raises(Boom):
        senders[0].failure_exception()
    assert any(isinstance(e, Boom) for e in pre[0].errors)
    rv2, senders2 = _room(pre, dec, 10, "c", np.arange(4, 8), 8, [8], aux=1)
    assert _settle(rv2, senders2) == (KVPoll.Success, [KVPoll.Success] * 2)


def test_decode_abort_fails_both_sides_and_fences_pages(servers):
    pre, dec = servers
    freed = []
    dec.on_free_pages = lambda room, tid: freed.append(room)
    rv = dec.receiver(11, "a")
    rv.init(np.arange(4), 8, 0)
    senders = [p.sender(11, "a") for p in pre]
    for s in senders:
        s.init(0)
    rv.abort("test")
    assert _settle(rv, senders) == (KVPoll.Failed, [KVPoll.Failed] * 2)
    deadline = time.monotonic() + 10
    while not rv.pages_freed() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rv.pages_freed() and freed == [11]  # every sender confirmed Stopped


def _gate_posts(monkeypatch, ep, gate):
    """Route ``ep``'s real NIXL posts through ``gate(room)`` first (called in the posting thread)."""
    real = ep.transport.post_write

    def gated(peer, *args):
        gate(decode_note(args[-1]).room)
        return real(peer, *args)

    monkeypatch.setattr(ep.transport, "post_write", gated)


def test_blocked_post_stalls_no_other_room_and_abort_waits_for_it(servers, monkeypatch):
    """The driver used to hold its lock through every post, so one slow post (a TP 2->1
    room is ~300k descriptors) stalled every worker, the progress thread and every API call.
    Room 10 (shard 0) blocks inside its post on P#0; room 11 (shard 1) must still complete, and
    an abort of room 10 lands while that post is in flight but cannot fence decode's pages
    until the post returned and its write finished."""
    pre, dec = servers
    release, entered = threading.Event(), threading.Event()

    def gate(room):
        if room == 10:
            entered.set()
            release.wait(30)

    _gate_posts(monkeypatch, pre[0], gate)
    try:
        rv10, s10 = _room(pre, dec, 10, "blocked", np.arange(0, 4), 13, [13], aux=0)
        assert entered.wait(10)
        rv11, s11 = _room(pre, dec, 11, "free", np.arange(4, 8), 13, [5, 13], aux=1)
        assert _settle(rv11, s11, timeout_s=10) == (KVPoll.Success, [KVPoll.Success] * 2)
        assert pattern.mismatches(dec.pool, dec.transport.region, 11, np.arange(4, 8), 13)[0] == 0
        rv10.abort("scheduler gave up")
        assert _settle(rv10, s10[:1], timeout_s=10) == (KVPoll.Failed, [KVPoll.Failed])
        # The write being posted is still in flight for P#0's core: no Stopped, no page reuse.
        assert pre[0].driver.posting == 2  # its KV write, and the aux row queued behind it
        with pre[0].lock:
            assert any(key[0] == 10 for key in pre[0].engine.writes.values())
        assert not rv10.pages_freed()
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while not rv10.pages_freed() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rv10.pages_freed() and pre[0].driver.posting == 0
    for h in [rv10, rv11, *s10, *s11]:
        h.clear()
    deadline = time.monotonic() + 10
    while any(v for e in [*pre, dec] for v in e.leaks().values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(v == 0 for e in [*pre, dec] for v in e.leaks().values())


def test_workers_post_concurrently_into_one_agent(servers, monkeypatch):
    """Both workers of P#0 must be inside a real NIXL post at the same time (a barrier that only
    opens with two parties); under the old single driver lock the barrier broke and both rooms
    failed with a refused post."""
    pre, dec = servers
    barrier = threading.Barrier(2, timeout=10)
    _gate_posts(monkeypatch, pre[0], lambda room: barrier.wait() if room in (20, 21) else None)
    rooms = [_room(pre, dec, 20 + k, f"c{k}", np.arange(4 * k, 4 * k + 4), 13, [13], aux=k) for k in range(2)]
    for k, (rv, senders) in enumerate(rooms):
        assert _settle(rv, senders) == (KVPoll.Success, [KVPoll.Success] * 2)
        assert (
            pattern.mismatches(dec.pool, dec.transport.region, 20 + k, np.arange(4 * k, 4 * k + 4), 13)[0]
            == 0
        )
    assert not barrier.broken


def test_closed_endpoint_refuses_calls():
    cfg = RuntimeConfig(num_queues=1, aux_rows=4)
    ep = PrefillEndpoint("P", PoolGeometry(MODEL, 1, 0, 4, 4), config=cfg)
    with pytest.raises(EndpointClosedError):
        ep.sender(1, "t")  # not started
    ep.start()
    s = ep.sender(1, "t")
    assert ep.close() == []
    assert not any(lp.thread.is_alive() for lp in ep._loops)
    with pytest.raises(EndpointClosedError):
        s.init(0)
    assert ep.close() == []  # idempotent


def test_sender_specs_one_aux_carrier():
    for ptp, dtp in [(2, 1), (1, 2), (4, 2), (8, 8)]:
        for d in range(dtp):
            specs = sender_specs(PoolGeometry(ModelGeometry.preset("qwen3-8b"), dtp, d, 16, 4), "P", ptp)
            assert sum(s.send_aux for s in specs) == 1
            assert all(not (s.send_aux and s.dummy) for s in specs)


def test_loop_survives_step_exceptions():
    errors: list[BaseException] = []
    n = {"i": 0}

    def step():
        n["i"] += 1
        if n["i"] % 2:
            raise ValueError(n["i"])
        return n["i"] < 20

    loop = Loop("t", step, errors.append)
    loop.start()
    deadline = time.monotonic() + 5
    while n["i"] < 20 and time.monotonic() < deadline:
        time.sleep(0.001)
    loop.stop()
    assert loop.join(5)
    assert n["i"] >= 20 and all(isinstance(e, ValueError) for e in errors) and len(errors) >= 10


@settings(max_examples=50)
@given(st.lists(st.sampled_from(list(KVPoll)), max_size=12))
def test_board_status_monotone_failed_sticks(seq):
    board = StatusBoard()
    board.track(1, "t")
    seen = [KVPoll.Bootstrapping]
    for s in seq:
        board.update(1, "t", s, reason=f"r{s}")
        seen.append(board.get(1, "t").status)
    for a, b in itertools.pairwise(seen):
        assert b is KVPoll.Failed or (a is not KVPoll.Failed and b >= a)
        if a is KVPoll.Failed:
            assert b is KVPoll.Failed
    if KVPoll.Failed in seq:
        assert board.get(1, "t").reason == "r0"  # the first failure's reason is kept


_BOARD_OPS = st.one_of(
    st.tuples(st.just("track"), st.integers(0, 3)),
    st.tuples(st.just("drop"), st.integers(0, 3)),
    st.tuples(st.just("update"), st.integers(0, 3), st.sampled_from(list(KVPoll))),
)


@settings(max_examples=200)
@given(st.lists(_BOARD_OPS, max_size=30))
def test_board_in_flight_counts_exactly_the_rooms_not_terminal(ops):
    """The data thread's fast-poll hint is an O(1) count: after any sequence of track, update
    and drop it equals a scan of the board (a drift would either spin an idle rank or slow a
    busy one's notifications to idle_max_s)."""
    board = StatusBoard()
    for op in ops:
        if op[0] == "track":
            board.track(op[1], "t")
        elif op[0] == "drop":
            board.drop(op[1], "t")
        else:
            board.update(op[1], "t", op[2])
        views = [board.get(r, "t") for r in range(4)]
        scan = any(v is not None and v.status not in (KVPoll.Success, KVPoll.Failed) for v in views)
        assert board.in_flight() is scan


def test_loop_idle_cap_bounds_the_sleep():
    """Idle sleeps double up to idle_max_s, but never past the cap while the cap is lower (the
    data thread with a room in flight); run synchronously, recording each sleep."""
    cap = {"s": 1e-4}

    class Recorder:  # stands in for the stop event: records each sleep, stops after 40
        def __init__(self) -> None:
            self.sleeps: list[float] = []

        def is_set(self) -> bool:
            return len(self.sleeps) >= 40

        def wait(self, t: float) -> bool:
            self.sleeps.append(t)
            if len(self.sleeps) == 20:
                cap["s"] = 1.0  # the room finished: back off to idle_max_s
            return False

    loop = Loop("t", lambda: False, lambda e: None, idle_max_s=0.2, idle_cap=lambda: cap["s"])
    rec = Recorder()
    loop.stop_event = rec  # type: ignore[assignment]
    loop._run()
    assert max(rec.sleeps[:20]) == pytest.approx(1e-4)
    assert rec.sleeps[0] <= 1e-4 and rec.sleeps[-1] == pytest.approx(0.2)
    assert all(b <= 2 * a + 1e-12 for a, b in itertools.pairwise(rec.sleeps[20:]))  # doubling


def test_malformed_control_and_notifications_are_counted_not_fatal(servers):
    import zmq
    from kvferry.backends.zmqctl import pack_parts

    pre, dec = servers
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(pre[0].address)
    # Correctly tagged (a holder of the key), well framed, bad payload: reaches the engine.
    from kvferry.backends.zmqctl import ControlAuth, load_keys

    bad = b"\x93not a control message"
    raw.send(pack_parts([b"evil#0", b"", ControlAuth(load_keys()).sign(b"evil#0", b"", b"P#0", bad), bad]))
    raw.send(pack_parts([b"only-one-frame"]))  # bad framing: dropped by the control plane
    raw.send(pack_parts([b"evil#0", b"", bad]))  # untagged: rejected before the engine
    rv, senders = _room(pre, dec, 77, "ok", np.arange(4), 8, [8])  # registers the peers
    assert _settle(rv, senders) == (KVPoll.Success, [KVPoll.Success] * 2)
    pre[0].transport.send_notif(dec.endpoint, b"\xc1garbage")
    deadline = time.monotonic() + 10

    def wire_errors(ep) -> int:
        with ep.lock:  # the engine only under its lock (lock-check mode asserts it)
            return ep.engine.counters["wire_error"]

    while time.monotonic() < deadline and (wire_errors(pre[0]) < 1 or wire_errors(dec) < 1):
        time.sleep(0.01)
    raw.close(0)
    assert wire_errors(pre[0]) == 1
    assert pre[0].transport.control.stats.malformed == 1
    assert pre[0].transport.control.stats.rejected == {"untagged": 1}
    assert wire_errors(dec) == 1
    rv2, senders2 = _room(pre, dec, 78, "ok2", np.arange(4, 8), 8, [4, 8], aux=1)
    assert _settle(rv2, senders2) == (KVPoll.Success, [KVPoll.Success] * 2)
    assert all(lp.thread.is_alive() for e in [*pre, dec] for lp in e._loops)


def test_decode_restart_on_a_new_port_is_followed(servers):
    pre, dec = servers
    rv, senders = _room(pre, dec, 90, "a", np.arange(4), 8, [8])
    assert _settle(rv, senders) == (KVPoll.Success, [KVPoll.Success] * 2)
    rv.clear()
    for s in senders:
        s.clear()
    assert dec.close() == []
    cfg = RuntimeConfig(num_queues=2, aux_rows=16, timeouts=TIMEOUTS)
    dec2 = DecodeEndpoint(
        "D",
        PoolGeometry(MODEL, 1, 0, 4, 32),
        prefill_server="P",
        prefill_addresses=[p.address for p in pre],
        config=cfg,
    )
    dec2.start()
    try:
        assert dec2.address != dec.address  # a new port, a new NIXL agent
        rv2, senders2 = _room(pre, dec2, 91, "b", np.arange(4, 8), 8, [4, 8], aux=1)
        assert _settle(rv2, senders2) == (KVPoll.Success, [KVPoll.Success] * 2)
        assert pattern.mismatches(dec2.pool, dec2.transport.region, 91, np.arange(4, 8), 8)[0] == 0
        # Prefill now writes to the new agent only: the old one's lists were released.
        assert [dec2.transport.agent_name] == pre[0].transport.agent.peers()
    finally:
        assert dec2.close() == []


def test_a_peer_the_transport_cannot_load_fails_its_rooms_with_the_reason(monkeypatch):
    """AddPeer raising (metadata or memory this transport cannot load) fails the peer's rooms at
    once with that reason, instead of at their first write as "no registered peer"."""
    cfg = RuntimeConfig(num_queues=1, aux_rows=4, timeouts=TIMEOUTS)
    pre = PrefillEndpoint("P", PoolGeometry(MODEL, 1, 0, 4, 8), config=cfg)

    def refuse(peer, registration):
        raise RuntimeError("cannot describe this memory")

    monkeypatch.setattr(pre.transport, "add_peer", refuse)
    dec = DecodeEndpoint(
        "D", PoolGeometry(MODEL, 1, 0, 4, 8), prefill_server="P", prefill_addresses=[pre.address], config=cfg
    )
    try:
        for e in (pre, dec):
            e.start()
        rv, senders = _room([pre], dec, 5, "t", np.arange(2), 6, [6])
        assert _settle(rv, senders, 10.0) == (KVPoll.Failed, [KVPoll.Failed])
        with pytest.raises(KVTransferError, match="unusable here: RuntimeError: cannot describe this memory"):
            senders[0].failure_exception()
        with pre.lock:
            assert pre.engine.counters["peer_unusable"] >= 1  # decode may register again; refused again
    finally:
        for e in (pre, dec):
            e.close()


@pytest.mark.parametrize("stalled_side", ["prefill", "decode"])
def test_heartbeats_go_on_while_the_data_plane_is_stalled(stalled_side):
    """A controlled stall: one rank's data plane (notification drain, where UCX waits while a big
    post holds its worker) blocks for longer than the heartbeat timeout. Liveness is judged by
    the control thread, which never waits on the data plane, so the peer is not declared dead
    and the room still succeeds. (With one progress thread doing both, the peer was lost: the
    CPU --inflight 8 failure "peer prefill#1 lost (no heartbeat)".)"""
    t = Timeouts(
        bootstrap_ns=20 * SEC,
        waiting_ns=20 * SEC,
        transfer_ns=20 * SEC,
        heartbeat_interval_ns=100 * MS,
        heartbeat_timeout_ns=1 * SEC,
        fence_ns=20 * SEC,
        tombstone_ns=60 * SEC,
    )
    cfg = RuntimeConfig(num_queues=1, aux_rows=4, timeouts=t, staging=StagingConfig(flow="direct"))
    pre = PrefillEndpoint("P", PoolGeometry(MODEL, 1, 0, 4, 8), config=cfg)
    dec = DecodeEndpoint(
        "D", PoolGeometry(MODEL, 1, 0, 4, 8), prefill_server="P", prefill_addresses=[pre.address], config=cfg
    )
    victim = pre if stalled_side == "prefill" else dec
    real = victim.transport.drain_notifs
    armed, done = threading.Event(), threading.Event()

    def stalled():
        if armed.is_set() and not done.is_set():
            done.set()
            time.sleep(2.5)  # 2.5 heartbeat timeouts
        return real()

    victim.transport.drain_notifs = stalled
    try:
        for e in (pre, dec):
            e.start()
        armed.set()
        rv, senders = _room([pre], dec, 21, "s", np.arange(2), 6, [6])
        assert _settle(rv, senders, 15.0) == (KVPoll.Success, [KVPoll.Success])
        assert done.is_set()  # the stall really happened
        for e in (pre, dec):
            with e.lock:
                assert e.engine.counters["peer_lost"] == 0
    finally:
        for e in (pre, dec):
            e.close()
