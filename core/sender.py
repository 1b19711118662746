"""Prefill side: one ``SenderEngine`` per prefill TP rank, holding its peers and its rooms.

Room states and KVPoll:

    BOOTSTRAPPING (Bootstrapping)  waiting for the local open, every expected TransferInfo, and the
                                   registration of every decode rank those came from
    WAITING       (WaitingForInput) ready; chunks from the scheduler are queued to the worker
    TRANSFERRING  (Transferring)   chunks planned and posted, writes in flight
    SUCCESS       (Success)        last chunk run and every write DONE
    FAILED        (Failed)         absorbing; tells every known decode rank (RoomFailed), and once
                                   no write is in flight sends the fence (Stopped)

The flows' prefill halves are composed in: the staged flows (``StagedSender``,
core/flows/staged_sender.py: lanes, grants, gathers, watermarks; its ledgers apart from the room), pull
(``PullSender``, core/flows/pull.py: offers instead of writes, pages kept until every offered
chunk was pulled or the fence) and push (``PushSender``, core/flows/push.py: the direct flow's
writes under registration leases). The aux row is written by prefill in every flow.

Failure notices are reliable: RoomFailed is resent every heartbeat interval to each decode rank
that has not answered (FailedAck, or its own Abort / RoomFailed, which prove it is Failed too),
for at most ``fence_ns`` after the failure. The pending notices live in ``notices``, apart from
the room: like the tombstone they outlive a released room (its pages need not wait for a peer's
answer) and are dropped on the last answer or at the give-up deadline.

``SENDER_TABLE`` lists every legal (state, input); any other pair fails the room with a reason
(core/machine.py runs it; FAIL is the only way into FAILED).
The engine is not thread-safe: a threaded driver serialises calls (one lock per engine).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
from kvferry.core import messages as m
from kvferry.core.commands import (
    AddPeer,
    AwaitWrites,
    ChunkSkipped,
    DropPeer,
    DropPrepared,
    EnqueueChunk,
    PostAuxWrite,
    PostPrepared,
    PostWrite,
    SendNotif,
    StatusChanged,
)
from kvferry.core.deadlines import DeadlineHeap, Timeouts
from kvferry.core.errors import KvferryError, LocalMisuseError
from kvferry.core.events import (
    AbortRoom,
    ChunkAhead,
    ChunkReady,
    ControlIn,
    LayersReady,
    NotificationIn,
    PeerUnusable,
    ReleaseRoom,
    SenderOpen,
    Tick,
    WriteDone,
    WriteFailed,
)
from kvferry.core.flows import Flow, FlowError, FlowPolicy, layerwise  # noqa: F401 (layerwise registers)
from kvferry.core.flows.ahead import AheadPlan, AheadPlans
from kvferry.core.flows.pull import PullSender
from kvferry.core.flows.push import PushSender
from kvferry.core.flows.registry import halves as flow_halves
from kvferry.core.flows.staged_sender import StagedSender
from kvferry.core.identity_enum import IdentityEnum
from kvferry.core.info_acks import OwedAcks
from kvferry.core.kvpoll import KVPoll
from kvferry.core.proto_common import (
    EngineFlowContext,
    RoomEngine,
    RoomError,
    RoomFailure,
    RoomStateError,
    Tombstones,
    Transition,
    step,
)
from kvferry.core.reliable import Resends
from kvferry.core.resources.leases import LeaseRegistry, NoticeKind, strip_retry_suffix
from kvferry.core.worker import Destination, shard_of

_encode = m.encode

__all__ = ["SENDER_TABLE", "SIn", "SState", "SenderEngine"]


class SState(IdentityEnum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


class SIn(IdentityEnum):
    """The room's own inputs; a flow component's are its table's (core/flows/parts.py)."""

    OPEN = "open"  # local SenderOpen on a room a TransferInfo created first
    INFO = "info"  # TransferInfo from a decode rank
    PEER_READY = "peer_ready"  # a decode rank this room needs registered
    CHUNK = "chunk"  # local ChunkReady
    LAYERS = "layers"  # local LayersReady (a flow that streams layers, core/flows/layerwise.py)
    RUN_CHUNK = "run_chunk"  # the worker step
    WRITE_DONE = "write_done"
    WRITE_FAILED = "write_failed"
    ABORT_LOCAL = "abort_local"
    ABORT_PEER = "abort_peer"  # Abort from decode
    PEER_FAILED = "peer_failed"  # RoomFailed from decode
    TIMEOUT = "timeout"
    PEER_LOST = "peer_lost"  # heartbeat loss of a decode rank of the room
    RELEASE = "release"
    FAIL = "fail"  # the failure funnel (``TableEngine.fail``): the only way into FAILED


STATUS = {
    SState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    SState.WAITING: KVPoll.WaitingForInput,
    SState.TRANSFERRING: KVPoll.Transferring,
    SState.SUCCESS: KVPoll.Success,
    SState.FAILED: KVPoll.Failed,
}

_B, _W, _T, _S, _F = SState.BOOTSTRAPPING, SState.WAITING, SState.TRANSFERRING, SState.SUCCESS, SState.FAILED


class _DecodeRanks:
    """What the room's decode ranks said in their TransferInfos."""

    __slots__ = ("dests", "expected_infos", "infos", "infos_sorted", "targets")

    def __init__(self) -> None:
        self.infos: dict[m.Endpoint, m.TransferInfo] = {}
        # Caches of what ``infos`` gives, dropped with each TransferInfo (read per chunk and lane).
        self.infos_sorted: list[tuple[m.Endpoint, m.TransferInfo]] | None = None
        self.targets: tuple[m.Endpoint, ...] | None = None  # the non-dummy ones, once all are in
        self.dests: dict[m.Endpoint, Any] = {}  # peer -> dst page array
        self.expected_infos = 0


class _Opening:
    """Who made the room (a TransferInfo may come before the local open) and what the open asked."""

    __slots__ = ("created_by_info", "flow_override", "opened")

    def __init__(self) -> None:
        self.opened = False
        self.created_by_info = False
        self.flow_override: str | None = None  # the open's flow, if it named one


class _Fence:
    """Who must hear the fence (Stopped) once nothing of a failed room is in flight, and whether
    it left."""

    __slots__ = ("stop_to", "stopped_sent")

    def __init__(self) -> None:
        self.stop_to: set[m.Endpoint] = set()
        self.stopped_sent = False


class _ChunkRun:
    """The room machine's side of the chunk run: chunks parked until the room is ready, whether
    the last was handed over, tokens computed so far and whether the last chunk ran."""

    __slots__ = ("last_enqueued", "last_run", "parked", "tokens_done")

    def __init__(self) -> None:
        self.parked: list[ChunkReady] = []
        self.last_enqueued = False
        self.tokens_done = 0
        self.last_run = False


class _Room:
    """One room of the rank. On the room itself: its identity and state, and what a flow's half
    reads of it (token range, decode ranks' topology, chunk order, writes in flight); the room
    machine's own bookkeeping sits in small records of one job each."""

    __slots__ = (
        "aux_index",
        "decode",
        "enqueue_end",
        "failure",
        "fence",
        "flow",
        "inflight",
        "key",
        "next_enqueue",
        "next_run",
        "num_tokens",
        "opening",
        "ranges",
        "receivers",
        "release_requested",
        "room",
        "run",
        "state",
        "tid",
        "token_start",
    )

    def __init__(self, room: int, tid: str) -> None:
        self.room = room
        self.tid = tid
        self.key = (room, tid)
        self.state = SState.BOOTSTRAPPING
        self.failure: RoomFailure | None = None
        self.opening = _Opening()
        self.decode = _DecodeRanks()
        self.run = _ChunkRun()
        self.fence = _Fence()
        self.aux_index = -1
        self.num_tokens = -1
        self.token_start = 0  # decode's prefix hit: it holds [0, token_start) already
        self.next_enqueue = 0
        self.next_run = 0
        self.inflight: set[int] = set()
        self.release_requested = False
        # Flows: the flow chosen (the key of its halves in core/flows/registry.py), the decode
        # ranks the scheduler named at open, and the token range of every enqueued chunk. A flow
        # keeps its own per-room ledger in its own table (core/flows/staged_sender.py
        # ``ledgers``, the layer-wise lanes in ``room_table``).
        self.receivers: tuple[m.Endpoint, ...] = ()
        self.flow: Any = None  # a Flow or an ExtraFlow, chosen once a decode rank registered
        self.ranges: list[tuple[int, int]] = []
        self.enqueue_end = 0


class _Peer:
    __slots__ = ("last_seen", "pool", "reg_id", "registration")

    def __init__(self, registration: m.Register, pool: Any, now: int) -> None:
        self.registration = registration
        self.reg_id = m.registration_id(registration)
        self.pool = pool
        self.last_seen = now


class _Writes(dict[int, tuple[int, str]]):
    """The rank's writes in flight: write id -> room key (the mapping itself), the next id, and
    the rooms whose writes in flight were cut when their decode peer was lost (``cut``, room key
    -> until when): over a transport that queues writes (UCX over TCP) they can still land after
    a heal, so no Stopped may vouch for them; decode frees those pages at its fence deadline."""

    __slots__ = ("cut", "next_id")

    def __init__(self) -> None:
        super().__init__()
        self.next_id = 1
        self.cut: dict[tuple[int, str], int] = {}


class _Flows:
    """The rank's flow components, built once with the context they reach the rank through:
    ``staged``, ``pull`` and ``push`` are its parts (core/flows/parts.py; ``parts`` holds them in
    hook order), ``ahead`` the chunks named and planned ahead (core/flows/ahead.py)."""

    __slots__ = ("ahead", "ctx", "pull", "push", "staged")

    ahead: AheadPlans
    ctx: SenderFlowContext
    pull: PullSender
    push: PushSender
    staged: StagedSender


class SenderFlowContext(EngineFlowContext):
    """What a flow's prefill half may use of its rank (core/flows/registry.py, ``SenderContext``):
    the room checks and bookkeeping every flow's run shares, posting and sending, the decode peers
    and the deadline heap. ``push``, ``pull`` and ``staged`` are the per-rank components of the
    flows that keep state across rooms."""

    __slots__ = ()

    @property
    def registration(self) -> m.Register | None:
        return self._engine.registration

    @property
    def staged(self) -> StagedSender:
        return self._engine.flows.staged

    @property
    def policy(self) -> FlowPolicy:
        return self._engine.policy

    @property
    def num_shards(self) -> int:
        return self._engine.num_shards

    @property
    def peers(self) -> dict[m.Endpoint, _Peer]:
        """The registered decode ranks (read only: registration, pool, reg_id)."""
        return self._engine.peers

    def targets(self, r: _Room) -> tuple[m.Endpoint, ...]:
        return self._engine._targets(r)

    def quiet(self, r: _Room) -> bool:
        """The last chunk ran and nothing of the room is in flight (it may succeed)."""
        return self._engine._quiet(r)

    def settle(self, r: _Room) -> None:
        """After failing a room outside its own step: fence it or drop it if it is done."""
        self._engine._maybe_finish(r)

    @property
    def push(self) -> PushSender:
        return self._engine.flows.push

    @property
    def pull(self) -> PullSender:
        return self._engine.flows.pull

    def chunk_bounds(self, r: _Room, c: ChunkReady) -> tuple[int, int]:
        return self._engine._chunk_bounds(r, c)

    def advance(self, r: _Room, c: ChunkReady, end: int) -> None:
        self._engine._advance(r, c, end)

    def infos_sorted(self, r: _Room) -> list[tuple[m.Endpoint, m.TransferInfo]]:
        return self._engine._infos_sorted(r)

    def destinations(self, r: _Room) -> list[Destination]:
        e = self._engine
        return [
            Destination(p, e.peers[p].pool, r.decode.dests[p], info.dummy) for p, info in e._infos_sorted(r)
        ]

    def chunk_note(self, r: _Room, c: Any, start: int, end: int, **kind: Any) -> bytes:
        return self._engine._chunk_note(r, c, start, end, **kind)

    def new_write(self, r: _Room) -> int:
        return self._engine._new_write(r)

    @property
    def finish_run(self) -> Callable[..., str]:
        return self._engine._finish_run

    # Chunks planned ahead (core/flows/ahead.py).
    def plans_ahead(self, r: _Room) -> bool:
        """The room is ready and its flow's prefill half plans ahead (``FlowSender.plans_ahead``,
        core/flows/registry.py): a chunk named ahead can be planned now."""
        if r.state is not SState.WAITING and r.state is not SState.TRANSFERRING:
            return False
        if r.flow is None:
            self._engine._choose_flow(r)
        return r.flow is not None and getattr(flow_halves(r.flow).sender, "plans_ahead", False)

    def decode_peers(self, r: _Room) -> tuple[Any, ...]:
        """The registration records of the room's decode ranks (a new record: a new agent)."""
        peers = self._engine.peers
        return tuple(peers.get(p) for p, _ in self._engine._infos_sorted(r))

    def take_ahead(self, r: _Room, c: ChunkReady, start: int, end: int) -> AheadPlan | None:
        return self._engine.flows.ahead.take(self, r, c, start, end)

    def named_ahead(self, r: _Room) -> dict[int, ChunkAhead]:
        """The room's chunks named ahead and not planned (core/flows/ahead.py), by chunk index."""
        return self._engine.flows.ahead.named.get(r.key, {})


class SenderEngine(RoomEngine):
    """All rooms of one prefill rank. Feed it events, execute the commands it returns."""

    # ClassVar: class constants (a compiled build reads them through the class, sim/planted.py
    # subclasses override them).
    STATUS = STATUS
    FAILED = SState.FAILED
    SUCCESS = SState.SUCCESS

    side: ClassVar[str] = "prefill"
    FAIL = SIn.FAIL
    TIMEOUT: ClassVar[SIn] = SIn.TIMEOUT
    PEER_LOST: ClassVar[SIn] = SIn.PEER_LOST
    # request-id matching: the id retries share
    push_base_id: ClassVar[Callable[[str], str]] = staticmethod(strip_retry_suffix)
    staged_class: ClassVar[type[StagedSender]] = StagedSender  # the staged flows' prefill half

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
        ``push_match``: how push registrations find their request (core/flows/push.py)."""
        if planner is None:
            from kvferry.core.planner import plan_rank_pair as planner
        self._new_tables()
        self.endpoint = endpoint
        self.pool = pool
        self.timeouts = timeouts or Timeouts()
        self.num_shards = num_shards
        self.planner = planner
        self.rooms: dict[int, _Room] = {}
        self.peers: dict[m.Endpoint, _Peer] = {}
        self.rooms_by_peer: dict[m.Endpoint, set[int]] = {}
        self.writes = _Writes()
        self.deadlines = DeadlineHeap()
        self.tombstones = Tombstones(self.timeouts.tombstone_ns)
        self.counters: Counter[str] = Counter()
        # Unacknowledged RoomFailed, by room key; outlives the room (like the tombstone).
        interval = self.timeouts.heartbeat_interval_ns
        self._notices = Resends(
            "notice", self.deadlines, self.counters, interval, "failure_resent", "failure_notice_gave_up"
        )
        self.registration = registration
        self.flows = flows = _Flows()
        flows.push = self._new_push(push_match)
        flows.ctx = SenderFlowContext(self)
        # Pull offers owed an answer (Pulled), by (room, transfer_id, chunk index).
        flows.pull = PullSender(flows.ctx)
        self._out: list[Any] = []
        self._now = 0
        self.last_internal_error: BaseException | None = None
        self.policy = policy or FlowPolicy()
        flows.ahead = AheadPlans(self.counters)
        self._track_tables()
        self._acks = OwedAcks(self)  # InfoAcks owed (core/info_acks.py)
        # The staged flows' prefill half (ring and pinned); it registers its own tables.
        flows.staged = self.staged_class(flows.ctx, worker_buffer_bytes, pinned_bytes)
        self._route_parts((flows.staged, flows.pull, flows.push))

    @property
    def staged(self) -> StagedSender:
        """The staged flows' prefill half (core/flows/staged_sender.py)."""
        return self.flows.staged

    @property
    def pull(self) -> PullSender:
        """Pull's prefill half: the offers (core/flows/pull.py)."""
        return self.flows.pull

    @property
    def push(self) -> PushSender:
        """Push's registration leases (core/flows/push.py)."""
        return self.flows.push

    def _new_push(self, push_match: str) -> PushSender:
        """Push registrations (a lease per room and decode rank); the watchdog fires just before
        the room's own waiting deadline, so the room fails with its reason."""
        t = self.timeouts
        return PushSender(
            lease_ns=t.heartbeat_timeout_ns,
            match_ns=max(1, t.waiting_ns - t.heartbeat_interval_ns),
            tombstone_ns=t.tombstone_ns,
            push_match=push_match,
            base_id=self.push_base_id,
            counters=self.counters,
            on_refused=self._push_refused,
            clock=self._clock,
            policy_override=lambda: self.policy.override,
        )

    def _clock(self) -> int:
        return self._now

    def _track_tables(self) -> None:
        self._track_rooms()
        self.track(
            "writes", lambda room: any(k[0] == room for k in self.writes.values()), lambda: len(self.writes)
        )
        self.track(
            "deadlines",
            lambda room: any(isinstance(k, tuple) and k[1] == room for k in self.deadlines.live_keys()),
        )
        self.track("pull_offers", self.pull.mentions, self.pull.size)
        self.track("leases", self.push.mentions, self.push.size)
        self.track("ahead", self.flows.ahead.mentions, self.flows.ahead.size)

    def staging_in_use(self) -> int:
        """Staging slots, pinned reservations and gathers held; 0 once every room settled."""
        return self.flows.staged.in_use()

    @property
    def leases(self) -> LeaseRegistry:
        """The push flow's lease registry (core/flows/push.py)."""
        return self.push.leases

    @leases.setter
    def leases(self, registry: LeaseRegistry) -> None:
        self.push.leases = registry

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
        elif t is LayersReady:
            self._room_input(event.room, event.transfer_id, SIn.LAYERS, event)
        elif t is ChunkAhead:
            r = self.rooms.get(event.room)
            if r is None or r.tid != event.transfer_id or r.state is SState.FAILED:
                self.counters["ahead_for_unknown_room"] += 1
            else:
                self.flows.ahead.name(self.flows.ctx, r, event)
        elif t is WriteDone or t is WriteFailed:
            inp = SIn.WRITE_DONE if t is WriteDone else SIn.WRITE_FAILED
            self._completion(self.writes, event.write_id, "unknown_write", inp, event)
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
        elif t in self._routes:
            self._routes[t](event)  # a flow's own completion (a gather's: core/flows/parts.py)
        else:
            self.counters["bad_event"] += 1
            raise TypeError(f"SenderEngine cannot handle {t.__name__}")
        if self._acks.owed:
            self._acks.ride(out)
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
        if self._acks.owed:
            self._acks.ride(out)
        self._out = []
        return out

    # --- control messages --------------------------------------------------------------------------

    def _on_control(self, data: bytes) -> None:
        msg = self._control_in(data)
        if msg is None:
            return
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
                if r is not None:
                    for part in self.parts:
                        part.heard_from(r, msg.src)
        elif t in self._routes:
            self._routes[t](msg)  # a flow's own message (core/flows/parts.py)
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
                self._parts_peer_lost(msg.src)
                self._acks.peer_gone(msg.src)
                self._out.append(DropPeer(peer=msg.src, reason="re-registered with a new agent"))
            self.peers[msg.src] = new
            self._out.append(AddPeer(peer=msg.src, registration=msg))
            if old is None:
                self._arm_peer(msg.src)
        self._send(msg.src, m.RegisterAck(src=self.endpoint, ok=True))
        for room in sorted(self.rooms_by_peer.get(msg.src, ())):
            r = self.rooms[room]
            if r.decode.infos[msg.src].reg != new.reg_id:
                for part in self.parts:  # the old process is gone, and what it did for the room
                    part.peer_replaced(r, msg.src)
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
                if (room, tid) not in self.writes.cut:
                    self._send(msg.src, m.Stopped(src=self.endpoint, room=room, transfer_id=tid))
            return
        r = self.rooms.get(msg.room)
        if r is None:
            r = self._create(msg.room, msg.transfer_id)
            r.opening.created_by_info = True
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
        first = msg.src not in r.decode.infos
        self._dispatch(r, SIn.INFO, msg)
        if first and r.decode.infos.get(msg.src) is msg and r.state is not SState.FAILED:
            self._acks.owe(r.key, msg.src)  # a note of the room will answer it, or the batch
        else:  # a resend (decode has waited an interval), or a room that failed on it
            self._send(msg.src, m.InfoAck(src=self.endpoint, room=msg.room, transfer_id=msg.transfer_id))

    def _on_abort(self, msg: m.Abort) -> None:
        r = self.rooms.get(msg.room)
        if r is None or r.tid != msg.transfer_id:
            # Nothing of ours is live for this incarnation, so nothing can be writing: fence now.
            self.counters["abort_for_unknown_room"] += 1
            self._late_failure(msg)
            if (msg.room, msg.transfer_id) not in self.writes.cut:
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
        if self._open_tombstoned(ev.room, ev.transfer_id):
            return
        r = self.rooms.get(ev.room)
        if r is None:
            r = self._create(ev.room, ev.transfer_id)
            r.opening.opened = True
            r.aux_index = ev.aux_index
            r.receivers, r.opening.flow_override = tuple(ev.receivers), ev.flow
            for part in self.parts:
                part.opened(r)
            self._out.append(StatusChanged(room=r.room, transfer_id=r.tid, status=KVPoll.Bootstrapping))
            return
        if r.tid != ev.transfer_id and r.opening.created_by_info and not r.opening.opened:
            # Only a TransferInfo made that room and no local request owns it: a message of an
            # incarnation whose tombstone expired. The local scheduler is the authority on which
            # request holds the id now: the ghost fails (it never wrote) and the new room starts.
            self.counters["ghost_superseded"] += 1
            self.fail(r, RoomFailure(f"superseded by request {ev.transfer_id}", at_ns=self._now))
            self._maybe_finish(r)
            if self.rooms.get(ev.room) is None:
                self._open(ev)
                return
        if r.tid != ev.transfer_id:
            # Same room id, another request: the old one is stale, the new one cannot start.
            self.counters["stale_transfer_id"] += 1
            self._refuse_open(ev.room, ev.transfer_id, "room id in use")
            return
        self._dispatch(r, SIn.OPEN, ev)

    def _room_input(self, room: int, tid: str, inp: SIn, payload: Any) -> None:
        r = self._live(room, tid)
        if r is not None:
            self._dispatch(r, inp, payload)

    BOOKKEEP = frozenset({SIn.RELEASE, SIn.WRITE_DONE, SIn.WRITE_FAILED})

    def _bookkeep(self, r: _Room, inp: SIn, payload: Any) -> None:
        if inp is SIn.RELEASE:
            r.release_requested = True
        elif inp is SIn.WRITE_DONE or inp is SIn.WRITE_FAILED:
            r.inflight.discard(payload.write_id)
            for part in self.parts:  # a write id is at most one component's
                part.write_finished(r, payload.write_id, inp is SIn.WRITE_DONE)

    def _forget_command(self, r: _Room, cmd: Any) -> None:
        t = type(cmd)
        if t is PostPrepared:  # a write prepared ahead, never posted: given back
            self._out.append(DropPrepared(prep_id=cmd.prep_id, room=r.room))
        elif t is DropPrepared:  # giving back moves nothing: it leaves even from a failed step
            self._out.append(cmd)
        if t is PostWrite or t is PostAuxWrite or t is PostPrepared:
            if self.writes.pop(cmd.write_id, None) is not None:
                self._bookkeep(r, SIn.WRITE_FAILED, WriteFailed(write_id=cmd.write_id, reason="withdrawn"))
        else:
            for part in self.parts:
                part.withdrawn(r, cmd)

    def _entered(self, r: _Room) -> None:
        st = r.state
        # The class's STATUS (the same table): mypyc 1.20 miscompiles the module's name here,
        # which the class body rebinds (``STATUS = STATUS``).
        self._out.append(StatusChanged(room=r.room, transfer_id=r.tid, status=self.STATUS[st]))
        key = ("room", r.room)
        if st is SState.WAITING:
            self.deadlines.set(key, self._now + self.timeouts.waiting_ns)
            parked, r.run.parked = r.run.parked, []
            shard = shard_of(r.room, self.num_shards)
            for c in parked:
                self._out.append(EnqueueChunk(shard=shard, chunk=c))
            if parked:
                for part in self.parts:
                    part.computed(r, True)
            self.flows.ahead.plan(self.flows.ctx, r)  # a chunk named before decode's TransferInfo
        elif st is SState.TRANSFERRING:
            self.deadlines.set(key, self._now + self.timeouts.transfer_ns)
        elif st is SState.SUCCESS:
            self.deadlines.cancel(key)

    def _started(self, r: _Room) -> bool:
        return r.state is not SState.BOOTSTRAPPING

    def _ready(self, r: _Room) -> bool:
        return (
            r.opening.opened
            and r.decode.expected_infos > 0
            and len(r.decode.infos) == r.decode.expected_infos
            and all(p in self.peers and self.peers[p].reg_id == i.reg for p, i in r.decode.infos.items())
        )

    # --- handlers (names referenced by SENDER_TABLE) -------------------------------------------

    def _h_on_open(self, r: _Room, inp: SIn, ev: SenderOpen) -> str:
        if r.opening.opened:
            raise RoomStateError("room opened twice")
        r.opening.opened = True
        r.aux_index = ev.aux_index
        r.receivers, r.opening.flow_override = tuple(ev.receivers), ev.flow
        for part in self.parts:
            part.opened(r)
        for info in list(r.decode.infos.values()):
            self._info_known(r, info)
        self._prepare(r)
        return "ready" if self._ready(r) else "stay"

    def _duplicate_info(self, r: _Room, msg: m.TransferInfo) -> bool:
        known = r.decode.infos.get(msg.src)
        if known is None:
            return False
        if known != msg:
            raise RoomError(f"conflicting TransferInfo from {msg.src}")
        self.counters["duplicate_info"] += 1
        return True

    def _h_on_info_late(self, r: _Room, inp: SIn, msg: m.TransferInfo) -> str:
        """Every expected TransferInfo arrived already: only a duplicate is fine."""
        if self._duplicate_info(r, msg):
            return "stay"
        raise RoomError(f"unexpected TransferInfo from {msg.src} after all {r.decode.expected_infos} arrived")

    def _h_on_info(self, r: _Room, inp: SIn, msg: m.TransferInfo) -> str:
        if self._duplicate_info(r, msg):
            return "stay"
        if r.decode.infos:
            if msg.expected_infos != r.decode.expected_infos:
                raise RoomError(f"decode ranks disagree on expected senders ({msg.expected_infos})")
            if msg.num_tokens != r.num_tokens:
                raise RoomError(
                    f"decode ranks disagree on the room's length ({msg.num_tokens} vs {r.num_tokens})"
                )
            if msg.token_start != r.token_start:
                raise RoomError(f"decode ranks disagree on the prefix they hold ({msg.token_start})")
        else:
            r.decode.expected_infos = msg.expected_infos
            r.num_tokens = msg.num_tokens
            r.token_start = msg.token_start
        if len(r.decode.infos) >= r.decode.expected_infos:
            raise RoomError(f"more TransferInfos than the {r.decode.expected_infos} expected")
        r.decode.infos[msg.src] = msg
        r.decode.infos_sorted = r.decode.targets = None
        r.decode.dests[msg.src] = np.asarray(msg.dst_pages, dtype=np.int64)
        r.fence.stop_to.add(msg.src)
        self.rooms_by_peer.setdefault(msg.src, set()).add(r.room)
        self._info_known(r, msg)
        self._prepare(r)
        return "ready" if self._ready(r) else "stay"

    def _h_on_peer_ready(self, r: _Room, inp: SIn, peer: Any) -> str:
        self._prepare(r)
        return "ready" if self._ready(r) else "stay"

    def _h_on_peer_ready_late(self, r: _Room, inp: SIn, peer: Any) -> str:
        self._prepare(r)
        return "stay"

    def _h_on_chunk_early(self, r: _Room, inp: SIn, c: ChunkReady) -> None:
        """Before the room is ready the chunk is parked: the worker never sees it early."""
        if self._accept_chunk(r, c):
            r.run.parked.append(c)

    def _h_on_chunk(self, r: _Room, inp: SIn, c: ChunkReady) -> None:
        if self._accept_chunk(r, c):
            ready = self.flows.ahead.ready(self.flows.ctx, r, c)
            self._out.append(EnqueueChunk(shard=shard_of(r.room, self.num_shards), chunk=c, prepared=ready))
            if c.chunk_index == 0:
                for part in self.parts:
                    part.computed(r, False)

    def _accept_chunk(self, r: _Room, c: ChunkReady) -> bool:
        """Check and record a chunk the scheduler hands over; False for a duplicate (skipped)."""
        if c.chunk_index < r.next_enqueue:
            self.counters["duplicate_chunk"] += 1
            self._out.append(ChunkSkipped(room=r.room, chunk_index=c.chunk_index, reason="duplicate chunk"))
            return False
        # These come from our own scheduler, not from a peer: its mistake is raised to it (the
        # room does not change), unlike a peer's garbage, which fails the room.
        if c.chunk_index != r.next_enqueue:
            raise LocalMisuseError(
                f"room {r.room}: chunk {c.chunk_index} handed over before chunk {r.next_enqueue}"
            )
        if r.run.last_enqueued:
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
        r.run.last_enqueued = c.is_last
        start = r.enqueue_end
        r.ranges.append((start, int(c.token_end)))
        r.enqueue_end = max(start, int(c.token_end))
        self._prepare(r)
        return True

    def _h_on_run_chunk(self, r: _Room, inp: SIn, c: ChunkReady) -> str:
        if c.chunk_index < r.next_run:
            self.counters["duplicate_chunk_run"] += 1
            self._out.append(ChunkSkipped(room=r.room, chunk_index=c.chunk_index, reason="already run"))
            return "stay"
        flow = r.flow
        if flow is None:  # RUN_CHUNK comes only once the room is ready (the table)
            self._choose_flow(r)
            flow = r.flow
        if c.chunk_index != r.next_run:
            raise RoomStateError(f"worker got chunk {c.chunk_index} before chunk {r.next_run}")
        return self._run_flow(r, c, flow)

    def _h_on_layers(self, r: _Room, inp: SIn, ev: LayersReady) -> str:
        """Layers of a chunk computed: the room's flow streams them if it can (``LayerSender``,
        core/flows/registry.py); any other flow waits for its ChunkReady and moves nothing here."""
        flow: Any = r.flow
        if flow is None:  # chosen once a decode rank registered: the open's, else the policy's
            try:
                flow = self.policy.requested(r.opening.flow_override)
            except FlowError:
                flow = None  # the open's unknown flow fails the room where it is chosen
        on_layers = None if flow is None else getattr(flow_halves(flow).sender, "on_layers", None)
        if on_layers is None:
            self.counters["layers_ignored"] += 1
            return "stay"
        outcome: str = on_layers(self.flows.ctx, r, ev)
        return outcome

    # --- the room's flow: chosen once, then its halves (core/flows/registry.py) -----------------------

    def _targets(self, r: _Room) -> tuple[m.Endpoint, ...]:
        """Decode ranks this rank writes data to: from the TransferInfos once all are in, before
        that from the topology the scheduler passed at open."""
        dec = r.decode
        if dec.expected_infos and len(dec.infos) == dec.expected_infos:
            # Asked many times per lane by the staged flows: kept until the next TransferInfo
            # (none comes once all are in). The items sort by peer alone (peers are distinct keys).
            if dec.targets is None:
                dec.targets = tuple(p for p, i in self._infos_sorted(r) if not i.dummy)
            return dec.targets
        return r.receivers

    def _choose_flow(self, r: _Room) -> None:
        """Pick the room's flow from the policy, once a decode rank it writes to is registered
        (its Register says what it can receive); the flow's prefill half may refuse the ranks."""
        if not r.opening.opened:
            # Decode's TransferInfo can arrive before the local open; the open may name the flow
            # (SenderOpen.flow), so nothing is chosen before it (else ranks disagree on a room).
            return
        targets = self._targets(r)
        known = [self.peers[p] for p in targets if p in self.peers]
        if not known:
            if self._started(r) and not targets:
                r.flow = self.policy.without_data()  # only dummy links: nothing to stage
            return
        reg = known[0].registration
        r.flow = self.policy.choose(
            self.pool, known[0].pool, reg.ring_bytes, reg.pinned_bytes, r.opening.flow_override
        )
        check = getattr(flow_halves(r.flow).sender, "check_peers", None)
        if check is not None:
            check(r.flow, [p.registration for p in known])

    def _prepare(self, r: _Room) -> None:
        """The room learned of chunks or decode ranks: choose its flow if it can, and let a flow
        that works ahead of the worker (the staged flows ask for space) do so."""
        if r.flow is None:
            self._choose_flow(r)
            if r.flow is None:
                return
        prepare = getattr(flow_halves(r.flow).sender, "prepare", None)
        if prepare is not None:
            prepare(self.flows.ctx, r)

    def _run_flow(self, r: _Room, c: ChunkReady, flow: Flow) -> str:
        """The flow's prefill half (core/flows/registry.py) runs the chunk through the context."""
        return flow_halves(flow).sender.run_chunk(self.flows.ctx, r, c)

    @staticmethod
    def _infos_sorted(r: _Room) -> list[tuple[m.Endpoint, m.TransferInfo]]:
        """``sorted(r.decode.infos.items())``, kept until the next TransferInfo (each chunk reads it)."""
        if r.decode.infos_sorted is None:
            r.decode.infos_sorted = sorted(r.decode.infos.items())
        return r.decode.infos_sorted

    def _chunk_bounds(self, r: _Room, c: ChunkReady) -> tuple[int, int]:
        """Validate the chunk the room runs next against decode's allocation; its token range."""
        if r.run.last_run:
            raise RoomStateError("chunk after the last chunk")
        start, end = r.run.tokens_done, c.token_end
        if end < start:
            raise RoomStateError(f"chunk {c.chunk_index} ends at token {end}, before its start {start}")
        # A prefix hit: decode holds [0, token_start); only the rest moves, at its own slots (the
        # planner places by absolute token), and a chunk wholly inside the prefix moves nothing.
        start, end = max(start, r.token_start), max(end, r.token_start)
        if end > r.num_tokens:
            raise RoomStateError(f"chunk {c.chunk_index} ends at token {end}, past decode's {r.num_tokens}")
        if c.is_last and end != r.num_tokens:
            raise RoomStateError(f"prefill produced {end} tokens but decode allocated {r.num_tokens}")
        for p, info in r.decode.infos.items():
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

    def _info_known(self, r: _Room, info: m.TransferInfo) -> None:
        for part in self.parts:
            part.transfer_info(r, info)

    # --- push: registration leases (core/flows/push.py) ----------------------------------------

    def lease_key(self, tid: str, peer: str) -> str:
        """The registry key of room ``tid``'s registration by decode rank ``peer`` (e.g. decode0)."""
        return self.push.lease_key(tid, peer)

    def _push_refused(self, key: tuple[int, str], kind: NoticeKind, reason: str) -> None:
        """A lease of a live room ended badly (expired, refused, never matched): the room fails."""
        r = self.rooms.get(key[0])
        if r is None or r.key != key or r.state is SState.FAILED:
            return
        self.counters[f"push_{kind.value}"] += 1
        self.fail(r, RoomFailure(f"push registration {kind.value}: {reason}", at_ns=self._now))
        self._maybe_finish(r)

    def _advance(self, r: _Room, c: ChunkReady, end: int) -> None:
        r.next_run += 1
        r.run.tokens_done = int(c.token_end)  # what prefill computed, not the prefix-clipped ``end``
        r.run.last_run = c.is_last

    def _finish_run(
        self,
        r: _Room,
        c: ChunkReady,
        start: int,
        end: int,
        posted: list[int],
        lease: PushSender | None = None,
        prepared_aux: dict[m.Endpoint, int] | None = None,
    ) -> str:
        """What every run chunk ends with: the last chunk's dummy and aux notes, the pacing hint;
        the outcome: "done" once the last chunk ran and nothing is in flight, else "running".
        ``lease``: the flow posts under registration leases (push): the aux write too.
        ``prepared_aux``: aux writes made ready ahead (core/flows/ahead.py), by decode rank."""
        if c.is_last:
            for p, info in self._infos_sorted(r):
                if info.dummy:
                    self._out.append(
                        SendNotif(peer=p, room=r.room, notif=self._chunk_note(r, c, start, end, dummy=True))
                    )
                if info.send_aux:
                    if lease is not None:
                        lease.post(r.key, p, self._now)
                    wid = self._new_write(r)
                    if lease is not None:
                        lease.posted(wid, r.key, p)
                    posted.append(wid)
                    pid = prepared_aux.get(p, 0) if prepared_aux else 0
                    if pid:
                        self._out.append(PostPrepared(prep_id=pid, write_id=wid, peer=p, room=r.room))
                        continue
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
        if c.is_last and lease is not None:
            lease.completed(r.key, self._now)
        return "done" if self._quiet(r) else "running"

    def _quiet(self, r: _Room) -> bool:
        """The last chunk ran and nothing of the room is in flight: writes, gathers, lanes."""
        return r.run.last_run and not r.inflight and all(p.quiet(r.key) for p in self.parts)

    def _new_write(self, r: _Room) -> int:
        wid = self.writes.next_id
        self.writes.next_id += 1
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
            r.fence.stop_to.add(payload.src)
        elif inp is SIn.PEER_FAILED:
            reason = f"failed on {payload.src}: {payload.reason}"
        elif inp is SIn.TIMEOUT:
            reason = f"timed out while {r.state.value}"
            blocked = next((b for p in self.parts if (b := p.blocked(r.key))), "")
            if blocked:
                reason += f" ({blocked})"
        elif isinstance(payload, tuple):
            reason = f"peer {payload[0]} {payload[1]}"
        else:
            reason = f"peer {payload} lost (no heartbeat)"
        tell = None if inp not in (SIn.ABORT_PEER, SIn.PEER_FAILED) else payload.src
        self.fail(r, RoomFailure(reason, at_ns=self._now), skip=tell)
        return "failed"

    def _h_on_failed_input(self, r: _Room, inp: SIn, payload: Any) -> None:
        """Failed absorbs everything; some inputs still matter for the fence and the peers."""
        if inp is SIn.ABORT_PEER:
            r.fence.stop_to.add(payload.src)
            if r.fence.stopped_sent:
                self._send(payload.src, m.Stopped(src=self.endpoint, room=r.room, transfer_id=r.tid))
        elif inp is SIn.INFO:
            # A decode rank that joins late must still hear the outcome (and get its fence).
            if payload.src not in r.decode.infos:
                reason = r.failure.reason if r.failure else "failed"
                self._send(
                    payload.src,
                    m.RoomFailed(src=self.endpoint, room=r.room, transfer_id=r.tid, reason=reason),
                )
                r.fence.stop_to.add(payload.src)
                if r.fence.stopped_sent:
                    self._send(payload.src, m.Stopped(src=self.endpoint, room=r.room, transfer_id=r.tid))
        elif inp is SIn.RUN_CHUNK or inp is SIn.CHUNK:
            # SGLang PR 20680: a worker that meets a Failed room skips its remaining chunks.
            self.counters["chunk_skipped_failed"] += 1
            self._out.append(ChunkSkipped(room=r.room, chunk_index=payload.chunk_index, reason="room failed"))
        elif inp not in (SIn.RELEASE, SIn.WRITE_DONE, SIn.WRITE_FAILED):
            self.counters[f"ignored_failed_{inp.value}"] += 1

    def _h_on_release(self, r: _Room, inp: SIn, payload: Any) -> None:
        pass  # handled by _maybe_finish

    # --- failure, fence, release -------------------------------------------------------------------

    def _h_fail(self, r: _Room, inp: SIn, payload: tuple[RoomFailure, dict[str, Any]]) -> str:
        """FAIL (the funnel): record why, stop what the room has in flight, tell its decode ranks
        (all but ``skip``, the one that told us)."""
        failure, why = payload
        skip = why.get("skip")
        r.failure = failure
        r.run.parked = []
        self.deadlines.cancel(("room", r.room))
        for part in self.parts:
            part.room_failed(r)
        self._out.append(
            StatusChanged(room=r.room, transfer_id=r.tid, status=KVPoll.Failed, reason=failure.reason)
        )
        self._tell_failure(r, failure, {p for p in r.decode.infos if p != skip})
        return "failed"

    def _tell_failure(self, r: _Room, failure: RoomFailure, tell: set[m.Endpoint]) -> None:
        """A decode rank may already be Success (our last write landed before we failed): it must
        hear this, so the notice is resent until answered, for at most fence_ns."""
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
        if not r.inflight and not r.fence.stopped_sent and r.key not in self.writes.cut:
            r.fence.stopped_sent = True
            for p in sorted(r.fence.stop_to):
                self._send(p, m.Stopped(src=self.endpoint, room=r.room, transfer_id=r.tid))
        # A gather still running owns a staging buffer: the room stays until it returns.
        terminal_quiet = not r.inflight and all(p.fenced(r.key) for p in self.parts)
        # A room only a TransferInfo ever created has no local owner to release it.
        auto = r.opening.created_by_info and not r.opening.opened
        if terminal_quiet and (r.release_requested or auto):
            self._remove(r)

    def _remove(self, r: _Room) -> None:
        for part in self.parts:
            part.forget(r)
        self.flows.ahead.forget(self.flows.ctx, r.key)
        self._forget(r, r.decode.infos)

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
        elif kind == "cut":
            self.writes.cut.pop(what, None)  # decode's fence deadline has passed: it freed the pages
        elif kind == OwedAcks.KIND:
            self._acks.fire(what)

    def _peer_gone(self, peer: m.Endpoint) -> None:
        self._acks.peer_gone(peer)
        until = self._now + self.timeouts.fence_ns
        for room in sorted(self.rooms_by_peer.get(peer, ())):
            r = self.rooms.get(room)
            if r is not None and r.inflight:
                self.writes.cut[r.key] = until
                self.deadlines.set(("cut", r.key), until)
                self.counters["writes_cut_by_peer_loss"] += 1


# --- the transition table (after the class: it holds the handlers themselves) --------------


_t = step
E = SenderEngine
_FAIL = _t(E._h_on_fail, failed=_F)
_LIVE_FAILURES = {
    SIn.FAIL: _t(E._h_fail, failed=_F),
    SIn.ABORT_LOCAL: _FAIL,
    SIn.ABORT_PEER: _FAIL,
    SIn.PEER_FAILED: _FAIL,
    SIn.TIMEOUT: _FAIL,
    SIn.PEER_LOST: _FAIL,
}

SENDER_TABLE: dict[SState, dict[SIn, Transition]] = {
    _B: {
        SIn.OPEN: _t(E._h_on_open, stay=_B, ready=_W),
        SIn.INFO: _t(E._h_on_info, stay=_B, ready=_W),
        SIn.PEER_READY: _t(E._h_on_peer_ready, stay=_B, ready=_W),
        SIn.CHUNK: _t(E._h_on_chunk_early, stay=_B),  # parked until WAITING
        SIn.LAYERS: _t(E._h_on_layers, stay=_B),  # recorded; posted once the chunk runs
        **_LIVE_FAILURES,
    },
    _W: {
        SIn.INFO: _t(E._h_on_info_late, stay=_W),
        SIn.PEER_READY: _t(E._h_on_peer_ready_late, stay=_W),
        SIn.CHUNK: _t(E._h_on_chunk, stay=_W),
        SIn.LAYERS: _t(E._h_on_layers, stay=_W),
        SIn.RUN_CHUNK: _t(E._h_on_run_chunk, stay=_W, running=_T, done=_S),
        **_LIVE_FAILURES,
    },
    _T: {
        SIn.INFO: _t(E._h_on_info_late, stay=_T),
        SIn.PEER_READY: _t(E._h_on_peer_ready_late, stay=_T),
        SIn.CHUNK: _t(E._h_on_chunk, stay=_T),
        SIn.LAYERS: _t(E._h_on_layers, stay=_T, running=_T, done=_S),
        SIn.RUN_CHUNK: _t(E._h_on_run_chunk, stay=_T, running=_T, done=_S),
        SIn.WRITE_DONE: _t(E._h_on_write_done, stay=_T, done=_S),
        SIn.WRITE_FAILED: _FAIL,
        **_LIVE_FAILURES,
    },
    _S: {
        SIn.INFO: _t(E._h_on_info_late, stay=_S),
        SIn.PEER_READY: _t(E._h_ignore, stay=_S),
        SIn.LAYERS: _t(E._h_ignore, stay=_S),  # a report repeated after every layer was posted
        SIn.PEER_LOST: _t(E._h_ignore, stay=_S),  # nothing left to send; the peer's fate is its own
        SIn.ABORT_LOCAL: _t(E._h_ignore, stay=_S),  # the transfer is complete: nothing left to abort
        SIn.ABORT_PEER: _FAIL,  # decode gave up (e.g. a lost notification): agree on Failed
        SIn.PEER_FAILED: _FAIL,
        SIn.RELEASE: _t(E._h_on_release, stay=_S),
        SIn.FAIL: _t(E._h_fail, failed=_F),  # a peer's failure after our Success (agree on Failed)
    },
    _F: {**{i: _t(E._h_on_failed_input, stay=_F) for i in SIn}, SIn.FAIL: _t(E._h_ignore_fail, stay=_F)},
}

SenderEngine.TABLE = SENDER_TABLE
