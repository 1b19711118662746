"""The lock-check debug mode (backends/lockcheck.py) beyond the core engine: the driver's in-flight
tables, the native executor's transfer/settled/notification tables and the host copy executor's
jobs check their lock on every use in the suite, so a lock dropped from any of them fails a test
(the suite's autouse fixture fails on a violation in any thread)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from kvferry.backends.copy_exec import HostCopyExecutor
from kvferry.backends.lockcheck import GuardedTable, LockDisciplineError
from kvferry.backends.nixl import native
from kvferry.backends.runtime import RuntimeConfig
from kvferry.core.kvpoll import KVPoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_lock_discipline as ld  # its room helper and violation taker, shared rather than copied

MODEL = ld.MODEL

pytestmark = pytest.mark.skipif(native.describe().startswith("python"), reason=native.describe())


@pytest.fixture
def pair():
    yield from ld.endpoints(RuntimeConfig(num_queues=2, aux_rows=4, nixl_engine="native"))


def test_native_endpoints_run_with_every_table_guarded(pair) -> None:
    pre, dec = pair
    for ep in (pre, dec):
        assert ep.transport.executor == "native"
        eng = ep.transport.agent._nixl
        for table in (eng._xfers, eng._settled, eng._notifs, ep.driver.handles, ep.driver.copies):
            assert isinstance(table, GuardedTable)
    for room in range(3):
        assert ld._room(pre, dec, room) == (KVPoll.Success, KVPoll.Success)
    assert ld._take_violations() == []


def test_a_native_table_used_without_its_lock_is_a_violation(pair) -> None:
    pre, _ = pair
    eng = pre.transport.agent._nixl
    assert len(eng._xfers) >= 0 and not eng._notifs  # peeks need no lock
    with pytest.raises(LockDisciplineError, match=r"NativeNixl\._xfers\.get entered by thread"):
        eng._xfers.get(1)
    with pytest.raises(LockDisciplineError, match=r"NativeNixl\._settled\.iter"):
        set(eng._settled)
    with eng._lock:
        assert eng._xfers.get(1) is None
    with pytest.raises(LockDisciplineError, match=r"Driver\.handles\.in"):
        _ = 5 in pre.driver.handles
    assert len(ld._take_violations()) == 3


def test_a_dropped_lock_in_the_native_executor_fails_the_run(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: settled() reads its table without the lock, as a careless edit would; the data
    thread's next poll records the violation."""
    pre, dec = pair
    honest = native.NativeNixl.settled
    state = {"planted": True, "running": 0}  # under `count`: a call is planted or not at once
    count = threading.Lock()

    def careless(self: native.NativeNixl) -> set[int]:
        with count:
            if not state["planted"]:
                return honest(self)
            state["running"] += 1
        try:
            self.drain()
            return set(self._settled)
        finally:
            with count:
                state["running"] -= 1

    monkeypatch.setattr(native.NativeNixl, "settled", careless)
    ld._room(pre, dec, 7)
    with count:
        state["planted"] = False
    end = time.monotonic() + 10
    while time.monotonic() < end:  # a data thread still inside the planted read records first
        with count:
            if state["running"] == 0:
                break
        time.sleep(0.001)
    found = ld._take_violations()
    assert found and all("NativeNixl._settled" in v for v in found)


def test_host_copy_jobs_are_guarded() -> None:
    ex = HostCopyExecutor({}, {0: np.zeros(16, dtype=np.uint8)}, "lk")
    try:
        assert isinstance(ex._jobs, GuardedTable)
        with pytest.raises(LockDisciplineError, match=r"HostCopyExecutor\._jobs"):
            ex._jobs.pop(1, None)
        assert ex.pending() == 0
    finally:
        ex.close()
    assert len(ld._take_violations()) == 1
