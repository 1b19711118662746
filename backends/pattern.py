"""Recognisable KV bytes: what a prefill rank's forward pass "computes" for a room, and the check
that a decode rank holds exactly those bytes.

The value of every byte is a function of (room key, region, token, global head, byte in head),
computed from the pool geometry alone, independently of the planner: the check therefore catches
a wrong plan as well as a wrong transfer.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import numpy as np
from kvferry.core.geometry import PoolGeometry
from kvferry.core.planner import consecutive

_MASK = (1 << 64) - 1
_MUL_INT = 0xD6E8FEB86659FD93
_MUL = np.uint64(_MUL_INT)
_POS_CACHE_ELEMENTS = 1 << 20  # uint64 positions kept per geometry (8 MiB)
_TOP_BYTE = slice(7, None, 8) if sys.byteorder == "little" else slice(0, None, 8)  # of a uint64


def _salt(room_key: int, rid: int) -> int:
    return (room_key * 0x9E3779B97F4A7C15 + rid * 0xC2B2AE3D27D4EB4F) & _MASK


class _Layout:
    """What ``fill`` and ``mismatches`` need of one pool, computed once per geometry (not per
    chunk): region ids, the per-head row and per-(head, byte) position terms, the strides."""

    __slots__ = ("dense", "hb", "heads", "inner_pos", "inner_rows", "page_rows", "page_size", "page_stride",
                 "pos_cache", "rids", "slot_rows", "tok_pos", "token_stride", "values_key")  # fmt: skip

    def __init__(self, pool: PoolGeometry) -> None:
        hb = pool.head_bytes
        self.rids = tuple(spec.region_id for spec in pool.regions)
        self.page_size = pool.page_size
        self.page_stride = pool.page_stride
        self.token_stride = pool.token_stride
        b = np.arange(hb, dtype=np.int64)
        heads = np.arange(pool.heads_per_rank, dtype=np.int64)
        # Every stride is a whole number of heads, so each (token, head) is one row of a region
        # viewed as [region bytes / head bytes, head bytes]: head_bytes times fewer indices.
        self.hb = hb
        self.inner_rows = heads * (pool.head_stride // hb)
        # The rows of one page's slots relative to the page's first row: [page_size, heads].
        self.page_rows = pool.page_stride // hb
        slots = np.arange(pool.page_size, dtype=np.int64) * (pool.token_stride // hb)
        self.slot_rows = slots[:, None] + self.inner_rows[None, :]
        # Token-major with every head of a token side by side (SGLang's NHD): a page's tokens are
        # one block of rows, so a room's rows are a few blocks, copied as slices (``_runs``).
        self.heads = pool.heads_per_rank
        self.dense = pool.head_stride == hb and pool.token_stride == self.heads * hb
        # A byte's position (t * heads + g) * hb + b, times MUL, split as t * (heads * hb * MUL)
        # + [(g * hb + b) * MUL] (mod 2**64: uint64 wraps, so the bits equal the product taken whole).
        g = np.arange(pool.head_start, pool.head_end, dtype=np.uint64)
        self.inner_pos = (g[:, None] * np.uint64(hb) + b.astype(np.uint64)[None, :]) * _MUL
        self.tok_pos = np.array([pool.model.num_kv_heads * hb * _MUL_INT & _MASK], dtype=np.uint64)
        self.pos_cache = np.empty((0, *self.inner_pos.shape), dtype=np.uint64)
        # Everything a room's values depend on besides the room (``_room_values``): pools with
        # the same key (a prefill rank and the decode rank holding its heads) share values.
        self.values_key = (self.rids, pool.head_start, pool.head_end, hb, pool.model.num_kv_heads)

    def positions(self, token_start: int, token_end: int) -> np.ndarray:
        """uint64 [tokens, heads, head bytes]: every byte's position times MUL. Positions do not
        depend on the room: those of tokens [0, n) are kept (up to 8 MiB) and sliced per call."""
        cache = self.pos_cache
        if token_end > len(cache) and token_end * self.inner_pos.size <= _POS_CACHE_ELEMENTS:
            cache = self.pos_cache = self._positions(0, max(token_end, 2 * len(cache)))
        if token_end <= len(cache):
            return cache[token_start:token_end]
        return self._positions(token_start, token_end)

    def _positions(self, token_start: int, token_end: int) -> np.ndarray:
        t = np.arange(token_start, token_end, dtype=np.uint64)
        return (t * self.tok_pos)[:, None, None] + self.inner_pos[None, :, :]


# By id, holding the pool (so the id cannot be reused while cached): a geometry's own hash walks
# every field of the model. Bounded: a campaign draws a new geometry per seed.
_LAYOUTS: dict[int, tuple[PoolGeometry, _Layout]] = {}


def _layout(pool: PoolGeometry) -> _Layout:
    hit = _LAYOUTS.get(id(pool))
    if hit is not None and hit[0] is pool:
        return hit[1]
    if len(_LAYOUTS) >= 64:
        _LAYOUTS.clear()
    lay = _Layout(pool)
    _LAYOUTS[id(pool)] = (pool, lay)
    return lay


def _room_rows(lay: _Layout, pages: np.ndarray, token_start: int, token_end: int) -> np.ndarray:
    """The rows [tokens, heads] (a row: one head of one token, ``head_bytes`` long) of the room's
    tokens in any region."""
    ps = lay.page_size
    # Whole pages' rows (a page's first row plus its slots' rows), cut to the token range.
    first, last = token_start // ps, -(-token_end // ps)
    page_row = np.asarray(pages, dtype=np.int64)[first:last] * lay.page_rows
    rows = (page_row[:, None, None] + lay.slot_rows[None]).reshape(-1, len(lay.inner_rows))
    return rows[token_start - first * ps : token_end - first * ps]


def _runs(
    lay: _Layout, pages: np.ndarray, token_start: int, token_end: int
) -> list[tuple[int, int, int]] | None:
    """On a dense layout, the range as (first row, first row of the values, rows) blocks of
    contiguous rows: one per page, pages with consecutive ids joined. None on other layouts."""
    if not lay.dense:
        return None
    ps, heads, page_rows = lay.page_size, lay.heads, lay.page_rows
    first = token_start // ps
    ids = np.asarray(pages)[first : -(-token_end // ps)].tolist()
    if page_rows == ps * heads and consecutive(ids):
        # Consecutive page ids (the usual allocation): on a dense layout a page's rows follow
        # the previous page's (page_rows == page_size * heads), so the loop below would join
        # every page into this one run.
        row = ids[0] * page_rows + (token_start - first * ps) * heads
        return [(row, 0, (token_end - token_start) * heads)]
    runs: list[tuple[int, int, int]] = []
    for k, page in enumerate(ids, first):
        a, b = max(token_start, k * ps), min(token_end, (k + 1) * ps)
        row, n = page * page_rows + (a - k * ps) * heads, (b - a) * heads
        if runs and runs[-1][0] + runs[-1][2] == row:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
        else:
            runs.append((row, (a - token_start) * heads, n))
    return runs


# A room's values [regions, tokens, heads, head bytes] for tokens [0, n), by (values key, room
# key): computed at the room's first fill for its whole allocation, sliced by its other chunks
# and by the check on the decode rank holding the same heads, which drops them. Values are a pure
# function of the key, so an entry is right whoever reads it; entries of rooms never checked
# (failed) are evicted oldest first. Bounded: small rooms only, 16 MiB in all.
# Under _VALUES_LOCK: the real backends' bench and soak processes fill and check from several
# threads.
_VALUES: dict[tuple[tuple[object, ...], int], np.ndarray] = {}
_VALUES_ENTRY_BYTES = 1 << 20
_VALUES_MAX_BYTES = 16 << 20
_VALUES_LOCK = threading.Lock()
_values_bytes = 0


def _values(lay: _Layout, room_key: int, token_start: int, token_end: int, whole: int) -> np.ndarray:
    """``_room_values`` of tokens [token_start, token_end), through the cache; ``whole``: the
    tokens the room's allocation holds (what a first call computes, when small enough)."""
    global _values_bytes
    key = (lay.values_key, room_key)
    with _VALUES_LOCK:
        hit = _VALUES.get(key)
    if hit is not None and hit.shape[1] >= token_end:
        return hit[:, token_start:token_end]
    n = max(token_end, whole)
    if n * len(lay.rids) * lay.inner_pos.size > _VALUES_ENTRY_BYTES:
        return _room_values(lay, room_key, token_start, token_end)
    values = _room_values(lay, room_key, 0, n)
    values.flags.writeable = False  # shared by every reader of the entry
    with _VALUES_LOCK:
        old = _VALUES.pop(key, None)
        if old is not None:
            _values_bytes -= old.nbytes
        while _VALUES and _values_bytes + values.nbytes > _VALUES_MAX_BYTES:
            _values_bytes -= _VALUES.pop(next(iter(_VALUES))).nbytes
        _VALUES[key] = values
        _values_bytes += values.nbytes
    return values[:, token_start:token_end]


def _drop_values(lay: _Layout, room_key: int) -> None:
    global _values_bytes
    with _VALUES_LOCK:
        hit = _VALUES.pop((lay.values_key, room_key), None)
        if hit is not None:
            _values_bytes -= hit.nbytes


def _room_values(lay: _Layout, room_key: int, token_start: int, token_end: int) -> np.ndarray:
    """The values [regions, tokens, heads, head bytes] the room's rows must hold (all regions in
    one pass)."""
    pos = lay.positions(token_start, token_end)
    # Per region: salt * MUL (mod 2**64), taken in Python ints (no overflow warning).
    salts = np.array([_salt(room_key, rid) * _MUL_INT & _MASK for rid in lay.rids], dtype=np.uint64)
    acc = pos[None] + salts[:, None, None, None]
    # value >> 56 is each uint64's top byte: read through a byte view, one pass instead of a
    # shift and a narrowing cast (and plain operators beat ``out=`` with broadcasting here).
    return acc.view(np.uint8)[..., _TOP_BYTE].copy()


def _rows(buf: np.ndarray, hb: int) -> np.ndarray | None:
    """``buf`` as [rows, head bytes], a view (None where it cannot be one: index per byte)."""
    if buf.ndim == 1 and buf.flags.c_contiguous and buf.size % hb == 0:
        return buf.reshape(-1, hb)
    return None


def _bytes_of(lay: _Layout, rows: np.ndarray) -> np.ndarray:
    """Byte offsets [tokens, heads, head bytes] of ``rows``."""
    return (rows * lay.hb)[:, :, None] + np.arange(lay.hb, dtype=np.int64)[None, None, :]


def fill(
    pool: PoolGeometry,
    region: Callable[[int], np.ndarray],
    room_key: int,
    pages: np.ndarray,
    token_start: int,
    token_end: int,
) -> None:
    """Write the room's bytes for tokens [token_start, token_end) into this rank's pool."""
    if token_end <= token_start:
        return
    lay = _layout(pool)
    values = _values(lay, room_key, token_start, token_end, len(pages) * lay.page_size)
    runs = _runs(lay, pages, token_start, token_end)
    rows = None
    # Every region's values as [region, rows, head bytes] (a view: the regions' token ranges are
    # contiguous), read below by one index per run instead of a reshape and a slice per region.
    flat = values.reshape(len(lay.rids), -1, lay.hb) if runs is not None else None
    for i, rid in enumerate(lay.rids):
        buf = region(rid)
        view = _rows(buf, lay.hb)
        if view is not None and flat is not None and runs is not None:  # runs: for the type checker
            for row, at, n in runs:
                view[row : row + n] = flat[i, at : at + n]
            continue
        rows = _room_rows(lay, pages, token_start, token_end) if rows is None else rows
        if view is not None:
            view[rows] = values[i]
        else:
            buf[_bytes_of(lay, rows)] = values[i]


def mismatches(
    pool: PoolGeometry, region: Callable[[int], np.ndarray], room_key: int, pages: np.ndarray, n_tokens: int
) -> tuple[int, str]:
    """(number of wrong bytes, description of the first) for the room's tokens on this rank."""
    if n_tokens <= 0:
        return 0, ""
    lay = _layout(pool)
    want_all = _values(lay, room_key, 0, n_tokens, 0)
    _drop_values(lay, room_key)  # the room's last reader on these heads
    runs = _runs(lay, pages, 0, n_tokens)
    rows = None
    got_all = np.empty(want_all.shape, dtype=np.uint8)  # C order: each region's rows are views
    flat = got_all.reshape(len(lay.rids), -1, lay.hb)  # a view: written through below
    for i, rid in enumerate(lay.rids):
        buf = region(rid)
        view = _rows(buf, lay.hb)
        if view is not None and runs is not None:
            for row, at, n in runs:
                flat[i, at : at + n] = view[row : row + n]
            continue
        rows = _room_rows(lay, pages, 0, n_tokens) if rows is None else rows
        if view is not None:
            np.take(view, rows, axis=0, out=got_all[i])
        else:
            got_all[i] = buf[_bytes_of(lay, rows)]
    if got_all.tobytes() == want_all.tobytes():
        return 0, ""  # the usual answer: every region's bytes compared at once
    bad_total, first = 0, ""
    for i, rid in enumerate(lay.rids):
        got, want = got_all[i], want_all[i]
        bad = got != want
        n = int(np.count_nonzero(bad))
        if n and not first:
            t, h, b = (int(x[0]) for x in np.nonzero(bad))
            first = (
                f"region {rid} token {t} head {pool.head_start + h} byte {b}: "
                f"got {int(got[t, h, b])} want {int(want[t, h, b])}"
            )
        bad_total += n
    return bad_total, first
