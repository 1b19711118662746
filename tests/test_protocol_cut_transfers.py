"""Transfers cut by a lost peer can still land: the fence must not vouch for them (over the harness).

When a peer is lost (heartbeat), the driver drops it and NIXL releases its transfers in flight as
failed. Over RDMA a failed transfer never lands; over UCX's TCP transport a WRITE (or a READ's
answer) that TCP still holds from before a partition is delivered after the heal, into whatever
the pages hold by then (found by ``kvferry chaos``: long partitions, canaries broken in pages
decode had freed as fenced). So a prefill rank whose writes were cut sends no ``Stopped`` for that
room, and a decode rank whose READs were cut does not count them as ended: the pages go back at
the fence deadline only. Here the fabric plays TCP: the cut transfer stays on the wire and lands
after the heal, and the harness's ownership check sees where.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvferry.backends.transport import XferState
from kvferry.core import messages as m
from kvferry.core.kvpoll import KVPoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H

T = H.TEST_TIMEOUTS


def _deliver_all(w: H.World) -> None:
    for _ in range(20):
        if not w.fabric.pending:
            return
        while w.fabric.pending:
            w.deliver(0)


def _partition_until_both_lose_the_other(w: H.World) -> list[H.PendingWrite]:
    """Every message in flight is lost and no write completes while time passes the heartbeat
    timeout; the writes stay on the wire (returned), as TCP keeps them."""
    held, w.fabric.writes = w.fabric.writes, []
    for _ in range(T.heartbeat_timeout_ns // T.heartbeat_interval_ns + 2):
        w.fabric.pending = []
        w.advance(T.heartbeat_interval_ns)
    assert w.prefill[0].engine.counters["peer_lost"] == 1
    assert w.decode[0].engine.counters["peer_lost"] == 1
    return held


def _cut(w: H.World, held: list[H.PendingWrite]) -> None:
    """What the real agent does when the driver drops the peer: its transfers end in ERR."""
    for pw in held:
        if pw.handle in w.fabric.states:
            w.fabric.states[pw.handle] = XferState.ERR
    w.pump()


def _land_late(w: H.World, held: list[H.PendingWrite]) -> None:
    """After the heal, TCP delivers what it held: the bytes land, checked for ownership."""
    for pw in held:
        w.fabric.writes.append(pw)
        w.fabric.complete(len(w.fabric.writes) - 1)
        w.fabric.states.pop(pw.handle, None)  # the driver released the handle long ago
    w.fabric.pending = [p for p in w.fabric.pending if not p.note]  # notes of a failed room
    w.pump()


def test_writes_cut_by_a_lost_peer_are_not_fenced_by_stopped() -> None:
    w = H.World(H.TINY, 1, 1, seed=3, flow="direct")
    req = w.open_room(7, "cut", 6, [6])
    assert req is not None
    _deliver_all(w)  # Register, TransferInfo, RegisterAck, InfoAck
    assert w.chunk_ready(req, 0)
    assert w.run_worker(0, 7 % 2)
    assert w.fabric.writes, "the chunk's writes are in flight"
    held = _partition_until_both_lose_the_other(w)
    assert w.history[("prefill", 0, 7, "cut")] is KVPoll.Failed
    assert w.history[("decode", 0, 7, "cut")] is KVPoll.Failed
    _cut(w, held)
    # The heal: decode's Abort reaches prefill, which must not answer Stopped for cut writes.
    for _ in range(3):
        _deliver_all(w)
        w.advance(T.heartbeat_interval_ns)
    stopped = [p for p in w.fabric.pending if not p.note and type(m.decode_control(p.data)) is m.Stopped]
    assert stopped == []
    assert req.freed == set(), "decode freed the pages on a Stopped that vouched for cut writes"
    _land_late(w, held)
    assert w.violations == []
    # The fence deadline frees them; everything settles.
    w.heal_and_settle()
    assert req.freed == {0}
    assert w.violations == [] and w.internal_errors() == []
    w.advance(T.fence_ns)
    assert w.prefill[0].engine.counters["writes_cut_by_peer_loss"] == 1
    assert not w.prefill[0].engine.writes.cut  # forgotten at decode's fence deadline


def test_reads_cut_by_a_lost_peer_wait_for_the_fence() -> None:
    w = H.World(H.TINY, 1, 1, seed=4, flow="pull")
    req = w.open_room(9, "cutr", 6, [6])
    assert req is not None
    _deliver_all(w)
    assert w.chunk_ready(req, 0)
    assert w.run_worker(0, 9 % 2)
    for _ in range(5):  # the PullOffer reaches decode, which posts its READ (the aux row flies too)
        _deliver_all(w)
        if any(pw.read for pw in w.fabric.writes):
            break
    reads = [pw for pw in w.fabric.writes if pw.read]
    assert reads, "decode's READ is in flight"
    for i in reversed(range(len(w.fabric.writes))):  # prefill's aux row lands before the cut
        if not w.fabric.writes[i].read:
            w.fabric.complete(i)
    w.pump()
    held = _partition_until_both_lose_the_other(w)
    _cut(w, held)
    for _ in range(3):
        _deliver_all(w)
        w.advance(T.heartbeat_interval_ns)
    assert req.freed == set(), "decode freed the pages though its cut READ may still land"
    _land_late(w, held)
    assert w.violations == []
    w.heal_and_settle()
    assert req.freed == {0}
    assert w.violations == [] and w.internal_errors() == []
    assert w.decode[0].engine.counters["reads_cut_by_peer_loss"] == 1
