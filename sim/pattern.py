"""Recognisable KV bytes: what a prefill rank's forward pass "computes" for a room, and the check
that a decode rank holds exactly those bytes.

The value of every byte is a function of (room key, region, token, global head, byte in head),
computed from the pool geometry alone, independently of the planner: the check therefore catches
a wrong plan as well as a wrong transfer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from kvferry.core.geometry import PoolGeometry

_MASK = (1 << 64) - 1
_MUL_INT = 0xD6E8FEB86659FD93
_MUL = np.uint64(_MUL_INT)


def _positions(pool: PoolGeometry, tokens: np.ndarray) -> np.ndarray:
    """uint64 [tokens, local heads, head bytes]: the logical position of every byte, premultiplied."""
    heads = pool.model.num_kv_heads
    hb = pool.head_bytes
    g = np.arange(pool.head_start, pool.head_end, dtype=np.uint64)
    pos = (tokens.astype(np.uint64)[:, None, None] * np.uint64(heads) + g[None, :, None]) * np.uint64(hb)
    return (pos + np.arange(hb, dtype=np.uint64)[None, None, :]) * _MUL


def _values(pos_mul: np.ndarray, room_key: int, rid: int) -> np.ndarray:
    """uint8 values of the room's bytes in region ``rid``: a multiplicative hash of position + salt."""
    salt = (room_key * 0x9E3779B97F4A7C15 + rid * 0xC2B2AE3D27D4EB4F) & _MASK
    # (pos + salt) * MUL, with the salt's product taken in Python ints (mod 2**64, no overflow warning).
    return ((pos_mul + np.uint64(salt * _MUL_INT & _MASK)) >> np.uint64(56)).astype(np.uint8)


def _offsets(pool: PoolGeometry, pages: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    ps = pool.page_size
    page = pages[tokens // ps]
    base = pool.byte_offset(page[:, None], (tokens % ps)[:, None], np.arange(pool.heads_per_rank)[None, :])
    return base[:, :, None] + np.arange(pool.head_bytes, dtype=np.int64)[None, None, :]


def fill(
    pool: PoolGeometry,
    region: Callable[[int], np.ndarray],
    room_key: int,
    pages: np.ndarray,
    token_start: int,
    token_end: int,
) -> None:
    """Write the room's bytes for tokens [token_start, token_end) into this rank's pool."""
    tokens = np.arange(token_start, token_end, dtype=np.int64)
    if tokens.size == 0:
        return
    off = _offsets(pool, pages, tokens)
    pos = _positions(pool, tokens)
    for spec in pool.regions:
        region(spec.region_id)[off] = _values(pos, room_key, spec.region_id)


def mismatches(
    pool: PoolGeometry, region: Callable[[int], np.ndarray], room_key: int, pages: np.ndarray, n_tokens: int
) -> tuple[int, str]:
    """(number of wrong bytes, description of the first) for the room's tokens on this rank."""
    tokens = np.arange(n_tokens, dtype=np.int64)
    if tokens.size == 0:
        return 0, ""
    off = _offsets(pool, pages, tokens)
    pos = _positions(pool, tokens)
    bad_total, first = 0, ""
    for spec in pool.regions:
        got = region(spec.region_id)[off]
        want = _values(pos, room_key, spec.region_id)
        bad = got != want
        n = int(bad.sum())
        if n and not first:
            t, h, b = (int(i[0]) for i in np.nonzero(bad))
            first = (
                f"region {spec.region_id} token {t} head {pool.head_start + h} byte {b}: "
                f"got {int(got[t, h, b])} want {int(want[t, h, b])}"
            )
        bad_total += n
    return bad_total, first
