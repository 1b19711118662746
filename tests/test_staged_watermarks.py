"""Decode's watermark pacing (core/flows/staged_wm.py): a new watermark goes at once only to a
writer it unblocks (a granted ring slot, its note not in, not writable under what the writer was
told and writable now); the others are owed it until a StagingRsp carries it, a heartbeat
repeats it, or a quarter heartbeat interval passes."""

from __future__ import annotations

from typing import Any

from kvferry.core import messages as m
from kvferry.core.deadlines import DeadlineHeap, Timeouts
from kvferry.core.flows.policy import Flow
from kvferry.core.flows.staged_rx import RxChunk, RxState
from kvferry.core.flows.staged_wm import OWED, WatermarkPacer
from kvferry.core.resources import RingSlot, Watermark

P0, P1 = m.Endpoint("prefill", 0), m.Endpoint("prefill", 1)
T = Timeouts(heartbeat_interval_ns=100, heartbeat_timeout_ns=1000)


class _Ctx:
    def __init__(self) -> None:
        self.deadlines = DeadlineHeap()
        self.timeouts = T
        self.sent: list[tuple[m.Endpoint, Any]] = []
        self.t = 0

    def send(self, peer: m.Endpoint, msg: Any) -> None:
        self.sent.append((peer, msg))

    def now(self) -> int:
        return self.t


def _pacer() -> tuple[_Ctx, WatermarkPacer]:
    ctx = _Ctx()
    return ctx, WatermarkPacer(ctx, lambda pool: ("wm", pool))  # type: ignore[arg-type]


def _granted(round_: int, start: int, end: int, writers: tuple[m.Endpoint, ...]) -> RxChunk:
    ch = RxChunk(0, 0, 4, Flow.RING, writers)
    ch.alloc = RingSlot(alloc_id=1, offset=start, round=round_, end=end, size=end - start)
    ch.offsets = {p: start for p in writers}
    ch.state = RxState.GRANTED
    return ch


def test_only_the_writer_a_new_watermark_unblocks_hears_it_now() -> None:
    ctx, pacer = _pacer()
    # Both writers were told (0, 0) with their grants; P0 holds a slot of the next lap that
    # needs the ring drained past 64, P1 holds nothing waiting.
    pacer.sent((P0, "ring"), Watermark(0, 0))
    pacer.sent((P1, "ring"), Watermark(0, 0))
    blocked = _granted(1, 0, 64, (P0,))
    pacer.moved("ring", Watermark(0, 32), [P0, P1], [blocked])  # still not writable: nobody now
    assert ctx.sent == [] and pacer.owed == {(P0, "ring"), (P1, "ring")}
    assert ctx.deadlines.next() == T.heartbeat_interval_ns // 4
    pacer.moved("ring", Watermark(0, 64), [P0, P1], [blocked])  # writable now: P0 at once
    assert ctx.sent == [(P0, ("wm", "ring"))] and pacer.owed == {(P1, "ring")}
    # A writer whose note is in no longer waits for the slot; a slot that was writable under
    # what its writer was told needs nothing new.
    blocked.notes[P0] = None  # type: ignore[assignment]
    pacer.moved("ring", Watermark(1, 0), [P0, P1], [_granted(0, 64, 128, (P1,)), blocked])
    assert ctx.sent[1:] == [] and pacer.owed == {(P0, "ring"), (P1, "ring")}
    # A grant of the next lap that the new watermark makes writable: its writer hears it now.
    pacer.moved("ring", Watermark(1, 64), [P0, P1], [_granted(2, 0, 64, (P1,))])
    assert ctx.sent[1:] == [(P1, ("wm", "ring"))] and pacer.owed == {(P0, "ring")}


def test_a_grant_or_heartbeat_pays_what_is_owed_and_the_deadline_sends_the_rest() -> None:
    ctx, pacer = _pacer()
    pacer.moved("pinned", Watermark(3, 0), [P0, P1], [])  # pinned lanes never wait on it
    assert ctx.sent == [] and OWED in ctx.deadlines
    pacer.sent((P0, "pinned"), Watermark(3, 0))  # a StagingRsp carried it
    assert pacer.owed == {(P1, "pinned")} and OWED in ctx.deadlines
    pacer.fire(lambda pool: Watermark(3, 0))
    assert ctx.sent == [(P1, ("wm", "pinned"))] and pacer.owed == set()
    assert pacer.told[(P1, "pinned")] == Watermark(3, 0)
    pacer.moved("pinned", Watermark(4, 0), [P0], [])
    pacer.sent((P0, "pinned"), Watermark(4, 0))  # the last owed one paid: no wake-up left
    assert OWED not in ctx.deadlines


def test_a_lost_writer_is_told_again_from_nothing() -> None:
    ctx, pacer = _pacer()
    pacer.sent((P0, "ring"), Watermark(2, 0))
    pacer.forget(P0)
    pacer.moved("ring", Watermark(2, 0), [P0], [_granted(2, 0, 64, (P0,))])
    assert ctx.sent == [(P0, ("wm", "ring"))]
