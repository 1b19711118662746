"""The driver's trace hook and the hop timeline built from it (``kvferry bench nixl --trace``):
real NIXL on DRAM in one process, and the row attribution on its own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from kvferry.backends.runtime import RuntimeConfig
from kvferry.backends.runtime.staging import StagingConfig
from kvferry.backends.runtime.tracing import DriverTrace, chrome, hops
from kvferry.core.commands import PostWrite
from kvferry.core.events import ControlIn, WriteDone
from kvferry.core.kvpoll import KVPoll
from kvferry.core.messages import Endpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_setup import TIMEOUTS, two_to_one


@pytest.mark.parametrize("flow", ["push", "pull"])
def test_every_room_is_traced_across_both_sides_in_order(flow: str) -> None:
    cfg = RuntimeConfig(num_queues=2, aux_rows=16, timeouts=TIMEOUTS, staging=StagingConfig(flow=flow))
    pre, dec = two_to_one(cfg, 32)
    traces = [DriverTrace(f"prefill{r}") for r in range(2)] + [DriverTrace("decode0")]
    for ep, tr in zip([*pre, dec], traces, strict=True):
        ep.driver.trace = tr
        ep.start()
    rooms = [300 + i for i in range(3)]
    try:
        for i, room in enumerate(rooms):
            pages = np.arange(i * 4, i * 4 + 4)
            rv = dec.receiver(room, f"t{i}")
            rv.init(pages, 13, i)
            senders = [p.sender(room, f"t{i}") for p in pre]
            for s in senders:
                s.write_aux(i, room.to_bytes(8, "little"))
                s.init(i)
                s.send(pages, 13, is_last=True)
            assert rv.wait(20.0) is KVPoll.Success
            assert [s.wait(20.0) for s in senders] == [KVPoll.Success] * 2
            rv.clear()
            for s in senders:
                s.clear()
    finally:
        for ep in [*pre, dec]:
            assert ep.close() == []
    rows = [r for tr in traces for r in tr.rows()]
    got = {h["label"]: h for h in hops(rows)}
    moved = "decode0 posted PostRead" if flow == "pull" else "prefill0 posted PostWrite"
    done = "decode0 in WriteDone" if flow == "pull" else "prefill0 in WriteDone"
    for label in ("decode0 in ReceiverOpen", moved, done, "decode0 run StatusChanged Success"):
        assert got[label]["count"] == len(rooms), label  # every room, and done rows found their room
    assert got["decode0 in ReceiverOpen"]["median_us"] == 0.0
    order = [got[x]["median_us"] for x in ("decode0 in ReceiverOpen", moved, done)]
    assert order == sorted(order)
    # Decode's Success follows what told it the bytes landed: its own READ's completion (pull),
    # the write's notification (push; prefill may notice its DONE later).
    landed = done if flow == "pull" else "decode0 in NotificationIn"
    assert got[landed]["median_us"] <= got["decode0 run StatusChanged Success"]["median_us"]
    events = chrome(rows)
    named = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert all((e["pid"], e["tid"]) in named for e in events if e["ph"] == "i")
    assert len([e for e in events if e["ph"] == "i"]) == len(rows)
    json.dumps(events)


def test_rows_attribute_completions_to_the_room_of_their_post_and_name_garbage() -> None:
    tr = DriverTrace("prefill0")
    peer = Endpoint(server="decode", rank=0)
    z = np.zeros(1, np.int64)
    tr(
        "run",
        PostWrite(
            write_id=7,
            peer=peer,
            room=42,
            src_region=z,
            src_offset=z,
            dst_region=z,
            dst_offset=z,
            length=z,
            notif=b"",
        ),
    )
    tr("in", WriteDone(write_id=7))
    tr("in", WriteDone(write_id=8))  # never posted here: no room
    tr("in", ControlIn(data=b"\xffnot a message"))
    rows = tr.rows()
    assert [(r["name"], r["room"]) for r in rows] == [
        ("PostWrite", 42),
        ("WriteDone", 42),
        ("WriteDone", -1),
        ("ControlIn (undecodable)", -1),
    ]
    assert [r["t_ns"] for r in rows] == sorted(r["t_ns"] for r in rows)


def test_hops_count_from_decodes_open_and_skip_warmup_rooms_and_rooms_decode_never_saw() -> None:
    def row(t: int, node: str, name: str, room: int) -> dict[str, object]:
        return {"t_ns": t, "node": node, "thread": "x", "what": "in", "name": name, "room": room}

    rows = [
        row(500, "decode0", "ControlIn StagingReq", 1),  # came before decode opened: not the base
        row(1_000, "decode0", "ReceiverOpen", 1),
        row(4_000, "prefill0", "WriteDone", 1),
        row(10_000, "decode0", "ReceiverOpen", 2),
        row(12_000, "prefill0", "WriteDone", 2),
        row(5_000, "prefill0", "WriteDone", 3),  # decode never saw room 3: no time base
        row(0, "decode0", "ReceiverOpen", 9),  # warm-up
        row(900_000, "prefill0", "WriteDone", 9),
    ]
    got = {h["label"]: h for h in hops(rows, skip_rooms=frozenset({9}))}
    assert got["prefill0 in WriteDone"] == {"label": "prefill0 in WriteDone", "median_us": 2.5, "count": 2}
