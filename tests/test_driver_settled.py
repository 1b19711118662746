"""Driver.poll_writes over a transport that says which writes left PROC (the native engine, the
simulated fabric): a worker's poll of its own writes checks only the settled ones."""

from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace
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


def _awaiting_endpoint(d: Driver, shards: int) -> Any:
    """The parts of a PrefillEndpoint its ``_await`` and ``_on_writes_done`` use (no NIXL)."""
    from kvferry.backends.runtime.prefill import PrefillEndpoint

    ep = PrefillEndpoint.__new__(PrefillEndpoint)
    ep.driver = d
    ep._writes_done = [threading.Event() for _ in range(shards)]
    ep._in_flight = [deque() for _ in range(shards)]
    ep._worker_loops = [SimpleNamespace(stop_event=threading.Event()) for _ in range(shards)]
    d.on_writes_done = ep._on_writes_done
    return ep


def test_a_worker_awaiting_its_writes_is_woken_by_the_data_threads_poll(monkeypatch: Any) -> None:
    """The worker sleeps until a poll elsewhere feeds its writes (its own sleep never times out
    here), and each write is fed once."""
    from kvferry.backends.runtime import prefill

    monkeypatch.setattr(prefill, "WORKER_IDLE_S", 3600.0)
    t, core = _Settling(), _Script()
    d = _driver(t, core)
    ep = _awaiting_endpoint(d, 2)
    ep._in_flight[1].append((1, 2))
    worker = threading.Thread(target=ep._await, args=(1, (1, 2)), daemon=True)
    worker.start()
    t.states.update({101: XferState.DONE, 102: XferState.DONE})
    t.settled = {101}
    assert d.poll_writes(0) == 1  # the data thread: one of the two, the worker sleeps on
    assert not ep._writes_done[0].is_set()  # shard 0 awaits nothing: not woken
    t.settled = {102}
    assert d.poll_writes(0) == 1
    worker.join(30)
    alive = worker.is_alive()
    ep._worker_loops[1].stop_event.set()
    ep._writes_done[1].set()
    assert not alive, "the worker was not woken by the completion"
    assert [type(e) for e in core.heard] == [WriteDone, WriteDone] and not d.handles.keys() & {1, 2}
