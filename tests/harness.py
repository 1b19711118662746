"""In-memory harness for the protocol core (in the spirit of h11's ConnectionPair).

Prefill ranks and decode ranks run the real engines behind the real ``backends.driver.Driver``,
over ``MemTransport``: control messages and notifications sit in lists until a test delivers,
duplicates, drops or reorders them; posted writes sit in a list until a test completes them (the
bytes are copied between numpy arrays, descriptor by descriptor) or fails them. Time is an integer
the test advances.

The fabric keeps the two promises the fence relies on (``Timeouts.problems``): a control message
or notification not delivered within ``max_msg_delay`` is lost, and a write not completed within
``max_write`` fails.

Checks done on the fly and collected in ``World.violations``:
- a write lands only in decode pages (and aux rows) owned by the live room it is for, and reads
  only prefill pages owned by that room;
- at most one write per (room, sender, receiver, chunk, kind): exactly-once effect;
- every status a rank reports moves up, or to Failed, and Failed sticks; the same for the server
  view (MIN over ranks);
- when a decode rank reports Success, every token of the room (every region, every head it holds)
  and the aux row are equal to the source, checked against a pattern recomputed from its
  definition (tests/refmodel.pattern salted by room), not against the planner.

How to import: ``sys.path.insert(0, str(Path(__file__).resolve().parent)); import harness``.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from kvferry.backends.driver import Driver
from kvferry.backends.staging_copy import copy_maps
from kvferry.backends.transport import XferState, aux_room_of, encode_aux_room
from kvferry.core import messages as m
from kvferry.core.deadlines import Timeouts
from kvferry.core.errors import KvferryError, WireError
from kvferry.core.events import (
    AbortRoom,
    ChunkReady,
    ReceiverOpen,
    ReleaseRoom,
    SenderOpen,
)
from kvferry.core.flows import Flow, FlowPolicy
from kvferry.core.flows.regions import PINNED_REGION, RING_REGION, is_staging_region, worker_region
from kvferry.core.geometry import Layout, ModelGeometry, PoolGeometry, make_pools
from kvferry.core.kvpoll import KVPoll, advance, is_terminal, min_status
from kvferry.core.receiver import ReceiverEngine
from kvferry.core.sender import SenderEngine
from kvferry.core.topology import receiver_endpoints, sender_specs

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refmodel

TINY = ModelGeometry("tiny", num_layers=2, num_kv_heads=2, head_dim=4)
TINY_MLA = ModelGeometry("tiny-mla", num_layers=2, num_kv_heads=1, head_dim=8, is_mla=True)

AUX_ROWS = 64
AUX_ROW_BYTES = 16

TEST_TIMEOUTS = Timeouts(
    bootstrap_ns=500,
    waiting_ns=500,
    transfer_ns=800,
    heartbeat_interval_ns=50,
    heartbeat_timeout_ns=1500,
    fence_ns=2500,
    tombstone_ns=3000,
)
MAX_MSG_DELAY = 60
MAX_WRITE = 60


class FabricError(KvferryError):
    """A descriptor outside a registered region, or a peer that was never added."""


@dataclass
class PendingMsg:
    src: m.Endpoint
    dst: m.Endpoint
    data: bytes
    sent_at: int
    note: bool  # notification (data plane) rather than control message


@dataclass
class PendingWrite:
    handle: int
    src: m.Endpoint
    dst: m.Endpoint
    descs: tuple[Any, ...] | None  # (src_region, src_offset, dst_region, dst_offset, length)
    aux: tuple[int, int] | None  # (src_aux_index, dst_aux_index)
    notif: bytes
    posted_at: int
    dst_incarnation: int = 0  # of the peer whose agent the initiator loaded (src for a READ)
    read: bool = False  # a pull READ: dst (decode) posted it, src is the peer; notif goes to src
    initiator_incarnation: int = -1  # of the process that posted it (-1: not tracked)


@dataclass
class PendingCopy:
    handle: int
    owner: m.Endpoint
    kind: str
    staging_region: int
    maps: tuple[Any, ...]


class MemFabric:
    def __init__(self) -> None:
        self.now = 0
        self.transports: dict[m.Endpoint, MemTransport] = {}
        self.pending: list[PendingMsg] = []
        self.writes: list[PendingWrite] = []
        self.copies: list[PendingCopy] = []  # gathers and scatters not yet run
        self.states: dict[int, XferState] = {}
        self._next_handle = 1
        self.on_land: Any = None  # callback(write, note) before the bytes are copied
        self.copy = True
        # Set to {} to log failure notices (RoomFailed, Abort) per stream
        # (room, tid, src, dst, kind) -> [first sent, last sent, ever delivered].
        self.failure_streams: dict[tuple[Any, ...], list[Any]] | None = None

    def track(self, msg: PendingMsg, delivered: bool) -> None:
        if self.failure_streams is None or msg.note:
            return
        try:
            obj = m.decode_control(msg.data)
        except WireError:
            return
        if type(obj) is not m.RoomFailed and type(obj) is not m.Abort:
            return
        key = (obj.room, obj.transfer_id, msg.src, msg.dst, type(obj).__name__)
        rec = self.failure_streams.setdefault(key, [self.now, self.now, False])
        if delivered:
            rec[2] = True
        else:
            rec[1] = self.now

    def post(self, w: PendingWrite) -> int:
        self.writes.append(w)
        self.states[w.handle] = XferState.PROC
        return w.handle

    def new_handle(self) -> int:
        h = self._next_handle
        self._next_handle += 1
        return h

    def complete(self, i: int) -> None:
        w = self.writes.pop(i)
        initiator = self.transports[w.dst if w.read else w.src]
        if w.initiator_incarnation >= 0 and initiator.incarnation != w.initiator_incarnation:
            # The process that posted it died: its queue pairs went with it, and so does the
            # transfer (a READ cannot land in memory its dead initiator no longer has).
            return
        if self.transports[w.src if w.read else w.dst].incarnation != w.dst_incarnation:
            # The target process died: like a WRITE to a stale remote agent, it ends in ERR.
            self.states[w.handle] = XferState.ERR
            return
        note = m.decode_layer_note(w.notif)
        if self.on_land is not None:
            self.on_land(w, note)
        src, dst = self.transports[w.src], self.transports[w.dst]
        if w.descs is not None and self.copy:
            sr, so, dr, do, ln = w.descs
            for k in range(len(ln)):
                n = int(ln[k])
                dst.memory(int(dr[k]))[int(do[k]) : int(do[k]) + n] = src.memory(int(sr[k]))[
                    int(so[k]) : int(so[k]) + n
                ]
        elif w.aux is not None:  # the aux row moves even when KV bytes are not copied
            s, d = w.aux
            dst.aux[d] = src.aux[s]
        self.states[w.handle] = XferState.DONE
        if w.read:
            self.pending.append(PendingMsg(w.dst, w.src, w.notif, self.now, note=True))
        else:
            self.pending.append(PendingMsg(w.src, w.dst, w.notif, self.now, note=True))

    def fail(self, i: int) -> None:
        w = self.writes.pop(i)
        self.states[w.handle] = XferState.ERR

    def run_copy(self, i: int) -> None:
        c = self.copies.pop(i)
        t = self.transports[c.owner]
        try:
            copy_maps(c.kind, t.regions, t.staging[c.staging_region], c.maps)
        except KvferryError:
            self.states[c.handle] = XferState.ERR
            return
        self.states[c.handle] = XferState.DONE

    def deliver(self, i: int) -> m.Endpoint:
        msg = self.pending.pop(i)
        self.track(msg, delivered=True)
        t = self.transports[msg.dst]
        (t.notes if msg.note else t.inbox).append(msg.data)
        return msg.dst

    def expire(self) -> None:
        """The fabric's promises: late messages are lost, slow writes fail."""
        self.pending = [p for p in self.pending if self.now - p.sent_at <= MAX_MSG_DELAY]
        for i in reversed(range(len(self.writes))):
            if self.now - self.writes[i].posted_at > MAX_WRITE:
                self.fail(i)


class MemTransport:
    """``backends.transport.Transport`` over numpy arrays and Python lists."""

    def __init__(
        self,
        fabric: MemFabric,
        endpoint: m.Endpoint,
        pool: PoolGeometry,
        fill: int,
        memory: bool = True,
        incarnation: int = 0,
        staging: dict[int, int] | None = None,
        advert: tuple[int, int] = (0, 0),
    ) -> None:
        self.fabric = fabric
        self.incarnation = incarnation
        self._endpoint = endpoint
        self.pool = pool
        # memory=False (benchmarks): bounds are still checked, nothing is allocated or copied.
        self.sizes = {r.region_id: r.nbytes for r in pool.regions}
        self.regions: dict[int, np.ndarray] = refmodel.garbage(pool, fill) if memory else {}
        # Staging memory (core.flows.regions ids): worker buffers, a ring, a pinned pool.
        self.staging = {rid: np.full(n, fill, dtype=np.uint8) for rid, n in (staging or {}).items()}
        self.sizes.update((staging or {}).items())
        self.ring_bytes, self.pinned_bytes = advert
        self.aux = np.zeros((AUX_ROWS, AUX_ROW_BYTES), dtype=np.uint8)
        self.peers: dict[m.Endpoint, m.Register] = {}
        self.peer_incarnation: dict[m.Endpoint, int] = {}
        self.inbox: list[bytes] = []
        self.notes: list[bytes] = []
        fabric.transports[endpoint] = self

    @property
    def endpoint(self) -> m.Endpoint:
        return self._endpoint

    @property
    def agent_name(self) -> str:
        return str(self._endpoint)

    def agent_metadata(self) -> bytes:
        return f"mem:{self._endpoint}:{self.incarnation}".encode()

    def register_regions(self, regions: Any, aux_rows: int, aux_row_bytes: int) -> None:
        pass  # allocated at construction

    def registration(self) -> m.Register:
        return m.Register(
            src=self._endpoint,
            agent_name=self.agent_name,
            agent_meta=self.agent_metadata(),
            geometry=m.GeometryWire.from_pool(self.pool),
            regions=[m.RegionAddr(region_id=r, addr=0, nbytes=n) for r, n in sorted(self.sizes.items())],
            aux_addr=0,
            aux_row_bytes=AUX_ROW_BYTES,
            aux_rows=AUX_ROWS,
            ring_bytes=self.ring_bytes,
            pinned_bytes=self.pinned_bytes,
        )

    def add_peer(self, peer: m.Endpoint, registration: m.Register) -> None:
        self.peers[peer] = registration
        # Writes go to the incarnation whose agent we loaded (a stale agent's writes end in ERR).
        self.peer_incarnation[peer] = int(registration.agent_meta.decode().rsplit(":", 1)[1])

    def drop_peer(self, peer: m.Endpoint) -> None:
        self.peers.pop(peer, None)
        self.peer_incarnation.pop(peer, None)

    def _check(self, sizes: dict[int, int], region: np.ndarray, off: np.ndarray, ln: np.ndarray) -> None:
        # Vectorised lookup of each descriptor's region size (-1: no such region); thousands of
        # descriptors per write make a per-element Python loop the fake transport's main cost.
        keys = np.fromiter(sizes.keys(), dtype=np.int64, count=len(sizes))
        vals = np.fromiter(sizes.values(), dtype=np.int64, count=len(sizes))
        order = np.argsort(keys)
        keys, vals = keys[order], vals[order]
        region = np.asarray(region, dtype=np.int64)
        size = np.full(len(region), -1, dtype=np.int64)
        if len(keys):
            idx = np.minimum(np.searchsorted(keys, region), len(keys) - 1)
            size = np.where(keys[idx] == region, vals[idx], size)
        bad = (size < 0) | (off < 0) | (ln <= 0) | (off + ln > size)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise FabricError(f"descriptor {k} ({region[k]}, {off[k]}, {ln[k]}) outside a region")

    def post_write(self, peer, src_region, src_offset, dst_region, dst_offset, length, notif):  # type: ignore[no-untyped-def]
        if peer not in self.peers:
            raise FabricError(f"peer {peer} not added")
        self._check(self.sizes, src_region, src_offset, length)
        self._check(self.fabric.transports[peer].sizes, dst_region, dst_offset, length)
        h = self.fabric.new_handle()
        descs = (src_region, src_offset, dst_region, dst_offset, length)
        inc = self.peer_incarnation[peer]
        return self.fabric.post(
            PendingWrite(h, self._endpoint, peer, descs, None, notif, self.fabric.now, inc)
        )

    def post_read(self, peer, src_region, src_offset, dst_region, dst_offset, length, notif):  # type: ignore[no-untyped-def]
        if peer not in self.peers:
            raise FabricError(f"peer {peer} not added")
        self._check(self.fabric.transports[peer].sizes, src_region, src_offset, length)
        self._check(self.sizes, dst_region, dst_offset, length)
        h = self.fabric.new_handle()
        descs = (src_region, src_offset, dst_region, dst_offset, length)
        inc = self.peer_incarnation[peer]
        return self.fabric.post(
            PendingWrite(
                h,
                peer,
                self._endpoint,
                descs,
                None,
                notif,
                self.fabric.now,
                inc,
                read=True,
                initiator_incarnation=self.incarnation,
            )
        )

    def post_aux_write(self, peer, src_aux_index, dst_aux_index, notif):  # type: ignore[no-untyped-def]
        if peer not in self.peers:
            raise FabricError(f"peer {peer} not added")
        if not (0 <= src_aux_index < AUX_ROWS and 0 <= dst_aux_index < AUX_ROWS):
            raise FabricError("aux row out of range")
        h = self.fabric.new_handle()
        aux = (src_aux_index, dst_aux_index)
        inc = self.peer_incarnation[peer]
        return self.fabric.post(PendingWrite(h, self._endpoint, peer, None, aux, notif, self.fabric.now, inc))

    def check_xfer(self, handle: int) -> XferState:
        return self.fabric.states[handle]

    def settled_handles(self) -> None:
        return None  # completions are checked one by one, as with NIXL

    def release_xfer(self, handle: int) -> None:
        del self.fabric.states[handle]

    def send_notif(self, peer: m.Endpoint, notif: bytes) -> None:
        self.fabric.pending.append(PendingMsg(self._endpoint, peer, notif, self.fabric.now, note=True))

    def drain_notifs(self) -> list[bytes]:
        out, self.notes = self.notes, []
        return out

    def read_aux_room(self, aux_index: int) -> int:
        return aux_room_of(self.aux[aux_index])

    def memory(self, region_id: int) -> np.ndarray:
        return self.staging[region_id] if is_staging_region(region_id) else self.regions[region_id]

    def post_copy(self, kind: str, staging_region: int, maps: Any) -> int:
        if staging_region not in self.staging:
            raise FabricError(f"{self._endpoint}: no staging region {staging_region}")
        h = self.fabric.new_handle()
        self.fabric.states[h] = XferState.PROC
        self.fabric.copies.append(PendingCopy(h, self._endpoint, kind, staging_region, tuple(maps)))
        return h

    def check_copy(self, handle: int) -> XferState:
        return self.fabric.states[handle]

    def release_copy(self, handle: int) -> None:
        del self.fabric.states[handle]

    def settled_copies(self) -> None:
        return None  # copies are checked one by one

    def send_control(self, peer: m.Endpoint, data: bytes) -> None:
        msg = PendingMsg(self._endpoint, peer, data, self.fabric.now, note=False)
        self.fabric.pending.append(msg)
        self.fabric.track(msg, delivered=False)

    def recv_control(self) -> list[bytes]:
        out, self.inbox = self.inbox, []
        return out


@dataclass
class Rank:
    side: str
    index: int
    endpoint: m.Endpoint
    pool: PoolGeometry
    transport: MemTransport
    engine: Any
    driver: Driver


@dataclass
class Request:
    room: int
    tid: str
    num_tokens: int
    cuts: list[int]  # chunk ends, last == num_tokens
    src_pages: np.ndarray
    dst_pages: np.ndarray
    src_aux: int
    dst_aux: int
    salt: int
    chunks_sent: list[int] = field(default_factory=list)  # per prefill rank: chunks handed over
    released: dict[str, set[int]] = field(default_factory=lambda: {"prefill": set(), "decode": set()})
    freed: set[int] = field(default_factory=set)  # decode ranks whose pages went back


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.free = list(range(num_pages))

    def take(self, n: int, rng: np.random.Generator) -> np.ndarray | None:
        if n > len(self.free):
            return None
        idx = rng.choice(len(self.free), size=n, replace=False)
        pages = np.array([self.free[i] for i in idx], dtype=np.int64)
        for i in sorted(idx, reverse=True):
            self.free.pop(i)
        return pages

    def give(self, pages: np.ndarray) -> None:
        self.free.extend(int(p) for p in pages)


class World:
    """P prefill ranks and D decode ranks of one model, wired through one MemFabric."""

    def __init__(
        self,
        model: ModelGeometry = TINY,
        prefill_tp: int = 1,
        decode_tp: int = 1,
        *,
        page_size: int = 2,
        num_pages: int = 32,
        decode_page_size: int | None = None,
        prefill_layout: Layout = Layout.SGLANG_NHD,
        decode_layout: Layout = Layout.SGLANG_NHD,
        num_shards: int = 2,
        timeouts: Timeouts = TEST_TIMEOUTS,
        seed: int = 0,
        memory: bool = True,
        flow: str | None = None,
        ring_bytes: int = 0,
        pinned_bytes: int = 0,
        worker_buffer_bytes: int = 0,
        prefill_pinned_bytes: int = 0,
        fallback_direct: bool = False,
    ) -> None:
        """``flow``: a flow every room is opened with (an override), "mixed" to draw one per
        room, or None for the policy's choice. ``ring_bytes``/``pinned_bytes``: what each decode
        rank registers; ``worker_buffer_bytes``/``prefill_pinned_bytes``: each prefill worker's
        staging buffer and each prefill rank's pinned pool."""
        self.model = model
        self.flow = flow
        self.staging_sizes = (ring_bytes, pinned_bytes, worker_buffer_bytes, prefill_pinned_bytes)
        self.P, self.D = prefill_tp, decode_tp
        self.timeouts = timeouts
        self.rng = np.random.default_rng(seed)
        self.fabric = MemFabric()
        self.memory = memory
        self.fabric.copy = memory
        self.fabric.on_land = self._on_land if memory else None
        self.violations: list[str] = []
        self.effects: Counter[tuple[Any, ...]] = Counter()
        self.reasons: Counter[tuple[str, str]] = Counter()
        self.failure_reasons: list[str] = []
        self.requests: dict[tuple[int, str], Request] = {}
        self.live: dict[int, Request] = {}  # room id -> current incarnation
        self.history: dict[tuple[str, int, int, str], KVPoll] = {}
        self.server_view: dict[tuple[str, int, str], KVPoll] = {}
        self.freed_log: list[tuple[int, str, int]] = []
        self.success_checked: set[tuple[int, str, int]] = set()
        src_pools = make_pools(model, prefill_tp, page_size, num_pages, prefill_layout)
        dst_pools = make_pools(model, decode_tp, decode_page_size or page_size, num_pages, decode_layout)
        self.src_alloc, self.dst_alloc = PageAllocator(num_pages), PageAllocator(num_pages)
        self.src_aux_free, self.dst_aux_free = list(range(AUX_ROWS)), list(range(AUX_ROWS))
        self.src_owner: dict[int, tuple[int, str]] = {}
        # Per decode rank: page -> owning (room, tid); a page leaves a rank's map when that rank frees it.
        self.dst_owner: list[dict[int, tuple[int, str]]] = [{} for _ in range(decode_tp)]
        self.dst_aux_owner: dict[int, tuple[int, str]] = {}
        self.prefill: list[Rank] = []
        self.decode: list[Rank] = []
        staging = {worker_region(i): worker_buffer_bytes for i in range(num_shards) if worker_buffer_bytes}
        if prefill_pinned_bytes:
            staging[PINNED_REGION] = prefill_pinned_bytes
        policy = FlowPolicy(fallback_direct=fallback_direct)
        for p, pool in enumerate(src_pools):
            ep = m.Endpoint("prefill", p)
            t = MemTransport(self.fabric, ep, pool, fill=100 + p, memory=memory, staging=staging)
            eng = SenderEngine(
                ep,
                pool,
                timeouts=timeouts,
                num_shards=num_shards,
                policy=policy,
                worker_buffer_bytes=worker_buffer_bytes,
                pinned_bytes=prefill_pinned_bytes,
                registration=t.registration(),
            )
            rank = Rank("prefill", p, ep, pool, t, eng, Driver(eng, t, num_shards=num_shards))
            rank.driver.on_status = self._status_cb(rank)
            self.prefill.append(rank)
        self.dst_pools = dst_pools
        self.decode_incarnation = 0
        for d in range(decode_tp):
            self.decode.append(self._decode_rank(d))

    def _decode_rank(self, d: int) -> Rank:
        ep = m.Endpoint("decode", d)
        pool = self.dst_pools[d]
        ring, pinned = self.staging_sizes[:2]
        staging = {rid: n for rid, n in ((RING_REGION, ring), (PINNED_REGION, pinned)) if n}
        t = MemTransport(
            self.fabric, ep, pool, 200 + d, self.memory, self.decode_incarnation, staging, (ring, pinned)
        )
        eng = ReceiverEngine(t.registration(), timeouts=self.timeouts)
        rank = Rank("decode", d, ep, pool, t, eng, Driver(eng, t))
        rank.driver.on_status = self._status_cb(rank)
        rank.driver.on_free_pages = self._free_cb(rank)
        return rank

    def restart_decode(self) -> list[Request]:
        """The decode server crashes and comes back at once (every rank: new agent, empty memory,
        empty allocator, so page ids get reused). Returns the requests whose decode side died."""
        self.decode_incarnation += 1
        dead = []
        for req in self.requests.values():
            if len(req.released["decode"]) == self.D:
                continue
            dead.append(req)
            for d in range(self.D):
                key = ("decode", d, req.room, req.tid)
                if not is_terminal(self.history.get(key, KVPoll.Bootstrapping)):
                    self.history[key] = KVPoll.Failed  # the process that held it is gone
                req.released["decode"].add(d)
                req.freed.add(d)
            self._maybe_forget(req)
        self.dst_alloc = PageAllocator(self.dst_pools[0].num_pages)
        self.dst_aux_free = list(range(AUX_ROWS))
        self.dst_owner = [{} for _ in range(self.D)]
        self.dst_aux_owner = {}
        self.decode = [self._decode_rank(d) for d in range(self.D)]
        return dead

    @property
    def ranks(self) -> list[Rank]:
        return self.prefill + self.decode

    # --- callbacks and checks ----------------------------------------------------------------------

    def _status_cb(self, rank: Rank) -> Any:
        def cb(cmd: Any) -> None:
            key = (rank.side, rank.index, cmd.room, cmd.transfer_id)
            old = self.history.get(key)
            if old is not None and advance(old, cmd.status) is not cmd.status:
                self.violations.append(f"{key}: status {old.name} -> {cmd.status.name}")
            if old is None or cmd.status is not old:
                self.history[key] = cmd.status
            if cmd.status is KVPoll.Failed and old is not KVPoll.Failed:
                self.reasons[(rank.side, cmd.reason.split(":")[0])] += 1
                self.failure_reasons.append(cmd.reason)
            self._check_server_view(rank.side, cmd.room, cmd.transfer_id)
            if rank.side == "decode" and cmd.status is KVPoll.Success and self.memory:
                self._check_bytes(rank, cmd.room, cmd.transfer_id)

        return cb

    def _check_server_view(self, side: str, room: int, tid: str) -> None:
        n = self.P if side == "prefill" else self.D
        seen = [self.history.get((side, i, room, tid)) for i in range(n)]
        if any(s is None for s in seen):
            return
        view = min_status(seen)  # type: ignore[arg-type]
        key = (side, room, tid)
        old = self.server_view.get(key)
        if old is not None and advance(old, view) is not view:
            self.violations.append(f"server view {key}: {old.name} -> {view.name}")
        self.server_view[key] = view

    def _free_cb(self, rank: Rank) -> Any:
        def cb(cmd: Any) -> None:
            req = self.requests.get((cmd.room, cmd.transfer_id))
            if req is None:
                self.violations.append(f"FreePages for unknown room {cmd.room}")
                return
            self.freed_log.append((cmd.room, cmd.transfer_id, rank.index))
            self._free_decode(req, rank.index)

        return cb

    def _free_decode(self, req: Request, d: int) -> None:
        if d in req.freed:
            self.violations.append(f"room {req.room} pages freed twice on decode {d}")
            return
        req.freed.add(d)
        for p in req.dst_pages:
            if self.dst_owner[d].get(int(p)) == (req.room, req.tid):
                del self.dst_owner[d][int(p)]
        if len(req.freed) == self.D:
            self.dst_alloc.give(req.dst_pages)
            self.dst_aux_owner.pop(req.dst_aux, None)
            self.dst_aux_free.append(req.dst_aux)

    def _on_land(self, w: PendingWrite, note: m.ChunkNote) -> None:
        key = (note.room, note.transfer_id)
        # A layer-wise chunk is written once per layer range (the note names it).
        kind = "aux" if note.aux else f"kv{note.layer_start}-{note.layer_end}"
        self.effects[(key, w.src, w.dst, note.chunk_index, kind)] += 1
        if self.effects[(key, w.src, w.dst, note.chunk_index, kind)] > 1:
            self.violations.append(f"chunk {note.chunk_index} of {key} written twice {w.src}->{w.dst}")
        d = self.fabric.transports[w.dst]
        s = self.fabric.transports[w.src]
        dst_rank = w.dst.rank
        if w.aux is not None:
            if self.dst_aux_owner.get(w.aux[1]) != key:
                self.violations.append(f"aux write of {key} into aux row {w.aux[1]} it does not own")
            return
        _sr, so, dr, do, ln = w.descs  # type: ignore[misc]
        if is_staging_region(int(dr[0])):
            self._check_staged_land(w, note, key)
            return
        dpb, spb = d.pool.page_bytes, s.pool.page_bytes
        for k in range(len(ln)):
            for off in (int(do[k]), int(do[k]) + int(ln[k]) - 1):
                page = off // dpb
                if self.dst_owner[dst_rank].get(page) != key:
                    self.violations.append(
                        f"write of {key} into decode {dst_rank} page {page} it does not own"
                    )
            for off in (int(so[k]), int(so[k]) + int(ln[k]) - 1):
                if self.src_owner.get(off // spb) != key:
                    self.violations.append(f"write of {key} reads prefill page {off // spb} it does not own")

    def _check_staged_land(self, w: PendingWrite, note: m.ChunkNote, key: tuple[int, str]) -> None:
        """A staged write lands only inside a live allocation its room holds on that decode rank."""
        _sr, _so, dr, do, ln = w.descs  # type: ignore[misc]
        lo, hi = int(do[0]), int(do[0]) + int(ln[0])
        if not self.decode[w.dst.rank].engine.staging_holds(key, int(dr[0]), lo, hi):
            self.violations.append(
                f"staged write of {key} chunk {note.chunk_index} into [{lo}, {hi}) of "
                f"region {int(dr[0])} on {w.dst}, outside its live allocations"
            )

    def _check_bytes(self, rank: Rank, room: int, tid: str) -> None:
        key = (room, tid, rank.index)
        if key in self.success_checked:
            return
        self.success_checked.add(key)
        req = self.requests[(room, tid)]
        pool = rank.pool
        heads = refmodel.ref_heads(pool.model.num_kv_heads, pool.tp_size, pool.tp_rank)
        hb = refmodel.head_bytes(pool.model)
        tokens = np.arange(req.num_tokens)
        pg = req.dst_pages[tokens // pool.page_size]
        tip = tokens % pool.page_size
        for r, buf in rank.transport.regions.items():
            view = refmodel.logical(pool, buf)
            for j, g in enumerate(heads):
                want = refmodel.pattern(r, tokens + req.salt, g, hb)
                if not np.array_equal(view[pg, tip, j, :], want):
                    self.violations.append(
                        f"room {room} decode {rank.index} region {r} head {g}: bytes differ"
                    )
                    return
        if aux_room_of(rank.transport.aux[req.dst_aux]) != room:
            self.violations.append(f"room {room} decode {rank.index}: aux row wrong")

    # --- the scheduler's side ----------------------------------------------------------------------

    def open_room(
        self, room: int, tid: str, num_tokens: int, cuts: list[int], decode_late: bool = False
    ) -> Request | None:
        """Allocate both sides, write the source KV, open the room on every rank. None if full."""
        if room in self.live or not self.src_aux_free or not self.dst_aux_free:
            return None
        src_pool, dst_pool = self.prefill[0].pool, self.decode[0].pool
        ns = -(-num_tokens // src_pool.page_size) or 1
        nd = -(-num_tokens // dst_pool.page_size) or 1
        if ns > len(self.src_alloc.free) or nd > len(self.dst_alloc.free):
            return None
        sp = self.src_alloc.take(ns, self.rng)
        dp = self.dst_alloc.take(nd, self.rng)
        assert sp is not None and dp is not None
        req = Request(
            room,
            tid,
            num_tokens,
            cuts,
            sp,
            dp,
            self.src_aux_free.pop(),
            self.dst_aux_free.pop(),
            salt=room << 16,
        )
        req.chunks_sent = [0] * self.P
        self.requests[(room, tid)] = req
        self.live[room] = req
        for p in sp:
            self.src_owner[int(p)] = (room, tid)
        for d in range(self.D):
            for p in dp:
                self.dst_owner[d][int(p)] = (room, tid)
        self.dst_aux_owner[req.dst_aux] = (room, tid)
        tokens = np.arange(num_tokens)
        for rank in self.prefill:
            pool = rank.pool
            heads = refmodel.ref_heads(pool.model.num_kv_heads, pool.tp_size, pool.tp_rank)
            hb = refmodel.head_bytes(pool.model)
            pg, tip = sp[tokens // pool.page_size], tokens % pool.page_size
            for r, buf in rank.transport.regions.items():  # empty when memory=False
                view = refmodel.logical(pool, buf)
                for j, g in enumerate(heads):
                    view[pg, tip, j, :] = refmodel.pattern(r, tokens + req.salt, g, hb)
            rank.transport.aux[req.src_aux] = 0
            rank.transport.aux[req.src_aux, :8] = np.frombuffer(encode_aux_room(room), dtype=np.uint8)
            rank.transport.aux[req.src_aux, 8:] = room & 0xFF
        if not decode_late:
            self.open_decode(req)
        flow = self.room_flow(room)
        for rank in self.prefill:
            receivers = receiver_endpoints(self.model, self.P, self.D, rank.index)
            ev = SenderOpen(room=room, transfer_id=tid, aux_index=req.src_aux, receivers=receivers, flow=flow)
            rank.driver.feed(ev, self.fabric.now)
        return req

    def open_decode(self, req: Request) -> None:
        """The decode scheduler opens the room on every decode rank (open_room does it first,
        unless ``decode_late``: then prefill may ask for staging space before decode knows it)."""
        for rank in self.decode:
            specs = sender_specs(self.model, self.P, self.D, rank.index)
            ev = ReceiverOpen(
                room=req.room,
                transfer_id=req.tid,
                dst_pages=req.dst_pages,
                num_tokens=req.num_tokens,
                aux_index=req.dst_aux,
                senders=specs,
            )
            rank.driver.feed(ev, self.fabric.now)

    def room_flow(self, room: int) -> str | None:
        if self.flow != "mixed":
            return self.flow
        offered = [Flow.DIRECT, Flow.PULL, Flow.PUSH]
        if self.staging_sizes[0] and self.staging_sizes[2]:
            offered.append(Flow.RING)
        if self.staging_sizes[1] and self.staging_sizes[3]:
            offered.append(Flow.PINNED)
        return offered[room % len(offered)].value

    def chunk_ready(self, req: Request, p: int) -> bool:
        """Prefill rank p finished its next chunk of the room. False if it has none left."""
        i = req.chunks_sent[p]
        if i >= len(req.cuts):
            return False
        req.chunks_sent[p] += 1
        ev = ChunkReady(
            room=req.room,
            transfer_id=req.tid,
            chunk_index=i,
            token_end=req.cuts[i],
            src_pages=req.src_pages,
            is_last=i == len(req.cuts) - 1,
        )
        self.prefill[p].driver.feed(ev, self.fabric.now)
        return True

    def run_worker(self, p: int, shard: int) -> bool:
        drv = self.prefill[p].driver
        return drv.worker_step(shard % len(drv.queues), self.fabric.now) is not None

    def abort(self, req: Request, side: str, i: int) -> None:
        rank = (self.prefill if side == "prefill" else self.decode)[i]
        rank.driver.feed(AbortRoom(room=req.room, transfer_id=req.tid, reason="test abort"), self.fabric.now)

    def rank_status(self, rank: Rank, req: Request) -> KVPoll | None:
        """This incarnation's status on one rank: live room, else its tombstone, else None."""
        r = rank.engine.rooms.get(req.room)
        if r is not None and r.tid == req.tid:
            return rank.engine.poll(req.room)
        return rank.engine.tombstones.get(req.room, req.tid)

    def release(self, req: Request, side: str, i: int) -> None:
        """The scheduler is done with the room on one rank (only once that rank says terminal)."""
        rank = (self.prefill if side == "prefill" else self.decode)[i]
        if i in req.released[side]:
            return
        req.released[side].add(i)
        rank.driver.feed(ReleaseRoom(room=req.room, transfer_id=req.tid), self.fabric.now)
        if side == "decode" and self.rank_status(rank, req) is KVPoll.Success and i not in req.freed:
            # A finished request's pages stay with it until it is done decoding; here, at once.
            self._free_decode(req, i)
        if side == "prefill" and len(req.released["prefill"]) == self.P:
            self._free_prefill_when_quiet(req)
        self._maybe_forget(req)

    def _free_prefill_when_quiet(self, req: Request) -> None:
        if any(req.room in r.engine.rooms and r.engine.rooms[req.room].tid == req.tid for r in self.prefill):
            return  # a rank still has writes in flight; retried by settle()
        if any(self.src_owner.get(int(p)) == (req.room, req.tid) for p in req.src_pages):
            for p in req.src_pages:
                del self.src_owner[int(p)]
            self.src_alloc.give(req.src_pages)
            self.src_aux_free.append(req.src_aux)

    def _maybe_forget(self, req: Request) -> None:
        done = len(req.released["prefill"]) == self.P and len(req.released["decode"]) == self.D
        if done and self.live.get(req.room) is req:
            del self.live[req.room]

    # --- the network's side --------------------------------------------------------------------------

    def pump(self) -> None:
        """Let every rank process what is in its inbox and any due deadline, until quiet."""
        for _ in range(100):
            n = sum(r.driver.pump(self.fabric.now) for r in self.ranks)
            if n == 0:
                break
        for req in list(self.requests.values()):
            if len(req.released["prefill"]) == self.P:
                self._free_prefill_when_quiet(req)

    def deliver(self, i: int) -> None:
        self.fabric.deliver(i)
        self.pump()

    def advance(self, dt: int) -> None:
        self.fabric.now += dt
        self.fabric.expire()
        self.pump()

    def flush(self) -> None:
        """Deliver everything pending, run every worker, complete every write, until quiet (no
        time passes)."""
        progressed = True
        while progressed:
            progressed = False
            while self.fabric.pending:
                self.deliver(0)
                progressed = True
            for p in range(self.P):
                for s in range(len(self.prefill[p].driver.queues)):
                    while self.run_worker(p, s):
                        progressed = True
            while self.fabric.writes:
                self.fabric.complete(0)
                self.pump()
                progressed = True
            while self.fabric.copies:
                self.fabric.run_copy(0)
                self.pump()
                progressed = True
            self.pump()

    def heal_and_settle(self, rounds: int = 200) -> None:
        """No more loss: deliver everything, run every worker, complete every write, let time pass
        past every deadline; release rooms as their ranks turn terminal."""
        for _ in range(rounds):
            self.flush()
            self.release_terminal()
            quiet = not (self.fabric.pending or self.fabric.writes or self.fabric.copies)
            if not self.live_rooms_anywhere() and quiet:
                return
            self.advance(self.timeouts.heartbeat_interval_ns)

    def release_terminal(self) -> None:
        for req in list(self.requests.values()):
            for side, ranks in (("prefill", self.prefill), ("decode", self.decode)):
                for rank in ranks:
                    st = self.rank_status(rank, req)
                    if st is not None and is_terminal(st):
                        self.release(req, side, rank.index)

    def internal_errors(self) -> list[BaseException]:
        return [r.engine.last_internal_error for r in self.ranks if r.engine.counters["internal_error"]]

    def live_rooms_anywhere(self) -> bool:
        # A released prefill room may still owe its peer a failure notice (resent each heartbeat
        # interval): settling must keep time moving in heartbeat steps until that stream ends,
        # or one big jump past fence_ns would give up without a single resend.
        # Likewise a watermark decode owes a writer (core/flows/staged_wm.py), sent a quarter
        # interval after the free, and the writer's notes that wait for it.
        return any(
            r.engine.rooms
            or (r.side == "prefill" and (r.engine.notices or r.engine.staged.unconfirmed))
            or (r.side == "decode" and r.engine.staged.pacer.owed)
            for r in self.ranks
        )

    def first_chunk_run(self, room: int, tid: str, num_tokens: int) -> Request:
        """A one-chunk room opened on every rank, its handshake delivered, and its chunk run by
        prefill rank 0's worker: the writes (or, pull, the offers) are on the fabric."""
        req = self.open_room(room, tid, num_tokens, [num_tokens])
        assert req is not None
        while self.fabric.pending:  # Register, TransferInfo, RegisterAck, InfoAck
            self.deliver(0)
        assert self.chunk_ready(req, 0)
        assert self.run_worker(0, room % len(self.prefill[0].driver.queues))
        return req
