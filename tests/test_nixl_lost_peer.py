"""A lost peer's transfers stay in flight until they end (backends/nixl/agent.py, "draining").

Over UCX's TCP transport a released WRITE still lands after a partition heals, so dropping a peer
must not report its transfers failed while they may still move: the peer takes no new posts, its
handles, lists and remote agent stay until each transfer ends, and one still in flight past
``drain_s`` is released with a warning and counted. The real transport's side of this is
tests/test_chaos.py's two-host test; here a fake NIXL holds a transfer in PROC for as long as a
test wants (real NIXL does so only for as long as a partition lasts).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from kvferry.backends.nixl.agent import NixlAgent
from kvferry.backends.nixl.errors import NixlPeerError
from kvferry.backends.nixl.memory import MemRegion

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ (importlib mode)
from test_nixl_agent import _FakeNixl  # the agent tests' fake NIXL

ONE = (np.array([0]), np.array([0]))
KEY = ("kv", 256)


class _Fake(_FakeNixl):
    """Transfers stay PROC until ``state`` changes; a peer's list release is told apart."""

    def __init__(self) -> None:
        super().__init__(fail="")
        self.state = "PROC"

    def prep_xfer_dlist(self, agent, rows, mem):
        outer = self

        class H:
            def release(self):
                outer.order.append(f"release_dlist:{agent}")

        return H()

    def check_xfer_state(self, h):
        return self.state


def _agent(drain_s: float = 30.0) -> tuple[NixlAgent, _Fake, str]:
    fake = _Fake()
    agent = NixlAgent("fake", factory=lambda *a: fake, drain_s=drain_s)
    agent.register([MemRegion(0, 1 << 20, 4096)])
    peer = agent.add_peer(b"md", {"kv": ([MemRegion(0, 1 << 21, 4096)], [256])})
    return agent, fake, peer


def test_a_dropped_peers_transfer_is_kept_until_it_ends_then_the_peer_goes() -> None:
    agent, fake, peer = _agent()
    t = agent.post("WRITE", peer, KEY, ONE, ONE, np.array([256]))
    agent.remove_peer(peer, settle_s=0.0)
    assert not agent.has_peer(peer) and agent.draining() == [peer]
    with pytest.raises(NixlPeerError):  # no new posts to a lost peer
        agent.post("WRITE", peer, KEY, ONE, ONE, np.array([256]))
    assert agent.poll(t) == "PROC" and agent.inflight() == 1  # not reported failed at the drop
    assert "release_xfer" not in fake.order and "remove_remote" not in fake.order
    fake.state = "DONE"  # e.g. the partition healed and the bytes were acknowledged
    assert agent.poll(t) == "DONE" and agent.inflight() == 0 and agent.draining() == []
    assert agent.abandoned == 0
    # NIXL's order: the handle, then the peer's list, then the remote agent.
    steps = [s for s in fake.order if s in ("release_xfer", "release_dlist:peer", "remove_remote")]
    assert steps == ["release_xfer", "release_dlist:peer", "remove_remote"]


def test_a_transfer_still_in_flight_past_the_drain_bound_is_released_and_counted() -> None:
    agent, fake, peer = _agent(drain_s=0.05)
    t = agent.post("WRITE", peer, KEY, ONE, ONE, np.array([256]))
    agent.remove_peer(peer, settle_s=0.0)
    assert agent.poll(t) == "PROC"
    time.sleep(0.06)
    assert agent.poll(t) == "ERR" and agent.abandoned == 1
    assert agent.inflight() == 0 and agent.draining() == [] and "remove_remote" in fake.order
    assert agent.poll(t) == "ERR" and agent.abandoned == 1  # released exactly once


def test_a_dropped_peer_without_transfers_goes_at_once() -> None:
    agent, fake, peer = _agent()
    agent.remove_peer(peer, settle_s=0.0)
    assert agent.draining() == [] and "remove_remote" in fake.order


def test_the_same_agent_registering_again_ends_the_drain() -> None:
    agent, _fake, peer = _agent()
    t = agent.post("WRITE", peer, KEY, ONE, ONE, np.array([256]))
    agent.remove_peer(peer, settle_s=0.0)
    assert agent.add_peer(b"md", {"kv": ([MemRegion(0, 1 << 21, 4096)], [256])}) == peer
    assert agent.draining() == [] and agent.poll(t) == "ERR" and agent.has_peer(peer)


def test_close_releases_a_draining_peer_in_nixls_order() -> None:
    agent, fake, peer = _agent()
    t = agent.post("WRITE", peer, KEY, ONE, ONE, np.array([256]))
    agent.remove_peer(peer, settle_s=0.0)
    agent.close(settle_s=0.0)
    assert agent.poll(t) == "ERR" and agent.draining() == []
    first = {s: fake.order.index(s) for s in ("release_xfer", "release_dlist:peer", "remove_remote", "dereg")}
    assert first["release_xfer"] < first["release_dlist:peer"] < first["remove_remote"] < first["dereg"]
