"""Decode picks a staged note's half by flow: the flow its StagingReq named, through the registry
(core/flows/registry.py), not a half fixed in the room machine. A counting wrapper registered for
one staged flow must see every note of that flow's rooms and none of the other's; bytes are
still checked by the harness. Fails if the receiver stops asking the registry."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvferry.core import messages as m
from kvferry.core.flows import Flow, registry
from kvferry.core.kvpoll import KVPoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_flows import TINY4, run_rooms, world


class CountingReceiver:
    """The registered decode half, counting the notes it is handed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.notes: Counter[int] = Counter()  # room -> staged notes

    def on_note(self, ctx: Any, r: Any, prog: Any, note: m.ChunkNote) -> bool:
        self.notes[note.room] += 1
        return self.inner.on_note(ctx, r, prog, note)


@pytest.fixture(params=[Flow.RING, Flow.PINNED])
def counted(request: pytest.FixtureRequest) -> Iterator[tuple[Flow, CountingReceiver]]:
    flow = request.param
    old = registry.halves(flow)
    counting = CountingReceiver(old.receiver)
    registry.register(flow, old.sender, counting)
    try:
        yield flow, counting
    finally:
        registry.register(flow, old.sender, old.receiver)


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 1), (1, 2)])
def test_staged_notes_go_to_the_half_of_their_flow(
    counted: tuple[Flow, CountingReceiver], p: int, d: int
) -> None:
    flow, counting = counted
    other = Flow.PINNED if flow is Flow.RING else Flow.RING
    cuts = [3, 6, 10]
    for name in (flow.value, other.value):
        w = world(TINY4, p, d, name, space=512)
        room0 = 100 if name == flow.value else 200
        for req in run_rooms(w, 3, 10, cuts, room0=room0):
            assert w.server_view[("decode", req.room, req.tid)] is KVPoll.Success
        assert w.violations == [] and w.internal_errors() == []
    # Every chunk of every room of the counted flow: one note per writer and decode rank.
    assert sorted(counting.notes) == [100, 101, 102]
    assert all(n == len(cuts) * p * d for n in counting.notes.values()), counting.notes
