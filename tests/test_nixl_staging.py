"""NixlTransport's staged-flow primitives over real NIXL (UCX, DRAM), one process.

A staging region is registered with NIXL and offered in the Register; a staged write is one block
from a local staging range into the peer's, checked against both regions before NIXL sees it; a
gather/scatter runs on the rank's copy executor and ends DONE or ERR, never writing outside.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from kvferry.backends import pattern
from kvferry.backends.copy_exec import CopyRefused, HostCopyExecutor
from kvferry.backends.nixl import transport as nt
from kvferry.backends.nixl.errors import DescriptorError
from kvferry.backends.nixl.memory import RegionError
from kvferry.backends.nixl.transport import NixlTransport
from kvferry.backends.transport import XferState
from kvferry.core.flows.regions import PINNED_REGION, RING_REGION, worker_region
from kvferry.core.geometry import ModelGeometry, PoolGeometry
from kvferry.core.messages import Endpoint
from kvferry.core.staging_layout import StagingFormat, staged_map

MODEL = ModelGeometry("st", num_layers=2, num_kv_heads=4, head_dim=8)


def _pair(ring: int = 4096, worker: int = 4096, decode_tp: int = 1):
    pre = NixlTransport(Endpoint(server="P", rank=0), PoolGeometry(MODEL, 2, 0, 4, 16), role="prefill")
    dec = NixlTransport(Endpoint(server="D", rank=0), PoolGeometry(MODEL, decode_tp, 0, 4, 16), role="decode")
    for t in (pre, dec):
        t.register_regions(t.pool.regions, 4, 64)
    pre.register_staging({worker_region(0): np.zeros(worker, np.uint8)})
    dec.register_staging({RING_REGION: np.zeros(ring, np.uint8)}, ring_bytes=ring)
    pre.add_peer(dec.endpoint, dec.registration())
    return pre, dec


def _wait(pre, dec, h, copy=False, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    check = pre.check_copy if copy else pre.check_xfer
    while (s := check(h)) is XferState.PROC and time.monotonic() < end:
        dec.agent.progress()
        time.sleep(0.0005)
    return s


def test_register_offers_staging_and_one_block_lands_where_asked():
    pre, dec = _pair()
    try:
        reg = dec.registration()
        assert reg.ring_bytes == 4096 and RING_REGION in {r.region_id for r in reg.regions}
        src = pre.staging_view(worker_region(0))
        src[100:356] = np.arange(256, dtype=np.uint8)
        one = lambda v: np.array([v], dtype=np.int64)  # noqa: E731
        h = pre.post_write(
            dec.endpoint, one(worker_region(0)), one(100), one(RING_REGION), one(1000), one(256), b"n"
        )
        assert _wait(pre, dec, h) is XferState.DONE
        ring = dec.staging_view(RING_REGION)
        assert (ring[1000:1256] == np.arange(256, dtype=np.uint8)).all()
        assert not ring[:1000].any() and not ring[1256:].any()  # nothing outside the block
    finally:
        pre.close()
        dec.close()


@pytest.mark.parametrize(
    ("src_off", "dst_off", "length", "match"),
    [
        (0, 4000, 200, "outside staging region"),  # past the ring's end
        (4000, 0, 200, "outside staging region"),  # past the local buffer's end
        (-8, 0, 16, "outside staging region"),
        (0, 0, 0, "outside staging region"),
    ],
)
def test_staged_write_out_of_range_is_refused_before_nixl(src_off, dst_off, length, match):
    pre, dec = _pair()
    try:
        one = lambda v: np.array([v], dtype=np.int64)  # noqa: E731
        with pytest.raises(DescriptorError, match=match):
            pre.post_write(
                dec.endpoint,
                one(worker_region(0)),
                one(src_off),
                one(RING_REGION),
                one(dst_off),
                one(length),
                b"",
            )
        # The peer offered no pinned region: naming one is refused too.
        with pytest.raises(DescriptorError, match="no staging region"):
            pre.post_write(
                dec.endpoint, one(worker_region(0)), one(0), one(PINNED_REGION), one(0), one(8), b""
            )
        assert pre.agent.inflight() == 0
        assert not dec.staging_view(RING_REGION).any()
    finally:
        pre.close()
        dec.close()


def test_gather_scatter_round_trip_and_bad_maps_end_err_writing_nothing():
    pre, dec = _pair(decode_tp=1)
    try:
        pages = np.arange(3)
        pattern.fill(pre.pool, pre.region, 9, pages, 0, 10)
        smap = staged_map(pre.pool, pages, 0, 2, 0, 10, StagingFormat.LAYER_MAJOR, 64)
        h = pre.post_copy("gather", worker_region(0), (smap,))
        assert _wait(pre, dec, h, copy=True) is XferState.DONE
        pre.release_copy(h)
        buf = pre.staging_view(worker_region(0))
        assert buf[64 : 64 + smap.nbytes].any() and not buf[:64].any()
        # Scatter into a cleared pool restores exactly the gathered bytes.
        before = {r: pre.region(r).copy() for r in range(MODEL.num_regions)}
        for r in range(MODEL.num_regions):
            pre.region(r)[:] = 0
        h = pre.post_copy("scatter", worker_region(0), (smap,))
        assert _wait(pre, dec, h, copy=True) is XferState.DONE
        for r in range(MODEL.num_regions):
            assert (pre.region(r) == before[r]).all()
        # A map past the staging buffer: ERR, and not one byte written.
        bad = staged_map(pre.pool, pages, 0, 2, 0, 10, StagingFormat.LAYER_MAJOR, 4096 - 8)
        snapshot = buf.copy()
        h = pre.post_copy("gather", worker_region(0), (bad,))
        assert _wait(pre, dec, h, copy=True) is XferState.ERR
        assert "outside" in pre.copies.reason(h)
        assert (buf == snapshot).all()
        with pytest.raises(CopyRefused, match="no staging region"):
            pre.post_copy("gather", RING_REGION, (smap,))
    finally:
        pre.close()
        dec.close()


def test_staging_is_registered_once_and_only_under_staging_ids():
    t = NixlTransport(Endpoint(server="P", rank=1), PoolGeometry(MODEL, 2, 1, 4, 16), role="prefill")
    try:
        with pytest.raises(RegionError, match="register_regions"):
            t.register_staging({worker_region(0): np.zeros(64, np.uint8)})
        t.register_regions(t.pool.regions, 4, 64)
        with pytest.raises(RegionError, match="not a staging region"):
            t.register_staging({3: np.zeros(64, np.uint8)})
        t.register_staging({worker_region(0): np.zeros(64, np.uint8)})
        with pytest.raises(RegionError, match="once"):
            t.register_staging({worker_region(1): np.zeros(64, np.uint8)})
        assert isinstance(t.copies, HostCopyExecutor)
    finally:
        t.close()


def test_a_pool_too_big_for_a_fine_list_still_registers_and_direct_is_refused_with_the_reason(monkeypatch):
    # The H100 failure: a long-context pool's head-slice list exceeded NIXL's limit, add_peer
    # raised, and every room failed later with "no registered peer". Now the peer registers,
    # staged writes work, and a direct write that needs the fine list says why it cannot.
    monkeypatch.setattr(nt, "MAX_PREP_DESCS", 64)
    pre, dec = _pair()
    try:
        assert pre.has_peer(dec.endpoint)
        one = lambda v: np.array([v], dtype=np.int64)  # noqa: E731
        h = pre.post_write(
            dec.endpoint, one(worker_region(0)), one(0), one(RING_REGION), one(0), one(64), b""
        )
        assert _wait(pre, dec, h) is XferState.DONE
        with pytest.raises(DescriptorError, match="use a staged flow"):
            pre.post_write(dec.endpoint, one(0), one(16), one(0), one(16), one(16), b"")
    finally:
        pre.close()
        dec.close()
