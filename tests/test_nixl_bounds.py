"""Every index a peer sends is bounds-checked before a byte moves, over real NIXL.

A peer's Register gives its region ids, sizes, aux rows and aux row size; its TransferInfo gives
page ids (which the planner turns into region offsets) and an aux row. Each test here hands the
transport one index past what the peer registered and checks two things: the post is refused
with DescriptorError, and not one byte of the peer's memory changed (a write that landed in a
neighbour, the next room's pages or aux row, would show). Planting the removal of a check (e.g.
the aux row-size comparison in ``NixlTransport.post_aux_write``) fails the matching test.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from kvferry.backends.nixl.errors import DescriptorError
from kvferry.backends.nixl.transport import AUX_REGION_ID, NixlTransport
from kvferry.backends.transport import XferState
from kvferry.core.errors import PlanError
from kvferry.core.geometry import Layout, ModelGeometry, PoolGeometry
from kvferry.core.messages import Endpoint
from kvferry.core.planner import plan_rank_pair

MODEL = ModelGeometry("bounds", num_layers=1, num_kv_heads=2, head_dim=8)
ROWS = 4


def _pair(pre_row: int = 64, dec_row: int = 64):
    pool = PoolGeometry(MODEL, 1, 0, 4, 8, Layout.SGLANG_NHD)
    p = NixlTransport(Endpoint("P", 0), pool, role="prefill")
    d = NixlTransport(Endpoint("D", 0), pool, role="decode")
    p.register_regions(pool.regions, ROWS, pre_row)
    d.register_regions(pool.regions, ROWS, dec_row)
    p.add_peer(d.endpoint, d.registration())
    return p, d


def _memory(d: NixlTransport) -> dict[int, bytes]:
    """Every byte decode registered: its pool regions and its aux rows."""
    out = {spec.region_id: d.region(spec.region_id).tobytes() for spec in d.pool.regions}
    out[AUX_REGION_ID] = bytes(d._views[AUX_REGION_ID])  # DRAM: the whole aux region
    return out


def _fill(d: NixlTransport) -> None:
    rng = np.random.default_rng(7)
    for spec in d.pool.regions:
        r = d.region(spec.region_id)
        r[:] = rng.integers(0, 255, r.size, dtype=np.uint8)
    for i in range(ROWS):
        d.write_aux_row(i, bytes([0xA0 + i]) * d.aux_row_bytes)


def _settle(p: NixlTransport, d: NixlTransport, h) -> XferState:
    end = time.monotonic() + 10
    while (s := p.check_xfer(h)) is XferState.PROC and time.monotonic() < end:
        d.agent.progress()
        time.sleep(0.0005)
    return s


def _refused_and_untouched(p: NixlTransport, d: NixlTransport, post) -> None:
    _fill(d)
    before = _memory(d)
    try:
        h = post()
    except DescriptorError:
        h = None
    if h is not None:  # the check is missing: let the write land, then show where it went
        _settle(p, d, h)
    after = _memory(d)
    changed = {rid: _diff(before[rid], after[rid]) for rid in before}
    assert h is None, f"the post was accepted; bytes changed per region: {changed}"
    assert before == after


def _diff(a: bytes, b: bytes) -> int:
    return int(np.count_nonzero(np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8)))


def test_an_aux_row_larger_than_the_peers_is_refused():
    # Prefill's rows are 128 B, decode's 64 B: a row written whole at decode row 1 would run
    # into row 2, the next room's aux row.
    p, d = _pair(pre_row=128, dec_row=64)
    try:
        p.write_aux_row(0, b"\x11" * 128)
        _refused_and_untouched(p, d, lambda: p.post_aux_write(d.endpoint, 0, 1, b"aux"))
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("row", [ROWS, ROWS + 1, -1, 1 << 40])
def test_an_aux_row_past_the_peers_rows_is_refused(row: int):
    p, d = _pair()
    try:
        _refused_and_untouched(p, d, lambda: p.post_aux_write(d.endpoint, 0, row, b"aux"))
    finally:
        p.close()
        d.close()


def _one(x: int) -> np.ndarray:
    return np.array([x], dtype=np.int64)


@pytest.mark.parametrize(
    ("what", "region", "offset", "length"),
    [
        ("a region id the peer never registered", 999, 0, 64),
        ("the aux region through the KV list", AUX_REGION_ID, 0, 64),
        ("an offset one granule past the region", 0, None, 64),
        ("a run crossing the region's end", 0, -64, 128),
        ("a negative offset", 0, -64 * 10**6, 64),
    ],
)
def test_a_kv_write_outside_the_peers_regions_is_refused(what: str, region: int, offset, length: int):
    p, d = _pair()
    try:
        size = d.pool.regions[0].nbytes
        off = size if offset is None else (size + offset if -size < offset < 0 else offset)
        post = lambda: p.post_write(  # noqa: E731
            d.endpoint, _one(0), _one(0), _one(region), _one(off), _one(length), b"kv"
        )
        _refused_and_untouched(p, d, post)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("pages", [[8], [-1], [0, 8], [3, 3]])
def test_page_ids_past_the_peers_pool_never_become_descriptors(pages: list[int]):
    # TransferInfo.dst_pages reach the transport only through the planner, which checks them
    # against the pool the peer registered (8 pages here); a repeated page is refused too.
    pool = PoolGeometry(MODEL, 1, 0, 4, 8, Layout.SGLANG_NHD)
    with pytest.raises(PlanError, match=r"page id|repeat"):
        plan_rank_pair(pool, pool, np.arange(len(pages)), np.array(pages), 0, 4 * len(pages))


@pytest.mark.parametrize(("start", "end"), [(0, 33), (-1, 4), (5, 4)])
def test_token_ranges_past_the_pages_never_become_descriptors(start: int, end: int):
    pool = PoolGeometry(MODEL, 1, 0, 4, 8, Layout.SGLANG_NHD)
    with pytest.raises(PlanError):
        plan_rank_pair(pool, pool, np.arange(8), np.arange(8), start, end)
