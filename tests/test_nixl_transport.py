"""NixlTransport over real NIXL (UCX, DRAM): planner descriptors land exactly where planned.

Every rank of both servers is a real transport (one NIXL agent each) in this process; the
expected decode memory is computed by the independent reference model applying the same plans.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.backends.nixl.errors import DescriptorError, NixlError, NixlPeerError
from kvferry.backends.nixl.transport import NixlTransport, decode_blob, pair_granule
from kvferry.backends.transport import Transport, XferState
from kvferry.core.errors import WireError
from kvferry.core.geometry import DType, Layout, ModelGeometry, PoolGeometry
from kvferry.core.messages import Endpoint, RegionAddr
from kvferry.core.planner import plan_rank_pair

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refmodel


def _wait(t: NixlTransport, h, targets=(), timeout_s: float = 10.0) -> XferState:
    """Poll a write; targets are polled too (no NIXL progress thread, as in the runtime)."""
    end = time.monotonic() + timeout_s
    while (s := t.check_xfer(h)) is XferState.PROC and time.monotonic() < end:
        for d in targets:
            d.agent.progress()
        time.sleep(0.0005)
    return s


def _servers(model, ptp, dtp, ps_p, ps_d, np_p, np_d, lay_p, lay_d, aux_rows=4):
    pre = [
        NixlTransport(
            Endpoint(server="P", rank=r), PoolGeometry(model, ptp, r, ps_p, np_p, lay_p), role="prefill"
        )
        for r in range(ptp)
    ]
    dec = [
        NixlTransport(
            Endpoint(server="D", rank=r), PoolGeometry(model, dtp, r, ps_d, np_d, lay_d), role="decode"
        )
        for r in range(dtp)
    ]
    for t in pre + dec:
        t.register_regions(t.pool.regions, aux_rows, 64)
    return pre, dec


@st.composite
def _rooms(draw):
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8]))
    model = ModelGeometry(
        "m",
        draw(st.integers(1, 2)),
        heads,
        draw(st.sampled_from([4, 8])),
        draw(st.sampled_from(list(DType))),
        mla,
    )
    tps = [t for t in (1, 2, 4) if (t <= heads and heads % t == 0) or (t > heads and t % heads == 0)]
    tokens = draw(st.integers(1, 64))
    ps_p, ps_d = draw(st.sampled_from([1, 4, 16])), draw(st.sampled_from([1, 4, 16]))
    cuts = sorted({draw(st.integers(0, tokens)) for _ in range(draw(st.integers(0, 2)))} | {0, tokens})
    return {
        "model": model,
        "ptp": draw(st.sampled_from(tps)),
        "dtp": draw(st.sampled_from(tps)),
        "ps_p": ps_p,
        "ps_d": ps_d,
        "need_p": -(-tokens // ps_p),
        "need_d": -(-tokens // ps_d),
        "lay_p": draw(st.sampled_from(list(Layout))),
        "lay_d": draw(st.sampled_from(list(Layout))),
        "tokens": tokens,
        "cuts": cuts,
        "seed": draw(st.integers(0, 2**31)),
    }


@settings(max_examples=8)
@given(room=_rooms())
def test_planned_bytes_land_exactly(room):
    rng = np.random.default_rng(room["seed"])
    np_p, np_d = room["need_p"] + 2, room["need_d"] + 2
    pre, dec = _servers(
        room["model"],
        room["ptp"],
        room["dtp"],
        room["ps_p"],
        room["ps_d"],
        np_p,
        np_d,
        room["lay_p"],
        room["lay_d"],
    )
    try:
        src_pages = rng.permutation(np_p)[: room["need_p"]]
        dst_pages = rng.permutation(np_d)[: room["need_d"]]
        expected = []
        for d in dec:
            for r in d.pool.regions:
                d.region(r.region_id)[:] = rng.integers(0, 256, r.nbytes, dtype=np.uint8)
            expected.append({r.region_id: d.region(r.region_id).copy() for r in d.pool.regions})
        for p in pre:
            for r in p.pool.regions:
                p.region(r.region_id)[:] = rng.integers(0, 256, r.nbytes, dtype=np.uint8)
            for d in dec:
                p.add_peer(d.endpoint, d.registration())
        handles = []
        for a, b in zip(room["cuts"], room["cuts"][1:], strict=False):
            for p in pre:
                src_mem = {r.region_id: p.region(r.region_id) for r in p.pool.regions}
                for d, exp in zip(dec, expected, strict=True):
                    plan = plan_rank_pair(p.pool, d.pool, src_pages, dst_pages, a, b)
                    if plan.count == 0:
                        continue
                    refmodel.apply_plan(plan, src_mem, exp)
                    args = (plan.src_region, plan.src_offset, plan.dst_region, plan.dst_offset, plan.length)
                    handles.append((p, p.post_write(d.endpoint, *args, b"")))
        for p, h in handles:
            assert _wait(p, h, dec) is XferState.DONE
        for d, exp in zip(dec, expected, strict=True):
            for rid, want in exp.items():
                assert np.array_equal(d.region(rid), want), f"decode rank {d.pool.tp_rank} region {rid}"
    finally:
        for t in pre + dec:
            t.close()


def test_transport_protocol_aux_notifs_and_control():
    model = ModelGeometry("tiny", 2, 4, 8)
    pre, dec = _servers(model, 2, 1, 4, 4, 8, 8, Layout.SGLANG_NHD, Layout.SGLANG_NHD)
    p, d = pre[0], dec[0]
    try:
        assert isinstance(p, Transport)
        p.add_peer(d.endpoint, d.registration())
        p.add_peer(d.endpoint, d.registration())  # idempotent
        p.write_aux_row(2, (987654321).to_bytes(8, "little") + b"meta")
        h = p.post_aux_write(d.endpoint, 2, 3, b"aux-note")
        assert _wait(p, h, dec) is XferState.DONE
        p.release_xfer(h)
        assert d.read_aux_room(3) == 987654321
        p.send_notif(d.endpoint, b"bare")
        got: list[bytes] = []
        end = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < end:
            got += d.drain_notifs()
            time.sleep(0.001)
        assert got == [b"aux-note", b"bare"]
        with pytest.raises(DescriptorError):
            p.post_aux_write(d.endpoint, 2, 4, b"")  # decode has 4 aux rows
        with pytest.raises(DescriptorError):
            d.read_aux_room(-1)
        with pytest.raises(NixlPeerError):
            p.post_aux_write(Endpoint(server="X", rank=0), 0, 0, b"")
        d.connect(p.endpoint, p.control_address)
        d.send_control(p.endpoint, b"reg")
        assert p.recv_control(5.0) == [b"reg"]
        p.send_control(d.endpoint, b"ack")  # address learned from the inbound message
        assert d.recv_control(5.0) == [b"ack"]
        p.drop_peer(d.endpoint)
        with pytest.raises(NixlPeerError):
            p.post_aux_write(d.endpoint, 0, 0, b"")
    finally:
        for t in pre + dec:
            t.close()


def test_registration_rejects_bad_metadata_and_regions():
    model = ModelGeometry("tiny", 1, 2, 8)
    pre, dec = _servers(model, 1, 1, 4, 4, 4, 4, Layout.SGLANG_NHD, Layout.SGLANG_NHD)
    try:
        reg = dec[0].registration()
        with pytest.raises(WireError):
            decode_blob(b"\x00garbage")
        bad = reg.__class__(**{**{f: getattr(reg, f) for f in reg.__struct_fields__}, "agent_meta": b"junk"})
        with pytest.raises(WireError):
            pre[0].add_peer(dec[0].endpoint, bad)
        # A peer table claiming a region bigger than the peer registered cannot be written past:
        # NIXL refuses the remote list (the memory is not registered there).
        top = max(reg.regions, key=lambda r: r.addr)  # enlarged past its end, overlapping nothing
        big = [
            RegionAddr(region_id=r.region_id, addr=r.addr, nbytes=r.nbytes * (4 if r is top else 1))
            for r in reg.regions
        ]
        lying = reg.__class__(**{**{f: getattr(reg, f) for f in reg.__struct_fields__}, "regions": big})
        with pytest.raises(NixlError, match="NOT_FOUND"):
            pre[0].add_peer(dec[0].endpoint, lying)
        assert not pre[0].has_peer(dec[0].endpoint)
    finally:
        for t in pre + dec:
            t.close()


def test_pair_granule_divides_every_planned_descriptor():
    model = ModelGeometry.preset("qwen3-8b")
    for ptp, dtp, lay in [
        (1, 1, Layout.SGLANG_NHD),
        (2, 1, Layout.SGLANG_NHD),
        (1, 2, Layout.VLLM_HND),
        (8, 2, Layout.SGLANG_NHD),
    ]:
        for pr in range(ptp):
            src = PoolGeometry(model, ptp, pr, 16, 8, lay)
            for dr in range(dtp):
                dst = PoolGeometry(model, dtp, dr, 16, 8, lay)
                g = pair_granule(src, dst)
                plan = plan_rank_pair(src, dst, [5, 2, 7], [1, 0, 3], 3, 41)
                for arr in (plan.src_offset, plan.dst_offset, plan.length):
                    assert not (arr % g).any()
    assert pair_granule(PoolGeometry(model, 1, 0, 16, 8), PoolGeometry(model, 1, 0, 16, 8)) == 2048


def test_page_aligned_writes_use_the_page_granule_list():
    model = ModelGeometry("tiny", 1, 2, 8)  # token bytes 32, page (4 tokens) 128
    pre, dec = _servers(model, 1, 1, 4, 4, 8, 8, Layout.SGLANG_NHD, Layout.SGLANG_NHD)
    p, d = pre[0], dec[0]
    try:
        p.add_peer(d.endpoint, d.registration())
        for r in p.pool.regions:
            p.region(r.region_id)[:] = np.arange(r.nbytes) % 253
        for start, end, want_indices in [(0, 8, 2 * 2), (1, 8, 7 * 2)]:  # 2 regions
            for r in d.pool.regions:
                d.region(r.region_id)[:] = 255
            exp = {r.region_id: d.region(r.region_id).copy() for r in d.pool.regions}
            plan = plan_rank_pair(p.pool, d.pool, [0, 1], [5, 6], start, end)
            refmodel.apply_plan(plan, {r.region_id: p.region(r.region_id) for r in p.pool.regions}, exp)
            args = (plan.src_region, plan.src_offset, plan.dst_region, plan.dst_offset, plan.length)
            assert _wait(p, p.post_write(d.endpoint, *args, b""), dec) is XferState.DONE
            rec = p.agent.telemetry.records()[-1]
            assert rec.descs_requested == want_indices  # pages when aligned, tokens otherwise
            assert all(np.array_equal(d.region(rid), exp[rid]) for rid in exp)
    finally:
        for t in pre + dec:
            t.close()
