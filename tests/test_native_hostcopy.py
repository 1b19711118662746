"""The native host gather/scatter (backends/native/copy.c) moves the same bytes as the numpy
reference (backends/staging_copy.py) for the maps the staged flows build, and refuses the same
maps with the same message, writing nothing."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.backends import staging_copy
from kvferry.backends.native import hostcopy
from kvferry.backends.staging_copy import StagingCopyError
from kvferry.core.geometry import make_pools
from kvferry.core.staging_layout import StagingFormat, staged_map

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refmodel

pytestmark = pytest.mark.skipif(bool(hostcopy.available()), reason=hostcopy.available() or "")


def _room_map(room: dict, fmt: StagingFormat, base_units: int, half: bool):
    model = room["model"]
    geo = make_pools(model, room["ptp"], room["ps_p"], room["pool_p"], room["layout_p"])[-1]
    rng = np.random.default_rng(room["seed"])
    pages = refmodel.fragmented_pages(rng, room["pool_p"], room["need_p"])
    lo, hi = room["cuts"][0], room["cuts"][1]
    n = max(1, geo.heads_per_rank // 2) if half else geo.heads_per_rank
    base = base_units * geo.head_bytes
    smap = staged_map(geo, pages, geo.head_start, n, lo, hi, fmt, base)
    mem = refmodel.source_memory(geo, pages, room["tokens"], salt=5)
    size = base + model.num_regions * (hi - lo) * geo.heads_per_rank * geo.head_bytes
    return smap, {r: v.reshape(-1) for r, v in mem.items()}, size


@settings(max_examples=60, deadline=None)
@given(
    room=refmodel.rooms(),
    fmt=st.sampled_from(list(StagingFormat)),
    base_units=st.integers(0, 5),
    half=st.booleans(),
)
def test_native_and_numpy_copies_move_the_same_bytes(
    room: dict, fmt: StagingFormat, base_units: int, half: bool
) -> None:
    smap, mem, size = _room_map(room, fmt, base_units, half)
    bufs = [np.full(size, 0xEE, dtype=np.uint8) for _ in range(2)]
    copies = (staging_copy.copy_maps, hostcopy.copy_maps)
    moved = [fn("gather", mem, buf, (smap,)) for fn, buf in zip(copies, bufs, strict=True)]
    assert moved[0] == moved[1] == smap.nbytes
    np.testing.assert_array_equal(bufs[0], bufs[1])
    pools = [{r: np.full_like(v, 0x11) for r, v in mem.items()} for _ in range(2)]
    staging_copy.copy_maps("scatter", pools[0], bufs[0], (smap,))
    hostcopy.copy_maps("scatter", pools[1], bufs[1], (smap,))
    for r in mem:
        np.testing.assert_array_equal(pools[0][r], pools[1][r])


@settings(max_examples=40, deadline=None)
@given(
    room=refmodel.rooms(),
    fmt=st.sampled_from(list(StagingFormat)),
    kind=st.sampled_from(["gather", "scatter"]),
    shift=st.sampled_from(["staging_base", "token", "region"]),
    amount=st.integers(1, 4096),
)
def test_native_copy_refuses_what_numpy_refuses_and_writes_nothing(
    room: dict, fmt: StagingFormat, kind: str, shift: str, amount: int
) -> None:
    """A map pushed past either buffer (the staging base moved out, a token offset past its
    region, a region the rank does not have): both raise the same error; no byte changed."""
    smap, mem, size = _room_map(room, fmt, 0, False)
    if shift == "staging_base":
        bad = dataclasses.replace(smap, staging_base=size - smap.head_bytes + amount)
    elif shift == "token":
        offs = smap.token_offsets.copy()
        offs[amount % offs.size] = next(iter(mem.values())).size - smap.head_bytes + amount
        bad = dataclasses.replace(smap, token_offsets=offs)
    else:
        bad = dataclasses.replace(smap, region_ids=smap.region_ids + len(mem))
    errors = []
    for fn in (staging_copy.copy_maps, hostcopy.copy_maps):
        pool = {r: v.copy() for r, v in mem.items()}
        buf = np.full(size, 0xEE, dtype=np.uint8)
        # A good map first: nothing of it may move either, since a later map is refused.
        with pytest.raises(StagingCopyError) as exc:
            fn(kind, pool, buf, (smap, bad))
        errors.append(str(exc.value))
        assert (buf == 0xEE).all()
        for r in mem:
            np.testing.assert_array_equal(pool[r], mem[r])
    assert errors[0] == errors[1]


def test_native_copy_rejects_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="gather or scatter"):
        hostcopy.copy_maps("swap", {}, np.zeros(1, dtype=np.uint8), ())
