"""Gather/scatter kernels against an independent numpy re-layout, through the Triton path.

On CPU (CI) the Triton kernels run in Triton's interpreter: TRITON_INTERPRET=1 is set below,
before Triton is first imported by the kernel module, and ``test_triton_path_is_the_interpreter``
proves the kernels really ran there rather than the torch fallback. On the GPU machine set
``KVFERRY_TEST_DEVICE=cuda`` to run the same tests compiled, with pinned and GPU staging.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

DEVICE = os.environ.get("KVFERRY_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kvferry.backends.kernels import (  # noqa: E402
    DTypeWidthError,
    KernelArgError,
    KernelBackendUnavailable,
    KVPool,
    StagingLayout,
    gather,
    scatter,
)
from kvferry.backends.kernels import triton_gather_scatter as tk  # noqa: E402
from kvferry.core.geometry import ModelGeometry, head_range, links  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float32]
STAGING_PLACES = ["gpu", "pinned"] if DEVICE == "cuda" else ["cpu"]


def rand_planes(n: int, slots: int, heads: int, hd: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Random bytes of every pattern (NaNs and infinities included): a copy must keep them all."""
    g = torch.Generator().manual_seed(seed)
    isz = torch.empty((), dtype=dtype).element_size()
    return [
        torch.randint(0, 256, (slots, heads, hd * isz), dtype=torch.uint8, generator=g).view(dtype).to(DEVICE)
        for _ in range(n)
    ]


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1)


def staging_buffer(n: int, dtype: torch.dtype, place: str, fill: int = 0xA5) -> torch.Tensor:
    isz = torch.empty((), dtype=dtype).element_size()
    buf = torch.full((n * isz,), fill, dtype=torch.uint8)
    if place == "pinned":
        buf = buf.pin_memory()
    elif place == "gpu":
        buf = buf.cuda()
    return buf.view(dtype)


def ref_gather(planes, pages, ps, t0, t1, h0, layout: StagingLayout, out: np.ndarray, t_off: int = 0) -> None:
    """numpy logical indexing: out bytes of staging rows (h, plane, t) = pool bytes of that row."""
    isz = planes[0].element_size()
    t = np.arange(t0, t1)
    slots = np.asarray(pages)[t // ps] * ps + t % ps
    hb = layout.head_dim * isz
    for p, plane in enumerate(planes):
        src = as_bytes(plane).reshape(plane.shape[0], plane.shape[1], hb)
        for h in range(layout.num_heads):
            rows = src[slots, h0 + h, :]
            el = (
                layout.base
                + h * layout.stride_head
                + p * layout.stride_plane
                + (t - t0 + t_off) * layout.stride_token
            )
            idx = (el * isz)[:, None] + np.arange(hb)[None, :]
            out[idx] = rows


def make_pages(rng: np.random.Generator, num_pages: int, need: int) -> np.ndarray:
    return rng.permutation(num_pages)[:need].astype(np.int64)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------------


def test_triton_path_is_the_interpreter() -> None:
    """The tests below exercise the Triton kernels, not the torch fallback."""
    if DEVICE == "cpu":
        assert type(tk._gather_kernel).__name__ == "InterpretedFunction"
        assert type(tk._scatter_kernel).__name__ == "InterpretedFunction"
    planes = rand_planes(2, 8, 2, 4, torch.bfloat16, 0)
    pool = KVPool(planes, 4)
    lay = StagingLayout.head_major(1, 2, 8, 4)
    before = dict(tk.LAUNCHES)
    st_ = staging_buffer(lay.extent, torch.bfloat16, STAGING_PLACES[0])
    gather(pool, st_, lay, np.array([1, 0]), token_start=0, token_end=8, head_start=1, backend="triton")
    scatter(pool, st_, lay, np.array([1, 0]), token_start=0, token_end=8, head_start=1, backend="triton")
    assert tk.LAUNCHES["gather"] == before["gather"] + 1
    assert tk.LAUNCHES["scatter"] == before["scatter"] + 1
    assert pool.stats.triton_launches == 2 and pool.stats.torch_runs == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("fmt", ["head_major", "plane_major"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gather_matches_reference_and_round_trips(dtype, page_size, fmt, backend) -> None:
    """Random pages, a head slice, a token range starting mid-page; then scatter into a fresh pool."""
    rng = np.random.default_rng([page_size, len(fmt), DTYPES.index(dtype)])
    layers, heads, hd = 2, 4, 8
    t0, t1 = 3, 3 + 77
    need = -(-t1 // page_size)
    num_pages = need + 3
    slots = num_pages * page_size
    planes = rand_planes(2 * layers, slots, heads, hd, dtype, seed=page_size)
    pool = KVPool(planes, page_size)
    pages = make_pages(rng, num_pages, need)
    h0, nh = 1, 2
    lay = getattr(StagingLayout, fmt)(nh, 2 * layers, t1 - t0, hd)
    for place in STAGING_PLACES:
        stg = staging_buffer(lay.extent + 5, dtype, place)
        gather(pool, stg, lay, pages, token_start=t0, token_end=t1, head_start=h0, backend=backend)
        sync()
        want = np.full((lay.extent + 5) * stg.element_size(), 0xA5, dtype=np.uint8)
        ref_gather(pool.planes, pages, page_size, t0, t1, h0, lay, want)
        np.testing.assert_array_equal(as_bytes(stg), want)

        # Round trip: scatter into a pool of other random bytes; exactly the moved rows change.
        dst_planes = rand_planes(2 * layers, slots, heads, hd, dtype, seed=99)
        expect = [as_bytes(p).reshape(slots, heads, -1).copy() for p in dst_planes]
        dst = KVPool(dst_planes, page_size)
        scatter(dst, stg, lay, pages, token_start=t0, token_end=t1, head_start=h0, backend=backend)
        sync()
        t = np.arange(t0, t1)
        sl = pages[t // page_size] * page_size + t % page_size
        for p in range(2 * layers):
            expect[p][sl, h0 : h0 + nh] = as_bytes(planes[p]).reshape(slots, heads, -1)[sl, h0 : h0 + nh]
            np.testing.assert_array_equal(as_bytes(dst.planes[p]).reshape(slots, heads, -1), expect[p])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_odd_widths_use_narrow_words(dtype) -> None:
    """head_dim 3 (rows of 3, 6 or 12 bytes) forces 1- or 2-byte words; still bit-exact."""
    planes = rand_planes(2, 12, 3, 3, dtype, seed=5)
    pool = KVPool(planes, 4)
    pages = np.array([2, 0, 1])
    lay = StagingLayout.plane_major(2, 2, 10, 3)
    stg = staging_buffer(lay.extent, dtype, STAGING_PLACES[0])
    gather(pool, stg, lay, pages, token_start=1, token_end=11, head_start=1, backend="triton")
    sync()
    want = np.full(lay.extent * stg.element_size(), 0xA5, dtype=np.uint8)
    ref_gather(pool.planes, pages, 4, 1, 11, 1, lay, want)
    np.testing.assert_array_equal(as_bytes(stg), want)


# Heterogeneous TP: (heads, prefill TP, decode TP): P > D, P < D, equal, replication both sides.
TP_CASES = [(8, 4, 2), (8, 2, 4), (4, 4, 4), (2, 8, 2), (2, 2, 8), (4, 8, 16), (1, 4, 2)]


@pytest.mark.parametrize("heads,ptp,dtp", TP_CASES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_hetero_tp_senders_at_head_offsets(heads, ptp, dtp, page_size) -> None:
    """Every decode rank receives the right global heads: each real sender gathers its slice and
    writes it at its own head offset of the decode rank's head-major buffer; the decode rank
    scatters all its heads at once (even ranks) or sender by sender (odd ranks). Replicas hold
    identical KV, so any replica may send."""
    model = ModelGeometry("t", num_layers=2, num_kv_heads=heads, head_dim=4)
    planes_n, hd, n_tok = 2 * model.num_layers, model.head_dim, 37
    rng = np.random.default_rng([heads, ptp, dtp, page_size])
    # The global KV of the room: [planes, tokens, heads, head_dim] random bf16 bit patterns.
    global_kv = torch.randint(-(2**15), 2**15, (planes_n, n_tok, heads, hd), dtype=torch.int16)

    def rank_pool(tp: int, rank: int, fill_seed: int) -> tuple[KVPool, np.ndarray]:
        h0, n = head_range(model, tp, rank)
        need = -(-n_tok // page_size)
        num_pages = need + 2
        pages = make_pages(rng, num_pages, need)
        g = torch.Generator().manual_seed(fill_seed)
        planes = [
            torch.randint(-(2**15), 2**15, (num_pages * page_size, n, hd), dtype=torch.int16, generator=g)
            for _ in range(planes_n)
        ]
        t = np.arange(n_tok)
        sl = torch.from_numpy(pages[t // page_size] * page_size + t % page_size)
        for p in range(planes_n):
            planes[p][sl] = global_kv[p, :, h0 : h0 + n]
        return KVPool([x.view(torch.bfloat16).to(DEVICE) for x in planes], page_size), pages

    prefill = [rank_pool(ptp, r, 100 + r) for r in range(ptp)]
    all_links = links(model, ptp, dtp)
    for d in range(dtp):
        dh0, dn = head_range(model, dtp, d)
        pool, pages = rank_pool(dtp, d, 200 + d)
        before = [as_bytes(p).copy() for p in pool.planes]
        buf_lay = StagingLayout.head_major(dn, planes_n, n_tok, hd)
        buf = staging_buffer(buf_lay.extent, torch.bfloat16, STAGING_PLACES[-1])
        senders = [x for x in all_links if x.decode_rank == d and not x.is_dummy]
        assert sum(x.num_heads for x in senders) == dn
        for x in senders:
            ph0, _ = head_range(model, ptp, x.prefill_rank)
            src_pool, src_pages = prefill[x.prefill_rank]
            gather(
                src_pool,
                buf,
                buf_lay.sub_heads(x.head_start - dh0, x.num_heads),
                src_pages,
                token_start=0,
                token_end=n_tok,
                head_start=x.head_start - ph0,
                backend="triton",
            )
        # Wipe the room's rows in the decode pool so a missing write cannot pass by accident.
        t = np.arange(n_tok)
        sl = pages[t // page_size] * page_size + t % page_size
        for p in pool.planes:
            p.view(torch.int16)[torch.from_numpy(sl).to(DEVICE)] = 0x7FC1
        if d % 2 == 0:  # one scatter over every sender's heads
            scatter(pool, buf, buf_lay, pages, token_start=0, token_end=n_tok, head_start=0, backend="triton")
        else:  # or one per sender, each from its own head offset of the buffer
            for x in senders:
                off = x.head_start - dh0
                sub = buf_lay.sub_heads(off, x.num_heads)
                scatter(
                    pool, buf, sub, pages, token_start=0, token_end=n_tok, head_start=off, backend="triton"
                )
        sync()
        for p in range(planes_n):
            got = pool.planes[p].view(torch.int16).cpu()
            assert torch.equal(got[torch.from_numpy(sl)], global_kv[p, :, dh0 : dh0 + dn])
            # Bytes outside the room's slots are untouched.
            keep = np.setdiff1d(np.arange(got.shape[0]), sl)
            want = torch.from_numpy(before[p]).view(torch.int16).reshape(got.shape)
            assert torch.equal(got[torch.from_numpy(keep)], want[torch.from_numpy(keep)])


def test_chunked_gather_equals_one_gather() -> None:
    """Chunked prefill: chunks at their running token offset fill the same buffer as one call."""
    rng = np.random.default_rng(7)
    planes = rand_planes(4, 64, 4, 8, torch.float16, seed=3)
    pool = KVPool(planes, 16)
    pages = make_pages(rng, 4, 4)
    lay = StagingLayout.head_major(2, 4, 60, 8)
    one = staging_buffer(lay.extent, torch.float16, STAGING_PLACES[0])
    gather(pool, one, lay, pages, token_start=0, token_end=60, head_start=2, backend="triton")
    chunked = staging_buffer(lay.extent, torch.float16, STAGING_PLACES[0], fill=0)
    for a, b in [(0, 17), (17, 18), (18, 60)]:
        gather(pool, chunked, lay, pages, token_start=a, token_end=b, head_start=2, staging_token_offset=a)
    sync()
    np.testing.assert_array_equal(as_bytes(one), as_bytes(chunked))


@settings(max_examples=12)
@given(
    page_size=st.sampled_from([1, 2, 16, 64]),
    heads=st.sampled_from([1, 2, 3, 4, 8]),
    layers=st.integers(1, 2),
    hd=st.sampled_from([1, 2, 4, 8, 16]),
    dtype=st.sampled_from(DTYPES),
    fmt=st.sampled_from(["head_major", "plane_major"]),
    data=st.data(),
)
def test_round_trip_property(page_size, heads, layers, hd, dtype, fmt, data) -> None:
    """Any slice of any shape: gather then scatter back into a wiped pool restores the source."""
    n_tok = data.draw(st.integers(1, 130), label="tokens")
    t0 = data.draw(st.integers(0, n_tok - 1), label="token_start")
    h0 = data.draw(st.integers(0, heads - 1), label="head_start")
    nh = data.draw(st.integers(1, heads - h0), label="num_heads")
    need = -(-n_tok // page_size)
    num_pages = need + data.draw(st.integers(0, 3), label="spare_pages")
    pages = make_pages(np.random.default_rng(data.draw(st.integers(0, 2**31))), num_pages, need)
    planes = rand_planes(2 * layers, num_pages * page_size, heads, hd, dtype, seed=n_tok)
    source = [as_bytes(p).copy() for p in planes]
    pool = KVPool(planes, page_size)
    lay = getattr(StagingLayout, fmt)(nh, 2 * layers, n_tok - t0, hd)
    stg = staging_buffer(lay.extent, dtype, STAGING_PLACES[-1])
    gather(pool, stg, lay, pages, token_start=t0, token_end=n_tok, head_start=h0)
    t = np.arange(t0, n_tok)
    sl = torch.from_numpy(pages[t // page_size] * page_size + t % page_size).to(DEVICE)
    for p in pool.planes:
        p.view(torch.uint8).view(p.shape[0], -1)[sl] = 0
    scatter(pool, stg, lay, pages, token_start=t0, token_end=n_tok, head_start=h0)
    sync()
    # Rows of heads outside the slice were wiped and not restored; everything else is the source.
    isz = planes[0].element_size()
    for p, src in zip(pool.planes, source, strict=True):
        got = as_bytes(p).reshape(p.shape[0], heads, hd * isz)
        want = src.reshape(p.shape[0], heads, hd * isz).copy()
        slc = sl.cpu().numpy()
        outside = np.r_[0:h0, h0 + nh : heads]
        want[np.ix_(slc, outside)] = 0
        np.testing.assert_array_equal(got, want)


# --- bad input: typed errors, counted, nothing written ------------------------------------------


def _small():
    pool = KVPool(rand_planes(2, 16, 4, 4, torch.bfloat16, seed=1), 4)
    lay = StagingLayout.head_major(2, 2, 8, 4)
    return pool, lay, staging_buffer(lay.extent, torch.bfloat16, STAGING_PLACES[0])


@pytest.mark.parametrize("bad", [torch.float32, torch.uint8, torch.float8_e4m3fn])
def test_width_mismatch_rejected(bad) -> None:
    pool, lay, _ = _small()
    stg = staging_buffer(lay.extent * 2, bad, STAGING_PLACES[0])
    with pytest.raises(DTypeWidthError, match="bytes"):
        gather(pool, stg, lay, np.arange(2), token_start=0, token_end=8, head_start=0)
    assert pool.stats.rejected == 1 and pool.stats.gathers == 0


def test_same_width_other_dtype_is_a_byte_copy() -> None:
    """int16 staging for a bf16 pool: same width, so allowed and bit-exact."""
    pool, lay, _ = _small()
    stg = staging_buffer(lay.extent, torch.int16, STAGING_PLACES[0])
    gather(pool, stg, lay, np.array([3, 1]), token_start=0, token_end=8, head_start=1, backend="triton")
    sync()
    want = np.full(lay.extent * 2, 0xA5, dtype=np.uint8)
    ref_gather(pool.planes, np.array([3, 1]), 4, 0, 8, 1, lay, want)
    np.testing.assert_array_equal(as_bytes(stg), want)


@pytest.mark.parametrize(
    "kwargs,pages,match",
    [
        ({"token_start": 0, "token_end": 8, "head_start": 3}, [0, 1], "heads"),
        ({"token_start": 0, "token_end": 9, "head_start": 0}, [0, 1, 2], "overflow"),
        ({"token_start": 0, "token_end": 8, "head_start": 0}, [0, 4], "outside the pool"),
        ({"token_start": 0, "token_end": 8, "head_start": 0}, [-1, 0], "outside the pool"),
        ({"token_start": 0, "token_end": 8, "head_start": 0}, [0], "do not cover"),
        ({"token_start": 5, "token_end": 5, "head_start": 0}, [0, 1], "empty"),
    ],
)
def test_bad_arguments_rejected_before_launch(kwargs, pages, match) -> None:
    pool, lay, stg = _small()
    snapshot = as_bytes(stg).copy()
    with pytest.raises(KernelArgError, match=match):
        gather(pool, stg, lay, np.array(pages), **kwargs)
    with pytest.raises(KernelArgError, match=match):
        scatter(pool, stg, lay, np.array(pages), **kwargs)
    assert pool.stats.rejected == 2 and pool.stats.triton_launches + pool.stats.torch_runs == 0
    np.testing.assert_array_equal(as_bytes(stg), snapshot)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 63), min_size=1, max_size=40))
def test_a_scatter_is_refused_exactly_when_two_tokens_share_a_slot(slots: list[int]) -> None:
    from kvferry.backends.kernels.api import _check_pages_host

    pages = np.array(slots, dtype=np.int64)
    _check_pages_host(pages, 0, len(pages), 64, unique=False)  # a gather may read a slot twice
    if len(set(slots)) == len(slots):
        _check_pages_host(pages, 0, len(pages), 64, unique=True)
    else:
        with pytest.raises(KernelArgError, match="duplicate"):
            _check_pages_host(pages, 0, len(pages), 64, unique=True)


def test_other_rejections() -> None:
    pool, lay, stg = _small()
    with pytest.raises(KernelArgError, match="duplicate"):
        scatter(pool, stg, lay, np.array([1, 1]), token_start=0, token_end=8, head_start=0)
    with pytest.raises(KernelArgError, match="elements"):
        gather(pool, stg[:-1], lay, np.array([0, 1]), token_start=0, token_end=8, head_start=0)
    with pytest.raises(KernelArgError, match="planes"):
        gather(
            pool,
            stg,
            StagingLayout.head_major(2, 4, 8, 4),
            np.array([0, 1]),
            token_start=0,
            token_end=4,
            head_start=0,
        )
    with pytest.raises(KernelArgError, match="overlap"):
        gather(
            pool,
            stg,
            StagingLayout(2, 2, 8, 4, 4, 4, 4),
            np.array([0, 1]),
            token_start=0,
            token_end=8,
            head_start=0,
        )
    with pytest.raises(KernelArgError, match="backend"):
        gather(pool, stg, lay, np.array([0, 1]), token_start=0, token_end=8, head_start=0, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(KernelArgError, match="plane"):
        KVPool([torch.zeros(4, 2, 2), torch.zeros(4, 2, 3)], 2)
    with pytest.raises(KernelArgError, match="pages of"):
        KVPool([torch.zeros(6, 2, 2)], 4)
    assert pool.stats.rejected == 5


def test_triton_unavailable_is_a_typed_error(monkeypatch) -> None:
    if DEVICE != "cpu":
        pytest.skip("CPU-only: on a GPU Triton is always usable")
    pool, lay, stg = _small()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelBackendUnavailable):
        gather(pool, stg, lay, np.array([0, 1]), token_start=0, token_end=8, head_start=0, backend="triton")
    # auto picks the fallback, which gives the same bytes
    gather(pool, stg, lay, np.array([0, 1]), token_start=0, token_end=8, head_start=0)
    assert pool.stats.torch_runs == 1


def test_kernel_masks_page_ids_outside_the_pool() -> None:
    """Device page ids are not checked on the host; the kernel skips tokens whose page is outside
    the pool instead of reading or writing out of bounds."""
    pool, lay, stg = _small()
    words = stg.view(torch.int32)
    pages = torch.tensor([1, -5, 10**9, 2], dtype=torch.int64, device=DEVICE)
    for kind in ("gather", "scatter"):
        before = [as_bytes(p).copy() for p in pool.planes]
        stg.view(torch.uint8).fill_(0xEE)
        tk.launch(
            kind, pool.table, pages, words, num_planes=2, n_tokens=8, token_start=0, page_size=2,
            num_pages=8, slot_stride=8, pool_head0=1, num_heads=2, row_words=2,
            s_base=0, s_head=lay.stride_head // 2, s_plane=lay.stride_plane // 2, s_tok=2, pool_align=16,
        )  # fmt: skip
        sync()
        got = as_bytes(stg).reshape(2, 2, 8, 8)  # [head, plane, token, bytes]
        if kind == "gather":
            assert (got[:, :, 2:6] == 0xEE).all()  # tokens of the two bad pages: untouched
            for tok, slot in ((0, 2), (1, 3), (6, 4), (7, 5)):  # pages 1 and 2 of page size 2
                for p, plane in enumerate(pool.planes):
                    rows = as_bytes(plane).reshape(16, 4, 8)[slot, 1:3]
                    np.testing.assert_array_equal(got[:, p, tok], rows)
        else:
            for p, b in zip(pool.planes, before, strict=True):
                now = as_bytes(p).reshape(16, 4, 8)
                was = b.reshape(16, 4, 8)
                changed = np.nonzero((now != was).any(axis=(1, 2)))[0]
                assert set(changed.tolist()) <= {2, 3, 4, 5}  # slots of pages 1 and 2 only


def test_core_and_kernel_package_import_without_torch_or_triton(tmp_path) -> None:
    code = (
        "import sys, kvferry.core.geometry, kvferry.core.staging_layout, kvferry.backends.kernels as k;"
        "k.StagingLayout.head_major(1, 1, 1, 1);"
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules)"
    )
    # cwd elsewhere: the repo root's kvferry/ folder alone would shadow the installed package.
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=tmp_path)


@pytest.mark.skipif(
    DEVICE != "cuda", reason="CUDA streams and events need a GPU (run with KVFERRY_TEST_DEVICE=cuda)"
)
def test_runs_on_the_given_stream_and_signals_an_event() -> None:
    planes = rand_planes(4, 4096, 4, 64, torch.bfloat16, seed=2)
    pool = KVPool(planes, 16)
    pages = make_pages(np.random.default_rng(1), 256, 256)
    lay = StagingLayout.head_major(2, 4, 4096, 64)
    stg = staging_buffer(lay.extent, torch.bfloat16, "pinned")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    ev = gather(pool, stg, lay, pages, token_start=0, token_end=4096, head_start=2, stream=side)
    assert isinstance(ev, torch.cuda.Event)
    ev.synchronize()
    assert ev.query()
    want = np.full(lay.extent * 2, 0xA5, dtype=np.uint8)
    ref_gather(pool.planes, pages, 16, 0, 4096, 2, lay, want)
    np.testing.assert_array_equal(as_bytes(stg), want)


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled kernels need a GPU (KVFERRY_TEST_DEVICE=cuda)")
def test_repeat_launches_reuse_the_compiled_kernel_and_move_the_same_bytes() -> None:
    """After the first launch of a specialization, later ones skip Triton's argument binding
    (``tk._COMPILED``): rooms with other pages and token counts still get exactly their bytes."""
    planes = rand_planes(4, 2048, 4, 64, torch.bfloat16, seed=3)
    pool = KVPool(planes, 16)
    rng = np.random.default_rng(5)
    lay = StagingLayout.head_major(2, 4, 1024, 64)
    tk._COMPILED.clear()
    for tokens in (1024, 1000, 512, 1024, 17):
        pages = make_pages(rng, 128, 64)
        stg = staging_buffer(lay.extent, torch.bfloat16, "gpu")
        gather(pool, stg, lay, pages, token_start=0, token_end=tokens, head_start=1)
        sync()
        want = np.full(lay.extent * 2, 0xA5, dtype=np.uint8)
        ref_gather(pool.planes, pages, 16, 0, tokens, 1, lay, want)
        np.testing.assert_array_equal(as_bytes(stg), want)
    assert tk._direct_on, "a direct launch raised: this Triton takes launcher arguments differently"
    assert len(tk._COMPILED) == 1  # five launches, one specialization


@settings(max_examples=40)
@given(
    heads=st.integers(1, 5),
    planes=st.integers(1, 7),
    tokens=st.integers(1, 9),
    hd=st.integers(1, 4),
    chunk=st.integers(1, 400),
    fmt=st.sampled_from(["head_major", "plane_major"]),
)
def test_copy_engine_chunks_tile_the_buffer(heads, planes, tokens, hd, chunk, fmt) -> None:
    """Each chunk of the copy-engine path is one contiguous staging range laid out like its scratch
    slot; together the chunks cover the buffer once, in order."""
    from kvferry.backends.kernels import bounce

    lay = getattr(StagingLayout, fmt)(heads, planes, tokens, hd, base=3)
    chunks = bounce.plan_chunks(lay, tokens, hd * 2, chunk)
    assert chunks is not None
    covered = np.zeros(lay.extent, dtype=np.int64)
    pos = lay.base
    for h0, nh, p0, npl in chunks:
        sub = bounce.chunk_layout(lay, nh, npl)
        e0 = lay.base + h0 * lay.stride_head + p0 * lay.stride_plane
        assert e0 == pos
        n = nh * npl * tokens * hd
        # every row of the chunk sits at the same offset in scratch as in the staging range
        for h, p, t in itertools.product(range(nh), range(npl), range(tokens)):
            parent = (
                lay.base + (h0 + h) * lay.stride_head + (p0 + p) * lay.stride_plane + t * lay.stride_token
            )
            child = h * sub.stride_head + p * sub.stride_plane + t * sub.stride_token
            assert parent - e0 == child and child + hd <= n
        covered[e0 : e0 + n] += 1
        pos += n
    assert (covered[lay.base :] == 1).all() and pos == lay.extent
    assert bounce.plan_chunks(lay, tokens - 1, hd * 2, chunk) is None if tokens > 1 else True
    gappy = StagingLayout(heads, planes, tokens, hd, hd + 1, (hd + 1) * heads * tokens, (hd + 1) * heads)
    assert bounce.plan_chunks(gappy, tokens, hd * 2, chunk) is None


@pytest.mark.skipif(DEVICE != "cuda", reason="the copy-engine path needs a GPU (KVFERRY_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("fmt", ["head_major", "plane_major"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2, torch.float32], ids=str)
def test_copy_engine_path_equals_zero_copy(fmt, dtype, monkeypatch) -> None:
    from kvferry.backends.kernels import bounce

    monkeypatch.setattr(bounce, "CHUNK_BYTES", 3000)  # many chunks: scratch slots get reused
    planes = rand_planes(6, 512, 4, 16, dtype, seed=4)
    pool = KVPool(planes, 16)
    pages = make_pages(np.random.default_rng(2), 32, 20)
    lay = getattr(StagingLayout, fmt)(3, 6, 300, 16)
    a = staging_buffer(lay.extent, dtype, "pinned")
    b = staging_buffer(lay.extent, dtype, "pinned", fill=0)
    gather(pool, a, lay, pages, token_start=5, token_end=305, head_start=1)
    chunks = bounce.STATS["chunks"]
    ev = gather(pool, b, lay, pages, token_start=5, token_end=305, head_start=1, pinned_path="copy_engine")
    assert bounce.STATS["chunks"] - chunks > 3
    ev.synchronize()
    sync()
    np.testing.assert_array_equal(as_bytes(a), as_bytes(b))
    dst = KVPool([torch.zeros_like(p) for p in planes], 16)
    ev = scatter(dst, b, lay, pages, token_start=5, token_end=305, head_start=1, pinned_path="copy_engine")
    ev.synchronize()
    c = staging_buffer(lay.extent, dtype, "gpu", fill=0)
    gather(dst, c, lay, pages, token_start=5, token_end=305, head_start=1)
    sync()
    np.testing.assert_array_equal(as_bytes(a), as_bytes(c))
