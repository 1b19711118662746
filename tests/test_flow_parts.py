"""The room machines reach their flow components only through RankFlowPart's hooks and routes
(core/flows/parts.py): a test-only component composed into a rank hears a room's life, gets the
messages and deadlines it claims, and can hold a room back, without any core file naming it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from kvferry.core import messages as m
from kvferry.core.commands import FreePages, PostWrite
from kvferry.core.errors import LocalMisuseError
from kvferry.core.events import AbortRoom, ControlIn, ReleaseRoom, Tick, WriteDone
from kvferry.core.flows.parts import FlowTable, RankFlowPart, earliest
from kvferry.core.identity_enum import IdentityEnum
from kvferry.core.kvpoll import KVPoll
from kvferry.core.machine import step
from kvferry.core.receiver import ReceiverEngine
from kvferry.core.sender import SenderEngine, SState

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_receiver import P0, P1, P2, ack, open_ev
from test_receiver import engine as receiver_engine
from test_sender import D0, ROOM, TID, chunk, engine, run, waiting


class Recorder(RankFlowPart):
    """Logs every hook it hears; ``busy`` makes it hold rooms back."""

    def __init__(self, busy: bool = False) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.busy = busy
        self.due: int | None = None

    def quiet(self, key: Any) -> bool:
        return not self.busy

    def writing(self, r: Any) -> bool:
        return self.busy

    def room_failed(self, r: Any) -> None:
        self.log.append(("room_failed", r.key))

    def forget(self, r: Any) -> None:
        self.log.append(("forget", r.key))

    def opened(self, r: Any) -> None:
        self.log.append(("opened", r.key))

    def transfer_info(self, r: Any, info: m.TransferInfo) -> None:
        self.log.append(("transfer_info", r.key, info.src))

    def peer_lost(self, peer: m.Endpoint, rooms: Any) -> None:
        self.log.append(("peer_lost", peer, [r.key for r in rooms]))

    def routes(self) -> dict[type, Any]:
        return {m.Stopped: lambda msg: self.log.append(("message", type(msg).__name__))}

    def deadline_kinds(self) -> dict[str, Any]:
        return {"probe": lambda what: self.log.append(("deadline", what))}

    def next_deadline(self) -> int | None:
        return self.due

    def tick(self, now: int) -> None:
        self.log.append(("tick", now))


def with_part(e: Any, part: RankFlowPart) -> Any:
    e._route_parts((*e.parts, part))
    return e


def test_a_composed_component_hears_the_rooms_life_in_order() -> None:
    rec = Recorder()
    e = waiting(with_part(engine(), rec))
    e.handle(AbortRoom(room=ROOM, transfer_id=TID, reason="test"), 1)
    e.handle(ReleaseRoom(room=ROOM, transfer_id=TID), 2)
    key = (ROOM, TID)
    assert rec.log == [("opened", key), ("transfer_info", key, D0), ("room_failed", key), ("forget", key)]
    assert e.state(ROOM) is None


def test_a_busy_component_holds_a_room_back_from_success() -> None:
    rec = Recorder(busy=True)
    e = waiting(with_part(engine(), rec))
    cmds = run(e, chunk(0, 6, True))
    for c in cmds:
        if type(c) is PostWrite:
            e.handle(WriteDone(write_id=c.write_id), 0)
    assert e.state(ROOM) is SState.TRANSFERRING  # every write landed; the component is not quiet


def test_claimed_messages_deadlines_and_clock_go_to_their_component() -> None:
    rec = Recorder()
    e = with_part(engine(), rec)
    e.handle(ControlIn(data=m.encode(m.Stopped(src=D0, room=ROOM, transfer_id=TID))), 0)
    assert ("message", "Stopped") in rec.log and not e.counters["wrong_side_message"]
    rec.due = 5
    assert e.next_deadline() == 5
    e.deadlines.set(("probe", 42), 7)
    e.handle(Tick(), 7)
    assert ("deadline", 42) in rec.log and ("tick", 7) in rec.log


def test_a_lost_peer_is_told_with_the_rooms_it_served() -> None:
    rec = Recorder()
    e = waiting(with_part(engine(), rec))
    e.handle(Tick(), e.timeouts.heartbeat_timeout_ns + 1)
    assert ("peer_lost", D0, [(ROOM, TID)]) in rec.log


def test_a_component_writing_a_failed_rooms_pages_keeps_them() -> None:
    rec = Recorder(busy=True)
    e = with_part(receiver_engine(), rec)
    assert isinstance(e, ReceiverEngine)
    e.handle(open_ev(), 0)
    for p in (P0, P1, P2):
        e.handle(ack(p), 0)
    cmds = e.handle(AbortRoom(room=ROOM, transfer_id=TID, reason="test"), 1)
    for p in (P0, P1, P2):
        cmds += e.handle(ControlIn(data=m.encode(m.Stopped(src=p, room=ROOM, transfer_id=TID))), 2)
    assert ("room_failed", (ROOM, TID)) in rec.log
    assert not [c for c in cmds if type(c) is FreePages]  # fenced, but the component writes them
    rec.busy = False
    cmds = e.handle(ReleaseRoom(room=ROOM, transfer_id=TID), 3)
    assert [c for c in cmds if type(c) is FreePages] and ("forget", (ROOM, TID)) in rec.log


def test_two_components_cannot_claim_one_message() -> None:
    e: SenderEngine = engine()
    with pytest.raises(LocalMisuseError, match="two flow components"):
        e._route_parts((*e.parts, Recorder(), Recorder()))


class PokeIn(IdentityEnum):
    POKE = "poke"


class Poker(RankFlowPart):
    """A component with a room input of its own: allowed while the room waits, where "go" moves
    the room to Transferring."""

    def __init__(self) -> None:
        self.poked: list[Any] = []

    def _h_poke(self, r: Any, inp: PokeIn, payload: str) -> str:
        self.poked.append((r.key, payload))
        return payload

    def table(self) -> FlowTable:
        w, t = KVPoll.WaitingForInput, KVPoll.Transferring
        return {w: {PokeIn.POKE: step(Poker._h_poke, stay=w, go=t)}}


def test_a_components_own_input_runs_on_the_room_table_by_status() -> None:
    poker = Poker()
    e = waiting(with_part(engine(), poker))
    assert e.transition(SState.WAITING, PokeIn.POKE) is not None
    e.flows.ctx.flow_input(ROOM, TID, PokeIn.POKE, "stay")
    assert e.state(ROOM) is SState.WAITING and poker.poked == [((ROOM, TID), "stay")]
    e.flows.ctx.flow_input(ROOM, TID, PokeIn.POKE, "go")
    assert e.state(ROOM) is SState.TRANSFERRING  # the component's table moved the room
    # A status its table does not list fails the room like any pair the room's table omits.
    e.flows.ctx.flow_input(ROOM, TID, PokeIn.POKE, "stay")
    assert e.state(ROOM) is SState.FAILED and "poke not allowed while transferring" in e.failure(ROOM).reason
    assert len(poker.poked) == 2 and e.counters["illegal_input"] == 1


def test_two_components_cannot_claim_one_input() -> None:
    e: SenderEngine = engine()
    with pytest.raises(LocalMisuseError, match="two tables"):
        e._route_parts((*e.parts, Poker(), Poker()))


def test_earliest_skips_unset_times() -> None:
    assert earliest([None, 9, None, 4]) == 4 and earliest([None]) is None and earliest([]) is None
