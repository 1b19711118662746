"""The flow seam: a flow registered from here, with no core file naming it, runs through the room
machines (core/flows/registry.py), in the in-memory harness, one simulated run and a short
campaign (the scenario checks read the registry).

``split`` is direct's writes under another chunk ledger: each chunk the worker hands over goes out
as two halves, numbered 2i and 2i+1 in the notes, so decode's ledger tiles twice as many chunks as
prefill ran. Decode's half is direct's (a note carries no flow on the wire). If the room machines
stopped calling the registered half (the seam broken), the halves' count stays 0 and the tests
fail; if they called it wrongly, the harness's byte and exactly-once checks fail.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kvferry.core.commands import SendNotif
from kvferry.core.events import ChunkReady
from kvferry.core.flows import Flow, FlowPolicy, registry
from kvferry.core.flows.direct import DIRECT, write_command
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.core.worker import plan_chunk
from kvferry.sim import scenario as sc
from kvferry.sim.campaign import campaign, run_one

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H

SPLIT = "split"
TINY4 = ModelGeometry("tiny4", num_layers=2, num_kv_heads=4, head_dim=4)
SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "quickstart.toml"


@dataclass(frozen=True, slots=True)
class _Half:
    """What ``SenderContext.chunk_note`` reads of a chunk: its index in the notes, and last-ness."""

    index: int
    is_last: bool


class SplitSender:
    """Prefill half of ``split``: every chunk as two write sets, each with its own note."""

    def __init__(self) -> None:
        self.halves: Counter[tuple[str, int]] = Counter()  # (endpoint, room) -> halves posted

    def run_chunk(self, ctx: Any, r: Any, c: ChunkReady) -> str:
        start, end = ctx.chunk_bounds(r, c)
        mid = (start + end) // 2
        dests = ctx.destinations(r)
        ctx.advance(r, c, end)
        posted: list[int] = []
        for k, (a, b) in enumerate(((start, mid), (mid, end))):
            half = _Half(2 * c.chunk_index + k, c.is_last and k == 1)
            note = ctx.chunk_note(r, half, a, b)
            self.halves[(str(ctx.endpoint), r.room)] += 1
            for w in plan_chunk(ctx.planner, ctx.pool, c.src_pages, dests, a, b):
                if not len(w.length):
                    ctx.emit(SendNotif(peer=w.peer, room=r.room, notif=note))
                    continue
                wid = ctx.new_write(r)
                posted.append(wid)
                ctx.emit(write_command(wid, r.room, w, note))
        return ctx.finish_run(r, c, start, end, posted)


@pytest.fixture
def split() -> Iterator[SplitSender]:
    sender = SplitSender()
    registry.register(SPLIT, sender, DIRECT)
    try:
        yield sender
    finally:
        registry.unregister(SPLIT)


def test_split_is_known_only_while_registered(split: SplitSender) -> None:
    flow = Flow.parse(SPLIT)
    assert flow == SPLIT and flow.value == SPLIT and not flow.staged
    assert registry.halves(flow).sender is split
    registry.unregister(SPLIT)
    with pytest.raises(ValueError, match="unknown flow"):
        Flow.parse(SPLIT)
    registry.register(SPLIT, split, DIRECT)  # the fixture unregisters it again


def test_split_overrides_the_policy(split: SplitSender) -> None:
    src, dst = PoolGeometry(TINY4, 2, 0, 4, 8), PoolGeometry(TINY4, 1, 0, 4, 8)
    assert FlowPolicy().choose(src, dst, 100, 100, override=SPLIT) == SPLIT


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 1), (1, 2)])
def test_split_moves_every_byte_through_the_room_machines(split: SplitSender, p: int, d: int) -> None:
    w = H.World(TINY4, p, d, flow=SPLIT, seed=p * 10 + d)
    cuts = [3, 6, 9, 10]
    reqs = [w.open_room(100 + i, f"t{i}", 10, cuts) for i in range(3)]
    assert all(req is not None for req in reqs)
    w.flush()
    for _ in cuts:
        for req in reqs:
            for rank in range(p):
                w.chunk_ready(req, rank)  # type: ignore[arg-type]
        w.flush()
    w.heal_and_settle()
    assert w.violations == [] and w.internal_errors() == []
    for req in reqs:
        assert req is not None
        assert w.server_view[("decode", req.room, req.tid)] is KVPoll.Success
        assert w.server_view[("prefill", req.room, req.tid)] is KVPoll.Success
        assert all((req.room, req.tid, i) in w.success_checked for i in range(d))  # bytes compared
    # Prefill's half ran every chunk of every room on every prefill rank, two halves each.
    assert sum(split.halves.values()) == 2 * len(cuts) * len(reqs) * p
    assert len(split.halves) == len(reqs) * p
    assert all(r.engine.rooms == {} for r in w.ranks)


def test_split_runs_in_the_simulator_and_a_short_campaign(split: SplitSender) -> None:
    s = sc.with_flow(sc.load(SCENARIO), SPLIT)  # the scenario checks read the registry
    res, _ = run_one(s, seed=1)
    assert res.violations == [] and res.succeeded == res.rooms > 0
    ran = sum(split.halves.values())
    assert ran > 0
    # Fault-drawing seeds: rooms may fail, the invariants (bytes, ownership, fences) may not.
    results = list(campaign(range(4), base=s))
    assert [r.violations for r in results] == [[]] * 4
    assert sum(r.succeeded for r in results) > 0 and sum(split.halves.values()) > ran


def test_scenarios_refuse_split_once_unregistered() -> None:
    with pytest.raises(sc.ScenarioError, match="split"):
        sc.with_flow(sc.load(SCENARIO), SPLIT)
