"""Pull and push over real NIXL (DRAM, one process, the threaded runtime as it stands).

The runtime (backends/runtime) has no per-room flow option yet, so each test sets the flow on the
prefill engines' policy (``FlowPolicy.override``) and, for pull, hands each engine its own
registration (what the runtime will pass once it builds the engine with it). Everything else is
the production path: the driver executes decode's ``PostRead`` through ``NixlTransport.post_read``
and the bytes are compared at decode's Success.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from kvferry.backends import pattern
from kvferry.backends.runtime import RuntimeConfig
from kvferry.backends.runtime.staging import StagingConfig
from kvferry.core.flows import Flow
from kvferry.core.kvpoll import KVPoll

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_setup import TIMEOUTS, two_to_one


@pytest.fixture(params=["pull", "push"])
def servers(request):
    flow = Flow(request.param)
    cfg = RuntimeConfig(num_queues=2, aux_rows=16, timeouts=TIMEOUTS, staging=StagingConfig(flow=flow.value))
    pre, dec = two_to_one(cfg, 32)
    for e in [*pre, dec]:
        e.start()
    yield flow, pre, dec
    for e in [*pre, dec]:
        assert e.close() == []


def test_rooms_move_every_byte_over_nixl(servers):
    flow, pre, dec = servers
    for i in range(4):
        pages = np.arange(i * 4, i * 4 + 4)
        room, tid = 200 + i, f"t{i}"
        rv = dec.receiver(room, tid)
        rv.init(pages, 13, i)
        senders = []
        for p in pre:
            pattern.fill(p.pool, p.transport.region, room, pages, 0, 13)
            s = p.sender(room, tid)
            s.write_aux(i, room.to_bytes(8, "little"))
            s.init(i)
            senders.append(s)
        for k, end in enumerate([5, 13]):
            for s in senders:
                s.send(pages, end, is_last=k == 1)
        assert rv.wait(20.0) is KVPoll.Success
        assert [s.wait(20.0) for s in senders] == [KVPoll.Success] * 2
        assert pattern.mismatches(dec.pool, dec.transport.region, room, pages, 13)[0] == 0
        rv.clear()
        for s in senders:
            s.clear()
    deadline = time.monotonic() + 10
    while any(v for e in [*pre, dec] for v in e.leaks().values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(v == 0 for e in [*pre, dec] for v in e.leaks().values())
    counts = []
    for p in pre:
        with p.lock:  # the engine only under its endpoint's lock
            counts.append(
                p.engine.counters["read_notif"]
                if flow is Flow.PULL
                else p.engine.leases.counters.get("delivered", 0)
            )
    if flow is Flow.PULL:
        assert sum(counts) > 0  # decode READ the KV
    else:
        assert sum(counts) >= 4
