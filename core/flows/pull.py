"""The pull flow, both halves: decode READs prefill's pages, then lets prefill free them.

Prefill half (``PullSender``, composed into the sender room machine): running a chunk posts no
data write; it offers the chunk's pages to every data decode rank (``PullOffer``, resent each
heartbeat interval until ``Pulled``) and the room stays Transferring until every offered chunk
was pulled. A failed pull room keeps its pages (the room is not dropped, so the scheduler cannot
free them) until every decode rank that was offered pages said ``ReadsStopped``, restarted (its
READs died with it), or the fence deadline passed: decode may still be reading them.

Decode half (``PullReceiver``, composed into ``ReceiverEngine`` as ``pull_rx``, reaching it only
through its ``ReceiverFlowContext``): READ offered chunks, answer Pulled.
Prefill offers each computed chunk (``PullOffer``: its page ids and its own Register). Decode
loads prefill's agent (``AddPeer``, once per incarnation), plans the chunk with the same planner
as a write (prefill's pages are the source, its own the destination; heterogeneous TP gives
direct slices), posts one ``PostRead`` per (chunk, sender), and on its completion records the
chunk exactly as a write's notification would (same tiling checks) and answers ``Pulled`` so that
prefill may free the pages. A duplicate offer is answered again (its Pulled was lost), or ignored
while its READ runs.

A failed room's pages are freed only once no READ of ours is in flight (a READ writes them), and
then every sender that offered hears ``ReadsStopped``: it may free its pages before its fence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from kvferry.core import messages as m
from kvferry.core.commands import AddPeer, DropPeer, PostRead
from kvferry.core.errors import KvferryError
from kvferry.core.events import WriteDone, WriteFailed
from kvferry.core.flows import registry
from kvferry.core.flows.direct import DIRECT as DIRECT_RECEIVER
from kvferry.core.flows.parts import FlowTable, RankFlowPart, ignore
from kvferry.core.flows.policy import Flow
from kvferry.core.identity_enum import IdentityEnum
from kvferry.core.kvpoll import KVPoll
from kvferry.core.proto_common import RoomError, RoomFailure, RoomStateError, step
from kvferry.core.reliable import Resends

__all__ = [
    "PULL_RX_ROOM_TABLE",
    "PULL_TX_ROOM_TABLE",
    "PullChunkSender",
    "PullReceiver",
    "PullRoom",
    "PullRxIn",
    "PullSender",
    "PullTxIn",
    "ReadInfo",
]


RoomKey = tuple[int, str]


class PullSender(RankFlowPart):
    """Every pull offer of one prefill rank: what was offered per room, what each decode rank
    still owes (it may be reading those pages: they stay ours until it says so or the fence
    expires), and the offers' resends. ``ctx``: the sender's flow context
    (``core.sender.SenderFlowContext``)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.counters = counters = ctx.counters
        self.deadlines = ctx.deadlines
        interval = ctx.timeouts.heartbeat_interval_ns
        self.offers = Resends("pull", self.deadlines, counters, interval, "pull_resent")
        self.offered: dict[RoomKey, list[int]] = {}
        self.owed: dict[RoomKey, dict[m.Endpoint, set[int]]] = {}

    def offer(
        self, room: RoomKey, targets: list[m.Endpoint], offer: m.PullOffer, now: int
    ) -> list[tuple[Any, Any]]:
        """Offer one chunk to ``targets``; the messages to send now."""
        idx = offer.chunk_index
        owed = self.owed.setdefault(room, {})
        for p in targets:
            owed.setdefault(p, set()).add(idx)
        self.offered.setdefault(room, []).append(idx)
        return self.offers.start((room[0], room[1], idx), targets, lambda p: offer, now)

    def answered(self, msg: m.Pulled) -> None:
        self.offers.answered((msg.room, msg.transfer_id, msg.chunk_index), msg.src)

    def pulled(self, room: RoomKey, src: m.Endpoint, chunk_index: int) -> None:
        owed = self.owed.get(room, {}).get(src)
        if owed is not None:
            owed.discard(chunk_index)

    def released_by(self, room: RoomKey, src: m.Endpoint) -> None:
        """``src`` reads no more (ReadsStopped), or restarted (its READs died with it)."""
        self.owed.get(room, {}).pop(src, None)

    def fenced(self, room: RoomKey) -> bool:
        """No decode rank can still be READing this room's pages."""
        owed = self.owed.get(room)
        return not owed or not any(owed.values())

    def cancel(self, room: RoomKey) -> None:
        """Stop resending the room's offers (it failed or is gone)."""
        for idx in self.offered.get(room, ()):
            self.offers.cancel((room[0], room[1], idx))

    # --- the room machine's hooks (core/flows/parts.py) ---------------------------------------------

    def quiet(self, key: RoomKey) -> bool:
        return self.fenced(key)

    def room_failed(self, r: Any) -> None:
        """Offers stop; decode may be READing our pages: they stay until it says it stopped, or
        ``fence_ns``."""
        self.cancel(r.key)
        if not self.fenced(r.key):
            self.deadlines.set(("pfence", r.room), self.ctx.now() + self.ctx.timeouts.fence_ns)

    def forget(self, r: Any) -> None:
        self.deadlines.cancel(("pfence", r.room))
        self.cancel(r.key)
        self.offered.pop(r.key, None)
        self.owed.pop(r.key, None)

    def peer_replaced(self, r: Any, peer: m.Endpoint) -> None:
        self.released_by(r.key, peer)  # its READs of our pages died with the old process

    def routes(self) -> dict[type, Callable[[Any], None]]:
        return {m.Pulled: self._on_pulled, m.ReadsStopped: self._on_reads_stopped}

    def table(self) -> FlowTable:
        return PULL_TX_ROOM_TABLE

    def deadline_kinds(self) -> dict[str, Callable[[Any], None]]:
        return {"pull": self._resend, "pfence": self._fence_deadline}

    def _on_pulled(self, msg: m.Pulled) -> None:
        self.answered(msg)
        self.pulled((msg.room, msg.transfer_id), msg.src, msg.chunk_index)
        self.ctx.flow_input(msg.room, msg.transfer_id, PullTxIn.PULLED, msg)

    def _on_reads_stopped(self, msg: m.ReadsStopped) -> None:
        self.released_by((msg.room, msg.transfer_id), msg.src)
        self.ctx.flow_input(msg.room, msg.transfer_id, PullTxIn.READS_STOPPED, msg)

    # --- the room inputs of PULL_TX_ROOM_TABLE ---------------------------------------------------------

    def _h_pulled(self, r: Any, inp: PullTxIn, msg: m.Pulled) -> str:
        return "done" if self.ctx.quiet(r) else "stay"

    def _h_reads_stopped(self, r: Any, inp: PullTxIn, msg: m.ReadsStopped) -> str:
        reason = f"{msg.src} failed the room and stopped reading"
        self.ctx.fail_room(r, RoomFailure(reason, at_ns=self.ctx.now()))
        return "failed"

    def _h_after_failure(self, r: Any, inp: PullTxIn, msg: Any) -> None:
        pass  # what it says was recorded before the table looked (``_on_pulled``, ``_on_reads_stopped``)

    def _resend(self, key: Any) -> None:
        for p, msg in self.offers.fire(key, self.ctx.now()):
            self.ctx.send(p, msg)

    def _fence_deadline(self, room: int) -> None:
        """The fence deadline of a failed pull room: the decode ranks still alive that may be
        reading are asked again (``fence_due``); look again in a heartbeat interval."""
        ctx = self.ctx
        r = ctx.room(room)
        if r is None or not ctx.is_failed(r) or self.fenced(r.key):
            return
        reason = r.failure.reason if r.failure else "failed"
        ask = self.fence_due(r.key, ctx.peers.__contains__)
        for p in ask:
            ctx.send(p, m.RoomFailed(src=ctx.endpoint, room=r.room, transfer_id=r.tid, reason=reason))
        if ask:
            self.deadlines.set(("pfence", r.room), ctx.now() + ctx.timeouts.heartbeat_interval_ns)
        ctx.settle(r)

    def fence_due(self, room: RoomKey, alive: Callable[[m.Endpoint], bool]) -> list[m.Endpoint]:
        """The fence deadline of a failed pull room: a decode rank that vanished (heartbeat lost)
        cannot be reading; one still alive may have READs queued behind others (a posted READ
        cannot be cancelled): returned, to be asked again (RoomFailed, answered with ReadsStopped
        once its READs drained); the pages stay until it answers or vanishes."""
        owed = self.owed.get(room, {})
        ask = []
        for p in sorted(owed):
            if not owed[p]:
                continue
            if alive(p):
                self.counters["pull_fence_extended"] += 1
                ask.append(p)
            else:
                self.counters["pull_fence_expired"] += 1
                del owed[p]
        return ask

    def mentions(self, room: int) -> bool:
        return any(k[0] == room for k in self.offers.entries)

    def size(self) -> int:
        return len(self.offers.entries)


class ReadInfo:
    """One posted READ: which sender's chunk it moves."""

    __slots__ = ("chunk_index", "is_last", "src", "token_end", "token_start")

    def __init__(self, offer: m.PullOffer) -> None:
        self.src = offer.src
        self.chunk_index = offer.chunk_index
        self.token_start = offer.token_start
        self.token_end = offer.token_end
        self.is_last = offer.is_last

    def note(self, room: int, tid: str) -> m.ChunkNote:
        """The notification a write of this chunk would have carried (for the shared ledger)."""
        return m.ChunkNote(
            room=room,
            transfer_id=tid,
            src=self.src,
            chunk_index=self.chunk_index,
            token_start=self.token_start,
            token_end=self.token_end,
            is_last=self.is_last,
        )


class PullChunkSender:
    """Pull's prefill half of a chunk run (core/flows/registry.py): offer the chunk's pages to
    every data decode rank; they READ, then answer Pulled. Offers and what each rank still owes
    live in the rank's ``PullSender`` (``ctx.pull``)."""

    __slots__ = ()

    def run_chunk(self, ctx: Any, r: Any, c: Any) -> str:
        reg = ctx.registration
        if reg is None:
            raise RoomStateError("pull flow: this prefill rank has no registration to offer")
        start, end = ctx.chunk_bounds(r, c)
        ctx.advance(r, c, end)
        targets = [p for p, info in ctx.infos_sorted(r) if not info.dummy]
        offer = m.PullOffer(
            src=ctx.endpoint,
            room=r.room,
            transfer_id=r.tid,
            registration=reg,
            chunk_index=c.chunk_index,
            token_start=start,
            token_end=end,
            is_last=c.is_last,
            src_pages=np.asarray(c.src_pages, dtype=np.int64).tolist(),
        )
        for p, msg in ctx.pull.offer(r.key, targets, offer, ctx.now()):
            ctx.send(p, msg)
        return ctx.finish_run(r, c, start, end, [])


class PullRoom:
    """What pull keeps of one decode room (in the flow's own per-room table, not on the room):
    READs in flight (they write the room's pages), chunks pulled, the senders that offered."""

    __slots__ = ("offered_by", "pulled", "reads", "reads_cut", "stopped_sent")

    def __init__(self) -> None:
        self.reads: dict[int, ReadInfo] = {}  # read id -> what it moves
        self.pulled: set[tuple[m.Endpoint, int]] = set()  # (sender, chunk index)
        self.offered_by: set[m.Endpoint] = set()
        # READs in flight when their peer was lost: cut by DropPeer, yet over a transport that
        # queues them (UCX over TCP) their data can still land after a heal, so only the fence
        # deadline frees the pages.
        self.reads_cut = False
        self.stopped_sent = False  # every sender that offered heard ReadsStopped


class PullReceiver(RankFlowPart):
    """Pull's decode half, composed into the receiver engine: the READs in flight (by read id),
    each pull room's ``PullRoom`` (its own table, ``pull_rooms``), the prefill agents loaded, and
    the rules of an offer. It reaches the engine only through ``ctx`` (the receiver's
    ``ReceiverFlowContext``)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.reads: dict[int, tuple[int, str]] = {}  # read id -> room key
        self.pull_peers: dict[m.Endpoint, int] = {}  # prefill agents loaded: registration id
        self.rooms: dict[RoomKey, PullRoom] = ctx.room_table("pull_rooms")
        self._next_read = 1
        reads = self.reads  # never rebound
        ctx.track("reads", lambda room: any(k[0] == room for k in reads.values()), reads.__len__)

    def _room(self, r: Any) -> PullRoom:
        pr = self.rooms.get(r.key)
        if pr is None:
            pr = self.rooms[r.key] = PullRoom()
        return pr

    # --- what the room machine asks ----------------------------------------------------------------

    def writing(self, r: Any) -> bool:
        return self.reading(r)

    def settle(self, r: Any) -> None:
        self.reads_drained(r)

    def reading(self, r: Any) -> bool:
        """A READ of ours is writing the room's pages."""
        pr = self.rooms.get(r.key)
        return pr is not None and bool(pr.reads)

    def cut(self, r: Any) -> bool:
        """A READ of the room was in flight when its peer was lost (only the fence deadline frees)."""
        pr = self.rooms.get(r.key)
        return pr is not None and pr.reads_cut

    def completed(self, read_id: int) -> tuple[RoomKey, ReadInfo | None] | None:
        """A READ's completion: its room key and what it moved (None once the room is gone), or
        None for an id that is not ours."""
        key = self.reads.pop(read_id, None)
        if key is None:
            return None
        pr = self.rooms.get(key)
        return key, (pr.reads.pop(read_id, None) if pr is not None else None)

    def withdrawn(self, r: Any, command: Any) -> None:
        """A READ of a step the table refused never left."""
        if type(command) is PostRead:
            self.completed(command.read_id)

    def room_unknown(self, peer: m.Endpoint, room: int, tid: str) -> None:
        self.not_reading(peer, room, tid)  # no room of ours reads its pages: it may free them

    def routes(self) -> dict[type, Callable[[Any], None]]:
        # Our READs come back as transfers by id, like a write's completion.
        return {m.PullOffer: self.on_offer_message, WriteDone: self._on_read, WriteFailed: self._on_read}

    def table(self) -> FlowTable:
        return PULL_RX_ROOM_TABLE

    def _on_read(self, ev: WriteDone | WriteFailed) -> None:
        """A READ's completion, for its room's table."""
        done = self.completed(ev.write_id)
        if done is None:
            self.ctx.count("unknown_read")
            return
        (room, tid), info = done
        inp = PullRxIn.READ_DONE if type(ev) is WriteDone else PullRxIn.READ_FAILED
        self.ctx.flow_input(room, tid, inp, (ev, info))

    def peer_lost(self, peer: m.Endpoint, rooms: list[Any]) -> None:
        """``peer`` is gone: READs of those rooms in flight are cut; its agent is dropped."""
        for r in rooms:
            pr = self.rooms.get(r.key)
            if pr is not None and pr.reads:
                pr.reads_cut = True
                self.ctx.count("reads_cut_by_peer_loss")
        self.pull_peers.pop(peer, None)  # the driver drops its agent with it (DropPeer)

    def asked_again(self, r: Any, src: m.Endpoint) -> bool:
        """A pull sender of a failed room still holding its pages asks again (RoomFailed): told
        ReadsStopped if nothing of ours reads them; False if it offered nothing or READs run."""
        pr = self.rooms.get(r.key)
        if pr is None or src not in pr.offered_by or pr.reads:
            return False
        self.ctx.send(src, m.ReadsStopped(src=self.ctx.endpoint, room=r.room, transfer_id=r.tid))
        return True

    def not_reading(self, src: m.Endpoint, room: int, tid: str) -> None:
        """No room of ours reads ``src``'s pages of that room (released or never known)."""
        self.ctx.send(src, m.ReadsStopped(src=self.ctx.endpoint, room=room, transfer_id=tid))

    # --- messages ----------------------------------------------------------------------------------

    def on_offer_message(self, offer: m.PullOffer) -> None:
        ctx = self.ctx
        r = ctx.room(offer.room)
        if r is None or r.tid != offer.transfer_id:
            status = ctx.tombstone(offer.room, offer.transfer_id)
            if status is KVPoll.Success:
                # Every chunk was pulled before the room was released: this copy's Pulled was lost.
                ctx.send(offer.src, self.pulled(offer))
            else:
                # Nothing of ours reads these pages (a finished, failed or unknown room): free them.
                ctx.send(
                    offer.src,
                    m.ReadsStopped(src=ctx.endpoint, room=offer.room, transfer_id=offer.transfer_id),
                )
            ctx.count("offer_for_unknown_room")
            return
        ctx.flow_input(offer.room, offer.transfer_id, PullRxIn.OFFER, offer, sender=offer.src)

    def pulled(self, offer: Any) -> m.Pulled:
        src, idx = self.ctx.endpoint, offer.chunk_index
        return m.Pulled(src=src, room=offer.room, transfer_id=offer.transfer_id, chunk_index=idx)

    # --- the room inputs of PULL_RX_ROOM_TABLE --------------------------------------------------------

    def _h_offer(self, r: Any, inp: PullRxIn, offer: m.PullOffer) -> str:
        return self.on_offer(r, offer)

    def _h_read_done(self, r: Any, inp: PullRxIn, payload: tuple[Any, ReadInfo | None]) -> str:
        return self.on_read_done(r, payload[1])

    def _h_offer_after_success(self, r: Any, inp: PullRxIn, offer: m.PullOffer) -> None:
        self.offer_after_success(r, offer)

    def _h_offer_after_failure(self, r: Any, inp: PullRxIn, offer: m.PullOffer) -> None:
        self.after_failure(r, offer)

    def _h_read_failed(self, r: Any, inp: PullRxIn, payload: tuple[WriteFailed, Any]) -> str:
        self.ctx.fail_room(r, RoomFailure(f"read failed: {payload[0].reason}", at_ns=self.ctx.now()))
        return "failed"

    def _h_read_after_failure(self, r: Any, inp: PullRxIn, payload: Any) -> None:
        pass  # the READ ended: ``settle`` looks at the failed room again

    def on_offer(self, r: Any, offer: m.PullOffer) -> str:
        ctx = self.ctx
        src = offer.src
        if src not in r.data_senders:
            raise RoomError(f"pull offer from {src}, which sends no data to this room")
        key = (src, offer.chunk_index)
        pr = self._room(r)
        pr.offered_by.add(src)
        if key in pr.pulled:
            ctx.count("duplicate_offer")
            ctx.send(src, self.pulled(offer))
            return "stay"
        if any(i.src == src and i.chunk_index == offer.chunk_index for i in pr.reads.values()):
            ctx.count("duplicate_offer")
            return "stay"
        ctx.room_alive(r)
        plan = self._plan_read(r, offer)
        self._load_pull_peer(offer.registration)
        info = ReadInfo(offer)
        if plan.count == 0:
            return self._chunk_read(r, info)
        rid = self._next_read
        self._next_read += 1
        self.reads[rid] = r.key
        pr.reads[rid] = info
        ctx.emit(
            PostRead(
                read_id=rid,
                peer=src,
                room=r.room,
                src_region=plan.src_region,
                src_offset=plan.src_offset,
                dst_region=plan.dst_region,
                dst_offset=plan.dst_offset,
                length=plan.length,
                notif=m.encode(info.note(r.room, r.tid)),
            )
        )
        return "running"

    def on_read_done(self, r: Any, info: ReadInfo | None) -> str:
        if info is None:
            return "stay"
        return self._chunk_read(r, info)

    def _chunk_read(self, r: Any, info: ReadInfo) -> str:
        ctx = self.ctx
        ctx.record_chunk(r, r.progress[info.src], info.note(r.room, r.tid))
        self._room(r).pulled.add((info.src, info.chunk_index))
        ctx.send(
            info.src,
            m.Pulled(src=ctx.endpoint, room=r.room, transfer_id=r.tid, chunk_index=info.chunk_index),
        )
        return "done" if ctx.complete(r) else "running"

    def offer_after_success(self, r: Any, offer: m.PullOffer) -> None:
        pr = self.rooms.get(r.key)
        if pr is not None and (offer.src, offer.chunk_index) in pr.pulled:
            self.ctx.count("duplicate_offer")
            self.ctx.send(offer.src, self.pulled(offer))
            return
        raise RoomError(f"new chunk {offer.chunk_index} offered by {offer.src} after Success")

    def after_failure(self, r: Any, offer: m.PullOffer) -> None:
        """An offer for a failed room: never read; its sender hears ReadsStopped once ours drain."""
        self.ctx.count("offer_after_failure")
        pr = self._room(r)
        pr.offered_by.add(offer.src)
        if not pr.reads:
            self.ctx.send(offer.src, m.ReadsStopped(src=self.ctx.endpoint, room=r.room, transfer_id=r.tid))

    def reads_drained(self, r: Any) -> None:
        """A failed room with no READ in flight tells every sender that offered (once)."""
        pr = self.rooms.get(r.key)
        if pr is None or pr.reads or pr.stopped_sent or not pr.offered_by:
            return
        pr.stopped_sent = True
        for p in sorted(pr.offered_by):
            self.ctx.send(p, m.ReadsStopped(src=self.ctx.endpoint, room=r.room, transfer_id=r.tid))

    # --- planning ------------------------------------------------------------------------------------

    def _plan_read(self, r: Any, offer: m.PullOffer) -> Any:
        try:
            src_pool = offer.registration.geometry.to_pool()
        except (KvferryError, ValueError) as exc:
            raise RoomError(f"pull offer from {offer.src} with a bad geometry: {exc}") from None
        pool = self.ctx.pool
        why = pool.model.same_kv_shape(src_pool.model)
        if why is not None:
            raise RoomError(f"pull offer from {offer.src}: incompatible KV: {why}")
        if src_pool.tp_rank != offer.src.rank:
            raise RoomError(f"pull offer from {offer.src} carries rank {src_pool.tp_rank}'s geometry")
        if offer.token_end > r.num_tokens:
            raise RoomError(
                f"chunk {offer.chunk_index} offered by {offer.src} ends at token {offer.token_end}, "
                f"past the {r.num_tokens} allocated"
            )
        pages = np.asarray(offer.src_pages, dtype=np.int64)
        need = -(-offer.token_end // src_pool.page_size)
        if pages.size < need:
            raise RoomError(
                f"pull offer from {offer.src}: {pages.size} pages cannot hold {offer.token_end} tokens"
            )
        if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= src_pool.num_pages):
            raise RoomError(f"pull offer from {offer.src}: page ids out of range [0, {src_pool.num_pages})")
        return self.ctx.planner(src_pool, pool, pages, r.dst_pages, offer.token_start, offer.token_end)

    def _load_pull_peer(self, reg: m.Register) -> None:
        rid = m.registration_id(reg)
        known = self.pull_peers.get(reg.src)
        if known == rid:
            return
        if known is not None:
            # Prefill restarted: its old agent's memory is gone; READs name the new one.
            self.ctx.emit(DropPeer(peer=reg.src, reason="prefill re-registered with a new agent"))
        self.pull_peers[reg.src] = rid
        self.ctx.emit(AddPeer(peer=reg.src, registration=reg))


class PullRxIn(IdentityEnum):
    """Pull's own room inputs on decode."""

    OFFER = "offer"  # a sender offers a computed chunk's pages
    READ_DONE = "read_done"  # our READ of an offered chunk finished
    READ_FAILED = "read_failed"


class PullTxIn(IdentityEnum):
    """Pull's own room inputs on prefill."""

    PULLED = "pulled"  # decode READ an offered chunk
    READS_STOPPED = "reads_stopped"  # decode failed the room and reads no more


_B, _W, _T = KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring
_S, _F = KVPoll.Success, KVPoll.Failed
_PULLED, _STOPPED = PullTxIn.PULLED, PullTxIn.READS_STOPPED
_TX = PullSender
_TX_STOPPED = step(_TX._h_reads_stopped, failed=_F)  # its Abort may still be on the way

# The room machine adds these rows to SENDER_TABLE (core/flows/parts.py, ``FlowTable``).
PULL_TX_ROOM_TABLE: FlowTable = {
    _B: {_STOPPED: _TX_STOPPED},
    _W: {_STOPPED: _TX_STOPPED},
    _T: {_PULLED: step(_TX._h_pulled, stay=_T, done=_S), _STOPPED: _TX_STOPPED},
    _S: {
        _PULLED: step(ignore, stay=_S),  # a duplicate answer to a resent offer
        _STOPPED: step(ignore, stay=_S),  # nothing was owed; its Abort follows
    },
    _F: {_PULLED: step(_TX._h_after_failure, stay=_F), _STOPPED: step(_TX._h_after_failure, stay=_F)},
}

_OFFER, _READ, _READ_FAILED = PullRxIn.OFFER, PullRxIn.READ_DONE, PullRxIn.READ_FAILED
_H = PullReceiver
_RX_READ_FAILED = step(_H._h_read_failed, failed=_F)

# The room machine adds these rows to RECEIVER_TABLE (core/flows/parts.py, ``FlowTable``). An offer
# proves the sender has our TransferInfo and registration, as a notification does.
PULL_RX_ROOM_TABLE: FlowTable = {
    _B: {_OFFER: step(_H._h_offer, stay=_B, running=_T, done=_S), _READ_FAILED: _RX_READ_FAILED},
    _W: {_OFFER: step(_H._h_offer, stay=_W, running=_T, done=_S), _READ_FAILED: _RX_READ_FAILED},
    _T: {
        _OFFER: step(_H._h_offer, stay=_T, running=_T, done=_S),
        _READ: step(_H._h_read_done, stay=_T, running=_T, done=_S),
        _READ_FAILED: _RX_READ_FAILED,
    },
    _S: {_OFFER: step(_H._h_offer_after_success, stay=_S)},
    _F: {
        _OFFER: step(_H._h_offer_after_failure, stay=_F),
        _READ: step(_H._h_read_after_failure, stay=_F),
        _READ_FAILED: step(_H._h_read_after_failure, stay=_F),
    },
}

registry.register(Flow.PULL, PullChunkSender(), DIRECT_RECEIVER)  # a READ's chunk is recorded as a note
