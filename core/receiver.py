"""Decode side: one ``ReceiverEngine`` per decode TP rank, holding its peers and its rooms.

Room states and KVPoll:

    BOOTSTRAPPING (Bootstrapping)   TransferInfo sent to every sender; waiting for every sender's
                                    registration ack
    WAITING       (WaitingForInput) every sender registered us; waiting for the first chunk
    TRANSFERRING  (Transferring)    chunks landing
    SUCCESS       (Success)         every non-dummy sender delivered every chunk (as a set: the
                                    count comes from its last chunk), the token ranges tile
                                    [0, num_tokens) exactly, the aux row holds this room id, and
                                    every dummy sender said it finished
    FAILED        (Failed)          absorbing; Abort sent to every sender; the pages are freed
                                    (FreePages) once every sender confirmed Stopped, or the fence
                                    deadline passed

Pull flow (core/flows/pull.py): a sender may offer its chunks (PullOffer) instead of writing
them; decode READs each one and records it like a write's notification, so Success means the same.

Late failures: a RoomFailed for a room that is Success here (live or tombstoned) turns it Failed
(Failed overrides and sticks, so both sides end Failed); every RoomFailed is answered with
FailedAck, which stops the sender's resending.

``RECEIVER_TABLE`` lists every legal (state, input); any other pair fails the room with a reason.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import numpy as np
from kvferry.core import messages as m
from kvferry.core.commands import CheckAux, FreePages, StatusChanged
from kvferry.core.deadlines import DeadlineHeap, Timeouts
from kvferry.core.errors import WireError
from kvferry.core.events import (
    AbortRoom,
    AuxChecked,
    ControlIn,
    NotificationIn,
    ReceiverOpen,
    ReleaseRoom,
    SenderSpec,
    Tick,
)
from kvferry.core.flows.direct import DIRECT as DIRECT_RECEIVER
from kvferry.core.flows.layerwise import LAYERWISE as LAYERWISE_RECEIVER
from kvferry.core.flows.pull import PullReceiver
from kvferry.core.flows.registry import FlowReceiver
from kvferry.core.flows.staged_receiver import StagedReceiver
from kvferry.core.identity_enum import IdentityEnum
from kvferry.core.kvpoll import KVPoll
from kvferry.core.proto_common import (
    EngineFlowContext,
    RoomEngine,
    RoomError,
    RoomFailure,
    Tombstones,
    Transition,
    step,
)
from kvferry.core.reliable import Resends

__all__ = ["RECEIVER_TABLE", "RIn", "RState", "ReceiverEngine"]


class RState(IdentityEnum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


class RIn(IdentityEnum):
    """The room's own inputs; a flow component's are its table's (core/flows/parts.py)."""

    OPEN = "open"  # a second ReceiverOpen for a live room
    PEER_READY = "peer_ready"  # RegisterAck(ok) from a sender
    PEER_REFUSED = "peer_refused"  # RegisterAck(not ok, final) from a sender
    NOTIFY = "notify"  # a chunk (or aux) notification
    AUX_CHECKED = "aux_checked"
    PEER_FAILED = "peer_failed"  # RoomFailed from a sender
    STOPPED = "stopped"  # fence ack from a sender
    ABORT_LOCAL = "abort_local"
    TIMEOUT = "timeout"
    PEER_LOST = "peer_lost"
    RELEASE = "release"
    FAIL = "fail"  # the failure funnel (``TableEngine.fail``): the only way into FAILED


# A shared empty stand-in for a room's rarely filled sets (dummies, fence): a room allocates its
# own set only when it first writes one (most rooms never do), so opening a room builds fewer
# objects. Readers need no change; the few writers replace the stand-in first.
NO_SET: frozenset[Any] = frozenset()

STATUS = {
    RState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    RState.WAITING: KVPoll.WaitingForInput,
    RState.TRANSFERRING: KVPoll.Transferring,
    RState.SUCCESS: KVPoll.Success,
    RState.FAILED: KVPoll.Failed,
}

_B, _W, _T, _S, _F = RState.BOOTSTRAPPING, RState.WAITING, RState.TRANSFERRING, RState.SUCCESS, RState.FAILED


class _SenderProgress:
    __slots__ = ("chunks", "done", "last_index")

    def __init__(self) -> None:
        self.chunks: dict[int, tuple[int, int]] = {}
        self.last_index = -1
        self.done = False


class _Fence:
    """A failed room's fence: the senders that confirmed Stopped, the fence deadline passed, a
    quarantine past it (``quarantine_ns``), and the pages given back (FreePages)."""

    __slots__ = ("expired", "freed", "quarantined", "stopped")

    def __init__(self) -> None:
        self.stopped: set[m.Endpoint] | frozenset[m.Endpoint] = NO_SET
        self.expired = False
        self.quarantined = False  # past the fence, still waiting for a Stopped (quarantine_ns)
        self.freed = False  # only ever set once Failed


class _Room:
    __slots__ = (
        "aux_index",
        "aux_ok",
        "aux_pending",
        "aux_sender",
        "data_senders",
        "dst_list",
        "dst_pages",
        "dummies_done",
        "failure",
        "fence",
        "key",
        "num_tokens",
        "progress",
        "release_requested",
        "room",
        "senders",
        "state",
        "tid",
        "token_start",
    )

    def __init__(self, ev: ReceiverOpen, pages: Any) -> None:
        self.room = ev.room
        self.tid = ev.transfer_id
        self.key = (ev.room, ev.transfer_id)
        self.state = RState.BOOTSTRAPPING
        self.dst_pages = pages
        self.dst_list: list[int] = []  # the page ids as a list, for every TransferInfo
        self.num_tokens = ev.num_tokens
        self.token_start = ev.token_start
        self.aux_index = ev.aux_index
        # One pass over the senders (this runs once per room and rank).
        self.senders: dict[m.Endpoint, SenderSpec] = {}
        self.data_senders: set[m.Endpoint] = set()
        self.progress: dict[m.Endpoint, _SenderProgress] = {}
        self.aux_sender: m.Endpoint | None = None
        for s in ev.senders:
            p = s.endpoint
            self.senders[p] = s
            if not s.dummy:
                self.data_senders.add(p)
                self.progress[p] = _SenderProgress()
            if s.send_aux and self.aux_sender is None:
                self.aux_sender = p
        self.aux_pending = False
        self.aux_ok = False
        self.dummies_done: set[m.Endpoint] | frozenset[m.Endpoint] = NO_SET
        self.fence = _Fence()
        self.failure: RoomFailure | None = None
        self.release_requested = False


class _Peer:
    __slots__ = ("acked", "last_seen")

    def __init__(self, now: int) -> None:
        self.acked = False
        self.last_seen = now


class _Flows:
    """The rank's flow components, built once with the context they reach the rank through:
    ``staged`` and ``pull_rx`` are its parts (core/flows/parts.py; ``parts`` holds them in hook
    order)."""

    __slots__ = ("ctx", "pull_rx", "staged")

    ctx: ReceiverFlowContext
    pull_rx: PullReceiver
    staged: StagedReceiver


class ReceiverFlowContext(EngineFlowContext):
    """What a flow's decode half may use of its rank (core/flows/registry.py, ``ReceiverContext``).
    ``staged`` and the engine's ``pull_rx`` are the per-rank components of the flows that keep
    state across rooms."""

    __slots__ = ()

    @property
    def staged(self) -> StagedReceiver:
        return self._engine.flows.staged

    @property
    def reg_id(self) -> int:
        return self._engine.reg_id

    def tombstone(self, room: int, tid: str) -> Any:
        return self._engine.tombstones.get(room, tid)

    def room_alive(self, r: _Room) -> None:
        """The room moved: its transfer deadline starts again."""
        e = self._engine
        e.deadlines.set(("room", r.room), e._now + e.timeouts.transfer_ns)

    def record_chunk(self, r: _Room, prog: _SenderProgress, note: m.ChunkNote) -> bool:
        return self._engine._record_chunk(r, prog, note)

    def complete(self, r: _Room) -> bool:
        return self._engine._complete(r)


class ReceiverEngine(RoomEngine):
    """All rooms of one decode rank. Feed it events, execute the commands it returns.

    ``registration``: this rank's ``Register`` message (agent, regions, geometry, aux rows), sent
    to every prefill rank it pairs with.

    ``quarantine_ns``: how long past the fence deadline a failed room's pages (and staging space)
    still wait for the ``Stopped`` of a sender that never gave it (its Abort is resent meanwhile).
    0 (the default) frees them at the fence, which suffices where a cut-off writer's transfer can
    no longer land (RDMA: a failed queue pair delivers nothing). Over UCX's TCP transport a WRITE
    queued during a partition lands whenever the connection comes back, so a writer that answers
    only after the heal (its write ended, or it restarted and never wrote) frees the pages; set it
    to the transport's own bound (TCP gives a silent connection up after about 15 minutes).
    """

    # ClassVar: class constants (a compiled build reads them through the class, sim/planted.py
    # subclasses override them).
    STATUS = STATUS
    FAILED = RState.FAILED
    SUCCESS = RState.SUCCESS

    side: ClassVar[str] = "decode"
    FAIL = RIn.FAIL
    TIMEOUT: ClassVar[RIn] = RIn.TIMEOUT
    PEER_LOST: ClassVar[RIn] = RIn.PEER_LOST
    staged_class: ClassVar[type[StagedReceiver]] = StagedReceiver  # the staged flows' decode half

    def __init__(
        self,
        registration: m.Register,
        *,
        timeouts: Timeouts | None = None,
        planner: Any = None,
        quarantine_ns: int = 0,
    ) -> None:
        self._new_tables()
        self.registration = registration
        self.reg_id = m.registration_id(registration)
        self.endpoint = registration.src
        self.pool = registration.geometry.to_pool()
        self.timeouts = timeouts or Timeouts()
        self.quarantine_ns = quarantine_ns
        self.rooms: dict[int, _Room] = {}
        self.peers: dict[m.Endpoint, _Peer] = {}
        self.rooms_by_peer: dict[m.Endpoint, set[int]] = {}
        self.deadlines = DeadlineHeap()
        self.tombstones = Tombstones(self.timeouts.tombstone_ns)
        self.counters: Counter[str] = Counter()
        interval = self.timeouts.heartbeat_interval_ns
        # Owed answers (core/reliable): Abort until Stopped (ended by the fence), TransferInfo
        # until InfoAck (ended when the room finishes).
        self._aborts = Resends("abort", self.deadlines, self.counters, interval, resent="abort_resent")
        self._infos = Resends("info", self.deadlines, self.counters, interval, resent="info_resent")
        self._out: list[Any] = []
        self._now = 0
        self.last_internal_error: BaseException | None = None
        if planner is None:
            from kvferry.core.planner import plan_rank_pair as planner
        self.planner = planner
        self.flows = flows = _Flows()
        flows.ctx = ReceiverFlowContext(self)
        self._track_tables()
        # The staged flows' decode half (ring and pinned); it registers its own tables.
        flows.staged = self.staged_class(flows.ctx, registration)
        # Pull's decode half (core/flows/pull.py); it registers its own tables.
        flows.pull_rx = PullReceiver(flows.ctx)
        self._route_parts((flows.staged, flows.pull_rx))

    @property
    def staged(self) -> StagedReceiver:
        """The staged flows' decode half (core/flows/staged_receiver.py)."""
        return self.flows.staged

    @property
    def pull_rx(self) -> PullReceiver:
        """Pull's decode half: the READs (core/flows/pull.py)."""
        return self.flows.pull_rx

    def _track_tables(self) -> None:
        self._track_rooms()
        self.track(
            "deadlines",
            lambda room: any(k in self.deadlines for k in (("room", room), ("abort", room), ("info", room))),
        )

    # --- public API ------------------------------------------------------------------------------

    def handle(self, event: Any, now: int) -> list[Any]:
        self._now = now
        self._out = out = []
        t = type(event)
        if t is NotificationIn:
            self._guarded(self._on_notification, event.data)
        elif t is ControlIn:
            self._guarded(self._on_control, event.data)
        elif t is AuxChecked:
            self._room_input(event.room, event.transfer_id, RIn.AUX_CHECKED, event)
        elif t is ReceiverOpen:
            self._open(event)
        elif t is AbortRoom:
            self._room_input(event.room, event.transfer_id, RIn.ABORT_LOCAL, event)
        elif t is ReleaseRoom:
            self._room_input(event.room, event.transfer_id, RIn.RELEASE, event)
        elif t is Tick:
            self._tick()
        elif t in self._routes:
            self._routes[t](event)  # a flow's own completion (a scatter's, a READ's: core/flows/parts.py)
        else:
            self.counters["bad_event"] += 1
            raise TypeError(f"ReceiverEngine cannot handle {t.__name__}")
        self._out = []
        return out

    def pages_in_use(self, room: int) -> bool:
        """True while the room's pages must not go back to the allocator."""
        r = self.rooms.get(room)
        return r is not None and not r.fence.freed

    def staging_in_use(self) -> int:
        """Live staging allocations (ring and pinned); 0 once every room settled."""
        return self.flows.staged.in_use()

    def staging_holds(self, key: Any, region_id: int, lo: int, hi: int) -> bool:
        """Whether bytes ``[lo, hi)`` of staging region ``region_id`` lie inside one live
        allocation that room ``key`` holds (what a staged write may touch; the checkers ask)."""
        return self.flows.staged.staging_holds(key, region_id, lo, hi)

    # --- messages --------------------------------------------------------------------------------

    def _on_notification(self, data: bytes) -> None:
        try:
            note = m.decode_layer_note(data)
        except WireError:
            self.counters["wire_error"] += 1
            return
        peer = self.peers.get(note.src)
        if peer is not None:
            peer.last_seen = self._now
        self._room_input(note.room, note.transfer_id, RIn.NOTIFY, note)

    def _on_control(self, data: bytes) -> None:
        msg = self._control_in(data)
        if msg is None:
            return
        t = type(msg)
        if t is m.Stopped:
            self._room_input(msg.room, msg.transfer_id, RIn.STOPPED, msg, sender=msg.src)
        elif t is m.RoomFailed:
            self._late_failure(msg)
            self._room_input(msg.room, msg.transfer_id, RIn.PEER_FAILED, msg, sender=msg.src)
            # Answer every notice, even for a room we never had, or the sender resends it until
            # its give-up deadline. ``known``: this side now reports Failed for the room.
            r = self.rooms.get(msg.room)
            known = (r is not None and r.tid == msg.transfer_id and msg.src in r.senders) or (
                self.tombstones.get(msg.room, msg.transfer_id) is not None
            )
            self._send(
                msg.src,
                m.FailedAck(src=self.endpoint, room=msg.room, transfer_id=msg.transfer_id, known=known),
            )
            if r is None or r.tid != msg.transfer_id:
                for part in self.parts:
                    part.room_unknown(msg.src, msg.room, msg.transfer_id)
        elif t is m.RegisterAck:
            self._on_register_ack(msg)
        elif t is m.InfoAck:
            self._info_acked(msg.src, msg.room, msg.transfer_id)
            for room, tid in msg.more:
                self._info_acked(msg.src, room, tid)
        elif t is m.Heartbeat:
            self.counters["heartbeat_in"] += 1
        elif t in self._routes:
            self._routes[t](msg)  # a flow's own message (core/flows/parts.py)
        else:
            self.counters["wrong_side_message"] += 1

    def _info_acked(self, src: m.Endpoint, room: int, tid: str) -> None:
        r = self.rooms.get(room)
        if r is not None and r.tid == tid and src in r.senders:
            self._infos.answered(r.room, src)

    def _on_register_ack(self, msg: m.RegisterAck) -> None:
        peer = self.peers.get(msg.src)
        if peer is None:
            self.counters["ack_from_unknown_peer"] += 1
            return
        if msg.ok:
            if peer.acked:
                self.counters["duplicate_ack"] += 1
                return
            peer.acked = True
            for room in sorted(self.rooms_by_peer.get(msg.src, ())):
                self._dispatch(self.rooms[room], RIn.PEER_READY, msg.src)
        elif msg.retry:
            # The sender forgot us (or our Register is still in flight): register again.
            peer.acked = False
            self._send(msg.src, self.registration)
        else:
            self.counters["register_refused"] += 1
            for room in sorted(self.rooms_by_peer.get(msg.src, ())):
                self._dispatch(self.rooms[room], RIn.PEER_REFUSED, msg)

    # --- rooms -------------------------------------------------------------------------------------

    def _open(self, ev: ReceiverOpen) -> None:
        if self._open_tombstoned(ev.room, ev.transfer_id):
            return
        live = self.rooms.get(ev.room)
        if live is not None:
            if live.tid == ev.transfer_id:
                self._dispatch(live, RIn.OPEN, ev)
            else:
                self.counters["stale_transfer_id"] += 1
                self._refuse_open(ev.room, ev.transfer_id, "room id in use")
            return
        pages = np.asarray(ev.dst_pages, dtype=np.int64)
        r = _Room(ev, pages)
        self.rooms[r.room] = r
        self.deadlines.set(("room", r.room), self._now + self.timeouts.bootstrap_ns)
        self._out.append(StatusChanged(room=r.room, transfer_id=r.tid, status=KVPoll.Bootstrapping))
        why = self._check_open(ev, r)
        if why is not None:
            self.counters["bad_open"] += 1
            r.fence.expired = True  # nothing was sent: nobody can be writing
            self.fail(r, RoomFailure(why, at_ns=self._now), abort=False)
            self._maybe_finish(r)
            return
        # Resent each heartbeat interval until its InfoAck, while the room is live (core/reliable).
        infos = dict(self._infos.start(r.room, r.senders, lambda p: self._transfer_info(r, p), self._now))
        for p in sorted(r.senders):
            self.rooms_by_peer.setdefault(p, set()).add(r.room)
            peer = self.peers.get(p)
            if peer is None:
                peer = self.peers[p] = _Peer(self._now)
                self._send(p, self.registration)
                self._arm_peer(p)
            self._send(p, infos[p])  # after the Register, as a new peer must hear them
        if self._all_acked(r):
            self._dispatch(r, RIn.PEER_READY, None)
        for part in self.parts:
            part.opened(r)

    def _transfer_info(self, r: _Room, p: m.Endpoint) -> m.TransferInfo:
        spec = r.senders[p]
        return m.TransferInfo(
            src=self.endpoint,
            room=r.room,
            transfer_id=r.tid,
            reg=self.reg_id,
            dst_pages=r.dst_list,
            num_tokens=r.num_tokens,
            aux_index=r.aux_index,
            send_aux=spec.send_aux,
            dummy=spec.dummy,
            expected_infos=spec.expected_infos,
            token_start=r.token_start,
        )

    def _all_acked(self, r: _Room) -> bool:
        for p in r.senders:
            peer = self.peers.get(p)
            if peer is None or not peer.acked:
                return False
        return True

    def _check_open(self, ev: ReceiverOpen, r: _Room) -> str | None:
        if not ev.senders:
            return "no senders"
        if len(r.senders) != len(ev.senders):
            return "a sender is listed twice"
        if not r.data_senders:
            return "every sender is a dummy"
        n_aux, aux_dummy = 0, False
        for s in ev.senders:  # one loop for both tests (a generator each cost ~1 us per open)
            n_aux += s.send_aux
            if s.send_aux and s.dummy:
                aux_dummy = True
        if n_aux != 1 or aux_dummy:
            return "exactly one non-dummy sender must carry the aux row"
        pages = r.dst_pages
        if pages.ndim != 1:
            return "page ids must be a 1-D array"
        ids = pages.tolist()  # small arrays: Python beats numpy's per-call overhead here
        geo = self.registration.geometry
        if ids and (min(ids) < 0 or max(ids) >= geo.num_pages):
            return f"page ids out of range [0, {geo.num_pages})"
        if len(set(ids)) != len(ids):
            return "a page is listed twice"
        r.dst_list = ids  # checked: every TransferInfo carries this list (no tolist() per sender)
        if not 0 <= ev.num_tokens <= pages.size * geo.page_size:
            return f"{ev.num_tokens} tokens do not fit {pages.size} pages of {geo.page_size}"
        if not 0 <= ev.aux_index < self.registration.aux_rows:
            return f"aux row {ev.aux_index} out of range"
        if not 0 <= ev.token_start <= ev.num_tokens:
            return f"token_start {ev.token_start} outside [0, {ev.num_tokens}]"
        return None

    def _room_input(
        self, room: int, tid: str, inp: RIn, payload: Any, sender: m.Endpoint | None = None
    ) -> None:
        r = self._live(room, tid)
        if r is None:
            return
        if sender is not None and sender not in r.senders:
            self.counters["message_from_stranger"] += 1
            return
        self._dispatch(r, inp, payload)

    BOOKKEEP = frozenset((RIn.RELEASE, RIn.STOPPED))

    def _bookkeep(self, r: _Room, inp: RIn, payload: Any) -> None:
        if inp is RIn.RELEASE:
            r.release_requested = True
        elif inp is RIn.STOPPED:
            if r.fence.stopped is NO_SET:
                r.fence.stopped = set()
            r.fence.stopped.add(payload.src)
            self._aborts.answered(r.room, payload.src)

    def _forget_command(self, r: _Room, cmd: Any) -> None:
        for part in self.parts:
            part.withdrawn(r, cmd)

    def _entered(self, r: _Room) -> None:
        st = r.state
        # The class's STATUS (the same table): mypyc 1.20 miscompiles the module's name here,
        # which the class body rebinds (``STATUS = STATUS``).
        self._out.append(StatusChanged(room=r.room, transfer_id=r.tid, status=self.STATUS[st]))
        key = ("room", r.room)
        if st is RState.WAITING:
            self.deadlines.set(key, self._now + self.timeouts.waiting_ns)
        elif st is RState.TRANSFERRING:
            self.deadlines.set(key, self._now + self.timeouts.transfer_ns)
        elif st is RState.SUCCESS:
            self.deadlines.cancel(key)

    # --- handlers (names referenced by RECEIVER_TABLE) -----------------------------------------

    def _h_on_peer_ready(self, r: _Room, inp: RIn, payload: Any) -> str:
        return "ready" if self._all_acked(r) else "stay"

    def _h_ignore_ready(self, r: _Room, inp: RIn, payload: Any) -> str:
        return "stay"  # the room is past bootstrapping: a late ack changes nothing

    def _h_on_notify(self, r: _Room, inp: RIn, note: m.ChunkNote) -> str:
        src = note.src
        if src not in r.senders:
            raise RoomError(f"notification from {src}, which is not a sender of this room")
        # A sender writes only after our TransferInfo: its note is as good as the InfoAck (which
        # may be lost). Resending on would hand the TransferInfo to a restarted sender, which
        # then knows the room only from it, times out, and fails a room that ended Success.
        if r.room in self._infos.entries:  # usually answered already by its InfoAck
            self._infos.answered(r.room, src)
        if src not in r.data_senders:
            # A dummy moves no bytes; its one "done" note makes decode's Success cover every
            # sender, so a dummy that failed (and said so, or went silent) fails the room here too.
            if not (note.dummy and note.is_last):
                raise RoomError(f"notification with data from dummy sender {src}")
            news = src not in r.dummies_done
            if not news:
                self.counters["duplicate_notification"] += 1
            if r.dummies_done is NO_SET:
                r.dummies_done = set()
            r.dummies_done.add(src)
        elif note.dummy:
            raise RoomError(f"dummy notification from data sender {src}")
        elif note.staged >= 0:
            # A note names no flow; one naming a staging allocation lands in space a StagingReq
            # asked for, and that request named its flow: the component that gave the space
            # names that flow's decode half.
            news = self._note_receiver(r, note).on_note(self.flows.ctx, r, r.progress[src], note)
        elif note.layer_end:
            # A layer range says layer-wise (core/flows/layerwise.py): the chunk is recorded once
            # every layer of it landed.
            news = self._layer_note(r, r.progress[src], note)
        elif note.aux:
            if src != r.aux_sender:
                raise RoomError(f"aux row written by {src}, expected {r.aux_sender}")
            news = not (r.aux_pending or r.aux_ok)
            if not news:
                self.counters["duplicate_notification"] += 1
            else:
                r.aux_pending = True
                self._out.append(CheckAux(room=r.room, transfer_id=r.tid, aux_index=r.aux_index))
        else:
            news = self._record_chunk(r, r.progress[src], note)
        if news:
            # Only news renews the transfer deadline (as only a new pull offer does). A staged
            # writer resends its note until our watermark passes it, for up to the fence; while
            # the chunk waits for another writer that never writes (it restarted and forgot the
            # room), each resend would push the deadline on and keep the room Transferring for
            # the whole fence. News is finite (chunks, layers, aux, dummies), so this bounds it.
            self.deadlines.set(("room", r.room), self._now + self.timeouts.transfer_ns)
        return "done" if self._complete(r) else "running"

    def _record_chunk(self, r: _Room, prog: _SenderProgress, note: m.ChunkNote) -> bool:
        """A data chunk in the sender's ledger (direct's decode half; pull and the staged flows
        record theirs here too once READ or scattered); True if it was news, not a duplicate."""
        return DIRECT_RECEIVER.on_note(self.flows.ctx, r, prog, note)

    def _layer_note(self, r: _Room, prog: _SenderProgress, note: m.LayerNote) -> bool:
        return LAYERWISE_RECEIVER.on_note(self.flows.ctx, r, prog, note)

    def _note_receiver(self, r: _Room, note: m.ChunkNote) -> FlowReceiver:
        for part in self.parts:
            half: FlowReceiver | None = part.note_receiver(r, note)
            if half is not None:
                return half
        raise RoomError(f"note of chunk {note.chunk_index} names staging space no flow here gave")

    def _complete(self, r: _Room) -> bool:
        if not r.aux_ok:
            return False
        for part in self.parts:  # a scatter of ours still writes the pages (a loop: per note)
            if part.writing(r):
                return False
        for p in r.progress.values():
            if not p.done:
                return False
        return len(r.dummies_done) == len(r.senders) - len(r.data_senders)

    def _h_on_aux_checked(self, r: _Room, inp: RIn, ev: AuxChecked) -> str:
        if r.aux_ok or not r.aux_pending:
            self.counters["duplicate_aux_check"] += 1
            return "stay"
        if ev.found_room != r.room:
            raise RoomError(f"aux row {r.aux_index} holds room {ev.found_room}, expected {r.room}")
        r.aux_pending = False
        r.aux_ok = True
        return "done" if self._complete(r) else "stay"

    def _h_on_notify_after_success(self, r: _Room, inp: RIn, note: m.ChunkNote) -> None:
        prog = r.progress.get(note.src)
        if (note.aux and note.src == r.aux_sender) or (note.dummy and note.src in r.dummies_done):
            self.counters["duplicate_notification"] += 1
            return
        if prog is not None and prog.chunks.get(note.chunk_index) == (note.token_start, note.token_end):
            self.counters["duplicate_notification"] += 1
            return
        raise RoomError(f"new chunk {note.chunk_index} from {note.src} after Success")

    def _h_on_fail(self, r: _Room, inp: RIn, payload: Any) -> str:
        if inp is RIn.PEER_FAILED:
            reason = f"failed on {payload.src}: {payload.reason}"
        elif inp is RIn.PEER_REFUSED:
            reason = f"registration refused by {payload.src}: {payload.reason}"
        elif inp is RIn.ABORT_LOCAL:
            reason = f"aborted: {payload.reason}"
        elif inp is RIn.TIMEOUT:
            reason = f"timed out while {r.state.value}"
        elif inp is RIn.STOPPED:
            reason = f"{payload.src} stopped sending before its failure notice arrived"
        else:
            reason = f"peer {payload} lost (no heartbeat)"
        self.fail(r, RoomFailure(reason, at_ns=self._now))
        return "failed"

    def _h_on_failed_input(self, r: _Room, inp: RIn, payload: Any) -> None:
        if inp is RIn.TIMEOUT:
            # The fence deadline: stop waiting for Stopped from senders that never answered, or
            # (``quarantine_ns``) wait that much longer for a sender whose writes may still land.
            if r.fence.freed:
                pass
            elif self.quarantine_ns and not r.fence.quarantined and not r.fence.stopped >= r.senders.keys():
                r.fence.quarantined = True
                self.counters["fence_quarantined"] += 1
                self.deadlines.set(("room", r.room), self._now + self.quarantine_ns)
            else:
                self.counters["fence_expired"] += 1
                r.fence.expired = True
        elif inp is RIn.NOTIFY:
            self.counters["notification_after_failure"] += 1
        elif inp is RIn.PEER_FAILED and any(p.asked_again(r, payload.src) for p in self.parts):
            pass  # a sender still holding its pages asked again: nothing of ours writes them
        elif inp not in (RIn.STOPPED, RIn.RELEASE):
            self.counters[f"ignored_failed_{inp.value}"] += 1

    # --- failure, fence, release -------------------------------------------------------------------

    def _h_fail(self, r: _Room, inp: RIn, payload: tuple[RoomFailure, dict[str, Any]]) -> str:
        """FAIL (the funnel): record why, arm the fence deadline, abort every sender (unless
        ``abort=False``: the senders were never told about the room)."""
        failure, why = payload
        r.failure = failure
        self._out.append(
            StatusChanged(room=r.room, transfer_id=r.tid, status=KVPoll.Failed, reason=failure.reason)
        )
        self.deadlines.set(("room", r.room), self._now + self.timeouts.fence_ns)
        for part in self.parts:
            part.room_failed(r)
        if why.get("abort", True):
            self._send_aborts(r)
        return "failed"

    def _send_aborts(self, r: _Room) -> None:
        """Abort every sender that has not confirmed Stopped; resent each heartbeat interval until
        the fence closes (core/reliable), so one lost Abort neither pins the pages until the fence
        deadline nor leaves the sender believing in a Success the decode side gave up on."""
        reason = r.failure.reason if r.failure else "failed"
        room, tid = r.room, r.tid
        owed = [p for p in r.senders if p not in r.fence.stopped]
        for p, msg in self._aborts.start(
            room,
            owed,
            lambda p: m.Abort(src=self.endpoint, room=room, transfer_id=tid, reason=reason),
            self._now,
        ):
            self._send(p, msg)

    def _maybe_finish(self, r: _Room) -> None:
        st = r.state
        if st is RState.FAILED:
            for part in self.parts:
                part.settle(r)
            # Writes of ours a lost peer cut wait for the fence deadline, which a quarantine is past.
            cut = any(p.cut(r) for p in self.parts)
            fenced = r.fence.expired or (
                r.fence.stopped >= r.senders.keys() and (not cut or r.fence.quarantined)
            )
            if not r.fence.freed and fenced and not self._pages_busy(r):
                # Pages and staging space go back only when no writer can still write them (fenced)
                # and no scatter or READ of ours is writing the pages.
                r.fence.freed = True
                for part in self.parts:
                    part.reclaim(r)
                self.deadlines.cancel(("room", r.room))
                self._aborts.cancel(r.room)
                reason = "fence expired" if r.fence.expired else "every sender stopped"
                self._out.append(FreePages(room=r.room, transfer_id=r.tid, reason=reason))
        elif st is not RState.SUCCESS:
            return  # a live room: nothing to free or drop (``freed`` is only ever set once Failed)
        settled = st is RState.SUCCESS and not self._pages_busy(r)
        if r.release_requested and (settled or r.fence.freed):
            self._remove(r)

    def _pages_busy(self, r: _Room) -> bool:
        """A flow component of ours (a READ, a scatter) is writing the room's pages."""
        return any(p.writing(r) for p in self.parts)

    def _remove(self, r: _Room) -> None:
        self._aborts.cancel(r.room)
        self._infos.cancel(r.room)
        for part in self.parts:
            part.forget(r)
        self._forget(r, r.senders)

    # --- time ----------------------------------------------------------------------------------------

    def _heartbeat(self, peer: m.Endpoint) -> None:
        # Until acked, the heartbeat is the Register again (it may have been lost). It names the
        # rooms still waiting on this sender: that renews their push registration leases.
        if self.peers[peer].acked:
            waiting = sorted(
                room
                for room in self.rooms_by_peer.get(peer, ())
                if self.rooms[room].state in (RState.BOOTSTRAPPING, RState.WAITING, RState.TRANSFERRING)
            )
            self._send(peer, m.Heartbeat(src=self.endpoint, rooms=waiting))
        else:
            self._send(peer, self.registration)

    def _on_deadline(self, kind: str, what: Any) -> None:
        if kind == "abort":
            for p, msg in self._aborts.fire(what, self._now):
                self._send(p, msg)
        elif kind == "info":
            r = self.rooms.get(what)
            if r is None or r.state is RState.FAILED or r.state is RState.SUCCESS:
                self._infos.cancel(what)  # a finished room needs no more of its TransferInfo
            else:
                for p, msg in self._infos.fire(what, self._now):
                    self._send(p, msg)


# --- the transition table (after the class: it holds the handlers themselves) --------------


_t = step
E = ReceiverEngine
_FAIL = _t(E._h_on_fail, failed=_F)
_LIVE_FAILURES = {
    RIn.FAIL: _t(E._h_fail, failed=_F),
    RIn.PEER_REFUSED: _FAIL,
    RIn.PEER_FAILED: _FAIL,
    RIn.ABORT_LOCAL: _FAIL,
    RIn.TIMEOUT: _FAIL,
    RIn.PEER_LOST: _FAIL,
    # A sender confirms Stopped only after it failed: its RoomFailed was lost or is overtaken.
    RIn.STOPPED: _FAIL,
}

RECEIVER_TABLE: dict[RState, dict[RIn, Transition]] = {
    _B: {
        **_LIVE_FAILURES,
        RIn.PEER_READY: _t(E._h_on_peer_ready, stay=_B, ready=_W),
        # A notification proves the sender has our registration even if its ack is still in flight.
        RIn.NOTIFY: _t(E._h_on_notify, running=_T, done=_S),
    },
    _W: {
        **_LIVE_FAILURES,
        RIn.PEER_READY: _t(E._h_ignore_ready, stay=_W),
        RIn.NOTIFY: _t(E._h_on_notify, running=_T, done=_S),
    },
    _T: {
        **_LIVE_FAILURES,
        RIn.PEER_READY: _t(E._h_ignore_ready, stay=_T),
        RIn.NOTIFY: _t(E._h_on_notify, running=_T, done=_S),
        RIn.AUX_CHECKED: _t(E._h_on_aux_checked, stay=_T, done=_S),
    },
    _S: {
        RIn.PEER_READY: _t(E._h_ignore, stay=_S),
        RIn.NOTIFY: _t(E._h_on_notify_after_success, stay=_S),
        RIn.AUX_CHECKED: _t(E._h_on_aux_checked, stay=_S, done=_S),
        RIn.PEER_LOST: _t(E._h_ignore, stay=_S),
        RIn.STOPPED: _t(E._h_ignore, stay=_S),  # the sender failed after our Success; its RoomFailed follows
        RIn.PEER_FAILED: _FAIL,  # both sides must agree on the outcome
        RIn.ABORT_LOCAL: _t(E._h_ignore, stay=_S),  # every byte landed: nothing left to abort
        RIn.RELEASE: _t(E._h_ignore, stay=_S),
        RIn.FAIL: _t(E._h_fail, failed=_F),  # a sender's failure after our Success (agree on Failed)
    },
    _F: {**{i: _t(E._h_on_failed_input, stay=_F) for i in RIn}, RIn.FAIL: _t(E._h_ignore_fail, stay=_F)},
}

ReceiverEngine.TABLE = RECEIVER_TABLE
