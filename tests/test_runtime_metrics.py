"""Prometheus metrics of real endpoints (backends/runtime/metrics.py): real rooms over NIXL, the
exporter scraped over HTTP, every number checked against what the test ran."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
import zmq
from kvferry.backends import pattern
from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
from kvferry.backends.runtime.metrics import reason_class
from kvferry.backends.zmqctl import pack_parts
from kvferry.core.deadlines import MS, SEC, Timeouts
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.kvpoll import KVPoll
from kvferry.core.planner import plan_rank_pair

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

MODEL = ModelGeometry("met", num_layers=2, num_kv_heads=2, head_dim=8)
TIMEOUTS = Timeouts(
    bootstrap_ns=10 * SEC,
    waiting_ns=10 * SEC,
    transfer_ns=10 * SEC,
    heartbeat_interval_ns=100 * MS,
    heartbeat_timeout_ns=5 * SEC,
    fence_ns=4 * SEC,
    tombstone_ns=30 * SEC,
)
ROOMS, TOKENS, CHUNKS = 5, 10, (4, 10)


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("server", "rank", "role")))
            out[(s.name, labels)] = s.value
    return out


def test_exporter_numbers_match_the_rooms_run():
    cfg = RuntimeConfig(timeouts=TIMEOUTS, aux_rows=8, metrics=True, metrics_port=0)
    pool = PoolGeometry(MODEL, 1, 0, 4, 32)
    pre = PrefillEndpoint("P", pool, config=cfg)
    dec = DecodeEndpoint("D", pool, prefill_server="P", prefill_addresses=[pre.address], config=cfg)
    pre.start()
    dec.start()
    try:
        assert pre.metrics.port > 0 and dec.metrics.port > 0 and pre.metrics.port != dec.metrics.port
        for i in range(ROOMS):
            pages = np.arange(i * 3, i * 3 + 3)
            rv = dec.receiver(i, f"t{i}")
            rv.init(pages, TOKENS, i)
            pattern.fill(pre.pool, pre.transport.region, i, pages, 0, TOKENS)
            tx = pre.sender(i, f"t{i}")
            tx.write_aux(i, i.to_bytes(8, "little"))
            tx.init(i)
            for end in CHUNKS:
                tx.send(pages, end, is_last=end == TOKENS)
            assert (rv.wait(15), tx.wait(15)) == (KVPoll.Success, KVPoll.Success)
        # One room decode aborts before prefill sends a byte: Failed on both sides.
        rv = dec.receiver(99, "gone")
        rv.init(np.arange(20, 23), TOKENS, 7)
        tx = pre.sender(99, "gone")
        tx.init(7)
        rv.abort("scheduler gave up")
        assert (rv.wait(15), tx.wait(15)) == (KVPoll.Failed, KVPoll.Failed)
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(pre.address)
        for _ in range(3):
            raw.send(pack_parts([b"mallory#0", b"", b"no tag"]))
        got = {}
        for _ in range(500):  # until the control plane has judged the three frames
            got = _scrape(pre.metrics.port)
            if got.get(("kvferry_control_frames_rejected_total", (("reason", "untagged"),))) == 3:
                break
        raw.close(0)
        d = _scrape(dec.metrics.port)
    finally:
        assert pre.close() == [] and dec.close() == []

    # Rooms by outcome and reason, on each side.
    assert got[("kvferry_rooms_total", (("outcome", "success"), ("reason", "")))] == ROOMS
    assert got[("kvferry_rooms_total", (("outcome", "failed"), ("reason", "aborted")))] == 1  # decode's Abort
    assert d[("kvferry_rooms_total", (("outcome", "success"), ("reason", "")))] == ROOMS
    assert d[("kvferry_rooms_total", (("outcome", "failed"), ("reason", "aborted")))] == 1
    assert got[("kvferry_room_seconds_count", (("flow", "direct"), ("outcome", "success")))] == ROOMS
    assert d[("kvferry_room_seconds_count", (("flow", "direct"), ("outcome", "success")))] == ROOMS
    assert got[("kvferry_room_seconds_sum", (("flow", "direct"), ("outcome", "success")))] > 0  # open->end
    # Bytes and transfers: every chunk one write of its tokens (one rank each side, same layout,
    # pages contiguous per room), plus one aux row per room.
    writes = ROOMS * (len(CHUNKS) + 1)
    room_bytes = plan_rank_pair(pool, pool, np.arange(3), np.arange(3), 0, TOKENS).total_bytes
    assert room_bytes == TOKENS * pool.token_bytes * len(pool.regions)  # K and V of every layer
    nbytes = ROOMS * (room_bytes + cfg.aux_row_bytes)
    assert got[("kvferry_bytes_posted_total", ())] == nbytes
    assert got[("kvferry_transfers_total", (("status", "done"),))] == writes
    assert got[("kvferry_transfers_total", (("status", "err"),))] == 0
    lat = ("kvferry_transfer_seconds_count", (("flow", "direct"), ("op", "write"), ("status", "done")))
    assert got[lat] == writes
    requested = got[("kvferry_descriptors_total", (("kind", "requested"),))]
    assert 0 < got[("kvferry_descriptors_total", (("kind", "posted"),))] <= requested
    # Nothing was resent or deferred; three forged frames rejected, none on decode.
    assert got[("kvferry_notices_total", (("event", "gave_up"), ("kind", "room_failed")))] == 0
    assert got[("kvferry_chunk_deferrals_total", ())] == 0
    assert got[("kvferry_control_frames_rejected_total", (("reason", "untagged"),))] == 3
    assert d.get(("kvferry_control_frames_rejected_total", (("reason", "untagged"),)), 0) == 0
    assert ("kvferry_bytes_posted_total", ()) in d  # decode posts nothing but still exports


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("aborted: scheduler gave up", "aborted"),
        ("failed on D#0: aborted: x", "peer_failed"),
        ("timed out while transferring", "timeout"),
        ("RoomError: chunk 3 from P#0 ends past", "remote_violation"),
        ("peer P#1 lost (no heartbeat)", "peer_lost"),
        ("failed on P#0 after release: x", "failed_after_release"),
        ("anything a peer could make up " * 10, "other"),
    ],
)
def test_failure_reasons_fall_in_a_fixed_set(reason: str, label: str):
    assert reason_class(reason) == label
