"""A write that TCP delivers after decode's fence deadline (over the harness, which plays TCP).

Over UCX's TCP transport a WRITE queued when the link went down is delivered whenever the
connection comes back, however long that takes; over RDMA a failed queue pair delivers nothing.
Decode frees a failed room's pages at its fence deadline when no Stopped came, so a partition that
outlasts the fence lets the held write land in pages decode already handed back. With
``quarantine_ns`` the pages wait past the fence for the writer's Stopped, which a writer sends
only once its write ended (landed or failed); the quarantine bounds the wait for one that never
comes back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvferry.core.kvpoll import KVPoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H

T = H.TEST_TIMEOUTS
QUARANTINE_NS = 10 * T.fence_ns


def _deliver_all(w: H.World) -> None:
    while w.fabric.pending:
        w.deliver(0)


def _partition_past_the_fence(
    quarantine_ns: int, flow: str = "direct"
) -> tuple[H.World, H.Request, list[H.PendingWrite]]:
    """A room's chunk is posted (pull: decode's READ of it), then the link goes down until after
    decode's fence deadline: every message is lost, and the transfers stay queued (returned), as
    TCP keeps them."""
    w = H.World(H.TINY, 1, 1, seed=3, flow=flow)
    w.decode[0].engine.quarantine_ns = quarantine_ns
    req = w.first_chunk_run(7, "late", 6)
    if flow == "pull":
        _deliver_all(w)  # the offer reaches decode, which posts its READ
        assert any(pw.read for pw in w.fabric.writes)
    held, w.fabric.writes = w.fabric.writes, []
    assert held, "the chunk's transfers are in flight"
    for _ in range((T.heartbeat_timeout_ns + T.fence_ns) // T.heartbeat_interval_ns + 10):
        w.fabric.pending = []
        w.advance(T.heartbeat_interval_ns)
    assert w.history[("decode", 0, 7, "late")] is KVPoll.Failed
    assert w.prefill[0].engine.counters["writes_cut_by_peer_loss"] == 1
    return w, req, held


def _heal(w: H.World, held: list[H.PendingWrite]) -> None:
    """The link is back: TCP delivers what it held (the harness checks who owns the pages)."""
    w.fabric.writes.extend(held)
    while w.fabric.writes:
        w.fabric.complete(0)
    w.pump()


@pytest.mark.parametrize("quarantine_ns", [0, QUARANTINE_NS])
def test_a_write_delivered_after_the_fence_lands_in_quarantined_pages(quarantine_ns: int) -> None:
    w, req, held = _partition_past_the_fence(quarantine_ns)
    dec = w.decode[0].engine
    if not quarantine_ns:
        # The hole: freed at the fence, the late bytes land in pages the room no longer owns.
        assert req.freed == {0} and dec.counters["fence_expired"] == 1
        _heal(w, held)
        assert any("it does not own" in v for v in w.violations), w.violations
        return
    assert req.freed == set() and dec.counters["fence_quarantined"] == 1
    _heal(w, held)
    assert w.violations == []
    # The writer's write ended: its Stopped (answering the resent Abort) frees the pages.
    w.heal_and_settle()
    assert req.freed == {0}
    assert dec.counters["fence_expired"] == 0
    assert w.violations == [] and w.internal_errors() == []


def test_a_pull_room_whose_reads_a_loss_cut_is_freed_by_the_stopped_after_its_fence() -> None:
    """Decode's own READ was in flight when it lost prefill (its pages wait for the fence, which
    the quarantine is past): the writer's Stopped after the heal frees them, not the bound."""
    w, req, held = _partition_past_the_fence(QUARANTINE_NS, flow="pull")
    dec = w.decode[0].engine
    assert dec.counters["reads_cut_by_peer_loss"] == 1 and dec.counters["fence_quarantined"] == 1
    _heal(w, held)
    w.heal_and_settle()
    assert req.freed == {0} and dec.counters["fence_expired"] == 0
    assert w.violations == [] and w.internal_errors() == []


def test_the_quarantine_is_bounded_when_the_writer_never_comes_back() -> None:
    w, req, _held = _partition_past_the_fence(QUARANTINE_NS)
    dec = w.decode[0].engine
    for _ in range(QUARANTINE_NS // T.heartbeat_interval_ns + 2):
        w.fabric.pending = []  # prefill stays cut off (or died and never restarted)
        w.advance(T.heartbeat_interval_ns)
    assert req.freed == {0}
    assert dec.counters["fence_quarantined"] == 1 and dec.counters["fence_expired"] == 1
    assert w.violations == [] and w.internal_errors() == []
