"""A decode process frozen past the heartbeat timeout (SIGSTOP, then SIGCONT), over the harness.

Pull at TP 1 -> 2: both decode ranks live in the frozen process. Prefill hears nothing for the
heartbeat timeout, loses them and fails the room; its RoomFailed waits in decode's socket. On the
thaw decode#0's READ, posted before the freeze, may complete before that notice is read: decode#0
is Success for a moment. The protocol's answer (docs/design.md, "Late failures"): Failed
overrides Success, so decode#0 must end Failed, like decode#1 and prefill, whichever of the READ
completion, the notice and decode's own heartbeat check the thawed process handles first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvferry.core.kvpoll import KVPoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H

T = H.TEST_TIMEOUTS


def _deliver_all(w: H.World) -> None:
    while w.fabric.pending:
        w.deliver(0)


def _freeze_decode(w: H.World, for_ns: int) -> None:
    """Time passes for prefill only; what it sends decode waits in decode's inbox, unread."""
    end = w.fabric.now + for_ns
    while w.fabric.now < end:
        w.fabric.now += T.heartbeat_interval_ns
        for rank in w.prefill:
            rank.driver.pump(w.fabric.now)
        while w.fabric.pending:
            w.fabric.deliver(0)  # into the frozen ranks' inboxes (or prefill's, never from decode)


@pytest.mark.parametrize("first", ["read", "notice"])
def test_a_read_that_completes_after_prefill_failed_the_room_ends_failed(first: str) -> None:
    w = H.World(H.TINY, 1, 2, seed=5, flow="pull")
    req = w.first_chunk_run(11, "stall", 6)
    for _ in range(5):  # the offers reach both decode ranks, which post their READs
        _deliver_all(w)
        if sum(pw.read for pw in w.fabric.writes) == 2:
            break
    for i in reversed(range(len(w.fabric.writes))):  # prefill's aux row lands before the freeze
        if not w.fabric.writes[i].read:
            w.fabric.complete(i)
    w.pump()
    reads = [i for i, pw in enumerate(w.fabric.writes) if pw.read]
    assert len(reads) == 2, "both decode ranks' READs are in flight"
    # decode#1's READ lands at once; decode#0's is still on the wire when the process freezes.
    w.fabric.complete(reads[1])
    w.decode[1].driver.pump(w.fabric.now)
    frozen_at = w.fabric.now
    _freeze_decode(w, T.heartbeat_timeout_ns + 2 * T.heartbeat_interval_ns)
    assert w.prefill[0].engine.counters["peer_lost"] == 2
    assert w.history[("prefill", 0, 11, "stall")] is KVPoll.Failed
    # The thaw: decode#0's READ completes; its data thread or its control thread goes first.
    w.fabric.complete(next(i for i, pw in enumerate(w.fabric.writes) if pw.read))
    d0 = w.decode[0]
    if first == "read":
        inbox, d0.transport.inbox = d0.transport.inbox, []
        d0.driver.pump(frozen_at)  # the completion, handled before the clock's jump is noticed
        assert w.history[("decode", 0, 11, "stall")] is KVPoll.Success
        d0.transport.inbox = inbox + d0.transport.inbox
    w.pump()
    w.heal_and_settle()
    final = {key: st for key, st in w.history.items() if key[2:] == (11, "stall")}
    assert final == {
        ("prefill", 0, 11, "stall"): KVPoll.Failed,
        ("decode", 0, 11, "stall"): KVPoll.Failed,
        ("decode", 1, 11, "stall"): KVPoll.Failed,
    }
    assert w.violations == [] and w.internal_errors() == []
    assert req.freed == {0, 1}
