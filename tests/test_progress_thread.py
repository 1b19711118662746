"""A native-engine rank with ``progress_threads=1`` runs one progress thread (base.py
``_progress_step``/``_wait_progress``): it sleeps on the control plane's inbox fd and the engine's
wake-up fd at once. By default, and on the python executor, a rank keeps its control and data
loops. Over real NIXL (UCX on DRAM) in this process.

Wake-ups are judged by what ended the thread's sleep (kvf_wait_fd's mask), never by wall time:
the idle cap and every deadline are tens of seconds, so a sleep that was not ended by its fd would
run out a long timeout and report 0.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvferry.backends import pattern
from kvferry.backends.nixl import native
from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
from kvferry.backends.runtime.base import PROGRESS_ENV
from kvferry.backends.runtime.staging import StagingConfig
from kvferry.core.deadlines import MS, SEC, Timeouts
from kvferry.core.geometry import PoolGeometry
from kvferry.core.kvpoll import KVPoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_setup import MODEL, TIMEOUTS

pytestmark = [
    pytest.mark.skipif(native.describe().startswith("python"), reason=native.describe()),
    pytest.mark.timeout(120),
]

LONG_S = 1.0  # a sleep this long is the idle thread's: the test acts while one is running
QUIET = Timeouts(  # nothing due for minutes: the thread's sleeps grow to the idle cap
    bootstrap_ns=100 * SEC,
    waiting_ns=100 * SEC,
    transfer_ns=100 * SEC,
    heartbeat_interval_ns=60 * SEC,
    heartbeat_timeout_ns=120 * SEC,
    fence_ns=400 * SEC,
    tombstone_ns=800 * SEC,
)


def _pair(cfg: RuntimeConfig, pages: int = 8) -> tuple[PrefillEndpoint, DecodeEndpoint]:
    pre = PrefillEndpoint("P", PoolGeometry(MODEL, 1, 0, 4, pages), config=cfg)
    dec = DecodeEndpoint(
        "D",
        PoolGeometry(MODEL, 1, 0, 4, pages),
        prefill_server="P",
        prefill_addresses=[pre.address],
        config=cfg,
    )
    return pre, dec


@pytest.fixture
def started(request) -> Iterator[tuple[PrefillEndpoint, DecodeEndpoint]]:
    pre, dec = _pair(request.param)
    for e in (pre, dec):
        e.start()
    yield pre, dec
    for e in (pre, dec):
        assert e.close() == []


def _progress(ep) -> list[str]:
    return sorted(lp.name.rsplit("-", 1)[1] for lp in ep._loops if "worker" not in lp.name)


@pytest.mark.parametrize(
    ("engine", "env", "want"),
    [
        ("native", "1", ["progress"]),
        ("python", "", ["control", "data"]),
        ("native", "", ["control", "data"]),
        ("native", "2", ["control", "data"]),
    ],
    ids=["native-one", "python", "native-auto-two", "native-forced-two"],
)
def test_progress_threads_by_engine_and_setting(
    engine: str, env: str, want: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PROGRESS_ENV, env)
    pre, dec = _pair(RuntimeConfig(num_queues=2, aux_rows=4, timeouts=TIMEOUTS, nixl_engine=engine))
    try:
        for e in (pre, dec):
            e.start()
            assert e.transport.executor == engine
            assert _progress(e) == want
            assert all(lp.thread.is_alive() for lp in e._loops)
    finally:
        for e in (pre, dec):
            assert e.close() == []


def test_progress_threads_is_checked() -> None:
    with pytest.raises(ValueError, match="progress_threads must be"):
        RuntimeConfig(progress_threads=3)
    with pytest.raises(ValueError, match="needs nixl_engine='native'"):
        RuntimeConfig(progress_threads=1)


def test_a_bad_progress_env_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROGRESS_ENV, "one")
    with pytest.raises(ValueError, match=r"\$KVFERRY_PROGRESS_THREADS must be 1 or 2, not 'one'"):
        _pair(RuntimeConfig(num_queues=1, aux_rows=4, nixl_engine="native"))


class Sleeps:
    """Records every sleep of an endpoint's one progress thread (not its workers') as (timeout,
    what woke it); ``long`` is set when one of at least LONG_S starts."""

    def __init__(self, ep) -> None:
        self._real = ep.transport.wait_events
        self.log: list[tuple[float, int]] = []
        self.long = threading.Event()
        ep.transport.wait_events = self

    def __call__(self, timeout_s: float, hot: bool | None = None, fd: int = -1) -> int | None:
        if not threading.current_thread().name.endswith("-progress"):
            return self._real(timeout_s, hot, fd)
        if timeout_s >= LONG_S:
            self.long.set()
        woke = self._real(timeout_s, hot, fd)
        self.log.append((timeout_s, woke))
        return woke

    def first_long(self) -> int:
        """What ended the first long sleep."""
        return next(w for t, w in self.log if t >= LONG_S)


QUIET_CFG = RuntimeConfig(
    num_queues=1,
    aux_rows=4,
    timeouts=QUIET,
    idle_max_s=30.0,
    nixl_engine="native",
    progress_threads=1,
    staging=StagingConfig(flow="direct"),
)


def _control_wakes_prefill(pre: PrefillEndpoint, dec: DecodeEndpoint) -> Sleeps:
    """Prefill's thread sleeps long with its engine quiet; decode's TransferInfo (a control
    message) reaches it. Returns prefill's sleeps once the sender heard it."""
    s = pre.sender(7, "t")
    s.init(0)
    sleeps = Sleeps(pre)
    assert sleeps.long.wait(60)
    dec.receiver(7, "t").init(np.arange(2), 6, 0)
    assert pre.board.wait_for(7, "t", {KVPoll.WaitingForInput}, 60) is KVPoll.WaitingForInput
    return sleeps


@pytest.mark.parametrize("started", [QUIET_CFG], indirect=True)
def test_a_control_message_ends_the_sleep_while_the_engine_is_quiet(started) -> None:
    sleeps = _control_wakes_prefill(*started)
    assert sleeps.first_long() & native.WOKE_FD


@pytest.mark.parametrize("started", [QUIET_CFG], indirect=True)
def test_planted_unregistered_inbox_fd_is_caught(started, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug the test above is for: the thread sleeps on the engine's fd alone. The control
    message then waits until the sleep runs out (what ended it: 0, a timeout)."""
    pre, dec = started
    monkeypatch.setattr(pre, "_control_fd", -1)
    sleeps = _control_wakes_prefill(pre, dec)
    assert sleeps.first_long() == 0


@pytest.mark.parametrize("started", [QUIET_CFG], indirect=True)
def test_a_notification_ends_the_sleep_while_the_socket_is_quiet(started) -> None:
    """Decode's thread sleeps long; prefill writes the room and its notification (NIXL, not the
    control plane): the engine's wake-up ends decode's sleep."""
    pre, dec = started
    rv = dec.receiver(9, "n")
    rv.init(np.arange(2), 6, 0)
    s = pre.sender(9, "n")
    s.write_aux(0, (9).to_bytes(8, "little"))  # decode checks the aux row names its room
    s.init(0)
    assert pre.board.wait_for(9, "n", {KVPoll.WaitingForInput}, 60) is KVPoll.WaitingForInput
    pattern.fill(pre.pool, pre.transport.region, 9, np.arange(2), 0, 6)
    sleeps = Sleeps(dec)
    assert sleeps.long.wait(60)
    s.send(np.arange(2), 6, is_last=True)
    assert rv.wait(60) is KVPoll.Success
    assert sleeps.first_long() & native.WOKE_ENGINE
    assert pattern.mismatches(dec.pool, dec.transport.region, 9, np.arange(2), 6)[0] == 0


BUSY = Timeouts(
    bootstrap_ns=20 * SEC,
    waiting_ns=20 * SEC,
    transfer_ns=20 * SEC,
    heartbeat_interval_ns=20 * MS,
    heartbeat_timeout_ns=2 * SEC,
    fence_ns=80 * SEC,
    tombstone_ns=160 * SEC,
)


@pytest.mark.parametrize(
    "started",
    [
        RuntimeConfig(
            num_queues=2,
            aux_rows=8,
            timeouts=BUSY,
            nixl_engine="native",
            progress_threads=1,
            staging=StagingConfig(flow="direct"),
        )
    ],
    indirect=True,
)
def test_heartbeats_leave_both_ranks_while_rooms_move(started) -> None:
    """Rooms run back to back until each side has heard five heartbeats more (no room is idle
    time: the next room starts as soon as the last one succeeded); no peer is lost."""
    pre, dec = started

    def heard() -> tuple[int, int]:
        with pre.lock, dec.lock:
            return pre.engine.counters["heartbeat_in"], dec.engine.counters["heartbeat_in"]

    start = heard()
    rooms = 0
    while min(n - s for n, s in zip(heard(), start, strict=True)) < 5:
        assert rooms < 2000, f"heartbeats heard: {heard()} from {start}"
        room, pages = 100 + rooms, np.arange(rooms % 2 * 4, rooms % 2 * 4 + 4)
        rv = dec.receiver(room, "h")
        rv.init(pages, 13, 0)
        pattern.fill(pre.pool, pre.transport.region, room, pages, 0, 13)
        s = pre.sender(room, "h")
        s.write_aux(0, room.to_bytes(8, "little"))
        s.init(0)
        s.send(pages, 13, is_last=True)
        assert (rv.wait(20), s.wait(20)) == (KVPoll.Success, KVPoll.Success)
        rv.clear()
        s.clear()
        rooms += 1
    for e in (pre, dec):
        with e.lock:
            assert e.engine.counters["peer_lost"] == 0
        assert e.errors == []
