"""One NIXL agent per rank: registration, prepared descriptor lists, WRITE/READ, notifications.

Descriptors. The planner addresses memory as (region_id, byte offset, length). NIXL's fast path
wants *prepared* descriptor lists built once, and per transfer only index arrays into them
(``make_prepped_xfer``, which merges dense index runs back into large descriptors). So every
region is cut into fixed ``granule``-byte descriptors. Regions belong to named groups ("kv" for
the pool, "aux" for the aux rows); a prepared list covers one group at one granule: the local one
built once per (group, granule), the remote one once per (peer, group, granule) when the peer
registers. A planner descriptor becomes the run of
indices ``[offset/granule, (offset+length)/granule)`` of its region, checked against the region
sizes on both sides before anything is posted: a bad descriptor raises DescriptorError and
never reaches NIXL, so nothing is written outside a registered region.

Prepared transfers. ``prepare`` runs ``post``'s checks and makes the transfer ready without
posting it (a write planned ahead of its chunk: core/flows/ahead.py); ``post_prepared`` posts it
once, ``release_prepared`` gives it back. A peer's removal (or its lists being replaced) gives its
prepared transfers back first, so a later post of one is refused (NixlPeerError), never sent with
a stale list; teardown gives back every one before the lists.

Thread-sync. The agent is created with an explicit NIXL sync mode: NONE when one thread touches it,
RW when several do (the runtime posts from N workers and drains notifications from another).

Progress. NIXL's own progress thread is off by default: the Python API fixes its delay at 0, so it
spins (about 70% of a core per agent, idle or not, measured). UCX then progresses when we poll
(check_xfer_state, get_new_notifs): the initiator polls its writes, and a target must keep
calling ``notifs()``/``progress()`` (the runtime's progress threads do, with an idle backoff).

Executors. ``factory`` builds what talks to NIXL: NIXL's Python agent (``make_nixl_agent``, the
reference executor), or the native engine (``native.make_native_agent``: same methods, but posts
run and are polled on the engine's own C thread, which reports which transfers finished:
``settled()``, ``wait_events()``). Tables, bounds checks and tickets here are the same for both.

Ownership. ``_tables`` (an RWLock) guards every table here: peers, prepared lists, in-flight
handles. Data-path calls (post, poll, notifications) take the shared side, table changes the
exclusive side; ``_inflight`` is a dict whose single-key operations are atomic under the GIL.
Several threads post at once (the runtime's workers post outside the driver lock). That is safe
with sync mode RW in nixl 1.5.x: the agent takes its own lock shared on the data path
(prep/make/post/status/release of *different* requests run concurrently) and exclusive for
metadata changes, and the UCX backend then creates its workers thread-safe (UCS_THREAD_MODE_MULTI).
What NIXL does not make safe is one request handle used by two threads at once (nixl#2049): a
ticket's ``lock`` is held while it is posted and while it is polled, so a settle (peer removal,
teardown) polling ``_inflight`` from another thread waits for a post in progress to return.
Teardown follows NIXL's order: transfer handles, prepared lists, remote agents, memory.

A lost peer's transfers. Releasing a handle does not cancel a transfer: over UCX's TCP transport a
WRITE queued during a partition still lands after the heal (the target checks no registration),
so a transfer reported failed at the drop would let the core answer ``Stopped`` (or free a READ's
pages) while bytes are still on their way. A dropped peer with transfers in flight is therefore
*draining*: it takes no new posts, but its handles, prepared lists and remote agent stay until
each transfer ends on its own (DONE: the bytes landed and were acknowledged; ERR: the connection
failed), which pollers see as usual. Past ``drain_s`` a transfer still in flight is released as
failed with a warning and counted in ``abandoned``: nothing fences it any more.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kvferry.backends.nixl.errors import DescriptorError, NixlError, NixlPeerError, NixlXferError
from kvferry.backends.nixl.memory import MemRegion, RegionError, check_disjoint
from kvferry.backends.nixl.rwlock import RWLock
from kvferry.backends.nixl.telemetry import Telemetry, XferRecord
from kvferry.backends.nixl.ucx_env import apply_ucx_defaults

log = logging.getLogger(__name__)

SYNC_MODES = ("none", "strict", "rw")
ListKey = tuple[str, int]  # (region group, granule in bytes)
# A prepared list is a C++ vector of descriptors; beyond this a pool would need a coarser granule.
MAX_PREP_DESCS = 1 << 23
OPS = ("WRITE", "READ")
# How long a lost peer's transfers may stay in flight before they are released unfenced: past a
# partition's heal plus TCP's retransmission backoff (seconds), well short of a stuck connect.
DRAIN_S = 30.0


def _nixl_api() -> Any:
    from nixl import _api

    return _api


def make_nixl_agent(
    name: str,
    sync: str,
    telemetry: bool,
    ucx_threads: int,
    progress_thread: bool = False,
    ucx_workers: int = 1,
) -> Any:
    api = _nixl_api()
    apply_ucx_defaults()
    modes = {
        "none": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
        "strict": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        "rw": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
    }
    cfg = api.nixl_agent_config(
        enable_prog_thread=progress_thread,
        enable_listen_thread=False,  # metadata travels in our own registration message
        capture_telemetry=telemetry,
        num_threads=ucx_threads,
        backends=["UCX"] if ucx_workers == 1 else [],
        sync_mode=modes[sync],
    )
    agent = api.nixl_agent(name, cfg)
    if ucx_workers != 1:
        # Several UCX workers: threads posting at once get their own workers and endpoints, so a
        # small write's completion is not queued behind a big post's on a shared endpoint.
        params = agent.get_plugin_params("UCX")
        params["num_workers"] = str(ucx_workers)
        if ucx_threads > 0:
            params["num_threads"] = str(ucx_threads)
        agent.create_backend("UCX", params)
    return agent


@dataclass
class _RegionTable:
    """Regions of one side, with the first descriptor index of each region in a prepared list."""

    regions: dict[int, MemRegion]
    granule: int
    first: np.ndarray = field(init=False)  # region_id -> first index, -1 if unknown
    units: np.ndarray = field(init=False)  # region_id -> descriptors in that region
    ndescs: int = field(init=False)
    addr: np.ndarray = field(init=False)  # region_id -> base address (one-shot posts)
    dev: np.ndarray = field(init=False)  # region_id -> device id
    _ends: dict[int, int] = field(init=False, repr=False)  # known region_id -> end, as Python ints

    def __post_init__(self) -> None:
        size = max(self.regions) + 1 if self.regions else 0
        self.first = np.full(size, -1, dtype=np.int64)
        self.units = np.zeros(size, dtype=np.int64)
        self.addr = np.zeros(size, dtype=np.uint64)
        self.dev = np.zeros(size, dtype=np.uint64)
        nxt = 0
        for rid in sorted(self.regions):
            n = self.regions[rid].nbytes // self.granule
            self.first[rid], self.units[rid] = nxt, n
            self.addr[rid], self.dev[rid] = self.regions[rid].addr, self.regions[rid].dev
            nxt += n
        self.ndescs = nxt
        if nxt > MAX_PREP_DESCS:
            raise RegionError(f"granule {self.granule} B gives {nxt} descriptors; use a coarser granule")
        # Region ends in bytes as Python ints: a one-descriptor post (an aux row, a one-run chunk)
        # is checked without a numpy call (~20 of them, ~40 us). A dict of the known regions, not
        # an array or list over every id up to the largest: region ids can be large, and a dense
        # table of ends cost tens of MB of resident memory per table (a soak's RSS bound caught it).
        self._ends = {rid: int(self.units[rid]) * self.granule for rid in self.regions}

    def rows(self) -> np.ndarray:
        """Nx3 (addr, len, dev) rows in index order, for prep_xfer_dlist."""
        parts = []
        for rid in sorted(self.regions):
            r = self.regions[rid]
            n = int(self.units[rid])
            rows = np.empty((n, 3), dtype=np.uint64)
            rows[:, 0] = r.addr + np.arange(n, dtype=np.uint64) * np.uint64(self.granule)
            rows[:, 1] = self.granule
            rows[:, 2] = r.dev
            parts.append(rows)
        return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.uint64)

    @functools.cached_property
    def mem_type(self) -> str:
        """The one memory kind of the regions (asked at every one-shot post: computed once)."""
        mems = {r.mem for r in self.regions.values()}
        if len(mems) != 1:
            raise RegionError(f"one prepared list cannot mix memory types {sorted(mems)}")
        return mems.pop()

    def _checked(
        self, region: np.ndarray, offset: np.ndarray, length: np.ndarray, side: str
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The three columns as int64, or DescriptorError on any descriptor outside its region."""
        g = self.granule
        region = np.asarray(region, dtype=np.int64)
        offset = np.asarray(offset, dtype=np.int64)
        length = np.asarray(length, dtype=np.int64)
        if region.size == offset.size == length.size == 1:
            self._check_one(region.item(), offset.item(), length.item(), side)
            return region, offset, length
        known = (region >= 0) & (region < self.first.size)
        if not known.all() or (self.first[region] < 0).any():
            raise DescriptorError(f"{side}: unknown region id in {np.unique(region).tolist()}")
        if (offset < 0).any() or (length <= 0).any():
            raise DescriptorError(f"{side}: negative offset or empty length")
        if (offset % g).any() or (length % g).any():
            raise DescriptorError(f"{side}: offset/length not multiples of the {g} B granule")
        if ((offset + length) > self.units[region] * g).any():
            raise DescriptorError(f"{side}: descriptor runs past the end of its registered region")
        return region, offset, length

    def _check_one(self, region: int, offset: int, length: int, side: str) -> None:
        """``_checked``'s checks, in its order and with its messages, for one descriptor (Python
        ints: no int64 wrap-around either)."""
        g = self.granule
        end = self._ends.get(region, -1)
        if end < 0:
            raise DescriptorError(f"{side}: unknown region id in {[region]}")
        if offset < 0 or length <= 0:
            raise DescriptorError(f"{side}: negative offset or empty length")
        if offset % g or length % g:
            raise DescriptorError(f"{side}: offset/length not multiples of the {g} B granule")
        if offset + length > end:
            raise DescriptorError(f"{side}: descriptor runs past the end of its registered region")

    def indices(self, region: np.ndarray, offset: np.ndarray, length: np.ndarray, side: str) -> np.ndarray:
        """Index run of every descriptor, concatenated; raises DescriptorError on any bad one."""
        if np.size(region) == 0:
            return np.empty(0, dtype=np.int32)
        region, offset, length = self._checked(region, offset, length, side)
        g = self.granule
        if (
            region.size == offset.size == length.size == 1
        ):  # one run: one arange (the general path costs ~10 numpy calls)
            start = int(self.first[region.item()]) + offset.item() // g
            return np.arange(start, start + length.item() // g, dtype=np.int32)
        base = self.first[region] + offset // g
        count = length // g
        total = int(count.sum())
        # idx[j] = base[i] + (j - first j of descriptor i), built without a Python loop.
        run_start = np.repeat(np.cumsum(count) - count, count)
        idx = np.repeat(base, count) + (np.arange(total, dtype=np.int64) - run_start)
        return idx.astype(np.int32)

    def rows_for(self, region: np.ndarray, offset: np.ndarray, length: np.ndarray, side: str) -> np.ndarray:
        """Nx3 (addr, len, dev) rows of the descriptors themselves, for a one-shot post; the same
        checks as ``indices``."""
        region, offset, length = self._checked(region, offset, length, side)
        rows = np.empty((region.size, 3), dtype=np.uint64)
        rows[:, 0] = self.addr[region] + offset.astype(np.uint64)
        rows[:, 1] = length.astype(np.uint64)
        rows[:, 2] = self.dev[region]
        return rows


@dataclass
class _Peer:
    name: str  # NIXL agent name of the remote
    regions: dict[int, MemRegion]
    tables: dict[ListKey, _RegionTable] = field(default_factory=dict)
    prepped: dict[ListKey, Any] = field(default_factory=dict)  # prepared list handles


@dataclass(eq=False)
class PreparedXfer:
    """A transfer checked and made ready ahead of its post (``NixlAgent.prepare``): posted once by
    ``post_prepared`` or given back by ``release_prepared``; its peer's removal gives it back."""

    pid: int
    peer: str
    op: str
    handle: Any
    descs: int
    nbytes: int


@dataclass(eq=False)  # identity: a ticket is one transfer, and sets of them are kept
class XferTicket:
    """A posted transfer; the caller polls it until DONE or ERR."""

    xid: int
    peer: str
    op: str
    handle: Any
    descs: int
    nbytes: int
    t0_ns: int
    final: str | None = None  # DONE or ERR once released
    lock: threading.Lock = field(default_factory=threading.Lock)


class NixlAgent:
    """The data plane of one rank.

    ``sync``: NIXL thread-sync mode; "rw" when several threads share the agent, "none" for one.
    ``factory`` builds the underlying nixl_agent; tests of error paths pass a fake.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        sync: str = "rw",
        telemetry: bool = True,
        ucx_threads: int = 0,
        progress_thread: bool = False,
        ucx_workers: int = 1,
        factory: Callable[..., Any] = make_nixl_agent,
        drain_s: float = DRAIN_S,
    ) -> None:
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}")
        # A fresh suffix per process: a restarted peer gets a new name, so stale state of the old
        # incarnation can never be mistaken for the new one.
        self.name = name or f"kvferry-{uuid.uuid4().hex[:12]}"
        if ucx_workers < 1:
            raise ValueError("ucx_workers must be >= 1")
        extra = {} if ucx_workers == 1 else {"ucx_workers": ucx_workers}  # fakes need not know it
        self._nixl = factory(self.name, sync, telemetry, ucx_threads, progress_thread, **extra)
        # The native engine (native.py) polls on its own thread and says which transfers finished.
        self.executor = "native" if hasattr(self._nixl, "settled") else "python"
        self._stash: deque[tuple[str, bytes]] = deque()  # notifications taken by progress()
        self._capture = telemetry
        self._tables = RWLock()
        self._reg_descs: list[Any] = []
        self._local: dict[int, MemRegion] = {}
        self._groups: dict[str, set[int]] = {}
        self._local_tables: dict[ListKey, _RegionTable] = {}
        self._local_prepped: dict[ListKey, Any] = {}
        self._peers: dict[str, _Peer] = {}
        # Dropped peers whose transfers have not ended yet: name -> (peer, release deadline).
        self._draining: dict[str, tuple[_Peer, float]] = {}
        self.drain_s = drain_s
        self.abandoned = 0  # a lost peer's transfers released still in flight (past drain_s)
        self._inflight: dict[int, XferTicket] = {}
        self._prepared: dict[int, PreparedXfer] = {}  # made ready, not yet posted or given back
        self._ids = itertools.count(1)
        self.telemetry = Telemetry()
        self._closed = False

    # ---- registration -------------------------------------------------------------------
    def register(self, regions: Sequence[MemRegion], group: str = "kv") -> None:
        """Register memory with NIXL (one registration list per memory type) under ``group``."""
        with self._tables.write():
            merged = {**self._local, **{r.region_id: r for r in regions}}
            if len(merged) != len(self._local) + len(regions):
                raise RegionError("region id registered twice")
            # Disjoint within a group (a descriptor may not land in two rooms' bytes); groups may
            # overlap, e.g. a benchmark's single covering region over the whole pool.
            check_disjoint([self._local[i] for i in self._groups.get(group, ())] + list(regions))
            by_mem: dict[str, list[MemRegion]] = {}
            for r in regions:
                by_mem.setdefault(r.mem, []).append(r)
            for mem, rs in by_mem.items():
                rows = np.array([[r.addr, r.nbytes, r.dev] for r in rs], dtype=np.uint64)
                self._reg_descs.append(self._call(self._nixl.register_memory, rows, mem))
            self._local = merged
            self._groups.setdefault(group, set()).update(r.region_id for r in regions)

    def regions(self) -> list[MemRegion]:
        return list(self._local.values())

    def metadata(self) -> bytes:
        """NIXL agent metadata (connection info and registered memory keys) for peers."""
        return bytes(self._call(self._nixl.get_agent_metadata))

    def _local_prep(self, key: ListKey) -> None:
        # Caller holds the exclusive side.
        if key not in self._local_prepped:
            group, granule = key
            if group not in self._groups:
                raise RegionError(f"no local regions in group {group!r}")
            table = _RegionTable({i: self._local[i] for i in self._groups[group]}, granule)
            handle = self._call(self._nixl.prep_xfer_dlist, "NIXL_INIT_AGENT", table.rows(), table.mem_type)
            self._local_tables[key], self._local_prepped[key] = table, handle

    def add_peer(self, metadata: bytes, groups: dict[str, tuple[Sequence[MemRegion], Sequence[int]]]) -> str:
        """Load a peer's metadata; for every group, its regions and the granules to prepare."""
        for regions, granules in groups.values():
            check_disjoint(regions)
            for g in granules:
                if g <= 0:
                    raise RegionError(f"granule must be positive, got {g}")
        with self._tables.write():
            name = self._call(self._nixl.add_remote_agent, metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name in self._draining:  # the same agent again: its old transfers are moot
                self._forget_draining_locked(name, invalidate=False)
            if name in self._peers:
                self._drop_peer_locked(name, invalidate=False)
            self._peers[name] = _Peer(name, {})
            try:
                self._add_lists_locked(name, groups)
            except Exception:
                self._drop_peer_locked(name, invalidate=True)
                raise
            return name

    def add_lists(self, name: str, groups: dict[str, tuple[Sequence[MemRegion], Sequence[int]]]) -> None:
        """Prepare more lists towards an already loaded peer (e.g. a benchmark's raw region)."""
        for regions, _ in groups.values():
            check_disjoint(regions)
        with self._tables.write():
            if name not in self._peers:
                raise NixlPeerError(f"peer {name!r} not registered")
            self._add_lists_locked(name, groups)

    def _add_lists_locked(
        self, name: str, groups: dict[str, tuple[Sequence[MemRegion], Sequence[int]]]
    ) -> None:
        peer = self._peers[name]
        for group, (regions, granules) in groups.items():
            peer.regions.update({r.region_id: r for r in regions})
            for g in granules:
                key = (group, g)
                self._local_prep(key)
                table = _RegionTable({r.region_id: r for r in regions}, g)
                old = peer.prepped.pop(key, None)
                if old is not None:
                    self._drop_prepared_locked(name)  # made from the list that goes
                    self._quiet(old.release)
                peer.tables[key] = table
                peer.prepped[key] = self._call(self._nixl.prep_xfer_dlist, name, table.rows(), table.mem_type)

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def peers(self) -> list[str]:
        return list(self._peers)

    def remove_peer(self, name: str, settle_s: float = 2.0) -> None:
        """Forget a peer: settle its transfers, release its lists, disconnect. Transfers still in
        flight after ``settle_s`` keep the peer draining until they end (see the module doc)."""
        self._settle(lambda t: t.peer == name, settle_s)
        with self._tables.write():
            self._drop_peer_locked(name, invalidate=True, drain=True)

    def draining(self) -> list[str]:
        """Dropped peers whose transfers are still in flight."""
        return list(self._draining)

    def _drop_peer_locked(self, name: str, invalidate: bool, drain: bool = False) -> None:
        peer = self._peers.pop(name, None)
        if peer is None:
            return
        live = [t for t in self._inflight.values() if t.peer == name]
        if drain and live:
            self._draining[name] = (peer, time.monotonic() + self.drain_s)
            return
        for t in live:
            self._release(t, "ERR")
        self._forget_locked(name, peer, invalidate)

    def _forget_locked(self, name: str, peer: _Peer, invalidate: bool) -> None:
        self._drop_prepared_locked(name)
        for h in peer.prepped.values():
            self._quiet(h.release)
        peer.prepped.clear()
        if invalidate:
            self._quiet(self._nixl.remove_remote_agent, name)

    def _forget_draining_locked(self, name: str, invalidate: bool) -> None:
        peer, _ = self._draining.pop(name)
        for t in [t for t in self._inflight.values() if t.peer == name]:
            self._release(t, "ERR")
        self._forget_locked(name, peer, invalidate)

    def _after_poll(self, ticket: XferTicket, state: str) -> None:
        """A draining peer's last transfer ended: release its lists and disconnect. One of its
        transfers past the drain deadline: released, unfenced, with a warning."""
        entry = self._draining.get(ticket.peer)
        if entry is None:
            return
        if state == "PROC" and time.monotonic() >= entry[1]:
            with self._tables.read(), ticket.lock:
                if ticket.final is None:
                    self.abandoned += 1
                    log.warning(
                        "transfer %d (%s) to lost peer %s still in flight %.0f s after the drop: "
                        "released unfenced, its bytes may still land",
                        ticket.xid, ticket.op, ticket.peer, self.drain_s,
                    )  # fmt: skip
                    self._release(ticket, "ERR")
        if any(t.peer == ticket.peer for t in list(self._inflight.values())):
            return
        with self._tables.write():
            if ticket.peer in self._draining and not any(
                t.peer == ticket.peer for t in self._inflight.values()
            ):
                peer, _ = self._draining.pop(ticket.peer)
                self._forget_locked(ticket.peer, peer, invalidate=True)

    # ---- data path ----------------------------------------------------------------------
    def post(
        self,
        op: str,
        peer: str,
        key: ListKey,
        local: tuple[np.ndarray, np.ndarray],
        remote: tuple[np.ndarray, np.ndarray],
        length: np.ndarray,
        notif: bytes = b"",
        *,
        oneshot: bool = False,
    ) -> XferTicket:
        """Post a WRITE (local -> remote) or READ (remote -> local) of (region, offset) runs,
        checked against the tables of ``key`` = (group, granule) of both sides. Through the
        prepared lists: one index per granule, which NIXL merges back into runs; ``oneshot``: the
        runs themselves as descriptors built for this post (cheaper for runs of many granules)."""
        with self._tables.read():
            handle, descs, nbytes, t0 = self._make(op, peer, key, local, remote, length, notif, oneshot)
            return self._start(op, peer, handle, descs, nbytes, t0)

    def prepare(
        self,
        op: str,
        peer: str,
        key: ListKey,
        local: tuple[np.ndarray, np.ndarray],
        remote: tuple[np.ndarray, np.ndarray],
        length: np.ndarray,
        notif: bytes = b"",
        *,
        oneshot: bool = False,
    ) -> PreparedXfer:
        """``post`` without the post: the same checks (DescriptorError before NIXL sees an index),
        and the transfer made ready (NIXL's Python agent makes the request here; the native engine
        makes it on its thread, ahead). ``post_prepared`` posts it."""
        with self._tables.read():
            handle, descs, nbytes, _ = self._make(op, peer, key, local, remote, length, notif, oneshot)
            ready = getattr(self._nixl, "prepare", None)
            if ready is not None:
                self._call(ready, handle)
            prep = PreparedXfer(next(self._ids), peer, op, handle, descs, nbytes)
            self._prepared[prep.pid] = prep
            return prep

    def post_prepared(self, prep: PreparedXfer) -> XferTicket:
        """Post a prepared transfer (NixlPeerError if it was given back: its peer went away)."""
        with self._tables.read():
            if self._closed:
                raise NixlError("agent is closed")
            if self._prepared.pop(prep.pid, None) is None:
                raise NixlPeerError(f"prepared {prep.op} to {prep.peer} was given back or posted already")
            if prep.peer not in self._peers:  # dropped, its transfers draining: no new post
                self._quiet(self._nixl.release_xfer_handle, prep.handle)
                raise NixlPeerError(f"peer {prep.peer!r} not registered")
            return self._start(prep.op, prep.peer, prep.handle, prep.descs, prep.nbytes, time.monotonic_ns())

    def release_prepared(self, prep: PreparedXfer) -> None:
        """Give back a prepared transfer that will not be posted (no-op if it is gone)."""
        with self._tables.read():
            if self._prepared.pop(prep.pid, None) is not None:
                self._quiet(self._nixl.release_xfer_handle, prep.handle)

    def prepared(self) -> int:
        return len(self._prepared)

    def _drop_prepared_locked(self, name: str | None) -> None:
        # Caller holds the exclusive side: the peer's (or every, for None) prepared transfers.
        for pid, prep in list(self._prepared.items()):
            if name is None or prep.peer == name:
                del self._prepared[pid]
                self._quiet(self._nixl.release_xfer_handle, prep.handle)

    def _make(
        self,
        op: str,
        peer: str,
        key: ListKey,
        local: tuple[np.ndarray, np.ndarray],
        remote: tuple[np.ndarray, np.ndarray],
        length: np.ndarray,
        notif: bytes,
        oneshot: bool,
    ) -> tuple[Any, int, int, int]:
        """The checked transfer's handle, descriptor count, bytes and start time. Caller holds
        the shared side."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}")
        if self._closed:
            raise NixlError("agent is closed")
        p = self._peers.get(peer)
        if p is None or key not in p.prepped or key not in self._local_prepped:
            raise NixlPeerError(f"peer {peer!r} has no prepared list {key}")
        mine, theirs = self._local_tables[key], p.tables[key]
        nbytes = int(np.asarray(length, dtype=np.int64).sum())
        if oneshot:
            lr = mine.rows_for(local[0], local[1], length, "local")
            rr = theirs.rows_for(remote[0], remote[1], length, "remote")
            t0 = time.monotonic_ns()  # from the first call that hands NIXL the descriptors
            ld = self._call(self._nixl.get_xfer_descs, lr, mine.mem_type)
            rd = self._call(self._nixl.get_xfer_descs, rr, theirs.mem_type)
            handle = self._call(self._nixl.initialize_xfer, op, ld, rd, peer, notif)
            return handle, int(lr.shape[0]), nbytes, t0
        li = mine.indices(local[0], local[1], length, "local")
        ri = theirs.indices(remote[0], remote[1], length, "remote")
        t0 = time.monotonic_ns()
        handle = self._call(
            self._nixl.make_prepped_xfer, op, self._local_prepped[key], li, p.prepped[key], ri, notif
        )
        return handle, int(li.size), nbytes, t0

    def post_single(
        self, op: str, peer: str, local: MemRegion, remote: MemRegion, notif: bytes = b""
    ) -> XferTicket:
        """Post one contiguous WRITE/READ between two ranges the caller has bounds-checked inside
        registered memory (a staged flow's block: no prepared list, since its offsets are the
        ring allocator's, not multiples of a granule). One descriptor each side."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}")
        with self._tables.read():
            if self._closed:
                raise NixlError("agent is closed")
            if peer not in self._peers:
                raise NixlPeerError(f"peer {peer!r} not registered")
            ld = self._call(
                self._nixl.get_xfer_descs,
                np.array([[local.addr, local.nbytes, local.dev]], np.uint64),
                local.mem,
            )
            rd = self._call(
                self._nixl.get_xfer_descs,
                np.array([[remote.addr, remote.nbytes, remote.dev]], np.uint64),
                remote.mem,
            )
            t0 = time.monotonic_ns()
            handle = self._call(self._nixl.initialize_xfer, op, ld, rd, peer, notif)
            return self._start(op, peer, handle, 1, int(local.nbytes), t0)

    def _start(self, op: str, peer: str, handle: Any, descs: int, nbytes: int, t0: int) -> XferTicket:
        # Caller holds the shared side. A NIXL request handle is single-threaded (nixl#2049), and
        # a settle in another thread polls whatever is in ``_inflight``: the ticket's lock keeps
        # it off until posted.
        ticket = XferTicket(next(self._ids), peer, op, handle, descs, nbytes, t0)
        with ticket.lock:
            self._inflight[ticket.xid] = ticket
            try:
                state = self._call(self._nixl.transfer, handle)
            except NixlError:
                self._release(ticket, "ERR")
                raise
            if state == "ERR":
                self._release(ticket, "ERR")
                raise NixlXferError(f"{op} to {peer} failed at post")
        return ticket

    def poll(self, ticket: XferTicket) -> str:
        """PROC, DONE or ERR. DONE and ERR release the handle and record telemetry."""
        with self._tables.read(), ticket.lock:
            if ticket.final is not None:
                return ticket.final  # settled by teardown, peer removal or another poller
            try:
                state = self._nixl.check_xfer_state(ticket.handle)
            except Exception as exc:  # NIXL raises e.g. nixlRemoteDisconnectError here
                log.warning("transfer %d to %s: %r", ticket.xid, ticket.peer, exc)
                state = "ERR"
            if state != "PROC":
                self._release(ticket, state)
        if self._draining:
            self._after_poll(ticket, state)
            state = ticket.final or state
        return state

    def wait(self, ticket: XferTicket, timeout_s: float, idle_s: float = 0.0) -> str:
        """Poll until DONE/ERR or the timeout; yields the CPU between polls (no busy spin)."""
        end = time.monotonic() + timeout_s
        while True:
            state = self.poll(ticket)
            if state != "PROC" or time.monotonic() >= end:
                return state
            time.sleep(idle_s)

    def notifs(self) -> list[tuple[str, bytes]]:
        """New notifications as (sender agent name, payload). Also makes UCX progress."""
        self.progress()
        out = []
        while self._stash:
            out.append(self._stash.popleft())
        return out

    def progress(self) -> None:
        """Drive UCX progress on this agent (keeping any notification for ``notifs()``).

        Without NIXL's progress thread a rank that is the *target* of writes moves only when
        polled: the runtime's progress thread polls every ``idle_max_s`` at most. The native
        executor's own thread makes the progress: when it queued nothing there is nothing to
        take (one memory read, no lock).
        """
        news = getattr(self._nixl, "has_news", None)
        if news is not None and not news():
            return
        with self._tables.read():
            if self._closed:
                return
            got = self._call(self._nixl.get_new_notifs)
        for sender, msgs in got.items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            self._stash.extend((name, bytes(m)) for m in msgs)

    def send_notif(self, peer: str, payload: bytes) -> None:
        with self._tables.read():
            if peer not in self._peers:
                raise NixlPeerError(f"peer {peer!r} not registered")
            self._call(self._nixl.send_notif, peer, payload)

    def inflight(self) -> int:
        return len(self._inflight)

    def settled(self) -> set[XferTicket] | None:
        """Tickets whose transfer may have left PROC (None: unknown, every ticket must be polled).
        Only the native executor knows: its thread polled them and queued the outcome."""
        settled = getattr(self._nixl, "settled", None)
        if settled is None:
            return None
        cookies = settled()
        if not cookies:
            return set()
        return {t for t in list(self._inflight.values()) if getattr(t.handle, "cookie", 0) in cookies}

    def fence_engine(self) -> Any:
        """The native engine that watches copy fences (backends/copy_fences.py); None on the
        Python executor (its copies are polled)."""
        return self._nixl if self.executor == "native" else None

    def wait_events(self, timeout_s: float, hot: bool | None = None, fd: int = -1) -> int | None:
        """Sleep until the native engine has news (truthy: what woke it, native.py WOKE_*) or the
        timeout passed (0); None when the executor has nothing to wait on (the caller sleeps its
        own way). ``hot``: a room this rank receives is in flight (the engine polls for
        notifications at its in-flight pace). ``fd``: another wake-up (the control plane's
        inbox) that ends the sleep as well."""
        wait = getattr(self._nixl, "wait", None)
        if wait is None:
            return None
        return wait(timeout_s, hot) if fd < 0 else wait(timeout_s, hot, fd)

    # ---- teardown -----------------------------------------------------------------------
    def close(self, settle_s: float = 2.0) -> None:
        """Handles, then prepared lists, then remote agents, then memory (NIXL's order)."""
        if self._closed:
            return
        self._settle(lambda t: True, settle_s)
        stop = getattr(self._nixl, "stop", None)
        if stop is not None:
            stop()  # the native thread lets go of the agent before anything is released
        with self._tables.write():
            self._closed = True
            for t in list(self._inflight.values()):
                self._release(t, "ERR")
            self._drop_prepared_locked(None)
            for name in list(self._peers):
                peer = self._peers[name]
                for h in peer.prepped.values():
                    self._quiet(h.release)
                peer.prepped.clear()
            for name, (peer, _) in list(self._draining.items()):
                self._forget_locked(name, peer, invalidate=False)
                self._peers.setdefault(name, peer)  # disconnected below with the others
            self._draining.clear()
            for h in self._local_prepped.values():
                self._quiet(h.release)
            self._local_prepped.clear()
            for name in list(self._peers):
                self._quiet(self._nixl.remove_remote_agent, name)
            self._peers.clear()
            for descs in self._reg_descs:
                self._quiet(self._nixl.deregister_memory, descs)
            self._reg_descs.clear()
            destroy = getattr(self._nixl, "destroy", None)
            if destroy is not None:
                self._quiet(destroy)

    def _settle(self, match: Callable[[XferTicket], bool], settle_s: float) -> None:
        """Let in-flight transfers finish before their handles go: a posted RDMA op cannot be
        cancelled, and releasing a busy handle makes NIXL try (and maybe fail) to abort it."""
        end = time.monotonic() + settle_s
        while time.monotonic() < end:
            busy = [t for t in list(self._inflight.values()) if match(t)]
            if not busy:
                return
            for t in busy:
                self.poll(t)
            time.sleep(0.001)

    # ---- helpers ------------------------------------------------------------------------
    def _release(self, ticket: XferTicket, state: str) -> None:
        # Whoever pops the ticket releases it, exactly once.
        if self._inflight.pop(ticket.xid, None) is None:
            return
        ticket.final = state
        wall = time.monotonic_ns() - ticket.t0_ns
        start = post = xfer = 0
        posted = -1
        if self._capture:
            try:
                tel = self._nixl.get_xfer_telemetry(ticket.handle)
                start, post, xfer = int(tel.startTime), int(tel.postDuration), int(tel.xferDuration)
                posted = int(tel.descCount)
            except Exception:  # no telemetry for failed requests
                pass
        self._quiet(self._nixl.release_xfer_handle, ticket.handle)
        self.telemetry.record(
            XferRecord(
                ticket.peer, ticket.op, state, ticket.descs, posted, ticket.nbytes, start, post, xfer, wall
            )
        )

    @staticmethod
    def _call(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            result = fn(*args)
        except (DescriptorError, RegionError, NixlError):
            raise
        except Exception as exc:
            raise NixlError(f"{getattr(fn, '__name__', fn)}: {type(exc).__name__}: {exc}") from exc
        if result is None and getattr(fn, "__name__", "") in ("prep_xfer_dlist", "register_memory"):
            raise NixlError(f"{fn.__name__} returned nothing")
        return result

    @staticmethod
    def _quiet(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # teardown goes on; the leak is logged, not fatal
            log.warning("teardown step %s failed: %r", getattr(fn, "__name__", fn), exc)
