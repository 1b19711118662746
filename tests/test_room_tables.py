"""Every per-room table is known to its engine and reports everything it holds: a flow's per-room
records live in the flow's own registered tables (not on the room), and no accessor filters."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from kvferry.core import messages as m
from kvferry.core.events import LayersReady
from kvferry.core.flows.push import PushSender
from kvferry.core.geometry import ModelGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.core.resources.leases import strip_retry_suffix

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H

TINY4 = ModelGeometry("tiny4", num_layers=2, num_kv_heads=4, head_dim=4)

D0 = m.Endpoint("decode", 0)
KEY = (7, "t7")


def _push_sender() -> PushSender:
    return PushSender(
        lease_ns=10**9,
        match_ns=10**9,
        tombstone_ns=10**9,
        push_match="transfer_id",
        base_id=strip_retry_suffix,
        counters=Counter(),
        on_refused=lambda *a: None,
        clock=lambda: 0,
        policy_override=lambda: None,
    )


def _info() -> m.TransferInfo:
    return m.TransferInfo(
        src=D0,
        room=KEY[0],
        transfer_id=KEY[1],
        reg=1,
        dst_pages=[0, 1],
        num_tokens=8,
        aux_index=0,
        send_aux=True,
        dummy=False,
        expected_infos=1,
        token_start=0,
    )


def test_a_released_push_room_is_reported_while_its_lease_fences_and_gone_when_it_ends() -> None:
    ps = _push_sender()
    ps.register(KEY, _info(), 0)
    ps.finish(KEY, 0)
    ps.post(KEY, D0, 1)  # one write in flight under the lease
    ps.abort(KEY, 2)  # the room failed: the lease fences until that write finishes
    tid, rid = ps._reg_ids(ps.keys[KEY][D0])
    ps.forget_room(KEY)  # the room is gone, its lease is not
    assert ps.mentions(KEY[0]) and ps.size() == 1
    ps.leases.write_done(tid, rid, False, 3)  # the write finished: the lease ends
    ps.tick(4)
    # The entry itself is gone (a filter on live leases would only have hidden it).
    assert not ps.mentions(KEY[0]) and ps.size() == 0 and ps.rooms == {}


def test_flow_records_live_in_registered_tables_emptied_with_the_room() -> None:
    for flow in ("pull", "layerwise"):
        w = H.World(TINY4, 2, 1, flow=flow, seed=3)
        req = w.open_room(100, "t0", 10, [4, 10])
        w.flush()
        for chunk in range(2):  # both chunks, on every prefill rank
            for q in range(w.P):
                w.chunk_ready(req, q)
                if flow == "layerwise":  # its forward reports the layers, here all at once
                    ev = LayersReady(
                        room=100,
                        transfer_id="t0",
                        chunk_index=chunk,
                        first_layer=0,
                        end_layer=TINY4.num_layers,
                    )
                    w.prefill[q].driver.feed(ev, w.fabric.now)
            w.flush()
        w.heal_and_settle()
        assert w.violations == [] and w.internal_errors() == []
        assert w.server_view[("decode", 100, "t0")] is KVPoll.Success
        assert w.server_view[("prefill", 100, "t0")] is KVPoll.Success
        for r in w.ranks:
            sizes = r.engine.table_sizes()
            assert all(n == 0 for n in sizes.values()), (flow, r.side, sizes)
            assert r.engine.references(100) == []
        names = {name for r in w.ranks for name in r.engine.table_sizes()}
        flow_tables = {"pull": {"pull_rooms", "reads"}, "layerwise": {"layer_lanes", "layer_notes"}}
        assert flow_tables[flow] <= names, names


def test_a_pull_room_keeps_its_reads_in_the_flows_table_not_on_the_room() -> None:
    w = H.World(TINY4, 1, 1, flow="pull", num_shards=1)
    req = w.open_room(7, "t7", 8, [8])
    w.flush()
    w.chunk_ready(req, 0)
    for _ in range(10):  # until decode's READ is posted (left unfinished)
        while w.fabric.pending:
            w.deliver(0)
        while w.run_worker(0, 0):
            pass
        w.pump()
        if any(x.read for x in w.fabric.writes):
            break
    dec = w.decode[0].engine
    room = dec.rooms[7]
    assert not hasattr(room, "reads") and dec.pull_rx.reading(room)
    assert dec.table_sizes()["pull_rooms"] == 1 and {"pull_rooms", "reads"} <= set(dec.references(7))
    w.heal_and_settle()
    assert w.server_view[("decode", 7, "t7")] is KVPoll.Success
    assert dec.table_sizes()["pull_rooms"] == 0 and dec.references(7) == []


def test_referencing_many_rooms_is_the_union_of_each_rooms_references() -> None:
    """``referencing`` (the simulator's end-of-run check) skips empty tables: an empty table must
    name no room, mid-flight as at the end, on every flow's tables."""
    for flow in ("direct", "ring", "pinned", "pull", "push", "layerwise"):
        w = H.World(TINY4, 2, 1, flow=flow, seed=3)
        reqs = [w.open_room(room, f"t{room}", 10, [4, 10]) for room in (100, 101)]
        w.flush()
        w.chunk_ready(reqs[0], 0)  # one chunk of one room on one rank: tables part full
        rooms = (100, 101, 102)
        for step in range(3):
            for r in w.ranks:
                eng = r.engine
                want = {name for room in rooms for name in eng.references(room)}
                assert eng.referencing(rooms) == want, (flow, step, r.side)
                sizes = eng.table_sizes()
                assert all(sizes[n] for n in want if n in sizes), (flow, step, sizes, want)
            assert any(r.engine.referencing(rooms) for r in w.ranks)
            if w.fabric.pending:
                w.deliver(0)
            else:
                w.pump()
        w.heal_and_settle()
        assert all(r.engine.referencing(rooms) == set() for r in w.ranks)
