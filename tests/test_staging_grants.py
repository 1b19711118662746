"""Decode grants a staged chunk to every writer on the first writer's request, so a second
writer's first request (it asked before the grant reached it) gets no second answer; a resend
(``StagingReq.again``: the grant may have been lost) is answered with the same allocation."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest
from kvferry.core import messages as m
from kvferry.core.events import ControlIn
from kvferry.core.kvpoll import KVPoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_flows import TINY4, world


def _answers(w: object, kind: type) -> list[tuple[m.Endpoint, object]]:
    out = []
    for x in w.fabric.pending:  # type: ignore[attr-defined]
        if not x.note:
            msg = m.decode_control(x.data)
            if type(msg) is kind:
                out.append((x.dst, msg))
    return out


@pytest.mark.parametrize("flow", ["ring", "pinned"])
def test_one_grant_per_writer_and_a_resend_is_answered_again(flow: str) -> None:
    w = world(TINY4, 2, 1, flow, space=4096)
    req = w.open_room(5, "t", 8, [8])
    assert req is not None
    w.flush()
    for p in range(w.P):
        w.chunk_ready(req, p)  # both writers ask for the chunk's space before any answer
    asks = _answers(w, m.StagingReq)
    assert len(asks) == 2 and not any(a.again for _, a in asks)
    dec = w.decode[0].engine
    grants: list[tuple[m.Endpoint, m.StagingRsp]] = []
    while w.fabric.pending:
        x = w.fabric.pending[0]
        if not x.note and type(msg := m.decode_control(x.data)) is m.StagingRsp:
            grants.append((x.dst, msg))
        w.deliver(0)
    grants = [(d, g) for d, g in grants if g.chunk_index == 0]
    assert sorted(d.rank for d, _ in grants) == [0, 1]  # one grant per writer, not three
    assert dec.counters["staging_req_granted_already"] == 1
    # A resend is answered: the writer may have lost its grant.
    again = msgspec.structs.replace(asks[1][1], again=True)
    out = dec.handle(ControlIn(data=m.encode(again)), w.fabric.now)
    [rsp] = [c.msg for c in out if type(c.msg) is m.StagingRsp]
    first = next(g for d, g in grants if d == again.src)
    assert (rsp.alloc_id, rsp.offset) == (first.alloc_id, first.offset)
    w.heal_and_settle()
    assert w.server_view[("decode", 5, "t")] is KVPoll.Success, w.failure_reasons
