"""Chunks planned ahead through the threaded runtime over real NIXL (DRAM, one process): on both
executors, with prepared-list and one-shot descriptors, rooms whose chunks were named ahead
(``KVSender.plan_ahead``) land every byte, post what was prepared, leave no prepared transfer
behind, and a chunk named with other pages is planned as ever. On the native engine a prepared
chunk is posted by the thread that calls ``send``; with ``nixl_post_on_send`` off, by the worker."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from kvferry.backends import pattern
from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
from kvferry.backends.runtime.staging import StagingConfig
from kvferry.core.geometry import PoolGeometry
from kvferry.core.kvpoll import KVPoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_setup import MODEL, TIMEOUTS, two_to_one

pytestmark = pytest.mark.timeout(180)


def one_to_one(cfg: RuntimeConfig) -> tuple[list[PrefillEndpoint], DecodeEndpoint]:
    pre = [PrefillEndpoint("P", PoolGeometry(MODEL, 1, 0, 4, 64), config=cfg)]
    dec = DecodeEndpoint(
        "D",
        PoolGeometry(MODEL, 1, 0, 4, 64),
        prefill_server="P",
        prefill_addresses=[pre[0].address],
        config=cfg,
    )
    return pre, dec


def wait_status(senders: list, status: KVPoll) -> None:
    end = time.monotonic() + 20
    while any(s.poll() is not status for s in senders) and time.monotonic() < end:
        time.sleep(0.002)


def _record_steppers(pre) -> list[str]:
    """The names of the threads that step prefill's chunks, one per step, as they run."""
    steppers: list[str] = []
    for p in pre:
        step = p.driver.worker_step

        def recorded(shard: int, now: int, step=step) -> tuple[int, ...] | None:
            steppers.append(threading.current_thread().name)
            return step(shard, now)

        p.driver.worker_step = recorded
    return steppers


@pytest.mark.parametrize(
    ("engine", "post", "tp", "on_send"),
    [
        ("python", "auto", "1->1", True),
        ("native", "auto", "1->1", True),
        ("native", "prepped", "2->1", True),
        ("native", "oneshot", "1->1", False),
    ],
)
def test_rooms_named_ahead_land_and_leave_nothing_prepared(
    engine: str, post: str, tp: str, on_send: bool
) -> None:
    cfg = RuntimeConfig(
        num_queues=2,
        aux_rows=16,
        timeouts=TIMEOUTS,
        staging=StagingConfig(flow="direct"),  # TP 2->1 too: only a direct room plans ahead
        nixl_engine=engine,
        nixl_direct_post=post,
        nixl_post_on_send=on_send,
    )
    pre, dec = one_to_one(cfg) if tp == "1->1" else two_to_one(cfg, 64)
    steppers = _record_steppers(pre)
    try:
        for e in [*pre, dec]:
            e.start()
        if engine == "native":
            assert {e.transport.executor for e in [*pre, dec]} == {"native"}
        for i in range(4):
            room, tid, tokens, cuts = 400 + i, f"a{i}", 61, [40, 61]
            pages = np.arange(i * 16, i * 16 + 16)
            rv = dec.receiver(room, tid)
            rv.init(pages, tokens, i)
            senders = []
            for p in pre:
                pattern.fill(p.pool, p.transport.region, room, pages, 0, tokens)
                s = p.sender(room, tid)
                s.write_aux(i, room.to_bytes(8, "little"))
                s.init(i)
                named = np.roll(pages, 1) if i == 3 else pages  # room 3: other pages: planned as ever
                s.plan_ahead(named, cuts[0], is_last=False)
                senders.append(s)
            wait_status(senders, KVPoll.WaitingForInput)  # decode's TransferInfo is in: planned
            for c, end in enumerate(cuts):
                for s in senders:
                    s.send(pages, end, is_last=c == len(cuts) - 1)
                    if c + 1 < len(cuts):
                        s.plan_ahead(pages, cuts[c + 1], is_last=True)
            assert rv.wait(20) is KVPoll.Success
            assert [s.wait(20) for s in senders] == [KVPoll.Success] * len(pre)
            assert pattern.mismatches(dec.pool, dec.transport.region, room, pages, tokens)[0] == 0
            rv.clear()
            for s in senders:
                s.clear()
        deadline = time.monotonic() + 10
        while any(v for e in [*pre, dec] for v in e.leaks().values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(v == 0 for e in [*pre, dec] for v in e.leaks().values())
        for p in pre:
            with p.lock:
                c, errors = dict(p.engine.counters), dict(p.driver.errors)
            assert (c.get("ahead_posted"), c.get("ahead_mismatch")) == (7, 1), c
            assert errors == {}, errors
        on_caller = sum(name == "MainThread" for name in steppers)
        if engine == "native" and on_send:
            assert on_caller >= 7 * len(pre) // 2  # most prepared chunks posted by send itself
        else:
            assert on_caller == 0
    finally:
        for e in [*pre, dec]:
            assert e.close() == []


def _granted(p: PrefillEndpoint, room: int, tid: str, chunk: int) -> bool:
    """Prefill rank ``p`` holds staging space for the room's chunk on every decode rank."""
    with p.lock:
        r = p.engine.rooms.get(room)
        led = p.engine.staged.ledgers.get((room, tid))
        if r is None or led is None:
            return False
        lanes = [led.lanes.get((chunk, t)) for t in p.engine._targets(r)]
        return bool(lanes) and all(x is not None and x.grant is not None for x in lanes)


@pytest.mark.parametrize(("engine", "tp"), [("python", "2->1"), ("native", "1->1"), ("native", "2->1")])
def test_ring_rooms_named_ahead_ask_space_first_and_send_launches_the_gather(engine: str, tp: str) -> None:
    """A ring chunk named ahead has its staging space asked for when it is named; once granted,
    its ``send`` runs the chunk's step (its gathers) on the caller's thread (native engine)."""
    cfg = RuntimeConfig(
        num_queues=2,
        aux_rows=16,
        timeouts=TIMEOUTS,
        staging=StagingConfig(worker_buffer_bytes=32 << 10, ring_bytes=128 << 10, flow="ring"),
        nixl_engine=engine,
    )
    pre, dec = one_to_one(cfg) if tp == "1->1" else two_to_one(cfg, 64)
    steppers = _record_steppers(pre)
    try:
        for e in [*pre, dec]:
            e.start()
        rooms = 3
        for i in range(rooms):
            room, tid, tokens, cuts = 500 + i, f"r{i}", 61, [24, 48, 61]
            pages = np.arange(i * 16, i * 16 + 16)
            rv = dec.receiver(room, tid)
            rv.init(pages, tokens, i)
            senders = []
            for p in pre:
                pattern.fill(p.pool, p.transport.region, room, pages, 0, tokens)
                s = p.sender(room, tid)
                s.write_aux(i, room.to_bytes(8, "little"))
                s.init(i)
                s.plan_ahead(pages, cuts[0], is_last=False)
                senders.append(s)
            for c, end in enumerate(cuts):
                # Space asked when named: wait for the grant, then the send finds it in.
                end_wait = time.monotonic() + 20
                while not all(_granted(p, room, tid, c) for p in pre) and time.monotonic() < end_wait:
                    time.sleep(0.002)
                for s in senders:
                    s.send(pages, end, is_last=c == len(cuts) - 1)
                    if c + 1 < len(cuts):
                        s.plan_ahead(pages, cuts[c + 1], is_last=c + 2 == len(cuts))
            assert rv.wait(20) is KVPoll.Success
            assert [s.wait(20) for s in senders] == [KVPoll.Success] * len(pre)
            assert pattern.mismatches(dec.pool, dec.transport.region, room, pages, tokens)[0] == 0
            rv.clear()
            for s in senders:
                s.clear()
        deadline = time.monotonic() + 10
        while any(v for e in [*pre, dec] for v in e.leaks().values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(v == 0 for e in [*pre, dec] for v in e.leaks().values())
        for p in pre:
            with p.lock:
                errors = {k: v for k, v in p.driver.errors.items() if k != "chunk_deferred"}
            assert errors == {}, errors
        on_caller = sum(name == "MainThread" for name in steppers)
        if engine == "native":
            # Every chunk's space was in at its send: most steps ran on the caller's thread (a
            # send finding its shard's worker mid-step leaves the chunk to it).
            assert on_caller >= rooms * len(cuts) * len(pre) // 2, (on_caller, len(steppers))
        else:
            assert on_caller == 0
    finally:
        for e in [*pre, dec]:
            assert e.close() == []
