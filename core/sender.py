"""Prefill side: one ``SenderEngine`` per prefill TP rank, holding its peers and its rooms.

Room states and KVPoll:

    BOOTSTRAPPING (Bootstrapping)  waiting for the local open, every expected TransferInfo, and the
                                   registration of every decode rank those came from
    WAITING       (WaitingForInput) ready; chunks from the scheduler are queued to the worker
    TRANSFERRING  (Transferring)   chunks planned and posted, writes in flight
    SUCCESS       (Success)        last chunk run and every write DONE
    FAILED        (Failed)         absorbing; tells every known decode rank (RoomFailed), and once
                                   no write is in flight sends the fence (Stopped)

Pull flow (``Flow.PULL``): running a chunk posts no data write; it offers the chunk's pages to
every data decode rank (``PullOffer``, resent each heartbeat interval until ``Pulled``) and the
room stays Transferring until every offered chunk was pulled. A failed pull room keeps its pages
(the room is not dropped, so the scheduler cannot free them) until every decode rank that was
offered pages said ``ReadsStopped``, restarted (its READs died with it), or the fence deadline
passed: decode may still be reading them. The aux row is still written by prefill (one small
write, like the metadata a router carries upstream).

Push flow (``Flow.PUSH``, seed 004): the direct flow's writes under registration leases
(core/resources/leases.py). Each TransferInfo of a push room is decode's PUSH_REG: a lease per
(room, decode rank), renewed by decode's heartbeats naming the room. The first chunk run is the
"forward finished" that matches it (chunks that come first are held, as in every flow); every
write (data and aux) is posted only while the lease lives; a lease that expires, or a
registration refused or never matched (watchdog), fails the room with that reason, which reaches
decode as RoomFailed; writes in flight are fenced (Stopped) before decode frees its pages.

Failure notices are reliable: RoomFailed is resent every heartbeat interval to each decode rank
that has not answered (FailedAck, or its own Abort / RoomFailed, which prove it is Failed too),
for at most ``fence_ns`` after the failure. The pending notices live in ``notices``, apart from
the room: like the tombstone they outlive a released room (its pages need not wait for a peer's
answer) and are dropped on the last answer or at the give-up deadline.

``SENDER_TABLE`` lists every legal (state, input); any other pair fails the room with a reason.
The engine is not thread-safe: a threaded driver serialises calls (one lock per engine).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
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
from kvferry.core.deadlines import DeadlineHeap, Timeouts
from kvferry.core.errors import KvferryError, LocalMisuseError, WireError
from kvferry.core.events import (
    AbortRoom,
    ChunkReady,
    ControlIn,
    CopyDone,
    CopyFailed,
    NotificationIn,
    PeerUnusable,
    ReleaseRoom,
    SenderOpen,
    Tick,
    WriteDone,
    WriteFailed,
)
from kvferry.core.flows import Flow, FlowPolicy
from kvferry.core.flows.staged_sender import StagedSender
from kvferry.core.flows.staged_tx import StagedLedger
from kvferry.core.identity_enum import IdentityEnum
from kvferry.core.kvpoll import KVPoll
from kvferry.core.proto_common import (
    RoomEngine,
    RoomError,
    RoomFailure,
    RoomStateError,
    Tombstones,
    Transition,
    step,
)
from kvferry.core.reliable import Resends
from kvferry.core.resources.leases import (
    Finish,
    LeaseMisuseError,
    LeaseRegistry,
    Notice,
    NoticeKind,
    PushReg,
    strip_retry_suffix,
)
from kvferry.core.worker import Destination, plan_chunk, shard_of

_encode = m.encode

__all__ = ["SENDER_TABLE", "SIn", "SState", "SenderEngine"]


class SState(IdentityEnum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


class SIn(IdentityEnum):
    OPEN = "open"  # local SenderOpen on a room a TransferInfo created first
    INFO = "info"  # TransferInfo from a decode rank
    PEER_READY = "peer_ready"  # a decode rank this room needs registered
    CHUNK = "chunk"  # local ChunkReady
    RUN_CHUNK = "run_chunk"  # the worker step
    WRITE_DONE = "write_done"
    WRITE_FAILED = "write_failed"
    ABORT_LOCAL = "abort_local"
    ABORT_PEER = "abort_peer"  # Abort from decode
    PEER_FAILED = "peer_failed"  # RoomFailed from decode
    TIMEOUT = "timeout"
    PEER_LOST = "peer_lost"  # heartbeat loss of a decode rank of the room
    RELEASE = "release"
    STAGING_RSP = "staging_rsp"  # decode granted (or refused) staging space for a chunk
    COPY_DONE = "copy_done"  # a gather finished
    COPY_FAILED = "copy_failed"
    PULLED = "pulled"  # pull flow: decode READ an offered chunk
    READS_STOPPED = "reads_stopped"  # pull flow: decode failed the room and reads no more


STATUS = {
    SState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    SState.WAITING: KVPoll.WaitingForInput,
    SState.TRANSFERRING: KVPoll.Transferring,
    SState.SUCCESS: KVPoll.Success,
    SState.FAILED: KVPoll.Failed,
}

_B, _W, _T, _S, _F = SState.BOOTSTRAPPING, SState.WAITING, SState.TRANSFERRING, SState.SUCCESS, SState.FAILED


class _Room:
    __slots__ = (
        "aux_index",
        "created_by_info",
        "dests",
        "enqueue_end",
        "expected_infos",
        "failure",
        "flow_override",
        "inflight",
        "infos",
        "infos_sorted",
        "key",
        "last_enqueued",
        "last_run",
        "ledger",
        "next_enqueue",
        "next_run",
        "num_tokens",
        "opened",
        "parked",
        "pull_offered",
        "pull_owed",
        "push_finished",
        "push_keys",
        "push_writes",
        "ranges",
        "receivers",
        "release_requested",
        "room",
        "state",
        "stop_to",
        "stopped_sent",
        "tid",
        "token_start",
        "tokens_done",
    )

    def __init__(self, room: int, tid: str) -> None:
        self.room = room
        self.tid = tid
        self.key = (room, tid)
        self.state = SState.BOOTSTRAPPING
        self.opened = False
        self.created_by_info = False
        self.aux_index = -1
        self.infos: dict[m.Endpoint, m.TransferInfo] = {}
        self.infos_sorted: list[tuple[m.Endpoint, m.TransferInfo]] | None = None  # cache
        self.dests: dict[m.Endpoint, Any] = {}  # peer -> dst page array
        self.expected_infos = 0
        self.num_tokens = -1
        self.token_start = 0  # decode's prefix hit: it holds [0, token_start) already
        self.parked: list[ChunkReady] = []
        self.next_enqueue = 0
        self.next_run = 0
        self.tokens_done = 0
        self.last_run = False
        self.last_enqueued = False
        self.inflight: set[int] = set()
        self.failure: RoomFailure | None = None
        self.stop_to: set[m.Endpoint] = set()
        self.stopped_sent = False
        self.release_requested = False
        # Flows: what the scheduler asked for, the token range of every enqueued chunk (the room
        # machine's), and the flow's own ledger (core.flows.staged_tx.StagedLedger).
        self.receivers: tuple[m.Endpoint, ...] = ()
        self.flow_override: str | None = None
        self.ranges: list[tuple[int, int]] = []
        self.enqueue_end = 0
        self.ledger = StagedLedger()
        # Pull flow: chunks offered, and per decode rank the offered chunks it has not pulled
        # (it may be reading those pages: they stay ours until it says so or the fence expires).
        self.pull_offered: list[int] = []
        self.pull_owed: dict[m.Endpoint, set[int]] = {}
        # Push flow: lease key per decode rank, and which decode rank each write in flight goes to.
        self.push_keys: dict[m.Endpoint, str] = {}  # decode rank -> tid@decodeN
        self.push_finished: set[Finish] = set()  # finishes handed to the lease registry
        self.push_writes: dict[int, m.Endpoint] = {}


class _Peer:
    __slots__ = ("last_seen", "pool", "reg_id", "registration")

    def __init__(self, registration: m.Register, pool: Any, now: int) -> None:
        self.registration = registration
        self.reg_id = m.registration_id(registration)
        self.pool = pool
        self.last_seen = now


class SenderEngine(StagedSender, RoomEngine):
    """All rooms of one prefill rank. Feed it events, execute the commands it returns."""

    STATUS = STATUS
    FAILED = SState.FAILED
    SUCCESS = SState.SUCCESS

    side = "prefill"
    TIMEOUT = SIn.TIMEOUT
    PEER_LOST = SIn.PEER_LOST
    push_base_id = staticmethod(strip_retry_suffix)  # request-id matching: the id retries share

    def __init__(
        self,
        endpoint: m.Endpoint,
        pool: Any,
        *,
        timeouts: Timeouts | None = None,
        num_shards: int = 1,
        planner: Callable[..., Any] | None = None,
        policy: FlowPolicy | None = None,
        worker_buffer_bytes: int = 0,
        pinned_bytes: int = 0,
        registration: m.Register | None = None,
        push_match: str = "transfer_id",
    ) -> None:
        """``registration``: this rank's own Register (agent, regions, geometry), which the pull
        flow hands to decode in its offers; without it a pull room fails with a reason.
        ``push_match``: how push registrations find their request: ``transfer_id`` (the router's
        id), or ``request_id`` (a client that sends none: decode names the request with its retry
        suffix, matched by the base id, ``push_base_id``)."""
        if push_match not in ("transfer_id", "request_id"):
            raise LocalMisuseError(f"push_match: expected transfer_id or request_id, got {push_match!r}")
        self._push_by_request = push_match == "request_id"
        if planner is None:
            from kvferry.core.planner import plan_rank_pair as planner
        self.endpoint = endpoint
        self.pool = pool
        self.timeouts = timeouts or Timeouts()
        self.num_shards = num_shards
        self.planner = planner
        self.rooms: dict[int, _Room] = {}
        self.peers: dict[m.Endpoint, _Peer] = {}
        self.rooms_by_peer: dict[m.Endpoint, set[int]] = {}
        self.writes: dict[int, tuple[int, str]] = {}  # write id -> room key
        self.deadlines = DeadlineHeap()
        self.tombstones = Tombstones(self.timeouts.tombstone_ns)
        self.counters: Counter[str] = Counter()
        # Rooms whose writes in flight were cut when their decode peer was lost: over a transport
        # that queues writes (UCX over TCP) they can still land after a heal, so no Stopped may
        # vouch for them; decode frees those pages at its fence deadline. By room key, until then.
        self._cut: dict[tuple[int, str], int] = {}
        # Unacknowledged RoomFailed, by room key; outlives the room (like the tombstone).
        self._notices = Resends(
            "notice",
            self.deadlines,
            self.counters,
            self.timeouts.heartbeat_interval_ns,
            resent="failure_resent",
            gave_up="failure_notice_gave_up",
        )
        self.registration = registration
        # Push registrations (a lease per room and decode rank); the watchdog fires just before
        # the room's own waiting deadline, so the room fails with its reason.
        t = self.timeouts
        self.leases = LeaseRegistry(
            t.heartbeat_timeout_ns,
            max(1, t.waiting_ns - t.heartbeat_interval_ns),
            suffix_match=self._push_by_request,
            base_id=self.push_base_id,
            tombstone_ns=t.tombstone_ns,
        )
        self._push_rooms: dict[str, tuple[int, str]] = {}  # registry key -> room key
        # Pull offers owed an answer (Pulled), by (room, transfer_id, chunk index).
        self._pulls = Resends(
            "pull", self.deadlines, self.counters, self.timeouts.heartbeat_interval_ns, "pull_resent"
        )
        self._next_write_id = 1
        self._out: list[Any] = []
        self._now = 0
        self.last_internal_error: BaseException | None = None
        self._init_staging(policy, worker_buffer_bytes, pinned_bytes)

    # --- public API ------------------------------------------------------------------------------

    def handle(self, event: Any, now: int) -> list[Any]:
        """Process one event at time ``now``; return the commands to execute, in order."""
        self._now = now
        self._out = out = []
        t = type(event)
        if t is ControlIn:
            self._guarded(self._on_control, event.data)
        elif t is ChunkReady:
            self._room_input(event.room, event.transfer_id, SIn.CHUNK, event)
        elif t is CopyDone or t is CopyFailed:
            key = self.ops.pop(event.op_id, None)
            if key is None:
                self.counters["unknown_op"] += 1
            else:
                self._room_input(key[0], key[1], SIn.COPY_DONE if t is CopyDone else SIn.COPY_FAILED, event)
        elif t is WriteDone or t is WriteFailed:
            key = self.writes.pop(event.write_id, None)
            if key is None:
                self.counters["unknown_write"] += 1
            else:
                self._room_input(
                    key[0], key[1], SIn.WRITE_DONE if t is WriteDone else SIn.WRITE_FAILED, event
                )
        elif t is SenderOpen:
            self._open(event)
        elif t is AbortRoom:
            self._room_input(event.room, event.transfer_id, SIn.ABORT_LOCAL, event)
        elif t is ReleaseRoom:
            self._room_input(event.room, event.transfer_id, SIn.RELEASE, event)
        elif t is Tick:
            self._tick()
        elif t is PeerUnusable:
            if event.peer in self.peers:
                self._lose_peer(event.peer, unusable=event.reason)
        elif t is NotificationIn:
            # The notification of decode's READ (pull flow): informational; the pages stay ours
            # until the control message Pulled, which is resent until it arrives.
            self.counters["read_notif"] += 1
        else:
            self.counters["bad_event"] += 1
            raise TypeError(f"SenderEngine cannot handle {t.__name__}")
        self._out = []
        return out

    def run_chunk(self, chunk: ChunkReady, now: int) -> list[Any]:
        """The worker step for one queued chunk: post its writes, or skip it, or fail the room."""
        self._now = now
        self._out = out = []
        r = self.rooms.get(chunk.room)
        if r is None or r.tid != chunk.transfer_id:
            self.counters["chunk_for_unknown_room"] += 1
            out.append(ChunkSkipped(room=chunk.room, chunk_index=chunk.chunk_index, reason="room not live"))
        else:
            self._dispatch(r, SIn.RUN_CHUNK, chunk)
        self._out = []
        return out

    def references(self, room: int) -> list[str]:
        """Names of the per-room tables that still mention ``room`` (empty once released)."""
        refs = []
        if room in self.rooms:
            refs.append("rooms")
        if any(room in s for s in self.rooms_by_peer.values()):
            refs.append("rooms_by_peer")
        if any(k[0] == room for k in self.writes.values()):
            refs.append("writes")
        if any(isinstance(k, tuple) and k[1] == room for k in self.deadlines.live_keys()):
            refs.append("deadlines")
        if any(k[0] == room for k in self._pulls.entries):
            refs.append("pull_offers")
        if any(rk[0] == room and k in self.leases.leases for k, rk in self._push_rooms.items()):
            refs.append("leases")
        return refs + self.staging_refs(room)

    # --- control messages --------------------------------------------------------------------------

    def _send(self, peer: m.Endpoint, msg: Any) -> None:
        self._out.append(SendControl(peer=peer, msg=msg))

    def _on_control(self, data: bytes) -> None:
        try:
            msg = m.decode_control(data)
        except WireError:
            self.counters["wire_error"] += 1
            return
        peer = self.peers.get(msg.src)
        if peer is not None:
            peer.last_seen = self._now
        t = type(msg)
        if t is m.TransferInfo:
            self._on_info(msg)
        elif t is m.Abort:
            self._acked(msg)  # a decode rank that aborts is Failed: it needs no notice from us
            self._on_abort(msg)
        elif t is m.RoomFailed:
            self._acked(msg)
            self._late_failure(msg)
            self._room_input(msg.room, msg.transfer_id, SIn.PEER_FAILED, msg)
        elif t is m.FailedAck:
            if not msg.known:
                # Our notice came too late (the peer restarted, or forgot the room): it cannot
                # report the failure; counted so that such runs are visible.
                self.counters["failure_notice_unknown"] += 1
            self._acked(msg)
        elif t is m.Register:
            self._on_register(msg)
        elif t is m.Heartbeat:
            self.counters["heartbeat_in"] += 1
            for room in msg.rooms:
                r = self.rooms.get(room)
                if r is not None and msg.src in r.push_keys:
                    self.leases.renew_key(*self._reg_ids(r.push_keys[msg.src]), self._now)
        elif t is m.StagingRsp:
            self._room_input(msg.room, msg.transfer_id, SIn.STAGING_RSP, msg)
        elif t is m.Watermark:
            self._on_watermark(msg)
        elif t is m.Pulled:
            self._pulls.answered((msg.room, msg.transfer_id, msg.chunk_index), msg.src)
            self._room_input(msg.room, msg.transfer_id, SIn.PULLED, msg)
        elif t is m.ReadsStopped:
            self._room_input(msg.room, msg.transfer_id, SIn.READS_STOPPED, msg)
        else:
            # RegisterAck / Stopped / StagingReq only travel prefill -> decode.
            self.counters["wrong_side_message"] += 1

    def _on_register(self, msg: m.Register) -> None:
        try:
            pool = msg.geometry.to_pool()
        except (KvferryError, ValueError) as exc:
            self.counters["register_refused"] += 1
            self._send(msg.src, m.RegisterAck(src=self.endpoint, ok=False, reason=f"bad geometry: {exc}"))
            return
        why = self.pool.model.same_kv_shape(pool.model)
        if why is not None:
            self.counters["register_refused"] += 1
            self._send(msg.src, m.RegisterAck(src=self.endpoint, ok=False, reason=f"incompatible KV: {why}"))
            return
        old = self.peers.get(msg.src)
        new = _Peer(msg, pool, self._now)
        if old is not None and old.reg_id == new.reg_id:
            self.counters["register_duplicate"] += 1
        else:
            if old is not None:
                # The decode rank restarted (new agent, maybe the same page ids): forget the old
                # incarnation before loading the new one.
                self.counters["peer_restarted"] += 1
                self._forget_staging_peer(msg.src)
                self._out.append(DropPeer(peer=msg.src, reason="re-registered with a new agent"))
            self.peers[msg.src] = new
            self._out.append(AddPeer(peer=msg.src, registration=msg))
            if old is None:
                self._arm_peer(msg.src)
        self._send(msg.src, m.RegisterAck(src=self.endpoint, ok=True))
        for room in sorted(self.rooms_by_peer.get(msg.src, ())):
            r = self.rooms[room]
            if r.infos[msg.src].reg != new.reg_id:
                # The old process is gone, and its READs of our pages (pull) died with it.
                r.pull_owed.pop(msg.src, None)
                # Pages named by a past incarnation: writing them would hit whoever owns them now.
                self._dispatch(r, SIn.PEER_LOST, (msg.src, "restarted since its TransferInfo"))
            elif r.state is SState.BOOTSTRAPPING:
                self._dispatch(r, SIn.PEER_READY, msg.src)

    def _on_info(self, msg: m.TransferInfo) -> None:
        status = self.tombstones.get(msg.room, msg.transfer_id)
        if status is not None:
            self.counters["tombstoned"] += 1
            self._send(msg.src, m.InfoAck(src=self.endpoint, room=msg.room, transfer_id=msg.transfer_id))
            if status is KVPoll.Failed:
                # A decode rank that joins after we failed and forgot the room must still hear it,
                # or it would wait for our chunks until its deadline and then disagree with us.
                room, tid = msg.room, msg.transfer_id
                self._send(
                    msg.src,
                    m.RoomFailed(src=self.endpoint, room=room, transfer_id=tid, reason="failed earlier"),
                )
                if (room, tid) not in self._cut:
                    self._send(msg.src, m.Stopped(src=self.endpoint, room=room, transfer_id=tid))
            return
        r = self.rooms.get(msg.room)
        if r is None:
            r = self._create(msg.room, msg.transfer_id)
            r.created_by_info = True
        elif r.tid != msg.transfer_id:
            self.counters["stale_transfer_id"] += 1
            return
        peer = self.peers.get(msg.src)
        if peer is None or peer.reg_id != msg.reg:
            # Maybe the Register is in flight, maybe we forgot the peer (heartbeat loss) or hold
            # another incarnation's registration: ask again; the room waits for a matching one.
            self._send(
                msg.src, m.RegisterAck(src=self.endpoint, ok=False, retry=True, reason="not registered")
            )
        self._dispatch(r, SIn.INFO, msg)
        self._send(msg.src, m.InfoAck(src=self.endpoint, room=msg.room, transfer_id=msg.transfer_id))

    def _on_abort(self, msg: m.Abort) -> None:
        r = self.rooms.get(msg.room)
        if r is None or r.tid != msg.transfer_id:
            # Nothing of ours is live for this incarnation, so nothing can be writing: fence now.
            self.counters["abort_for_unknown_room"] += 1
            self._late_failure(msg)
            if (msg.room, msg.transfer_id) not in self._cut:
                self._send(msg.src, m.Stopped(src=self.endpoint, room=msg.room, transfer_id=msg.transfer_id))
            return
        self._dispatch(r, SIn.ABORT_PEER, msg)

    # --- rooms -------------------------------------------------------------------------------------

    def _create(self, room: int, tid: str) -> _Room:
        r = _Room(room, tid)
        self.rooms[room] = r
        self.deadlines.set(("room", room), self._now + self.timeouts.bootstrap_ns)
        return r

    def _open(self, ev: SenderOpen) -> None:
        if self.tombstones.get(ev.room, ev.transfer_id) is not None:
            self.counters["open_tombstoned"] += 1
            self._out.append(
                StatusChanged(
                    room=ev.room,
                    transfer_id=ev.transfer_id,
                    status=KVPoll.Failed,
                    reason=self.tombstones.finished_reason(ev.room, ev.transfer_id),
                )
            )
            return
        r = self.rooms.get(ev.room)
        if r is None:
            r = self._create(ev.room, ev.transfer_id)
            r.opened = True
            r.aux_index = ev.aux_index
            r.receivers, r.flow_override = tuple(ev.receivers), ev.flow
            self._out.append(StatusChanged(room=r.room, transfer_id=r.tid, status=KVPoll.Bootstrapping))
            return
        if r.tid != ev.transfer_id and r.created_by_info and not r.opened:
            # Only a TransferInfo made that room and no local request owns it: a message of an
            # incarnation whose tombstone expired. The local scheduler is the authority on which
            # request holds the id now: the ghost fails (it never wrote) and the new room starts.
            self.counters["ghost_superseded"] += 1
            self._fail(r, RoomFailure(f"superseded by request {ev.transfer_id}", at_ns=self._now))
            self._maybe_finish(r)
            if self.rooms.get(ev.room) is None:
                self._open(ev)
                return
        if r.tid != ev.transfer_id:
            # Same room id, another request: the old one is stale, the new one cannot start.
            self.counters["stale_transfer_id"] += 1
            self._out.append(
                StatusChanged(
                    room=ev.room, transfer_id=ev.transfer_id, status=KVPoll.Failed, reason="room id in use"
                )
            )
            return
        self._dispatch(r, SIn.OPEN, ev)

    def _room_input(self, room: int, tid: str, inp: SIn, payload: Any) -> None:
        r = self.rooms.get(room)
        if r is None or r.tid != tid:
            if self.tombstones.get(room, tid) is not None:
                self.counters["tombstoned"] += 1
            elif r is not None:
                self.counters["stale_transfer_id"] += 1
            else:
                self.counters["unknown_room"] += 1
            return
        self._dispatch(r, inp, payload)

    BOOKKEEP = frozenset(
        {
            SIn.RELEASE,
            SIn.WRITE_DONE,
            SIn.WRITE_FAILED,
            SIn.COPY_DONE,
            SIn.COPY_FAILED,
            SIn.PULLED,
            SIn.READS_STOPPED,
        }
    )

    def _bookkeep(self, r: _Room, inp: SIn, payload: Any) -> None:
        if inp is SIn.RELEASE:
            r.release_requested = True
        elif inp is SIn.WRITE_DONE or inp is SIn.WRITE_FAILED:
            r.inflight.discard(payload.write_id)
            if r.push_writes:
                self._push_write_finished(r, payload.write_id, inp is SIn.WRITE_DONE)
            if r.ledger.write_lane:
                self._write_finished(r, payload.write_id, inp is SIn.WRITE_DONE)
        elif inp is SIn.COPY_DONE or inp is SIn.COPY_FAILED:
            self._op_finished(r, payload.op_id)
        elif inp is SIn.PULLED:
            owed = r.pull_owed.get(payload.src)
            if owed is not None:
                owed.discard(payload.chunk_index)
        elif inp is SIn.READS_STOPPED:
            r.pull_owed.pop(payload.src, None)

    def _entered(self, r: _Room) -> None:
        st = r.state
        self._out.append(StatusChanged(room=r.room, transfer_id=r.tid, status=STATUS[st]))
        key = ("room", r.room)
        if st is SState.WAITING:
            self.deadlines.set(key, self._now + self.timeouts.waiting_ns)
            parked, r.parked = r.parked, []
            shard = shard_of(r.room, self.num_shards)
            for c in parked:
                self._out.append(EnqueueChunk(shard=shard, chunk=c))
            if parked and self._wants_push(r):
                self.counters["push_computed_before_registration"] += 1  # the finish-first order
                self._push_finish(r)
        elif st is SState.TRANSFERRING:
            self.deadlines.set(key, self._now + self.timeouts.transfer_ns)
        elif st is SState.SUCCESS:
            self.deadlines.cancel(key)

    def _ready(self, r: _Room) -> bool:
        return (
            r.opened
            and r.expected_infos > 0
            and len(r.infos) == r.expected_infos
            and all(p in self.peers and self.peers[p].reg_id == i.reg for p, i in r.infos.items())
        )

    # --- handlers (names referenced by SENDER_TABLE) -------------------------------------------

    def _h_on_open(self, r: _Room, inp: SIn, ev: SenderOpen) -> str:
        if r.opened:
            raise RoomStateError("room opened twice")
        r.opened = True
        r.aux_index = ev.aux_index
        r.receivers, r.flow_override = tuple(ev.receivers), ev.flow
        if not self._wants_push(r):
            # Registered on the policy's push before the open named another flow: withdraw.
            for p, key in sorted(r.push_keys.items()):
                if self._reg_key(key) in self.leases.leases:
                    self.leases.abort(*self._reg_ids(key), p, self._now)
                self._push_rooms.pop(self._reg_key(key), None)
            r.push_keys.clear()
        for info in list(r.infos.values()):
            self._push_register(r, info)
        self._prefetch(r)
        return "ready" if self._ready(r) else "stay"

    def _h_on_info(self, r: _Room, inp: SIn, msg: m.TransferInfo) -> str:
        known = r.infos.get(msg.src)
        if known is not None:
            if known != msg:
                raise RoomError(f"conflicting TransferInfo from {msg.src}")
            self.counters["duplicate_info"] += 1
            return "stay"
        if r.state is not SState.BOOTSTRAPPING:
            raise RoomError(f"unexpected TransferInfo from {msg.src} after all {r.expected_infos} arrived")
        if r.infos:
            if msg.expected_infos != r.expected_infos:
                raise RoomError(f"decode ranks disagree on expected senders ({msg.expected_infos})")
            if msg.num_tokens != r.num_tokens:
                raise RoomError(
                    f"decode ranks disagree on the room's length ({msg.num_tokens} vs {r.num_tokens})"
                )
            if msg.token_start != r.token_start:
                raise RoomError(f"decode ranks disagree on the prefix they hold ({msg.token_start})")
        else:
            r.expected_infos = msg.expected_infos
            r.num_tokens = msg.num_tokens
            r.token_start = msg.token_start
        if len(r.infos) >= r.expected_infos:
            raise RoomError(f"more TransferInfos than the {r.expected_infos} expected")
        r.infos[msg.src] = msg
        r.infos_sorted = None
        r.dests[msg.src] = np.asarray(msg.dst_pages, dtype=np.int64)
        r.stop_to.add(msg.src)
        self.rooms_by_peer.setdefault(msg.src, set()).add(r.room)
        self._push_register(r, msg)
        self._prefetch(r)
        return "ready" if self._ready(r) else "stay"

    def _h_on_peer_ready(self, r: _Room, inp: SIn, peer: Any) -> str:
        self._prefetch(r)
        return "ready" if r.state is SState.BOOTSTRAPPING and self._ready(r) else "stay"

    def _h_on_chunk(self, r: _Room, inp: SIn, c: ChunkReady) -> None:
        if c.chunk_index < r.next_enqueue:
            self.counters["duplicate_chunk"] += 1
            self._out.append(ChunkSkipped(room=r.room, chunk_index=c.chunk_index, reason="duplicate chunk"))
            return
        # These come from our own scheduler, not from a peer: its mistake is raised to it (the
        # room does not change), unlike a peer's garbage, which fails the room.
        if c.chunk_index != r.next_enqueue:
            raise LocalMisuseError(
                f"room {r.room}: chunk {c.chunk_index} handed over before chunk {r.next_enqueue}"
            )
        if r.last_enqueued:
            raise LocalMisuseError(f"room {r.room}: chunk {c.chunk_index} after the last chunk")
        if r.num_tokens >= 0 and c.token_end > r.num_tokens:
            raise LocalMisuseError(
                f"room {r.room}: chunk {c.chunk_index} ends at token {c.token_end}, past the "
                f"{r.num_tokens} tokens decode allocated"
            )
        if c.token_end < r.enqueue_end:
            raise LocalMisuseError(
                f"room {r.room}: chunk {c.chunk_index} ends at token {c.token_end}, before the "
                f"previous chunk's end {r.enqueue_end}"
            )
        r.next_enqueue += 1
        r.last_enqueued = c.is_last
        start = r.enqueue_end
        r.ranges.append((start, int(c.token_end)))
        r.enqueue_end = max(start, int(c.token_end))
        self._prefetch(r)
        if r.state is SState.BOOTSTRAPPING:
            r.parked.append(c)
        else:
            self._out.append(EnqueueChunk(shard=shard_of(r.room, self.num_shards), chunk=c))
            if c.chunk_index == 0 and self._wants_push(r):
                self._push_finish(r)

    def _h_on_run_chunk(self, r: _Room, inp: SIn, c: ChunkReady) -> str:
        if c.chunk_index < r.next_run:
            self.counters["duplicate_chunk_run"] += 1
            self._out.append(ChunkSkipped(room=r.room, chunk_index=c.chunk_index, reason="already run"))
            return "stay"
        flow = r.ledger.flow
        if flow is None and r.state is not SState.BOOTSTRAPPING:
            self._choose_flow(r)
            flow = r.ledger.flow
        if c.chunk_index != r.next_run:
            raise RoomStateError(f"worker got chunk {c.chunk_index} before chunk {r.next_run}")
        if flow is Flow.RING or flow is Flow.PINNED:  # Flow.staged, without the property call
            if r.token_start:
                raise RoomStateError(f"flow {flow.value} cannot skip decode's prefix hit")
            # The worker hands a staged chunk over and moves on; its lanes wait for space.
            return self._accept_staged(r, c)
        if flow is Flow.PULL:
            return self._run_pull(r, c)
        return self._run_direct(r, c)

    @staticmethod
    def _infos_sorted(r: _Room) -> list[tuple[m.Endpoint, m.TransferInfo]]:
        """``sorted(r.infos.items())``, kept until the next TransferInfo (each chunk reads it)."""
        if r.infos_sorted is None:
            r.infos_sorted = sorted(r.infos.items())
        return r.infos_sorted

    def _chunk_bounds(self, r: _Room, c: ChunkReady) -> tuple[int, int]:
        """Validate the chunk the room runs next against decode's allocation; its token range."""
        if r.last_run:
            raise RoomStateError("chunk after the last chunk")
        start, end = r.tokens_done, c.token_end
        if end < start:
            raise RoomStateError(f"chunk {c.chunk_index} ends at token {end}, before its start {start}")
        # A prefix hit: decode holds [0, token_start); only the rest moves, at its own slots (the
        # planner places by absolute token), and a chunk wholly inside the prefix moves nothing.
        start, end = max(start, r.token_start), max(end, r.token_start)
        if end > r.num_tokens:
            raise RoomStateError(f"chunk {c.chunk_index} ends at token {end}, past decode's {r.num_tokens}")
        if c.is_last and end != r.num_tokens:
            raise RoomStateError(f"prefill produced {end} tokens but decode allocated {r.num_tokens}")
        for p, info in r.infos.items():
            peer = self.peers.get(p)
            if peer is None or peer.reg_id != info.reg:
                raise RoomStateError(f"decode rank {p} is gone or restarted since its TransferInfo")
        return start, end

    def _chunk_note(self, r: _Room, c: Any, start: int, end: int, **kind: Any) -> bytes:
        # Every note of a chunk names the same room, sender and token range; ``kind`` marks the
        # dummy "done" note, the aux write, or the staging allocation the bytes landed in.
        # ``c``: the ChunkReady, or a staged lane (same fields under other names).
        index = c.chunk_index if type(c) is ChunkReady else c.index
        note = m.ChunkNote(
            room=r.room,
            transfer_id=r.tid,
            src=self.endpoint,
            chunk_index=index,
            token_start=start,
            token_end=end,
            is_last=c.is_last,
            **kind,
        )
        return _encode(note)

    def _run_direct(self, r: _Room, c: ChunkReady) -> str:
        start, end = self._chunk_bounds(r, c)
        peers = self.peers
        dests = [Destination(p, peers[p].pool, r.dests[p], info.dummy) for p, info in self._infos_sorted(r)]
        writes = plan_chunk(self.planner, self.pool, c.src_pages, dests, start, end)
        push = r.ledger.flow is Flow.PUSH
        if push and c.chunk_index == 0:
            self._push_finish(r)
        self._advance(r, c, end)
        posted: list[int] = []
        note = self._chunk_note(r, c, start, end)  # identical for every data write: encode once
        out = self._out
        for w in writes:
            if not len(w.length):
                out.append(SendNotif(peer=w.peer, room=r.room, notif=note))
                continue
            if push:
                self._push_post(r, w.peer)
            wid = self._new_write(r)
            if push:
                r.push_writes[wid] = w.peer
            posted.append(wid)
            out.append(
                PostWrite(
                    write_id=wid,
                    peer=w.peer,
                    room=r.room,
                    src_region=w.src_region,
                    src_offset=w.src_offset,
                    dst_region=w.dst_region,
                    dst_offset=w.dst_offset,
                    length=w.length,
                    notif=note,
                )
            )
        return self._finish_run(r, c, start, end, posted)

    def _run_pull(self, r: _Room, c: ChunkReady) -> str:
        """Offer the chunk's pages to every data decode rank; they READ, then answer Pulled."""
        if self.registration is None:
            raise RoomStateError("pull flow: this prefill rank has no registration to offer")
        start, end = self._chunk_bounds(r, c)
        self._advance(r, c, end)
        targets = [p for p, info in self._infos_sorted(r) if not info.dummy]
        idx = c.chunk_index
        reg, room, tid = self.registration, r.room, r.tid
        pages = np.asarray(c.src_pages, dtype=np.int64).tolist()
        for p in targets:
            r.pull_owed.setdefault(p, set()).add(idx)
        r.pull_offered.append(idx)
        offer = m.PullOffer(
            src=self.endpoint,
            room=room,
            transfer_id=tid,
            registration=reg,
            chunk_index=idx,
            token_start=start,
            token_end=end,
            is_last=c.is_last,
            src_pages=pages,
        )
        for p, msg in self._pulls.start((room, tid, idx), targets, lambda p: offer, self._now):
            self._send(p, msg)
        return self._finish_run(r, c, start, end, [])

    def _h_on_pulled(self, r: _Room, inp: SIn, msg: m.Pulled) -> str:
        return "done" if self._quiet(r) else "stay"

    # --- push: registration leases -----------------------------------------------------------

    def _push_register(self, r: _Room, info: m.TransferInfo) -> None:
        """A TransferInfo of a push room is decode's PUSH_REG: a lease for that decode rank."""
        if not self._wants_push(r) or info.dummy or info.src in r.push_keys:
            return
        key = f"{r.tid}@{info.src.server}{info.src.rank}"
        r.push_keys[info.src] = key
        self._push_rooms[self._reg_key(key)] = r.key
        transfer_id, request_id = self._reg_ids(key)
        reg = PushReg(
            transfer_id=transfer_id,
            request_id=request_id,
            decode=info.src,
            incarnation=0,  # a restarted decode rank is caught by its registration id (PEER_LOST)
            blocks=tuple(info.dst_pages),
            token_start=info.token_start,
            token_end=info.num_tokens,
        )
        self._lease_notices(self.leases.register(reg, self._now))

    def _wants_push(self, r: _Room) -> bool:
        """The room will run the push flow: asked per room, or the policy's own override."""
        if r.flow_override is not None:
            return r.flow_override == Flow.PUSH.value
        return self.policy.override is Flow.PUSH

    def _push_finish(self, r: _Room) -> None:
        """The room's first chunk is computed (its forward pass finished): that matches every
        registration of the room. Called when chunk 0 is handed to its worker and again when it
        runs (a registration that arrived in between); a lease matched already is left alone,
        so the watchdog measures decode's wait for prefill, not the worker queue."""
        for _p, key in sorted(r.push_keys.items()):
            lease = self.leases.leases.get(self._reg_key(key))
            fin = self._finish_of(key)
            held = LeaseRegistry.key(fin.transfer_id, fin.request_id) in self.leases.held
            # By request id the finish may have paired with (or been refused for) another entry:
            # it is handed over once.
            again = self._push_by_request and fin in r.push_finished
            if lease is not None and lease.finish is None and not held and not again:
                r.push_finished.add(fin)
                self._lease_notices(self.leases.finish(fin, self._now))

    def _reg_ids(self, key: str) -> tuple[str, str]:
        """(transfer_id, request_id) of the registration for ``key`` (``tid@decodeN``): the router's
        id, or with request-id matching the request as decode names it, with its retry suffix."""
        if self._push_by_request:
            return "", f"{key}-1"
        return key, key.rpartition("@")[0]

    def _reg_key(self, key: str) -> str:
        return LeaseRegistry.key(*self._reg_ids(key))

    def _finish_of(self, key: str) -> Finish:
        """Prefill's finish for ``key``: the request as prefill names it (no retry suffix)."""
        if self._push_by_request:
            return Finish("", key)
        return Finish(key, key.rpartition("@")[0])

    def lease_key(self, tid: str, peer: str) -> str:
        """The registry key of room ``tid``'s registration by decode rank ``peer`` (e.g. decode0)."""
        return self._reg_key(f"{tid}@{peer}")

    def _push_post(self, r: _Room, peer: m.Endpoint) -> None:
        """One write to ``peer`` is about to be posted: only under its live lease, and only where
        that registration was paired with this request's own finish (a wrong pairing is an error,
        never a write into another request's blocks)."""
        key = r.push_keys.get(peer)
        lease = self.leases.leases.get(self._reg_key(key)) if key is not None else None
        if lease is not None and lease.finish is not None and lease.finish != self._finish_of(key):
            self.counters["push_wrong_pair"] += 1
            raise RoomStateError(
                f"push registration of {peer} was paired with another request's finish "
                f"({lease.finish.transfer_id or lease.finish.request_id}): nothing is written"
            )
        if lease is None or lease.finish is None or self.leases.post(*self._reg_ids(key), self._now) is None:
            self._lease_notices(self.leases.drain())
            how = self.leases.finished.get(self._reg_key(key), None) if key is not None else None
            why = how.value if how else "never registered"
            raise RoomStateError(f"push lease of {peer} is over ({why}): nothing is written")

    def _lease_notices(self, notices: list[Notice]) -> None:
        for n in notices:
            if n.kind not in (NoticeKind.EXPIRED, NoticeKind.FAILED, NoticeKind.REFUSED):
                continue  # MATCHED, DELIVERED, RELEASED: the room's own machine tracks writes and fences
            rk = self._push_rooms.get(LeaseRegistry.key(n.transfer_id, n.request_id))
            r = self.rooms.get(rk[0]) if rk is not None else None
            if r is None or r.key != rk or r.state is SState.FAILED:
                continue
            self.counters[f"push_{n.kind.value}"] += 1
            self._fail(r, RoomFailure(f"push registration {n.kind.value}: {n.reason}", at_ns=self._now))
            self._maybe_finish(r)

    def _push_write_finished(self, r: _Room, wid: int, ok: bool) -> None:
        peer = r.push_writes.pop(wid, None)
        if peer is None:
            return
        try:
            notices = self.leases.write_done(*self._reg_ids(r.push_keys[peer]), ok, self._now)
        except LeaseMisuseError:
            self.counters["push_untracked_write"] += 1  # posted without its lease (never in real code)
            return
        self._lease_notices(notices)

    def next_deadline(self) -> int | None:
        a, b = RoomEngine.next_deadline(self), self.leases.next_deadline()
        if a is None:
            return b
        return a if b is None else min(a, b)

    def _tick(self) -> None:
        RoomEngine._tick(self)
        self._lease_notices(self.leases.tick(self._now))

    def _pull_fence_due(self, r: _Room) -> None:
        """The fence deadline of a failed pull room: a decode rank that vanished (heartbeat lost)
        cannot be reading; one still alive may have READs queued behind others (a posted READ
        cannot be cancelled), so it is asked again (RoomFailed, answered with ReadsStopped once
        its READs drained) and the pages stay until it answers or vanishes."""
        reason = r.failure.reason if r.failure else "failed"
        alive = False
        for p in sorted(r.pull_owed):
            if not r.pull_owed[p]:
                continue
            if p in self.peers:
                alive = True
                self.counters["pull_fence_extended"] += 1
                self._send(p, m.RoomFailed(src=self.endpoint, room=r.room, transfer_id=r.tid, reason=reason))
            else:
                self.counters["pull_fence_expired"] += 1
                del r.pull_owed[p]
        if alive:
            self.deadlines.set(("pfence", r.room), self._now + self.timeouts.heartbeat_interval_ns)
        self._maybe_finish(r)

    def _pull_fenced(self, r: _Room) -> bool:
        """No decode rank can still be READing this room's pages."""
        return not any(r.pull_owed.values())

    def _advance(self, r: _Room, c: ChunkReady, end: int) -> None:
        r.next_run += 1
        r.tokens_done = int(c.token_end)  # what prefill computed, not the prefix-clipped ``end``
        r.last_run = c.is_last

    def _finish_run(self, r: _Room, c: ChunkReady, start: int, end: int, posted: list[int]) -> str:
        """What every run chunk ends with: the last chunk's dummy and aux notes, the pacing hint;
        the outcome: "done" once the last chunk ran and nothing is in flight, else "running"."""
        if c.is_last:
            for p, info in self._infos_sorted(r):
                if info.dummy:
                    self._out.append(
                        SendNotif(peer=p, room=r.room, notif=self._chunk_note(r, c, start, end, dummy=True))
                    )
                if info.send_aux:
                    push = r.ledger.flow is Flow.PUSH
                    if push:
                        self._push_post(r, p)
                    wid = self._new_write(r)
                    if push:
                        r.push_writes[wid] = p
                    posted.append(wid)
                    self._out.append(
                        PostAuxWrite(
                            write_id=wid,
                            peer=p,
                            room=r.room,
                            src_aux_index=r.aux_index,
                            dst_aux_index=info.aux_index,
                            notif=self._chunk_note(r, c, start, end, aux=True),
                        )
                    )
        if posted:
            self._out.append(AwaitWrites(room=r.room, write_ids=tuple(posted)))
        if c.is_last and r.ledger.flow is Flow.PUSH:
            for key in sorted(r.push_keys.values()):
                try:
                    self._lease_notices(self.leases.complete(*self._reg_ids(key), self._now))
                except LeaseMisuseError:
                    self.counters["push_complete_without_lease"] += 1
        return "done" if self._quiet(r) else "running"

    def _quiet(self, r: _Room) -> bool:
        """The last chunk ran and nothing of the room is in flight: writes, gathers, lanes."""
        return r.last_run and not r.inflight and r.ledger.quiet() and not any(r.pull_owed.values())

    def _new_write(self, r: _Room) -> int:
        wid = self._next_write_id
        self._next_write_id += 1
        r.inflight.add(wid)
        self.writes[wid] = r.key
        return wid

    def _h_on_write_done(self, r: _Room, inp: SIn, ev: WriteDone) -> str:
        return "done" if self._quiet(r) else "stay"

    def _h_on_fail(self, r: _Room, inp: SIn, payload: Any) -> str:
        if inp is SIn.WRITE_FAILED:
            reason = f"write failed: {payload.reason}"
        elif inp is SIn.ABORT_LOCAL:
            reason = f"aborted: {payload.reason}"
        elif inp is SIn.ABORT_PEER:
            reason = f"aborted by {payload.src}: {payload.reason}"
            r.stop_to.add(payload.src)
        elif inp is SIn.PEER_FAILED:
            reason = f"failed on {payload.src}: {payload.reason}"
        elif inp is SIn.TIMEOUT:
            reason = f"timed out while {r.state.value}"
            if r.ledger.blocked:
                reason += f" ({r.ledger.blocked})"
        elif inp is SIn.COPY_FAILED:
            reason = f"gather failed: {payload.reason}"
        elif inp is SIn.READS_STOPPED:
            reason = f"{payload.src} failed the room and stopped reading"
        elif isinstance(payload, tuple):
            reason = f"peer {payload[0]} {payload[1]}"
        else:
            reason = f"peer {payload} lost (no heartbeat)"
        tell = None if inp not in (SIn.ABORT_PEER, SIn.PEER_FAILED) else payload.src
        self._fail(r, RoomFailure(reason, at_ns=self._now), skip=tell)
        return "failed"

    def _h_on_failed_input(self, r: _Room, inp: SIn, payload: Any) -> None:
        """Failed absorbs everything; some inputs still matter for the fence and the peers."""
        if inp is SIn.ABORT_PEER:
            r.stop_to.add(payload.src)
            if r.stopped_sent:
                self._send(payload.src, m.Stopped(src=self.endpoint, room=r.room, transfer_id=r.tid))
        elif inp is SIn.INFO:
            # A decode rank that joins late must still hear the outcome (and get its fence).
            if payload.src not in r.infos:
                reason = r.failure.reason if r.failure else "failed"
                self._send(
                    payload.src,
                    m.RoomFailed(src=self.endpoint, room=r.room, transfer_id=r.tid, reason=reason),
                )
                r.stop_to.add(payload.src)
                if r.stopped_sent:
                    self._send(payload.src, m.Stopped(src=self.endpoint, room=r.room, transfer_id=r.tid))
        elif inp is SIn.RUN_CHUNK or inp is SIn.CHUNK:
            # seed 000: a worker that meets a Failed room skips its remaining chunks.
            self.counters["chunk_skipped_failed"] += 1
            self._out.append(ChunkSkipped(room=r.room, chunk_index=payload.chunk_index, reason="room failed"))
        elif inp not in (SIn.RELEASE, SIn.WRITE_DONE, SIn.WRITE_FAILED, SIn.PULLED, SIn.READS_STOPPED):
            self.counters[f"ignored_failed_{inp.value}"] += 1

    def _h_on_release(self, r: _Room, inp: SIn, payload: Any) -> None:
        pass  # handled by _maybe_finish

    # --- failure, fence, release -------------------------------------------------------------------

    def _fail(self, r: _Room, failure: RoomFailure, skip: m.Endpoint | None = None) -> None:
        if r.state is SState.FAILED:
            return
        r.state = SState.FAILED
        r.failure = failure
        r.parked = []
        r.ledger.drop_waiting()
        self.stalled.discard(r.room)
        self.deadlines.cancel(("room", r.room))
        self.deadlines.cancel(("stg", r.room))
        for idx in r.pull_offered:
            self._pulls.cancel((r.room, r.tid, idx))
        for p, key in sorted(r.push_keys.items()):
            if self._reg_key(key) in self.leases.leases:
                self.leases.abort(*self._reg_ids(key), p, self._now)  # its writes in flight fence it
        if not self._pull_fenced(r):
            # Decode may be READing our pages: they stay until it says it stopped, or this.
            self.deadlines.set(("pfence", r.room), self._now + self.timeouts.fence_ns)
        self._out.append(
            StatusChanged(room=r.room, transfer_id=r.tid, status=KVPoll.Failed, reason=failure.reason)
        )
        tell = {p for p in r.infos if p != skip}
        # A decode rank may already be Success (our last write landed before we failed): it must
        # hear this, so the notice is resent until answered, for at most fence_ns.
        room, tid, reason = r.room, r.tid, failure.reason
        for p, msg in self._notices.start(
            r.key,
            tell,
            lambda p: m.RoomFailed(src=self.endpoint, room=room, transfer_id=tid, reason=reason),
            self._now,
            give_up_at=self._now + self.timeouts.fence_ns,
        ):
            self._send(p, msg)

    def _maybe_finish(self, r: _Room) -> None:
        st = r.state
        if st is SState.SUCCESS:
            if r.release_requested:
                self._remove(r)
            return
        if st is not SState.FAILED:
            return  # a live room: nothing to fence or drop
        if not r.inflight and not r.stopped_sent and r.key not in self._cut:
            r.stopped_sent = True
            for p in sorted(r.stop_to):
                self._send(p, m.Stopped(src=self.endpoint, room=r.room, transfer_id=r.tid))
        # A gather still running owns a staging buffer: the room stays until it returns.
        terminal_quiet = not r.inflight and not r.ledger.ops and self._pull_fenced(r)
        # A room only a TransferInfo ever created has no local owner to release it.
        auto = r.created_by_info and not r.opened
        if terminal_quiet and (r.release_requested or auto):
            self._remove(r)

    def _remove(self, r: _Room) -> None:
        del self.rooms[r.room]
        for p in r.infos:
            s = self.rooms_by_peer.get(p)
            if s is not None:
                s.discard(r.room)
                if not s:
                    del self.rooms_by_peer[p]
        self.deadlines.cancel(("room", r.room))
        self.deadlines.cancel(("stg", r.room))
        self.deadlines.cancel(("pfence", r.room))
        for idx in r.pull_offered:
            self._pulls.cancel((r.room, r.tid, idx))
        for key in r.push_keys.values():
            rkey = self._reg_key(key)
            if self._push_rooms.get(rkey) == r.key and rkey not in self.leases.leases:
                del self._push_rooms[rkey]
        reason = r.failure.reason if r.failure is not None else ""
        self.tombstones.add(r.room, r.tid, STATUS[r.state], self._now, reason)

    def _late_failure(self, msg: m.RoomFailed | m.Abort) -> None:
        """The peer failed a room we already released: the tombstone (and the poller) learn it."""
        if self.tombstones.fail(msg.room, msg.transfer_id):
            self.counters["failed_after_release"] += 1
            reason = f"failed on {msg.src} after release: {msg.reason}"
            self._out.append(
                StatusChanged(room=msg.room, transfer_id=msg.transfer_id, status=KVPoll.Failed, reason=reason)
            )

    def _acked(self, msg: m.FailedAck | m.Abort | m.RoomFailed) -> None:
        self._notices.answered((msg.room, msg.transfer_id), msg.src)

    @property
    def notices(self) -> dict[Any, Any]:
        """Unacknowledged failure notices by room key (empty once every peer answered)."""
        return self._notices.entries

    # --- time ----------------------------------------------------------------------------------------

    def _heartbeat(self, peer: m.Endpoint) -> None:
        self._send(peer, m.Heartbeat(src=self.endpoint))

    def _on_deadline(self, kind: str, what: Any) -> None:
        if kind == "notice":
            for p, msg in self._notices.fire(what, self._now):
                self._send(p, msg)
        elif kind == "pull":
            for p, msg in self._pulls.fire(what, self._now):
                self._send(p, msg)
        elif kind == "pfence":
            r = self.rooms.get(what)
            if r is not None and r.state is SState.FAILED and not self._pull_fenced(r):
                self._pull_fence_due(r)
        elif kind == "notes":
            self._resend_notes(what)
        elif kind == "stg":
            r = self.rooms.get(what)
            if r is not None:
                self._resend_staging(r)
        elif kind == "cut":
            self._cut.pop(what, None)  # decode's fence deadline has passed: it freed the pages

    def _peer_gone(self, peer: m.Endpoint) -> None:
        self._forget_staging_peer(peer)
        until = self._now + self.timeouts.fence_ns
        for room in sorted(self.rooms_by_peer.get(peer, ())):
            r = self.rooms.get(room)
            if r is not None and r.inflight:
                self._cut[r.key] = until
                self.deadlines.set(("cut", r.key), until)
                self.counters["writes_cut_by_peer_loss"] += 1


# --- the transition table (after the class: it holds the handlers themselves) --------------


_t = step
E = SenderEngine
_FAIL = _t(E._h_on_fail, failed=_F)
_LIVE_FAILURES = {
    SIn.ABORT_LOCAL: _FAIL,
    SIn.ABORT_PEER: _FAIL,
    SIn.PEER_FAILED: _FAIL,
    SIn.TIMEOUT: _FAIL,
    SIn.PEER_LOST: _FAIL,
    SIn.READS_STOPPED: _FAIL,  # decode failed the room (its Abort may still be on the way)
}

SENDER_TABLE: dict[SState, dict[SIn, Transition]] = {
    _B: {
        SIn.OPEN: _t(E._h_on_open, stay=_B, ready=_W),
        SIn.INFO: _t(E._h_on_info, stay=_B, ready=_W),
        SIn.PEER_READY: _t(E._h_on_peer_ready, stay=_B, ready=_W),
        SIn.CHUNK: _t(E._h_on_chunk, stay=_B),  # parked until WAITING: the worker never sees it early
        SIn.STAGING_RSP: _t(E._h_on_staging_rsp, stay=_B),  # asked for ahead of the TransferInfos
        **_LIVE_FAILURES,
    },
    _W: {
        SIn.INFO: _t(E._h_on_info, stay=_W, ready=_W),
        SIn.PEER_READY: _t(E._h_on_peer_ready, stay=_W),
        SIn.CHUNK: _t(E._h_on_chunk, stay=_W),
        SIn.RUN_CHUNK: _t(E._h_on_run_chunk, stay=_W, running=_T, done=_S),
        SIn.STAGING_RSP: _t(E._h_on_staging_rsp, stay=_W),
        **_LIVE_FAILURES,
    },
    _T: {
        SIn.INFO: _t(E._h_on_info, stay=_T, ready=_T),
        SIn.PEER_READY: _t(E._h_on_peer_ready, stay=_T),
        SIn.CHUNK: _t(E._h_on_chunk, stay=_T),
        SIn.RUN_CHUNK: _t(E._h_on_run_chunk, stay=_T, running=_T, done=_S),
        SIn.WRITE_DONE: _t(E._h_on_write_done, stay=_T, done=_S),
        SIn.WRITE_FAILED: _FAIL,
        SIn.STAGING_RSP: _t(E._h_on_staging_rsp, stay=_T),
        SIn.COPY_DONE: _t(E._h_on_copy_done, stay=_T),
        SIn.COPY_FAILED: _FAIL,
        SIn.PULLED: _t(E._h_on_pulled, stay=_T, done=_S),
        **_LIVE_FAILURES,
    },
    _S: {
        SIn.PULLED: _t(E._h_ignore, stay=_S),  # a duplicate answer to a resent offer
        SIn.READS_STOPPED: _t(E._h_ignore, stay=_S),  # nothing was owed; its Abort follows
        SIn.STAGING_RSP: _t(E._h_ignore, stay=_S),
        SIn.INFO: _t(E._h_on_info, stay=_S, ready=_S),
        SIn.PEER_READY: _t(E._h_ignore, stay=_S),
        SIn.PEER_LOST: _t(E._h_ignore, stay=_S),  # nothing left to send; the peer's fate is its own
        SIn.ABORT_LOCAL: _t(E._h_ignore, stay=_S),  # the transfer is complete: nothing left to abort
        SIn.ABORT_PEER: _FAIL,  # decode gave up (e.g. a lost notification): agree on Failed
        SIn.PEER_FAILED: _FAIL,
        SIn.RELEASE: _t(E._h_on_release, stay=_S),
    },
    _F: {i: _t(E._h_on_failed_input, stay=_F) for i in SIn},
}

SenderEngine.TABLE = SENDER_TABLE
