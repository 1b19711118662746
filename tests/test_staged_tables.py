"""The staged flows keep their per-room state in their own tables, registered with the engine, so
the quiescence checks (``references``, ``table_sizes``: the simulator's and the runtime's) see it
without naming it; the room record holds only which flow it runs. And the planted-bug seam: an
engine subclass swaps the staged component through ``staged_class``.

Fails if a staged table stops being registered (a leak would go unseen), if the prefill ledger
moves back onto the room, or if the room machines stop building their component from
``staged_class``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from kvferry.core import messages as m
from kvferry.core.events import ControlIn
from kvferry.core.flows import Flow
from kvferry.core.flows.staged_receiver import StagedReceiver
from kvferry.core.flows.staged_sender import StagedSender
from kvferry.core.kvpoll import KVPoll
from kvferry.core.receiver import ReceiverEngine
from kvferry.core.sender import SenderEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H
from test_flows import TINY4, world


@pytest.mark.parametrize("flow", ["ring", "pinned"])
def test_a_live_staged_room_is_in_the_flow_tables_and_leaves_them_on_release(flow: str) -> None:
    w = world(TINY4, 2, 1, flow, space=1024)
    req = w.open_room(5, "t", 8, [8])
    assert req is not None
    w.flush()
    for p in range(w.P):
        w.chunk_ready(req, p)  # prefill asks for the chunk's space at once (the prefetch)
    while w.fabric.pending:
        w.deliver(0)  # decode allocates and grants; no worker has run the chunk yet
    pre, dec = w.prefill[0].engine, w.decode[0].engine
    room = pre.rooms[5]
    assert room.flow is Flow(flow)
    assert not any("ledger" in name or "lane" in name for name in type(room).__slots__)
    assert "staged_ledgers" in pre.references(5)
    assert pre.table_sizes()["staged_ledgers"] == 1
    assert [lane.index for lane in pre.staged.lanes(room.key)] == [0]
    assert {"staged_chunks", flow} <= set(dec.references(5))
    w.heal_and_settle()
    assert w.server_view[("decode", 5, "t")] is KVPoll.Success
    for eng in (*[r.engine for r in w.prefill], *[r.engine for r in w.decode]):
        assert eng.references(5) == []  # released as it turned terminal
        sizes = eng.table_sizes()
        for name in ("staged_ledgers", "staged_chunks", "scattering", "held_staging_reqs", "ops"):
            assert sizes.get(name, 0) == 0, (name, sizes)


def test_a_held_staging_request_is_a_registered_table() -> None:
    """A StagingReq for a room decode has not opened is held: ``leaks()`` and ``references`` see
    it until the room opens or the bootstrap deadline drops it."""
    w = world(TINY4, 1, 1, "ring", space=1024)
    dec = w.decode[0].engine
    req = m.StagingReq(
        src=w.prefill[0].engine.endpoint,
        room=9,
        transfer_id="early",
        flow="ring",
        chunk_index=0,
        token_start=0,
        token_end=4,
    )
    dec.handle(ControlIn(data=m.encode(req)), now=1)
    assert dec.table_sizes()["held_staging_reqs"] == 1
    assert "held_staging_reqs" in dec.references(9)
    dec.handle(ControlIn(data=m.encode(req)), now=2)
    assert dec.table_sizes()["held_staging_reqs"] == 2
    dec.staged.held_expired((9, "early"))
    assert dec.table_sizes()["held_staging_reqs"] == 0 and dec.references(9) == []


class _CountingStagedSender(StagedSender):
    accepted = 0

    def accept(self, r: Any, c: Any) -> str:
        type(self).accepted += 1
        return super().accept(r, c)


class _CountingStagedReceiver(StagedReceiver):
    notes = 0

    def note(self, r: Any, note: Any) -> None:
        type(self).notes += 1
        super().note(r, note)


def test_an_engine_subclass_composes_its_own_staged_component(monkeypatch: pytest.MonkeyPatch) -> None:
    """What sim/planted.py relies on: ``staged_class`` picks the component the engine builds, and
    the room machines call the flow only through it."""
    sender = type("S", (SenderEngine,), {"staged_class": _CountingStagedSender})
    receiver = type("R", (ReceiverEngine,), {"staged_class": _CountingStagedReceiver})
    assert not issubclass(SenderEngine, StagedSender) and not issubclass(ReceiverEngine, StagedReceiver)
    monkeypatch.setattr(H, "SenderEngine", sender)
    monkeypatch.setattr(H, "ReceiverEngine", receiver)
    w = world(TINY4, 1, 1, "ring", space=1024)
    assert type(w.prefill[0].engine.staged) is _CountingStagedSender
    req = w.open_room(3, "t", 8, [4, 8])
    assert req is not None
    w.flush()
    for _ in range(2):
        w.chunk_ready(req, 0)
        w.flush()
    w.heal_and_settle()
    assert w.server_view[("decode", 3, "t")] is KVPoll.Success
    assert _CountingStagedSender.accepted == 2 and _CountingStagedReceiver.notes == 2


@pytest.mark.parametrize("flow", ["ring", "pinned"])
def test_the_metrics_read_the_staging_pools_a_live_room_holds(flow: str) -> None:
    """The runtime's staging gauges (backends/runtime/metrics.py) read the staged halves' pools:
    decode's pool shows the live room's bytes, and nothing once it settled."""
    from kvferry.backends.runtime.metrics import _staging

    w = world(TINY4, 2, 1, flow, space=1024)
    req = w.open_room(5, "t", 8, [8])
    assert req is not None
    w.flush()
    for p in range(w.P):
        w.chunk_ready(req, p)
    while w.fabric.pending:
        w.deliver(0)
    pools = _staging(w.decode[0].engine)
    used, capacity = pools[flow]
    assert 0 < used <= capacity == 1024, pools
    w.heal_and_settle()
    assert _staging(w.decode[0].engine)[flow][0] == 0
