"""Driver.poll_writes over a transport that says which writes left PROC (the native engine, the
simulated fabric): a worker's poll of its own writes checks only the settled ones."""

from __future__ import annotations

from typing import Any

from kvferry.backends.driver import Driver
from kvferry.backends.transport import XferState
from kvferry.core.events import WriteDone, WriteFailed


class _Script:
    def __init__(self) -> None:
        self.heard: list[Any] = []

    def handle(self, ev: Any, now: int) -> list[Any]:
        self.heard.append(ev)
        return []

    def next_deadline(self) -> None:
        return None


class _Settling:
    """Handles are ints; ``states`` their NIXL state; ``settled`` what the engine announced."""

    def __init__(self) -> None:
        self.states: dict[int, XferState] = {}
        self.settled: set[int] | None = set()
        self.checked: list[int] = []

    def check_xfer(self, handle: int) -> XferState:
        self.checked.append(handle)
        return self.states[handle]

    def release_xfer(self, handle: int) -> None:
        pass

    def settled_handles(self) -> set[int] | None:
        return None if self.settled is None else set(self.settled)


def _driver(t: _Settling, core: _Script) -> Driver:
    d = Driver(core, t)  # type: ignore[arg-type]
    for wid, h in ((1, 101), (2, 102), (3, 103)):
        d.handles[wid] = h
        t.states[h] = XferState.PROC
    return d


def test_nothing_settled_checks_nothing() -> None:
    t, core = _Settling(), _Script()
    d = _driver(t, core)
    assert d.poll_writes(0, (1, 2)) == 0
    assert t.checked == [] and core.heard == [] and d.writes_pending((1, 2))


def test_only_the_settled_writes_of_the_ids_are_checked_and_fed_in_their_order() -> None:
    t, core = _Settling(), _Script()
    d = _driver(t, core)
    t.states.update({101: XferState.ERR, 102: XferState.DONE, 103: XferState.DONE})
    t.settled = {101, 102, 103}
    assert d.poll_writes(0, (2, 1)) == 2
    assert t.checked == [102, 101]  # 103 settled too, but not asked for
    assert [type(e) for e in core.heard] == [WriteDone, WriteFailed]
    assert not d.writes_pending((1, 2)) and d.writes_pending((3,))


def test_a_settled_write_still_in_proc_stays_in_flight() -> None:
    t, core = _Settling(), _Script()
    d = _driver(t, core)
    t.settled = {101}  # announced, but the check says PROC (a stale announcement)
    assert d.poll_writes(0, (1, 2)) == 0
    assert t.checked == [101] and d.writes_pending((1,))


def test_a_transport_that_cannot_tell_checks_every_asked_write() -> None:
    t, core = _Settling(), _Script()
    d = _driver(t, core)
    t.settled = None
    t.states[102] = XferState.DONE
    assert d.poll_writes(0, (1, 2)) == 1
    assert t.checked == [101, 102] and [type(e) for e in core.heard] == [WriteDone]
