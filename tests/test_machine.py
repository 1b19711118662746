"""The table engine (core/machine.py) on a toy room machine: the table decides, a failed step's
commands never leave, Failed is reached only through the FAIL input, a local caller's mistake
propagates with the room untouched."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.core.errors import LocalMisuseError
from kvferry.core.identity_enum import IdentityEnum
from kvferry.core.machine import (
    IllegalStep,
    RoomError,
    RoomFailure,
    RoomStateError,
    TableEngine,
    Transition,
    fire,
    step,
)


class S(IdentityEnum):
    IDLE = "idle"
    BUSY = "busy"
    DONE = "done"
    FAILED = "failed"


class I(IdentityEnum):  # noqa: E742 (a toy alphabet)
    GO = "go"
    FINISH = "finish"
    FAIL = "fail"


class Room:
    def __init__(self) -> None:
        self.state = S.IDLE
        self.failure: RoomFailure | None = None


class Toy(TableEngine):
    FAILED, SUCCESS, FAIL = S.FAILED, S.DONE, I.FAIL

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self._now = 0
        self._out: list[Any] = []
        self.forgotten: list[Any] = []
        self.entered: list[S] = []

    def run(self, r: Room, inp: I, payload: Any) -> list[Any]:
        self._out = out = []
        self._dispatch(r, inp, payload)
        self._out = []
        return out

    def _entered(self, r: Room) -> None:
        self.entered.append(r.state)

    def _maybe_finish(self, r: Room) -> None:
        pass

    def _forget_command(self, r: Room, cmd: Any) -> None:
        self.forgotten.append(cmd)

    def _h_go(self, r: Room, inp: I, payload: str) -> str:
        self._out.append(f"post {payload}")
        if payload == "garbage":
            raise RoomError("a peer sent garbage")
        if payload == "ours":
            raise RoomStateError("our own state")
        if payload == "misuse":
            raise LocalMisuseError("the caller's mistake")
        return payload  # "running", or an outcome the table does not list

    def _h_fail(self, r: Room, inp: I, payload: tuple[RoomFailure, dict[str, Any]]) -> str:
        r.failure = payload[0]
        self._out.append("status failed")
        return "failed"


_FAIL = step(Toy._h_fail, failed=S.FAILED)
Toy.TABLE = {
    S.IDLE: {I.GO: step(Toy._h_go, running=S.BUSY), I.FAIL: _FAIL},
    S.BUSY: {I.FINISH: step(lambda e, r, i, p: "done", done=S.DONE), I.FAIL: _FAIL},
    S.DONE: {I.FAIL: _FAIL},
    S.FAILED: {i: step(Toy._h_ignore_fail, stay=S.FAILED) for i in I},
}


def test_an_accepted_step_lets_its_commands_out_and_moves_by_the_table() -> None:
    e, r = Toy(), Room()
    assert e.run(r, I.GO, "running") == ["post running"]
    assert r.state is S.BUSY and e.entered == [S.BUSY]


@pytest.mark.parametrize(("payload", "remote"), [("garbage", 1), ("ours", 0), ("bogus-outcome", 0)])
def test_a_failed_step_never_lets_its_commands_out(payload: str, remote: int) -> None:
    e, r = Toy(), Room()
    out = e.run(r, I.GO, payload)
    assert out == ["status failed"]  # the failure's own status leaves, the step's post does not
    assert e.forgotten == [f"post {payload}"]
    assert r.state is S.FAILED and r.failure is not None
    assert e.counters["commands_withdrawn"] == 1
    assert e.counters["remote_violation"] == remote  # a peer's garbage is told apart from ours


def test_an_input_the_table_does_not_list_fails_the_room_without_running_a_handler() -> None:
    e, r = Toy(), Room()
    assert e.run(r, I.FINISH, None) == ["status failed"]
    assert r.state is S.FAILED and "not allowed while idle" in r.failure.reason  # type: ignore[union-attr]
    assert e.counters["illegal_input"] == 1


def test_a_local_misuse_propagates_and_leaves_the_room_as_it_was() -> None:
    e, r = Toy(), Room()
    with pytest.raises(LocalMisuseError):
        e.run(r, I.GO, "misuse")
    assert r.state is S.IDLE and r.failure is None


def test_fail_goes_through_the_table_and_failed_absorbs_a_second_failure() -> None:
    e, r = Toy(), Room()
    e.fail(r, RoomFailure("first"))
    e.fail(r, RoomFailure("second"))
    assert r.state is S.FAILED and r.failure == RoomFailure("first")


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from(list(I)), st.sampled_from(["running", "garbage", "ours", "x"]))))
def test_any_input_sequence_stays_on_the_table(steps: list[tuple[I, str]]) -> None:
    e, r = Toy(), Room()
    for inp, payload in steps:
        before = r.state
        if inp is I.FAIL:
            payload = (RoomFailure("why"), {})  # type: ignore[assignment]
        e.run(r, inp, payload)
        tr = Toy.TABLE[before].get(inp)
        assert r.state is S.FAILED or (tr is not None and r.state in tr.targets)
        if before is S.FAILED:
            assert r.state is S.FAILED  # absorbing


def test_fire_checks_input_and_outcome_before_moving() -> None:
    class Lane:
        state = S.IDLE

    table = {S.IDLE: {I.GO: Transition(lambda lane, out: out, {"ok": S.BUSY})}}
    lane = Lane()
    with pytest.raises(IllegalStep):
        fire(table, lane, I.GO, "nope")
    assert lane.state is S.IDLE
    with pytest.raises(IllegalStep):
        fire(table, lane, I.FINISH)
    assert fire(table, lane, I.GO, "ok") == "ok" and lane.state is S.BUSY
