"""The simulated fabric: nodes with NICs, links between them, RDMA transfers and a control channel.

Time is SimPy's integer-ns clock. Every delay is computed in integers and every random choice
comes from the RNG passed in, so a run is a pure function of its seed.

Transfer model, per post:
1. Posting costs ``post_cost + per_desc * descriptors`` on the initiator's NIC, serialised per NIC
   (descriptors after NIXL-style dense-run merging when the fabric uses prepared lists). With
   ``shared_desc`` set, a node posts through its device as well: a descriptor costs
   ``max(per_desc, k * shared_desc)``, k the nodes of that device posting when the post begins
   (one device for every node with ``FabricSpec.one_gpu``, the bench's layout; else one a node).
   A READ's descriptors cost ``read_desc`` instead of ``per_desc`` where it is set.
2. At most ``max_inflight`` transfers per initiating NIC are active; later ones queue in order.
3. Active transfers share bandwidth: a transfer moves at
   ``min(src_bw / active_out(src), dst_bw / active_in(dst)) * link_factor``, recomputed whenever a
   transfer starts or ends. A host-to-host transfer (pinned buffers at both ends) is capped, when
   ``host_bandwidth`` is set, at that rate over its initiator's active host transfers, and, when
   ``host_shared_bandwidth`` is set, at that rate over the active host transfers of its host (every
   node's with ``one_gpu``; else those of the nodes ``add_node`` placed on the same host).
4. When its last byte has left, the data lands after ``latency + jitter``: bytes are copied then
   (read from the source at that moment), then the notification is delivered, and the initiator
   sees DONE one latency later. ``completion_delay`` (0 by default) delays both: the time a real
   runtime takes to pick a notification or a completion up (its data thread's next poll).
A transfer into a dead or restarted peer, or over a down link, ends in ERR after the NIC's error
timeout and writes nothing; an injected ERR may leave a prefix of its descriptors written, as a
real failed RDMA write may.

Nothing here interrupts a SimPy process. Arrivals (control messages, notifications) are kept in
per-node lists that the transport drains; wake-ups are tokens in the node's inbox Store, or a
callback (``Node.waker``) when the runtime installs one.
So a token consumed by a ``Store.get()`` whose process then stops loses no data (SimPy's lost-item
pitfall), and a crashed node's processes notice the crash on their next wake-up and exit.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import simpy
from kvferry.backends.simfabric.calls import call_after
from kvferry.backends.simfabric.descriptors import SMALL, DescList, gather_index, merge_dense_runs
from kvferry.backends.simfabric.errors import NodeDownError, UnknownPeerError
from kvferry.backends.simfabric.faultapi import NoFaults
from kvferry.backends.simfabric.memory import FakeMemory
from kvferry.backends.simfabric.spec import NS_PER_S, FabricSpec, NicSpec
from kvferry.core.flows.regions import PINNED_REGION
from kvferry.core.identity_enum import IdentityEnum
from kvferry.core.messages import PullOffer, StagingReq, StagingRsp, TransferInfo, Watermark

Recorder = Callable[..., None]


def _no_record(kind: str, node: str, **attrs: Any) -> None:
    return None


class XferState(IdentityEnum):
    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


# The members as plain module names: under Python 3.11 every ``XferState.PROC`` read goes through
# EnumType.__getattr__'s slow attribute hook (about ten times a global's cost), several per write.
_PROC, _DONE, _ERR = XferState.PROC, XferState.DONE, XferState.ERR

# A retired transfer's trace kind ("xfer_done", "xfer_err"), without ``Enum.value``'s property call.
_RETIRED = {s: "xfer_" + s.value.lower() for s in XferState}


@dataclass(slots=True)
class Xfer:
    xid: int
    initiator: str
    src: str  # node whose memory is read
    dst: str  # node whose memory is written
    descs: DescList
    notif: bytes | None
    tag: Any
    src_inc: int
    dst_inc: int
    posted_ns: int
    charged_descs: int
    inject_err: bool
    state: XferState = _PROC
    remaining: int = 0
    started_ns: int = -1
    finish_at: int = -1
    landed_ns: int = -1
    done_ns: int = -1
    err_reason: str = ""
    active: bool = False
    weight: int = 1  # copies of ``descs`` the post stands for (Fabric._weight)
    host_bps: int = 0  # a host-to-host transfer's wire (NicSpec.host_bandwidth_bps); 0: the NIC's
    # Its link, looked up once at the post (links are made once and changed in place): the
    # bandwidth recomputations read it for every active transfer.
    link: Link | None = None


@dataclass(slots=True)
class Node:
    name: str
    nic: NicSpec
    skew_ns: int = 0
    incarnation: int = 0
    up: bool = True
    memory: FakeMemory = field(init=False)
    inbox: simpy.Store = field(init=False)
    # Set by a runtime that wants wake-ups as a callback instead of Store tokens (cheaper: no
    # get/put machinery per message). Cleared on a crash.
    waker: Callable[[Any], None] | None = None
    notifs: list[tuple[str, bytes]] = field(default_factory=list)
    control: list[tuple[str, bytes]] = field(default_factory=list)
    post_busy_until: int = 0
    active_out: int = 0
    active_in: int = 0
    queued: deque[int] = field(default_factory=deque)
    inflight: int = 0
    active_host: int = 0  # this initiator's active host-to-host transfers (they share its host wire)
    host: str = ""  # the host whose memory its host copies share (NicSpec.host_shared_bandwidth_bps)
    # Its runtime thread does one thing at a time: control messages (ControlSpec.handle_ns and
    # staging_handle_ns) and copy submits (KernelSpec.submit_ns) queue behind each other.
    host_busy_until: int = 0
    handles: set[int] = field(default_factory=set)
    # Handles of this initiator that left PROC and were not released yet: what a poll must look at.
    settled: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Link:
    up: bool = True
    # Bandwidth multiplier as a fraction num/den so the arithmetic stays integer.
    slow_num: int = 1
    slow_den: int = 1


@dataclass(slots=True)
class FabricStats:
    posts: int = 0
    descriptors_posted: int = 0
    descriptors_charged: int = 0
    bytes_landed: int = 0
    transfers_done: int = 0
    transfers_err: int = 0
    notifs_delivered: int = 0
    notifs_dropped: int = 0
    control_sent: int = 0
    control_delivered: int = 0
    control_dropped: int = 0
    control_duplicated: int = 0


class Fabric:
    """All nodes, links and in-flight operations of one simulated world."""

    def __init__(
        self,
        env: simpy.Environment,
        spec: FabricSpec,
        rng: random.Random,
        faults: Any = None,
        record: Recorder = _no_record,
    ) -> None:
        spec.validate()
        self.env = env
        self.spec = spec
        self.rng = rng
        self.faults = faults if faults is not None else NoFaults()
        self.record = record
        self.nodes: dict[str, Node] = {}
        self.links: dict[tuple[str, str], Link] = {}
        self.xfers: dict[int, Xfer] = {}
        self.stats = FabricStats()
        self.write_latencies: list[int] = []
        self._next_xid = 1
        self._gen = 0
        self._active: list[int] = []  # xids in start order, so recomputation order is fixed
        self._host_active: dict[str, int] = {}  # active host-to-host transfers of each host
        self._last_progress = 0
        # Called with (xfer) just before a transfer's bytes land; the world uses it to check that
        # the writer owns the destination.
        self.on_land: Callable[[Xfer], None] | None = None
        # Called with ("sent" | "delivered", src, dst, payload) for every control message sent
        # and every copy handed to its receiver (a sent message never delivered was dropped);
        # the world derives per-room reachability from it. Returning False on "delivered" makes
        # the receiver ignore that copy (only the simulator's planted bugs do).
        self.on_control: Callable[[str, str, str, bytes], bool] | None = None
        # Whether a room runs the push flow (NicSpec.push_handle_ns); the world that opens the
        # rooms knows, a TransferInfo does not say.
        self.push_room: Callable[[int], bool] | None = None

    # ------------------------------------------------------------------ nodes and links
    def add_node(self, name: str, nic: NicSpec | None = None, skew_ns: int = 0, host: str = "") -> Node:
        """``host``: the machine the node runs on (its server; default: a host of its own); with
        ``FabricSpec.one_gpu`` every node is on one GPU of one host whatever it says."""
        if name in self.nodes:
            raise ValueError(f"node {name} exists")
        node = Node(name=name, nic=nic or self.spec.nic, skew_ns=skew_ns)
        node.host = "host0" if self.spec.one_gpu else host or name
        node.memory = FakeMemory(name)
        node.inbox = simpy.Store(self.env)
        self.nodes[name] = node
        return node

    def node(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise UnknownPeerError(f"unknown node {name!r}") from None

    def link(self, a: str, b: str) -> Link:
        key = (a, b) if a <= b else (b, a)
        link = self.links.get(key)
        if link is None:
            link = self.links[key] = Link()
        return link

    def clock(self, name: str) -> int:
        """The node's local clock: virtual time plus its skew (never negative)."""
        return self.node_clock(self.nodes[name])

    def node_clock(self, node: Node) -> int:
        """``clock`` of a node already in hand (a rank asks at every event: no lookup by name)."""
        t = int(self.env._now) + node.skew_ns
        return t if t > 0 else 0

    def wake(self, name: str, item: Any) -> None:
        node = self.nodes[name]
        if node.up:
            self._signal(node, item)

    @staticmethod
    def _signal(node: Node, item: Any) -> None:
        if node.waker is not None:
            node.waker(item)
        else:
            node.inbox.put(item)

    def crash(self, name: str) -> None:
        """Memory, registrations, notifications, handles and the inbox of the node are lost."""
        node = self.node(name)
        if not node.up:
            return
        self.record("crash", name, incarnation=node.incarnation)
        node.up = False
        node.memory.wipe()
        node.notifs.clear()
        node.control.clear()
        # Transfers this node initiated die with it; their source memory is gone.
        for xid in sorted(node.handles):
            x = self.xfers.get(xid)
            if x is not None and x.state is _PROC:
                self._retire(x, _ERR, "initiator crashed", silent=True)
            self.xfers.pop(xid, None)
        node.handles.clear()
        node.settled.clear()
        node.queued.clear()
        node.inflight = 0
        old_inbox, old_waker = node.inbox, node.waker
        node.inbox = simpy.Store(self.env)
        node.waker = None
        # Wake whatever waits on the old inbox so its process sees the crash and exits.
        if old_waker is not None:
            old_waker(("crashed", node.incarnation))
        else:
            old_inbox.put(("crashed", node.incarnation))
        self._reschedule()

    def restart(self, name: str) -> None:
        node = self.node(name)
        if node.up:
            return
        node.incarnation += 1
        node.up = True
        node.post_busy_until = int(self.env._now)
        self.record("restart", name, incarnation=node.incarnation)

    def set_link(self, a: str, b: str, up: bool) -> None:
        link = self.link(a, b)
        if link.up == up:
            return
        link.up = up
        self.record("link_up" if up else "link_down", a, peer=b)
        if not up:
            for xid in list(self._active) + [x for n in self.nodes.values() for x in n.queued]:
                x = self.xfers.get(xid)
                if x is not None and x.state is _PROC and {x.src, x.dst} == {a, b}:
                    self._fail_later(x, "link down")
        self._reschedule()

    def set_link_speed(self, a: str, b: str, num: int, den: int) -> None:
        if num <= 0 or den <= 0:
            raise ValueError("link speed fraction must be positive")
        self._advance()
        link = self.link(a, b)
        link.slow_num, link.slow_den = num, den
        self.record("link_speed", a, peer=b, num=num, den=den)
        self._reschedule()

    # ------------------------------------------------------------------ memory
    def register(self, name: str, region_id: int, nbytes: int) -> np.ndarray:
        node = self.node(name)
        if not node.up:
            raise NodeDownError(f"{name} is down")
        return node.memory.register(region_id, nbytes)

    def deregister(self, name: str, region_id: int) -> None:
        self.node(name).memory.deregister(region_id)

    # ------------------------------------------------------------------ transfers
    def post(
        self,
        initiator: str,
        src: str,
        dst: str,
        descs: DescList,
        notif: bytes | None,
        tag: Any = None,
        dst_incarnation: int | None = None,
    ) -> int:
        """Post one transfer; returns its handle. Refuses descriptors outside registered memory.

        ``dst_incarnation`` (or the source's, for a READ) is the peer incarnation whose metadata
        the initiator loaded: a transfer aimed at an older incarnation fails with ERR.
        """
        now = int(self.env._now)
        nodes = self.nodes  # ``node`` inline (three per post); it raises for a name not there
        ini = nodes.get(initiator) or self.node(initiator)
        if not ini.up:
            raise NodeDownError(f"{initiator} is down")
        s, d = nodes.get(src) or self.node(src), nodes.get(dst) or self.node(dst)
        peer = d if initiator == src else s
        peer_inc = peer.incarnation if dst_incarnation is None else dst_incarnation
        # The local side is checked against live registrations; the remote side against the
        # peer's registrations when it is the incarnation we hold metadata for (NIXL checks the
        # loaded remote metadata, which matches the peer until it restarts).
        writes = initiator == src
        (s if writes else d).memory.check_descs(descs, dst=not writes)
        if peer.up and peer.incarnation == peer_inc:
            peer.memory.check_descs(descs, dst=writes)
        weight = self._weight(descs)
        n = descs.count
        charged = (merge_dense_runs(descs).count if self.spec.prepped else n) * weight
        xid = self._next_xid
        self._next_xid += 1
        x = Xfer(
            xid=xid,
            initiator=initiator,
            src=src,
            dst=dst,
            descs=descs,
            notif=notif,
            tag=tag,
            src_inc=s.incarnation if initiator == src else peer_inc,
            dst_inc=d.incarnation if initiator == dst else peer_inc,
            posted_ns=now,
            charged_descs=charged,
            inject_err=self.faults.transfer_err(src, dst, now),
            remaining=descs.total_bytes * weight,
            weight=weight,
            link=self.link(src, dst),
        )
        self.xfers[xid] = x
        ini.handles.add(xid)
        self.stats.posts += 1
        self.stats.descriptors_posted += n * weight
        self.stats.descriptors_charged += charged
        nic = ini.nic
        begin = max(now, ini.post_busy_until)
        # A READ (the initiator is the destination) posts at its own cost where the NIC has one.
        per_desc = nic.per_desc_ns if writes or not nic.read_desc_ns else nic.read_desc_ns
        if nic.shared_desc_ns:  # k nodes posting through one device: each gets 1/k of it
            per_desc = max(per_desc, nic.shared_desc_ns * self._posting_on_device(ini, begin))
        ready = begin + nic.post_cost_ns + per_desc * charged
        if nic.host_bandwidth_bps and _host_to_host(descs):
            x.host_bps = nic.host_bandwidth_bps
        ini.post_busy_until = ready
        self.record(
            "post",
            initiator,
            xid=xid,
            src=src,
            dst=dst,
            descs=n * weight,
            charged=charged,
            nbytes=x.remaining,
            tag=tag,
        )
        self._at(ready - now, self._admit, x)
        return xid

    def _posting_on_device(self, ini: Node, begin: int) -> int:
        """Nodes posting through ``ini``'s device when it begins to (itself included): the
        device's descriptor work is split among them (a post already under way keeps its end)."""
        if not self.spec.one_gpu:  # a device of its own
            return 1
        return 1 + sum(
            1
            for n in self.nodes.values()
            if n is not ini and n.nic.shared_desc_ns and n.post_busy_until > begin
        )

    def _weight(self, descs: DescList) -> int:
        """How many copies of ``descs`` one post stands for, in cost and bytes: 1 here; a
        timing-only deployment posts one layer's descriptors for every layer (sim/deploy/timing.py)."""
        return 1

    def state(self, initiator: str, xid: int) -> XferState:
        node = self.node(initiator)
        if xid not in node.handles:
            raise UnknownPeerError(f"{initiator}: no transfer handle {xid}")
        return self.xfers[xid].state

    def release(self, initiator: str, xid: int) -> None:
        """Forget a handle (NIXL release_xfer_handle). A PROC transfer keeps running to its end."""
        node = self.node(initiator)
        node.handles.discard(xid)
        node.settled.discard(xid)
        x = self.xfers.get(xid)
        if x is not None and x.state is not _PROC:
            del self.xfers[xid]

    def send_notif(self, src: str, dst: str, payload: bytes, tag: Any = None) -> None:
        """A notification with no data (NIXL send_notif), over the data path."""
        now = int(self.env._now)
        s = self.node(src)
        if not s.up:
            raise NodeDownError(f"{src} is down")
        d = self.node(dst)
        if not self.link(src, dst).up:  # no path: lost, as a control message would be
            self.stats.notifs_dropped += 1
            self.record("notif_drop", dst, src=src, tag=tag)
            return
        delay = s.nic.latency_ns + self._jitter(s.nic.jitter_ns) + d.nic.completion_delay_ns
        inc = d.incarnation
        self._at(delay, self._deliver_notif, src, dst, inc, payload, tag)
        self.record("notif_send", src, dst=dst, tag=tag, at=now)

    def drain_notifs(self, name: str) -> list[tuple[str, bytes]]:
        node = self.node(name)
        out, node.notifs = node.notifs, []
        return out

    def drain_control(self, name: str) -> list[tuple[str, bytes]]:
        node = self.node(name)
        out, node.control = node.control, []
        return out

    # ------------------------------------------------------------------ control channel
    def send_control(self, src: str, dst: str, payload: bytes, tag: Any = None) -> None:
        nodes = self.nodes  # ``node`` inline; it raises for a name not there
        s = nodes.get(src) or self.node(src)
        if not s.up:
            raise NodeDownError(f"{src} is down")
        if dst not in nodes:
            self.node(dst)
        now = int(self.env._now)
        self.stats.control_sent += 1
        if self.on_control is not None:
            self.on_control("sent", src, dst, payload)
        if not self.link(src, dst).up:
            self.stats.control_dropped += 1
            self.record("ctrl_drop", src, dst=dst, why="link down", tag=tag)
            return
        fate = self.faults.control_fate(src, dst, now)
        if fate.dropped:
            self.stats.control_dropped += 1
            self.record("ctrl_drop", src, dst=dst, why="fault", tag=tag)
            return
        if len(fate.extra_delays_ns) > 1:
            self.stats.control_duplicated += len(fate.extra_delays_ns) - 1
        spec = self.spec.control
        sent = 0
        if spec.send_ns:  # the send holds the sender's runtime thread (ControlSpec.send_ns)
            s.host_busy_until = max(now, s.host_busy_until) + spec.send_ns
            sent = s.host_busy_until - now
        for extra in fate.extra_delays_ns:
            delay = sent + spec.latency_ns + self._jitter(spec.jitter_ns) + extra
            self._at(delay, self._deliver_control, src, dst, payload, tag)

    def _deliver_control(self, src: str, dst: str, payload: bytes, tag: Any) -> None:
        d = self.nodes[dst]
        if not d.up or not self.link(src, dst).up:
            self.stats.control_dropped += 1
            self.record("ctrl_drop", dst, src=src, why="receiver down" if not d.up else "link down", tag=tag)
            return
        handle = self.spec.control.handle_ns
        if self.spec.control.staging_handle_ns or d.nic.room_handle_ns or d.nic.push_handle_ns:
            handle += self._kind_work(payload, d.nic)
        now = int(self.env._now)
        # queue behind what this node's runtime thread is still doing (messages, copy submits)
        if handle or d.host_busy_until > now:
            d.host_busy_until = max(now, d.host_busy_until) + handle
            self._at(d.host_busy_until - now, self._hand_control, src, dst, d.incarnation, payload, tag)
            return
        self._hand_control(src, dst, d.incarnation, payload, tag)

    def _kind_work(self, payload: bytes, nic: NicSpec) -> int:
        """The host work a control message's kind adds on its receiver's runtime thread: a staged
        flow's StagingReq, StagingRsp or Watermark (ControlSpec.staging_handle_ns); a TransferInfo
        or PullOffer, the room's plan (NicSpec.room_handle_ns), and a push room's TransferInfo,
        decode's PUSH_REG, on top (NicSpec.push_handle_ns). Its head is decoded once for all."""
        try:
            head = _head_decoder.decode(payload)
        except msgspec.DecodeError:
            return 0  # not a message of ours (a fault may garble one): no extra work
        if head.t in _STAGING_TAGS:
            return self.spec.control.staging_handle_ns
        if head.t not in _ROOM_TAGS:
            return 0
        work = nic.room_handle_ns
        push_room = self.push_room
        if (
            nic.push_handle_ns
            and head.t == _INFO_TAG
            and push_room is not None
            and type(head.room) is int
            and push_room(head.room)
        ):
            work += nic.push_handle_ns
        return work

    def _hand_control(self, src: str, dst: str, inc: int, payload: bytes, tag: Any) -> None:
        d = self.nodes[dst]
        if not d.up or d.incarnation != inc:
            self.stats.control_dropped += 1
            self.record("ctrl_drop", dst, src=src, why="receiver down", tag=tag)
            return
        self.stats.control_delivered += 1
        if self.on_control is not None and self.on_control("delivered", src, dst, payload) is False:
            return
        d.control.append((src, payload))
        self._signal(d, ("ctrl", src))

    # ------------------------------------------------------------------ internals
    def _jitter(self, jitter_ns: int) -> int:
        return self.rng.randrange(jitter_ns) if jitter_ns > 0 else 0

    def _at(self, delay: int, fn: Callable[..., None], *args: Any) -> None:
        call_after(self.env, max(0, int(delay)), fn, *args)

    def _admit(self, x: Xfer) -> None:
        if x.state is not _PROC:
            return
        ini = self.nodes[x.initiator]
        if ini.inflight >= ini.nic.max_inflight:
            ini.queued.append(x.xid)
            return
        self._start(x)

    def _start(self, x: Xfer) -> None:
        ini = self.nodes[x.initiator]
        ini.inflight += 1
        x.started_ns = int(self.env._now)
        if not x.link.up:  # type: ignore[union-attr]
            self._fail_later(x, "link down")
            return
        self._advance()
        x.active = True
        if x.host_bps:
            ini.active_host += 1
            self._host_active[ini.host] = self._host_active.get(ini.host, 0) + 1
        self.nodes[x.src].active_out += 1
        self.nodes[x.dst].active_in += 1
        self._active.append(x.xid)
        self._reschedule()

    def _rate(self, x: Xfer) -> int:
        s, d = self.nodes[x.src], self.nodes[x.dst]
        link = x.link
        rate = min(s.nic.bandwidth_bps // max(1, s.active_out), d.nic.bandwidth_bps // max(1, d.active_in))
        if x.host_bps:
            ini = self.nodes[x.initiator]
            rate = min(rate, x.host_bps // max(1, ini.active_host))
            if ini.nic.host_shared_bandwidth_bps:  # a host's processes' copies share its memory
                rate = min(rate, ini.nic.host_shared_bandwidth_bps // max(1, self._host_active[ini.host]))
        return max(1, rate * link.slow_num // link.slow_den)  # type: ignore[union-attr]

    def _advance(self) -> None:
        """Move every active transfer's byte count to the current time."""
        now = int(self.env._now)
        dt = now - self._last_progress
        self._last_progress = now
        if dt <= 0:
            return
        for xid in self._active:
            x = self.xfers[xid]
            x.remaining = max(0, x.remaining - dt * self._rate(x) // NS_PER_S)

    def _reschedule(self) -> None:
        self._advance()
        now = int(self.env._now)
        self._gen += 1
        gen = self._gen
        soonest = -1
        for xid in self._active:
            x = self.xfers[xid]
            rate = self._rate(x)
            x.finish_at = now + -(-x.remaining * NS_PER_S // rate)
            if soonest < 0 or x.finish_at < soonest:
                soonest = x.finish_at
        if soonest >= 0:
            self._at(soonest - now, self._on_timer, gen)

    def _on_timer(self, gen: int) -> None:
        if gen != self._gen:
            return  # superseded by a later recomputation
        self._advance()
        now = int(self.env._now)
        finished = [xid for xid in self._active if self.xfers[xid].finish_at <= now]
        for xid in finished:
            x = self.xfers[xid]
            x.remaining = 0
            self._deactivate(x)
            nic = self.nodes[x.initiator].nic
            delay = nic.latency_ns + self._jitter(nic.jitter_ns)
            self._at(delay, self._land, x)
        self._reschedule()

    def _deactivate(self, x: Xfer) -> None:
        if not x.active:
            return
        x.active = False
        if x.host_bps:
            ini = self.nodes[x.initiator]
            ini.active_host -= 1
            self._host_active[ini.host] -= 1
        self._active.remove(x.xid)
        self.nodes[x.src].active_out -= 1
        self.nodes[x.dst].active_in -= 1

    def _free_slot(self, x: Xfer) -> None:
        ini = self.nodes[x.initiator]
        if ini.incarnation != (x.src_inc if x.initiator == x.src else x.dst_inc) or not ini.up:
            return
        ini.inflight -= 1
        while ini.queued and ini.inflight < ini.nic.max_inflight:
            nxt = self.xfers.get(ini.queued.popleft())
            if nxt is not None and nxt.state is _PROC:
                self._start(nxt)

    def _peer_gone(self, x: Xfer) -> str:
        s, d = self.nodes[x.src], self.nodes[x.dst]
        if not s.up or s.incarnation != x.src_inc:
            return f"{x.src} restarted or down"
        if not d.up or d.incarnation != x.dst_inc:
            return f"{x.dst} restarted or down"
        if not x.link.up:  # type: ignore[union-attr]
            return "link down"
        return ""

    def _land(self, x: Xfer) -> None:
        if x.state is not _PROC:
            return
        gone = self._peer_gone(x)
        if gone:
            self._fail_later(x, gone, already_waited=False)
            return
        descs = x.descs
        if x.inject_err:
            # A failed write may have placed any prefix of its descriptors.
            keep = self.rng.randrange(descs.count + 1) if descs.count else 0
            descs = DescList(*(a[:keep] for a in descs.columns()))
        if self.on_land is not None:
            self.on_land(x)
        self._copy(x, descs)
        x.landed_ns = int(self.env._now)
        if x.inject_err:
            self.record("xfer_err_injected", x.initiator, xid=x.xid, written=descs.count, tag=x.tag)
            self._retire(x, _ERR, "injected transfer error")
            return
        self.stats.bytes_landed += descs.total_bytes * x.weight
        if x.notif is not None:
            target = x.dst if x.initiator == x.src else x.src
            pickup = self.nodes[target].nic.completion_delay_ns
            notif = x.notif
            if pickup > 0:  # the target's runtime sees the notification on its next poll
                self._at(pickup, self._deliver_notif, x.initiator, target, None, notif, x.tag)
            else:
                self._deliver_notif(x.initiator, target, None, notif, x.tag)
        nic = self.nodes[x.initiator].nic
        done = self._handle_done if nic.completion_handle_ns else self._retire
        self._at(nic.latency_ns + nic.completion_delay_ns, done, x, _DONE, "")

    def _handle_done(self, x: Xfer, state: XferState, reason: str) -> None:
        """The initiator's runtime thread handles a DONE after its other work (completion_handle_ns)."""
        node, now = self.nodes[x.initiator], int(self.env._now)
        node.host_busy_until = max(now, node.host_busy_until) + node.nic.completion_handle_ns
        self._at(node.host_busy_until - now, self._retire, x, state, reason)

    def _copy(self, x: Xfer, descs: DescList) -> None:
        if descs.count == 0:
            return
        smem, dmem = self.nodes[x.src].memory, self.nodes[x.dst].memory
        if descs.count <= SMALL:
            self._copy_small(smem, dmem, descs)
            return
        sr, dr = descs.src_region, descs.dst_region
        # Group consecutive descriptors of the same (src region, dst region) pair: planner output
        # is sorted by region, so this is one numpy copy per region, in descriptor order.
        change = np.flatnonzero((sr[1:] != sr[:-1]) | (dr[1:] != dr[:-1])) + 1
        bounds = [0, *change.tolist(), descs.count]
        for a, b in itertools.pairwise(bounds):
            dst, src = dmem.region(int(dr[a])), smem.region(int(sr[a]))
            if b - a <= 8:
                # Few long runs (coalesced plans): slice copies beat building index arrays.
                for so, do, n in zip(
                    descs.src_offset[a:b].tolist(),
                    descs.dst_offset[a:b].tolist(),
                    descs.length[a:b].tolist(),
                    strict=True,
                ):
                    dst[do : do + n] = src[so : so + n]
                continue
            length = descs.length[a:b]
            dst[gather_index(descs.dst_offset[a:b], length)] = src[
                gather_index(descs.src_offset[a:b], length)
            ]

    @staticmethod
    def _copy_small(smem: FakeMemory, dmem: FakeMemory, descs: DescList) -> None:
        """``_copy`` of a few descriptors: one slice copy each, in descriptor order (the same
        bytes land as through the grouped copies; numpy's per-call cost exceeds the work)."""
        dregs, sregs = dmem.by_id, smem.by_id
        for sr, so, dr, do, n in descs.rows():
            # From the tables (no call per descriptor); ``region`` refuses a missing one. The
            # destination is looked up before the source, as ``_copy`` does.
            dst = dregs.get(dr)
            if dst is None:
                dst = dmem.region(dr)
            src = sregs.get(sr)
            if src is None:
                src = smem.region(sr)
            dst[do : do + n] = src[so : so + n]

    def _deliver_notif(self, src: str, dst: str, inc: int | None, payload: bytes, tag: Any) -> None:
        now = int(self.env._now)
        fate = self.faults.notif_fate(src, dst, now)
        if fate.dropped:
            self.stats.notifs_dropped += 1
            self.record("notif_drop", dst, src=src, tag=tag)
            return

        def put() -> None:
            d = self.nodes[dst]
            if not d.up or (inc is not None and d.incarnation != inc):
                self.stats.notifs_dropped += 1
                return
            if d.nic.completion_handle_ns:  # its runtime thread handles it after what it is doing
                t = int(self.env.now)
                d.host_busy_until = max(t, d.host_busy_until) + d.nic.completion_handle_ns
                self._at(d.host_busy_until - t, self._handled_notif, src, dst, d.incarnation, payload)
                return
            d.notifs.append((src, payload))
            self.stats.notifs_delivered += 1
            self._signal(d, ("notif", src))

        if fate.extra_delay_ns > 0:
            self._at(fate.extra_delay_ns, put)
        else:
            put()

    def _handled_notif(self, src: str, dst: str, inc: int, payload: bytes) -> None:
        d = self.nodes[dst]
        if not d.up or d.incarnation != inc:
            self.stats.notifs_dropped += 1
            return
        d.notifs.append((src, payload))
        self.stats.notifs_delivered += 1
        self._signal(d, ("notif", src))

    def _fail_later(self, x: Xfer, reason: str, already_waited: bool = False) -> None:
        """ERR after the NIC's error timeout, the way a dead peer shows up on a real NIC."""
        if x.active:
            self._advance()
            self._deactivate(x)
        x.err_reason = reason
        nic = self.nodes[x.initiator].nic
        self._at(0 if already_waited else nic.error_timeout_ns, lambda: self._retire(x, _ERR, reason))

    def _retire(self, x: Xfer, state: XferState, reason: str, silent: bool = False) -> None:
        if x.state is not _PROC:
            return
        if x.active:
            self._deactivate(x)
            self._reschedule()
        x.state = state
        x.err_reason = reason
        x.done_ns = int(self.env._now)
        self.nodes[x.initiator].settled.add(x.xid)
        if x.started_ns >= 0:
            self._free_slot(x)
        if state is _DONE:
            self.stats.transfers_done += 1
            self.write_latencies.append(x.done_ns - x.posted_ns)
        else:
            self.stats.transfers_err += 1
        self.record(
            _RETIRED[state],
            x.initiator,
            xid=x.xid,
            reason=reason,
            tag=x.tag,
            posted=x.posted_ns,
        )
        ini = self.nodes[x.initiator]
        if x.xid not in ini.handles:
            self.xfers.pop(x.xid, None)
        if not silent:
            self.wake(x.initiator, ("xfer", x.xid))

    # ------------------------------------------------------------------ introspection
    def open_handles(self) -> dict[str, int]:
        return {name: len(n.handles) for name, n in self.nodes.items() if n.handles}

    def in_flight(self) -> int:
        return sum(1 for x in self.xfers.values() if x.state is _PROC)


def _host_to_host(descs: DescList) -> bool:
    """Every descriptor between pinned host buffers (the pinned flow's bounce pools)."""
    return (
        bool(descs.count)
        and bool((descs.src_region == PINNED_REGION).all())
        and bool((descs.dst_region == PINNED_REGION).all())
    )


class _Head(msgspec.Struct):
    """A control message's tag and room alone, its other fields skipped (``room`` as sent: only
    a TransferInfo's is read)."""

    t: str = ""
    room: Any = None


_head_decoder = msgspec.msgpack.Decoder(_Head)
_STAGING_TAGS = frozenset(m.__struct_config__.tag for m in (StagingReq, StagingRsp, Watermark))
_ROOM_TAGS = frozenset(m.__struct_config__.tag for m in (TransferInfo, PullOffer))
_INFO_TAG = TransferInfo.__struct_config__.tag
