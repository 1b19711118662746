"""KV geometry: presets, head ownership (incl. replication), regions, byte offsets, topology."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.core.errors import GeometryError
from kvferry.core.geometry import (
    PRESETS,
    DType,
    KVKind,
    Layout,
    ModelGeometry,
    PoolGeometry,
    head_range,
    links,
    make_pools,
    receivers_for,
    senders_for,
)


def test_presets() -> None:
    q = ModelGeometry.preset("qwen3-8b")
    assert (q.num_layers, q.num_kv_heads, q.head_dim, q.is_mla) == (36, 8, 128, False)
    ll = ModelGeometry.preset("llama-3.1-70b")
    assert (ll.num_layers, ll.num_kv_heads, ll.head_dim) == (80, 8, 128)
    ds = ModelGeometry.preset("deepseek-v3")
    assert (ds.num_layers, ds.num_kv_heads, ds.head_dim, ds.is_mla) == (61, 1, 576, True)
    assert ds.kinds == (KVKind.LATENT,) and q.kinds == (KVKind.K, KVKind.V)
    assert set(PRESETS) >= {"qwen3-8b", "llama-3.1-70b", "deepseek-v3"}
    with pytest.raises(GeometryError, match="unknown model preset"):
        ModelGeometry.preset("gpt-7")


def test_dtype_itemsize() -> None:
    assert [d.itemsize for d in DType] == [2, 2, 1, 1, 4]
    assert ModelGeometry("m", 1, 1, 4, "fp8_e5m2").dtype is DType.FP8_E5M2
    with pytest.raises(GeometryError, match="unknown dtype"):
        ModelGeometry("m", 1, 1, 4, "int3")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"num_kv_heads": 2, "is_mla": True}, "MLA"),
    ],
)
def test_model_rejects_impossible(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"name": "m", "num_layers": 2, "num_kv_heads": 1, "head_dim": 8}
    base.update(kwargs)
    with pytest.raises(GeometryError, match=match):
        ModelGeometry(**base)  # type: ignore[arg-type]


def test_head_ranges_split_and_replicate_by_division() -> None:
    q = PRESETS["qwen3-8b"]  # 8 heads
    assert [head_range(q, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # TP 16 > 8 heads: ranks 2h and 2h+1 share head h (a modulo would give r % 8).
    assert [head_range(q, 16, r)[0] for r in range(16)] == [r // 2 for r in range(16)]
    ds = PRESETS["deepseek-v3"]
    assert all(head_range(ds, 8, r) == (0, 1) for r in range(8))


@pytest.mark.parametrize(("heads", "tp"), [(8, 3), (8, 12), (6, 4), (4, 6)])
def test_tp_neither_dividing_nor_replicating_is_rejected(heads: int, tp: int) -> None:
    m = ModelGeometry("m", 2, heads, 16)
    with pytest.raises(GeometryError, match="TP"):
        head_range(m, tp, 0)
    with pytest.raises(GeometryError):
        PoolGeometry(m, tp, 0, 16, 4)


def test_pool_rejects_bad_values() -> None:
    q = PRESETS["qwen3-8b"]
    with pytest.raises(GeometryError, match="rank"):
        PoolGeometry(q, 4, 4, 16, 8)
    with pytest.raises(GeometryError, match="page_size"):
        PoolGeometry(q, 4, 0, 0, 8)
    with pytest.raises(GeometryError, match="num_pages"):
        PoolGeometry(q, 4, 0, 16, 0)
    with pytest.raises(GeometryError, match="layout"):
        PoolGeometry(q, 4, 0, 16, 8, "paged")  # type: ignore[arg-type]


def test_regions() -> None:
    q = PRESETS["qwen3-8b"]
    pool = PoolGeometry(q, 4, 1, 16, 10)
    assert (pool.head_start, pool.heads_per_rank) == (2, 2)
    regions = pool.regions
    assert len(regions) == 72
    assert [r.region_id for r in regions] == list(range(72))
    assert regions[5].layer == 2 and regions[5].kind is KVKind.V
    assert all(r.nbytes == 10 * 16 * 2 * 128 * 2 for r in regions)
    assert pool.region_id(2, KVKind.V) == 5
    ds = PoolGeometry(PRESETS["deepseek-v3"], 8, 3, 64, 2)
    assert len(ds.regions) == 61 and ds.regions[60].kind is KVKind.LATENT
    assert ds.regions[0].nbytes == 2 * 64 * 576 * 2
    with pytest.raises(GeometryError):
        ds.region_id(0, KVKind.K)


@settings(max_examples=40)
@given(
    layout=st.sampled_from(list(Layout)),
    heads=st.sampled_from([1, 2, 4]),
    page_size=st.integers(1, 5),
    num_pages=st.integers(1, 4),
    head_dim=st.integers(1, 3),
    dtype=st.sampled_from(list(DType)),
)
def test_byte_offset_matches_logical_view(
    layout: Layout, heads: int, page_size: int, num_pages: int, head_dim: int, dtype: DType
) -> None:
    pool = PoolGeometry(ModelGeometry("m", 1, heads, head_dim, dtype), 1, 0, page_size, num_pages, layout)
    isz = dtype.itemsize
    # Label every byte with its own offset, view it the way the layout names its axes, and check
    # byte_offset against the label: an independent check of the stride arithmetic.
    mem = np.arange(pool.region_bytes, dtype=np.int64)
    if layout is Layout.VLLM_HND:
        view = mem.reshape(num_pages, heads, page_size, head_dim, isz).transpose(0, 2, 1, 3, 4)
    else:
        view = mem.reshape(num_pages, page_size, heads, head_dim, isz)
    p, t, h, e = np.meshgrid(
        np.arange(num_pages), np.arange(page_size), np.arange(heads), np.arange(head_dim), indexing="ij"
    )
    np.testing.assert_array_equal(pool.byte_offset(p, t, h, e), view[..., 0])


def _valid_tps(heads: int) -> list[int]:
    return [t for t in range(1, 17) if (heads % t == 0) if t <= heads] + [
        t for t in range(1, 17) if t > heads and t % heads == 0
    ]


@st.composite
def topologies(draw: st.DrawFn) -> tuple[ModelGeometry, int, int]:
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.integers(1, 64))
    model = ModelGeometry("m", 2, heads, 8, is_mla=mla)
    tps = _valid_tps(heads)
    return model, draw(st.sampled_from(tps)), draw(st.sampled_from(tps))


@settings(max_examples=150)
@given(topologies())
def test_links_cover_every_decode_head_exactly_once(topo: tuple[ModelGeometry, int, int]) -> None:
    model, ptp, dtp = topo
    all_links = links(model, ptp, dtp)
    seen_prefill = {x.prefill_rank for x in all_links}
    assert seen_prefill == set(range(ptp)), "every prefill rank must hear of every room"
    for d in range(dtp):
        d_start, d_n = head_range(model, dtp, d)
        covered: list[int] = []
        for link in senders_for(model, ptp, dtp, d):
            assert link.decode_rank == d
            if link.is_dummy:
                continue
            p_start, p_n = head_range(model, ptp, link.prefill_rank)
            # A sender only sends heads it holds and the decode rank holds.
            assert p_start <= link.head_start and link.head_start + link.num_heads <= p_start + p_n
            assert d_start <= link.head_start and link.head_start + link.num_heads <= d_start + d_n
            covered += range(link.head_start, link.head_start + link.num_heads)
        assert sorted(covered) == list(range(d_start, d_start + d_n))
    for p in range(ptp):
        mine = receivers_for(model, ptp, dtp, p)
        assert mine and all(x.prefill_rank == p for x in mine)
        # A dummy link only exists for a rank that sends to nobody.
        assert all(not x.is_dummy for x in mine) or len(mine) == 1


@pytest.mark.parametrize(("ptp", "dtp"), [(2, 1), (4, 2), (8, 2), (16, 4)])
def test_mla_prefill_larger_has_one_real_sender_per_decode_rank(ptp: int, dtp: int) -> None:
    ds = PRESETS["deepseek-v3"]
    for d in range(dtp):
        group = senders_for(ds, ptp, dtp, d)
        assert len(group) == ptp // dtp
        real = [x for x in group if not x.is_dummy]
        assert len(real) == 1 and real[0].prefill_rank == d * (ptp // dtp)


def test_replicated_heads_exactly_one_replica_sends() -> None:
    q = PRESETS["qwen3-8b"]
    # TP 16 prefill -> TP 8 decode: ranks 2h, 2h+1 hold head h; decode rank h needs head h once.
    for d in range(8):
        real = [x for x in senders_for(q, 16, 8, d) if not x.is_dummy]
        assert [(x.prefill_rank, x.head_start, x.num_heads) for x in real] == [(2 * d, d, 1)]
    # TP 16 -> TP 16: both replicas of a head each serve one of the two decode replicas.
    pairs = {(x.prefill_rank, x.decode_rank) for x in links(q, 16, 16) if not x.is_dummy}
    assert pairs == {(r, r) for r in range(16)}


def test_topology_rank_out_of_range() -> None:
    q = PRESETS["qwen3-8b"]
    with pytest.raises(GeometryError):
        senders_for(q, 4, 2, 2)
    with pytest.raises(GeometryError):
        receivers_for(q, 4, 2, -1)


def test_make_pools() -> None:
    pools = make_pools(PRESETS["qwen3-8b"], 4, 16, 8, Layout.VLLM_HND)
    assert [p.tp_rank for p in pools] == [0, 1, 2, 3]
    assert all(p.layout is Layout.VLLM_HND and p.tp_size == 4 for p in pools)
    with pytest.raises(GeometryError):
        make_pools(PRESETS["qwen3-8b"], 3, 16, 8)
