"""Descriptor plumbing of a post: the native executor's columns (backends/nixl/native.py
``_cols``: what the engine reads through its three pointers is the rows' addr, len and dev
columns, in order) and the prepared list a write is expressed in (transport ``key_for``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.backends.nixl.native import _cols


def _read(rows: np.ndarray) -> list[list[int]]:
    c = _cols(rows)
    return [[c.addr[i], c.length[i], c.dev[i]] for i in range(c.n)]


@pytest.mark.parametrize("n", [0, 1, 3, 72])
def test_columns_are_the_rows_read_back(n: int) -> None:
    rows = np.arange(n * 3, dtype=np.uint64).reshape(n, 3) * 4099 + (1 << 40)
    assert _read(rows) == rows.tolist()


def test_any_layout_or_integer_type_of_rows_reads_the_same() -> None:
    rows = np.array([[1 << 45, 4096, 0], [(1 << 45) + 8192, 64, 3]], dtype=np.uint64)
    want = rows.tolist()
    assert _read(np.asfortranarray(rows)) == want
    assert _read(rows.astype(np.int64)) == want
    assert _read(np.vstack([rows, rows])[::2]) == want[:1] * 2  # a strided view
    assert _read(rows.reshape(-1)) == want  # flat rows


@settings(max_examples=150)
@given(
    g=st.sampled_from([64, 4096, 3 * 1024, 96]),
    units=st.lists(st.tuples(*[st.integers(0, 9)] * 3), min_size=1, max_size=6),
    off=st.sampled_from([0, 1, 32, 64, -64, 1024]),
    which=st.integers(0, 2),
)
def test_the_coarse_list_is_chosen_exactly_when_every_column_is_a_multiple_of_its_granule(
    g: int, units: list[tuple[int, int, int]], off: int, which: int
) -> None:
    """``_PeerEntry.key_for`` (backends/nixl/transport.py): its one-test path for a power-of-two
    granule agrees with the modulo rule, for negative values too."""
    from kvferry.backends.nixl.transport import _PeerEntry

    cols = [np.array([u[k] * g for u in units], dtype=np.int64) for k in range(3)]
    cols[which] = cols[which] + off
    entry = _PeerEntry("a", ("kv", 8), ("coarse", g), ("aux", 64), None, {})  # type: ignore[arg-type]
    exact = all(int(v) % g == 0 for c in cols for v in c)
    assert entry.key_for(*cols) == (("coarse", g) if exact else ("kv", 8))
