"""Hypothesis stateful test of the whole protocol over the in-memory harness.

Each step the machine picks what happens next: open a room (or reuse a released room id with a
new transfer_id), hand a chunk to a prefill rank, run a worker, deliver / duplicate / drop any
pending control message or notification, complete or fail any posted write, advance time, abort
on either side, release rooms that turned terminal, restart the decode server. Invariants after
every step (see tests/harness.py for the on-the-fly checks): statuses monotone with Failed absorbing, per rank
and for the MIN view; exactly-once effect per (room, chunk); no write outside the pages and aux
row a room owns; Success on decode implies every byte equal to the source; released rooms leave
no trace in any per-room table. Teardown heals the network, lets time pass every deadline, and
checks that every room is terminal everywhere and that both sides agree on the outcome for every
room. Two exemptions, both unavoidable: a room whose failing side retried its failure notice
(RoomFailed or Abort) for its whole give-up window while the network lost every copy (two
generals: judged from the fabric's log, so a side that stops resending is not exempt), and a
room not yet settled when the decode server restarted (the process that knew its outcome died).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvferry.core import messages as m
from kvferry.core.kvpoll import KVPoll, is_terminal, min_status

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H

CONFIGS = [
    (H.TINY, 1, 1, None),
    (H.TINY, 2, 1, None),  # P > D: two senders per decode rank
    (H.TINY, 1, 2, None),  # P < D: one sender serves two decode ranks
    (H.TINY, 4, 1, None),  # replication: TP 4 > 2 heads, one replica of each pair sends
    (H.TINY_MLA, 2, 1, None),  # MLA P > D: a dummy sender
    (H.TINY, 1, 1, 4),  # different page sizes on the two sides
]
MAX_LIVE = 5
_NOTICES = (m.RoomFailed, m.Abort)


def _cut_off(w: H.World) -> set[tuple[int, str]]:
    """Rooms where a failure notice stream was resent for at least half the give-up window
    (``fence_ns``) and no copy was ever delivered: the network, not the protocol, kept the sides
    apart. A side that sends its notice once (no resend) never spans that window."""
    assert w.fabric.failure_streams is not None
    span = w.timeouts.fence_ns // 2
    return {
        (room, tid)
        for (room, tid, _src, _dst, _kind), (first, last, delivered) in w.fabric.failure_streams.items()
        if not delivered and last - first >= span
    }


def _awaits_open(engine: Any, table: str, room: int) -> bool:
    """A StagingReq held for a room this incarnation has not opened (a restarted decode, or the
    request before the TransferInfo) waits for that open until its own bootstrap deadline
    (core/flows/staged_receiver.py): bounded by a deadline the engine holds, not a trace of the
    released room. Teardown's quiescence check still finds it if the deadline never clears it."""
    if table != "held_staging_reqs":
        return False
    return any(k[0] == room and ("held", k) in engine.deadlines for k in engine.staged.held)


class ProtocolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.w: H.World = None  # type: ignore[assignment]
        self.restarted: set[tuple[int, str]] = set()  # rooms not settled at a decode restart
        self.next_room = 1
        self.incarnation = 0
        self.restarts = 0

    @initialize(
        cfg=st.sampled_from(CONFIGS),
        seed=st.integers(0, 1000),
        shards=st.integers(1, 3),
        flow=st.sampled_from([None, "direct", "ring", "pinned", "pull", "push", "mixed"]),
        space=st.sampled_from([256, 768, 2048, 1 << 14]),  # from less than one chunk to many
        fallback=st.booleans(),
    )
    def setup(self, cfg, seed, shards, flow, space, fallback) -> None:  # type: ignore[no-untyped-def]
        model, p, d, dps = cfg
        self.w = H.World(
            model,
            p,
            d,
            decode_page_size=dps,
            num_shards=shards,
            seed=seed,
            flow=flow,
            ring_bytes=space,
            pinned_bytes=space,
            worker_buffer_bytes=space,
            prefill_pinned_bytes=space,
            fallback_direct=fallback,
        )
        self.w.fabric.failure_streams = {}

    # --- helpers ---------------------------------------------------------------------------------

    def _live(self) -> list[H.Request]:
        return list(self.w.live.values())

    def _views(self, req: H.Request) -> dict[str, KVPoll | None]:
        """Each server's MIN view of one room (None while a rank has no status for it)."""
        views: dict[str, KVPoll | None] = {}
        for side, ranks in (("prefill", self.w.prefill), ("decode", self.w.decode)):
            sts = [self.w.rank_status(r, req) for r in ranks]
            sts = [
                s if s is not None else self.w.history.get((side, i, req.room, req.tid))
                for i, s in enumerate(sts)
            ]
            views[side] = None if any(s is None for s in sts) else min_status(sts)  # type: ignore[arg-type]
        return views

    # --- scheduler rules --------------------------------------------------------------------------

    @precondition(lambda self: len(self.w.live) < MAX_LIVE)
    @rule(n=st.integers(0, 12), cuts=st.lists(st.integers(0, 12), max_size=3))
    def open_room(self, n: int, cuts: list[int]) -> None:
        ends = [*sorted({c for c in cuts if c < n}), n]
        self.incarnation += 1
        if self.w.open_room(self.next_room, f"t{self.incarnation}", n, ends) is not None:
            self.next_room += 1

    @precondition(lambda self: len(self.w.live) < MAX_LIVE)
    @rule(pick=st.integers(0, 100), n=st.integers(1, 8))
    def reuse_room_id(self, pick: int, n: int) -> None:
        """A new request under a room id whose previous incarnation was released everywhere."""
        old = sorted({req.room for req in self.w.requests.values()} - set(self.w.live))
        if old:
            self.incarnation += 1
            self.w.open_room(old[pick % len(old)], f"t{self.incarnation}", n, [n])

    @precondition(lambda self: self.w.live)
    @rule(pick=st.integers(0, 100), p=st.integers(0, 3))
    def chunk_ready(self, pick: int, p: int) -> None:
        live = self._live()
        self.w.chunk_ready(live[pick % len(live)], p % self.w.P)

    @rule(p=st.integers(0, 3), shard=st.integers(0, 2))
    def run_worker(self, p: int, shard: int) -> None:
        self.w.run_worker(p % self.w.P, shard)

    @precondition(lambda self: self.w.live)
    @rule(pick=st.integers(0, 100), side=st.sampled_from(["prefill", "decode"]), rank=st.integers(0, 3))
    def abort(self, pick: int, side: str, rank: int) -> None:
        live = self._live()
        n = self.w.P if side == "prefill" else self.w.D
        self.w.abort(live[pick % len(live)], side, rank % n)

    @precondition(lambda self: self.w.fabric.writes)
    @rule(i=st.integers(0, 1000), lose=st.booleans())
    def abort_writer(self, i: int, lose: bool) -> None:
        """A prefill rank gives up a room while one of its writes is in flight (the write may
        still land: a posted RDMA write cannot be cancelled); ``lose``: its notice is lost."""
        wr = self.w.fabric.writes[i % len(self.w.fabric.writes)]
        note = m.decode_note(wr.notif)
        req = self.w.live.get(note.room)
        if req is not None and req.tid == note.transfer_id:
            self.w.abort(req, "prefill", wr.src.rank)
            if lose:
                self.lose_failure_notices()

    @precondition(lambda self: self.w.live)
    @rule(pick=st.integers(0, 100))
    def finish_prefill(self, pick: int) -> None:
        """Every prefill rank hands over every remaining chunk of one room."""
        live = self._live()
        req = live[pick % len(live)]
        for p in range(self.w.P):
            while self.w.chunk_ready(req, p):
                pass

    @precondition(lambda self: self.w.live)
    @rule(pick=st.integers(0, 100), give_up=st.sampled_from([None, 0, 1, 2, 3]), lose=st.booleans())
    def run_prefill(self, pick: int, give_up: int | None, lose: bool) -> None:
        """Every prefill rank hands over and runs every chunk of one room; the writes stay in
        flight. ``give_up``: then that prefill rank aborts the room with its writes in flight
        (they may still land), and ``lose``: its failure notice is lost."""
        live = self._live()
        req = live[pick % len(live)]
        for p in range(self.w.P):
            while self.w.chunk_ready(req, p):
                pass
            for shard in range(len(self.w.prefill[p].driver.queues)):
                while self.w.run_worker(p, shard):
                    pass
        if give_up is not None:
            self.w.abort(req, "prefill", give_up % self.w.P)
            if lose:
                self.lose_failure_notices()

    @rule()
    def flush(self) -> None:
        """A calm moment: everything pending is delivered and every write completes."""
        self.w.flush()

    @precondition(lambda self: self.w.fabric.pending)
    @rule()
    def deliver_all(self) -> None:
        """Every pending message arrives (in order), while posted writes stay in flight: makes
        "fail with a write in flight, then the write lands" a short path for the search."""
        while self.w.fabric.pending:
            self.w.deliver(0)

    @rule()
    def release_terminal(self) -> None:
        self.w.release_terminal()

    # --- network rules ----------------------------------------------------------------------------

    @precondition(lambda self: self.w.fabric.pending)
    @rule(i=st.integers(0, 1000))
    def deliver(self, i: int) -> None:
        self.w.deliver(i % len(self.w.fabric.pending))

    @precondition(lambda self: self.w.fabric.pending)
    @rule(i=st.integers(0, 1000))
    def duplicate(self, i: int) -> None:
        msg = self.w.fabric.pending[i % len(self.w.fabric.pending)]
        self.w.fabric.pending.append(H.PendingMsg(msg.src, msg.dst, msg.data, msg.sent_at, msg.note))

    @precondition(lambda self: self.w.fabric.pending)
    @rule(i=st.integers(0, 1000))
    def drop(self, i: int) -> None:
        self.w.fabric.pending.pop(i % len(self.w.fabric.pending))

    @precondition(lambda self: self.w.fabric.pending)
    @rule()
    def lose_failure_notices(self) -> None:
        """The network loses every failure notice now pending (RoomFailed, Abort): the resends
        must repair it (a plain drop of one message rarely hits the one that matters)."""
        self.w.fabric.pending = [
            x for x in self.w.fabric.pending if x.note or type(m.decode_control(x.data)) not in _NOTICES
        ]

    @precondition(lambda self: self.w.fabric.writes)
    @rule(i=st.integers(0, 1000))
    def complete_write(self, i: int) -> None:
        self.w.fabric.complete(i % len(self.w.fabric.writes))
        self.w.pump()

    @precondition(lambda self: self.w.fabric.copies)
    @rule(i=st.integers(0, 1000))
    def run_copy(self, i: int) -> None:
        """A gather or scatter finishes (in any order relative to writes and messages)."""
        self.w.fabric.run_copy(i % len(self.w.fabric.copies))
        self.w.pump()

    @precondition(lambda self: self.w.fabric.writes)
    @rule(i=st.integers(0, 1000))
    def fail_write(self, i: int) -> None:
        self.w.fabric.fail(i % len(self.w.fabric.writes))
        self.w.pump()

    @precondition(lambda self: self.restarts < 2)
    @rule()
    def restart_decode(self) -> None:
        """The decode server dies and restarts at once (new agents, page ids reused); prefill may
        still hold rooms it registered with the old incarnation."""
        self.restarts += 1
        # A room both sides had already settled (terminal, same outcome) stays held to agreement:
        # nothing can change either side any more. Any other room may lose for good what only
        # the dead decode knew, and no protocol can repair that: e.g. every write of the room
        # completed (prefill Success) but decode died before reading the notifications (Failed
        # with the process), or decode reported Success and then prefill failed (its notice
        # reaches a process that never had the room). Prefill cannot tell these apart, so it
        # cannot pick the dead side's outcome. Every other invariant still applies to them.
        for key, req in self.w.requests.items():
            v = self._views(req)
            pre, dec = v["prefill"], v["decode"]
            if pre is None or dec is None or not (is_terminal(pre) and pre is dec):
                self.restarted.add(key)
        self.w.restart_decode()

    @rule(dt=st.sampled_from([1, 10, 30, 100, 400]))
    def advance_time(self, dt: int) -> None:
        self.w.advance(dt)

    # --- invariants -------------------------------------------------------------------------------

    @invariant()
    def no_violation(self) -> None:
        if self.w is not None:
            assert self.w.violations == [], self.w.violations
            assert self.w.internal_errors() == []

    @invariant()
    def released_rooms_leave_no_trace(self) -> None:
        if self.w is None:
            return
        for req in self.w.requests.values():
            for side, ranks in (("prefill", self.w.prefill), ("decode", self.w.decode)):
                for rank in ranks:
                    if rank.index in req.released[side] and req.room not in rank.engine.rooms:
                        refs = rank.engine.references(req.room)
                        refs = [t for t in refs if not _awaits_open(rank.engine, t, req.room)]
                        assert refs == [], f"{side} {rank.index} room {req.room} still in {refs}"

    def teardown(self) -> None:
        w = self.w
        if w is None:
            return
        w.heal_and_settle()
        # Let every tombstone and peer deadline run out too; nothing may wake a finished room.
        for _ in range(3):
            w.advance(w.timeouts.tombstone_ns)
        assert w.violations == [], w.violations
        exempt = self.restarted | _cut_off(w)
        for req in w.requests.values():
            # After the tombstones expired the status is gone: _views falls back to the last reported.
            views = self._views(req)
            for side, v in views.items():
                assert v is not None and is_terminal(v), (side, req.room, views)
            if (req.room, req.tid) not in exempt:
                assert views["prefill"] is views["decode"], (req.room, req.tid, views)
            if views["decode"] is KVPoll.Success:
                assert all((req.room, req.tid, d) in w.success_checked for d in range(w.D))
        for rank in w.ranks:
            assert rank.engine.rooms == {}, rank.engine.rooms
            assert rank.engine.rooms_by_peer == {}
            assert len(rank.engine.tombstones) == 0
            assert all(k[0] in ("hb", "loss") for k in rank.engine.deadlines.live_keys())
            if rank.side == "prefill":
                assert rank.engine.writes == {}
                assert rank.engine.notices == {}, rank.engine.notices
                assert rank.engine.staging_in_use() == 0 and not rank.engine.staged.stalled
                assert not rank.engine.staged.unconfirmed
            else:
                assert rank.engine.staging_in_use() == 0, "staging space leaked"
                assert (
                    rank.engine.staged.ops == {}
                    and not rank.engine.staged.pinned_queue
                    and rank.engine.staged.held == {}
                )
            assert rank.driver.handles == {} and rank.driver.copies == {}
        assert not w.fabric.writes and not w.fabric.copies


ProtocolMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestProtocol = ProtocolMachine.TestCase
