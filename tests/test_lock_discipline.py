"""Lock discipline debug mode (backends/lockcheck.py): on in the suite (tests/conftest.py),
every entry into an endpoint's engine asserts that the calling thread holds the endpoint lock,
so a lock removed from the runtime (e.g. in the status sync, base.py ``_sync``) fails a test."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
from kvferry.backends import lockcheck, pattern
from kvferry.backends.lockcheck import GuardedEngine, LockDisciplineError, OwnedLock
from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
from kvferry.backends.runtime.base import EndpointBase
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll

MODEL = ModelGeometry("lk", num_layers=1, num_kv_heads=2, head_dim=8)


def endpoints(cfg: RuntimeConfig):
    """A started prefill and decode endpoint pair (a fixture's body: closed cleanly after)."""
    pre = PrefillEndpoint("P", PoolGeometry(MODEL, 1, 0, 4, 16), config=cfg)
    dec = DecodeEndpoint(
        "D", PoolGeometry(MODEL, 1, 0, 4, 16), prefill_server="P", prefill_addresses=[pre.address], config=cfg
    )
    pre.start()
    dec.start()
    yield pre, dec
    assert pre.close() == [] and dec.close() == []


@pytest.fixture
def pair():
    yield from endpoints(RuntimeConfig(num_queues=2, aux_rows=4))


def _room(pre, dec, room: int):
    pages = np.arange(4)
    rv = dec.receiver(room, f"t{room}")
    rv.init(pages, 10, 0)
    pattern.fill(pre.pool, pre.transport.region, room, pages, 0, 10)
    tx = pre.sender(room, f"t{room}")
    tx.write_aux(0, room.to_bytes(8, "little"))
    tx.init(0)
    tx.send(pages, 10, is_last=True)
    return rv.wait(15.0), tx.wait(15.0)


def _take_violations() -> list[str]:
    found = list(lockcheck.VIOLATIONS)
    del lockcheck.VIOLATIONS[:]
    return found


def test_the_suite_runs_endpoints_in_the_debug_mode(pair):
    pre, dec = pair
    assert lockcheck.enabled()
    for ep in (pre, dec):
        assert isinstance(ep.lock, OwnedLock)
        assert isinstance(ep.engine, GuardedEngine) and ep.driver.engine is ep.engine
    assert _room(pre, dec, 1) == (KVPoll.Success, KVPoll.Success)  # the runtime keeps the rule


def test_entering_the_engine_without_the_lock_raises_and_is_recorded(pair):
    pre, _ = pair
    with pre.lock:
        assert pre.engine.rooms is not None
    with pytest.raises(LockDisciplineError, match=r"SenderEngine\.rooms .* without the endpoint lock"):
        _ = pre.engine.rooms
    with pytest.raises(LockDisciplineError, match="counters"):
        pre.engine.counters = None
    assert len(_take_violations()) == 2


def test_a_violation_in_another_thread_is_recorded_even_if_swallowed(pair):
    pre, _ = pair

    def sloppy() -> None:
        with contextlib.suppress(LockDisciplineError):  # swallowed: the record stays
            pre.engine.poll(1)

    t = threading.Thread(target=sloppy, name="sloppy")
    t.start()
    t.join()
    found = _take_violations()
    assert len(found) == 1 and "'sloppy'" in found[0]


def test_a_status_sync_without_the_lock_fails(pair, monkeypatch):
    """What removing ``with self.lock`` from ``EndpointBase._sync`` does under the mode."""

    def unlocked_sync(self, room: int, tid: str) -> None:
        live = self.engine.rooms.get(room)
        if live is None or live.tid != tid:
            return
        self.board.update(room, tid, self.engine.poll(room), "", None)

    monkeypatch.setattr(EndpointBase, "_sync", unlocked_sync)
    _, dec = pair
    with pytest.raises(LockDisciplineError, match=r"ReceiverEngine\.rooms"):
        dec.receiver(2, "t2").init(np.arange(4), 10, 0)
    assert _take_violations()


def test_owned_lock_knows_its_holder():
    lock = OwnedLock()
    seen: list[bool] = []
    with lock:
        assert lock.held_by_me() and lock.locked()
        t = threading.Thread(target=lambda: seen.append(lock.held_by_me()))
        t.start()
        t.join()
    assert seen == [False] and not lock.held_by_me() and not lock.locked()
    lock.acquire()
    t = threading.Thread(target=lambda: seen.append(_release_fails(lock)))
    t.start()
    t.join()
    assert seen[-1] is True
    lock.release()


def _release_fails(lock: OwnedLock) -> bool:
    try:
        lock.release()
    except RuntimeError:
        return True
    return False


def test_off_unless_the_variable_says_1(monkeypatch):
    monkeypatch.setenv(lockcheck.ENV, "0")
    assert not lockcheck.enabled()
    assert not isinstance(lockcheck.new_lock(), OwnedLock)
