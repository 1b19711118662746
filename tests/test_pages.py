"""The page allocators (sim/pages.py): ownership, frees, determinism, and the fragmentation each
policy produces under churn."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.sim.pages import FREE, LowestFirst, SortedFreeList, make_allocator, pair_runs, runs

KINDS = ("sglang", "lowest-first")

# A churn program: (allocate count | free the i-th live grant), drawn by hypothesis.
ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 12)),
        st.tuples(st.just("free"), st.integers(0, 1_000)),
    ),
    max_size=120,
)


def _churn(
    a: LowestFirst | SortedFreeList, program: list[tuple[str, int]]
) -> tuple[list[np.ndarray | None], dict[int, np.ndarray]]:
    """Run ``program`` and check every invariant after each step; the grants in order, and the
    grants still held by key."""
    n = a.owner.size
    live: dict[int, np.ndarray] = {}
    grants: list[np.ndarray | None] = []
    key = 0
    for op, arg in program:
        if op == "alloc":
            free_before = n - a.used
            got = a.alloc(arg, key)
            grants.append(got)
            if got is None:
                assert arg > free_before  # refused only when the pool cannot cover it
            else:
                assert len(got) == arg and len(np.unique(got)) == arg
                assert ((got >= 0) & (got < n)).all()
                live[key] = got
            key += 1
        elif live:
            k = sorted(live)[arg % len(live)]
            a.free(live.pop(k), k)
        # No unit owned twice, and the owner table agrees with the live grants.
        held = np.concatenate(list(live.values())) if live else np.empty(0, dtype=np.int64)
        assert len(np.unique(held)) == held.size
        assert a.used == held.size
        expect = np.full(n, FREE, dtype=np.int64)
        for k, ids in live.items():
            expect[ids] = k
        assert (a.owner == expect).all()
    return grants, live


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=60, deadline=None)
@given(program=ops, n=st.integers(1, 40), start=st.integers(0, 40))
def test_no_page_owned_twice_and_frees_return_pages(
    kind: str, program: list[tuple[str, int]], n: int, start: int
) -> None:
    a = SortedFreeList(n, min(start, n)) if kind == "sglang" else LowestFirst(n)
    _, live = _churn(a, program)
    for k, ids in live.items():
        a.free(ids, k)
    # Everything freed: the whole pool can be granted again.
    assert a.used == 0 and (a.owner == FREE).all()
    got = a.alloc(n, 7)
    assert got is not None and sorted(got.tolist()) == list(range(n))


@pytest.mark.parametrize("kind", KINDS)
def test_freeing_another_owners_pages_is_refused(kind: str) -> None:
    a = make_allocator(kind, 8)
    got = a.alloc(3, 1)
    assert got is not None
    with pytest.raises(AssertionError, match="not owned by 2"):
        a.free(got, 2)
    assert a.used == 3


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_same_seeded_churn_gives_the_same_grants(seed: int) -> None:
    def program(s: int) -> list[tuple[str, int]]:
        rng = random.Random(s)
        return [
            ("alloc", rng.randint(1, 9)) if rng.random() < 0.6 else ("free", rng.randrange(1000))
            for _ in range(200)
        ]

    one, _ = _churn(SortedFreeList(64), program(seed))
    two, _ = _churn(SortedFreeList(64), program(seed))
    assert len(one) == len(two)
    for x, y in zip(one, two, strict=True):
        assert (x is None and y is None) or (x is not None and y is not None and (x == y).all())


def test_sorted_free_list_is_contiguous_until_the_first_merge() -> None:
    a = SortedFreeList(100)
    first = [a.alloc(7, k) for k in range(14)]  # 98 of 100 pages, never merged
    assert all(g is not None and runs(g) == 1 for g in first)
    for k in range(0, 14, 2):  # free every other grant: holes of 7 between held grants
        a.free(first[k], k)  # type: ignore[arg-type]
    assert a.merges == 0 and a.used == 49
    got = a.alloc(10, 99)  # 2 left at the front: merge, then the lowest free pages
    assert a.merges == 1
    assert got is not None and got.tolist() == [0, 1, 2, 3, 4, 5, 6, 14, 15, 16]
    assert runs(got) == 2


def test_frees_wait_for_the_merge() -> None:
    # Freed pages are not reused while the front still covers a request (SGLang's release list).
    a = SortedFreeList(10)
    g = a.alloc(4, 1)
    assert g is not None
    a.free(g, 1)
    assert a.alloc(4, 2).tolist() == [4, 5, 6, 7]  # type: ignore[union-attr]
    assert a.alloc(3, 3).tolist() == [0, 1, 2]  # type: ignore[union-attr]  # front had 2: merged


def test_start_puts_the_front_past_pages_already_handed_back() -> None:
    a = SortedFreeList(10, start=6)
    assert a.used == 0
    assert a.alloc(4, 1).tolist() == [6, 7, 8, 9]  # type: ignore[union-attr]
    assert a.alloc(2, 2).tolist() == [0, 1]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="start"):
        SortedFreeList(10, start=11)


def _mixed_churn(a: LowestFirst | SortedFreeList, seed: int, live_target: int) -> list[int]:
    """Requests of 1-24 pages arriving and finishing in a random order, about ``live_target``
    held at once; the runs of every grant."""
    rng = random.Random(seed)
    live: list[tuple[int, np.ndarray]] = []
    out: list[int] = []
    for key in range(2_000):
        while len(live) >= live_target or (live and rng.random() < 0.3):
            k, ids = live.pop(rng.randrange(len(live)))
            a.free(ids, k)
        size = rng.randint(1, 24)
        got = a.alloc(size, key)
        while got is None:  # pool full: wait for someone to finish
            k, ids = live.pop(rng.randrange(len(live)))
            a.free(ids, k)
            got = a.alloc(size, key)
        live.append((key, got))
        out.append(runs(got))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_fragmentation_appears_under_churn_when_the_pool_is_busy(kind: str) -> None:
    # A pool about as large as what is held at once: grants straddle held pages.
    busy = _mixed_churn(make_allocator(kind, 400), seed=3, live_target=30)
    assert np.mean(busy) > 1.2 and max(busy) >= 4


def test_sorted_free_list_stays_contiguous_when_the_pool_is_mostly_free() -> None:
    # The same churn in a pool 50x what is held: SGLang's sorted sweep reaches held pages again
    # only every few thousand grants, so almost every grant is one run (the heap refills holes
    # at once and fragments regardless).
    sweep = _mixed_churn(SortedFreeList(20_000), seed=3, live_target=30)
    heap = _mixed_churn(LowestFirst(20_000), seed=3, live_target=30)
    assert np.mean(sweep) < 1.05
    assert np.mean(heap) > 1.2


def test_pair_runs_break_where_either_side_breaks() -> None:
    assert pair_runs(np.array([3, 4, 5, 6]), np.array([10, 11, 12, 13])) == 1
    assert pair_runs(np.array([3, 4, 9, 10]), np.array([10, 11, 12, 13])) == 2
    assert pair_runs(np.array([3, 4, 5, 6]), np.array([10, 11, 20, 30])) == 3
    assert pair_runs(np.array([3, 4]), np.array([10])) == 1
    assert pair_runs(np.array([], dtype=np.int64), np.array([1])) == 0
    assert runs(np.array([5, 6, 7, 1, 2])) == 2 and runs(np.array([], dtype=np.int64)) == 0


def test_unknown_allocator_is_refused() -> None:
    with pytest.raises(ValueError, match="page allocator"):
        make_allocator("buddy", 8)
