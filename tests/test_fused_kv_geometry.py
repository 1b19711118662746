"""Fused K and V regions (``ModelGeometry.fused_kv``): the form of vLLM's per-layer KV view, where
one head of one token holds its K and V side by side. One region per layer, heads split across TP
ranks like K and V; the planner moves every head byte between NHD and HND blocks, block sizes and
TP sizes, and the form survives the wire."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
from kvferry.core.errors import GeometryError
from kvferry.core.geometry import DType, KVKind, Layout, ModelGeometry, make_pools
from kvferry.core.messages import GeometryWire
from kvferry.core.planner import plan_room

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refmodel

FUSED = ModelGeometry("vllm", num_layers=2, num_kv_heads=4, head_dim=8, dtype=DType.FP16, fused_kv=True)
NHD, HND = Layout.VLLM_NHD, Layout.VLLM_HND


def test_one_region_per_layer_split_by_heads() -> None:
    assert FUSED.kinds == (KVKind.LATENT,) and FUSED.num_regions == 2
    assert FUSED.token_bytes == 2 * 4 * 8 * 2
    pools = make_pools(FUSED, 2, 16, 8, HND)
    assert [(p.head_start, p.heads_per_rank) for p in pools] == [(0, 2), (2, 2)]
    with pytest.raises(GeometryError, match="exclude each other"):
        ModelGeometry("x", 1, 1, 8, is_mla=True, fused_kv=True)
    unfused = ModelGeometry("vllm", 2, 4, 8, DType.FP16)
    assert FUSED.same_kv_shape(unfused) == "fused_kv differs: True vs False"


def test_the_wire_keeps_the_fused_form() -> None:
    pool = make_pools(FUSED, 2, 16, 8, HND)[1]
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(GeometryWire.from_pool(pool)), type=GeometryWire)
    assert wire.to_pool().model.fused_kv and wire.to_pool().model.same_kv_shape(FUSED) is None


@pytest.mark.parametrize(
    ("p", "d", "src_layout", "dst_layout", "sps", "dps"),
    [
        (1, 1, NHD, HND, 16, 32),
        (2, 2, HND, NHD, 32, 16),
        (2, 1, NHD, HND, 16, 16),
        (1, 2, HND, HND, 16, 32),
        (4, 2, NHD, NHD, 16, 32),
    ],
)
def test_every_head_byte_lands(
    p: int, d: int, src_layout: Layout, dst_layout: Layout, sps: int, dps: int
) -> None:
    """A 45-token room in three chunks, fragmented pages on both sides: each decode rank ends up
    with exactly the reference bytes of its heads (refmodel, independent of the planner)."""
    src, dst = make_pools(FUSED, p, sps, 8, src_layout), make_pools(FUSED, d, dps, 8, dst_layout)
    n = 45
    sp = np.array([5, 2, 7, 0])[: -(-n // sps)]
    dp = np.array([3, 6, 1, 4])[: -(-n // dps)]
    src_mem = [refmodel.source_memory(pool, sp, n, salt=i) for i, pool in enumerate(src)]
    dst_mem = [refmodel.blank(pool, 0) for pool in dst]
    for lo, hi in ((0, 16), (16, 17), (17, n)):
        for pair in plan_room(src, dst, sp, dp, lo, hi).pairs:
            refmodel.apply_plan(pair, src_mem[pair.src_rank], dst_mem[pair.dst_rank])
    for pool, mem in zip(dst, dst_mem, strict=True):
        expected = refmodel.blank(pool, 0)
        refmodel.write_room(pool, expected, dp, 0, n)
        for region in expected:
            np.testing.assert_array_equal(mem[region], expected[region])
