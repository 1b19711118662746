"""Property and stateful tests of the staging ring and the pinned pool (docs/design.md section 5).

Ring: no byte range is writable by two live slots at once, and a slot is never writable while an
overlapping slot of an earlier round is live (overlaps computed from byte ranges and rounds, not
from ``writable``); used bytes equal the sum of live sizes; watermarks never decrease; the oldest
live slot is writable under the last watermark a producer heard (progress), and after a full drain
the next slot is writable at once (a waiting producer resumes). Pool: live reservations are
disjoint, inside the pool, and tile it exactly with the free list; first-fit matches a reference.

The planted-bug tests rerun the same checks against a ring that keeps its old head when emptied
(the upstream wedge) and one whose writability ignores the slot's end, and require them to fail.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kvferry.core.errors import KvferryError, ResourceError
from kvferry.core.resources import (
    PinnedPool,
    PinnedRefused,
    Reservation,
    RingRefused,
    RingSlot,
    StagingRing,
    Watermark,
    writable,
)

OWNERS = ("room-a", "room-b", "room-c")
STATEFUL = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _overlap(a: RingSlot, b: RingSlot) -> bool:
    return a.offset < b.end and b.offset < a.end


class StaleHeadRing(StagingRing):
    """Planted bug: an emptied ring keeps its old head (upstream's stale tail)."""

    def _restart(self) -> None:
        pass


def _lax_writable(slot: RingSlot, wm: Watermark) -> bool:
    """Planted bug: trusts any watermark one lap behind, whatever the slot's end."""
    return wm.round >= slot.round - 1


# -- ring examples -------------------------------------------------------------------------------


def _emptied_ring_example(ring_cls: type[StagingRing]) -> None:
    """Capacity 100: assign 60, free it, assign 70. The watermark the consumer broadcast when it
    freed (the last one a producer hears) must already let the new slot be written."""
    ring = ring_cls(100)
    first = ring.assign(60, "r1")
    assert isinstance(first, RingSlot)
    ring.free(first.alloc_id)
    heard = ring.watermark()
    slot = ring.assign(70, "r2")
    assert isinstance(slot, RingSlot)
    assert (slot.offset, slot.end) == (0, 70)
    assert slot.round == first.round + 1
    assert writable(slot, heard), f"{slot} not writable under broadcast watermark {heard}"
    assert writable(slot, ring.watermark())


def test_emptied_ring_restarts_in_new_round() -> None:
    _emptied_ring_example(StagingRing)
    ring = StagingRing(100)
    ring.free(ring.assign(60, "r1").alloc_id)
    assert ring.watermark() == Watermark(1, 0) == ring.head


def test_planted_stale_head_fails_example() -> None:
    with pytest.raises(AssertionError, match="not writable under broadcast watermark"):
        _emptied_ring_example(StaleHeadRing)


def test_ring_misuse_and_refusal() -> None:
    for bad in (0, -5, True, 1.5):
        with pytest.raises(ResourceError):
            StagingRing(bad)  # type: ignore[arg-type]
    with pytest.raises(ResourceError):
        StagingRing(10, align=0)
    assert issubclass(ResourceError, KvferryError) and issubclass(ResourceError, ValueError)
    ring = StagingRing(100, align=8)
    for bad in (0, -1):
        with pytest.raises(ResourceError):
            ring.assign(bad, "x")
    assert isinstance(ring.assign(101, "x"), RingRefused)
    # 97 <= capacity but 104 aligned does not fit: refusing beats a slot that can never be written.
    assert isinstance(ring.assign(97, "x"), RingRefused)
    assert len(ring) == 0 and ring.head == Watermark(0, 0)
    with pytest.raises(ResourceError):
        ring.free(0)
    with pytest.raises(ResourceError):
        ring.owner_of(0)


def test_ring_alignment_wrap_and_owners() -> None:
    ring = StagingRing(100, align=8)
    a = ring.assign(30, "a")
    b = ring.assign(50, "b")
    assert isinstance(a, RingSlot) and isinstance(b, RingSlot)
    assert (a.offset, a.end, a.size, a.round) == (0, 32, 30, 0)
    assert (b.offset, b.end) == (32, 88)
    c = ring.assign(20, "a")  # 88 + 24 > 100: no split, next round from 0
    assert isinstance(c, RingSlot)
    assert (c.round, c.offset, c.end) == (1, 0, 24)
    assert ring.used == 100 and len(ring) == 3 and ring.owner_of(c.alloc_id) == "a"
    assert ring.watermark() == Watermark(0, 0)
    assert not writable(c, ring.watermark())  # a = [0, 32) of round 0 is still live
    assert writable(a, ring.watermark())  # the oldest live slot is always writable
    ring.free(b.alloc_id)  # out of order: the watermark stays on a
    assert ring.watermark() == Watermark(0, 0)
    assert ring.free_owner("a") == [a.alloc_id, c.alloc_id]
    assert len(ring) == 0 and ring.used == 0
    assert ring.watermark() == Watermark(2, 0)
    with pytest.raises(ResourceError):
        ring.free(a.alloc_id)
    assert ring.free_owner("a") == []


def test_ring_live_view_is_read_only() -> None:
    ring = StagingRing(10)
    slot = ring.assign(4, "a")
    assert isinstance(slot, RingSlot)
    with pytest.raises(TypeError):
        ring.live[99] = slot  # type: ignore[index]
    assert dict(ring.live) == {slot.alloc_id: slot}


@given(
    rnd=st.integers(0, 5),
    offset=st.integers(0, 50),
    size=st.integers(1, 50),
    wm1=st.tuples(st.integers(0, 7), st.integers(0, 100)),
    wm2=st.tuples(st.integers(0, 7), st.integers(0, 100)),
)
def test_writable_is_monotone_in_watermark(
    rnd: int, offset: int, size: int, wm1: tuple[int, int], wm2: tuple[int, int]
) -> None:
    """A stale (smaller) watermark never allows what a newer one forbids."""
    slot = RingSlot(alloc_id=0, offset=offset, round=rnd, end=offset + size, size=size)
    lo, hi = sorted((Watermark(*wm1), Watermark(*wm2)))
    if writable(slot, lo):
        assert writable(slot, hi)
    assert writable(slot, slot.position)


# -- ring state machine --------------------------------------------------------------------------


class RingMachine(RuleBasedStateMachine):
    """Random assign / free / free_owner / drain against an independent model of the live set.

    ``heard`` is what a producer on the other machine knows: the max of the watermarks the consumer
    broadcast after each free (and the initial one); it is checked separately from watermark().
    """

    ring_cls: type[StagingRing] = StagingRing
    writable_fn: Callable[[RingSlot, Watermark], bool] = staticmethod(writable)

    @initialize(capacity=st.integers(1, 200), align=st.sampled_from([1, 1, 4, 16]), seed=st.integers())
    def setup(self, capacity: int, align: int, seed: int) -> None:
        self.ring = self.ring_cls(capacity, align)
        self.rng = random.Random(seed)
        self.model: dict[int, RingSlot] = {}
        self.freed: list[int] = []
        self.last_position = Watermark(-1, 0)
        self.last_wm = self.ring.watermark()
        self.heard = self.ring.watermark()

    def _assign(self, n: int, owner: str) -> RingSlot | RingRefused:
        got = self.ring.assign(n, owner)
        span = -(-n // self.ring.align) * self.ring.align
        if span > self.ring.capacity:
            assert isinstance(got, RingRefused) and got.reason
            return got
        assert isinstance(got, RingSlot)
        assert got.size == n and got.end == got.offset + span <= self.ring.capacity
        assert got.offset % self.ring.align == 0
        assert got.position > self.last_position, "allocations are handed out in ring order"
        assert got.alloc_id not in self.model and got.alloc_id not in self.freed
        self.last_position = got.position
        self.model[got.alloc_id] = got
        return got

    def _broadcast(self) -> None:
        self.heard = max(self.heard, self.ring.watermark())

    @rule(data=st.data(), owner=st.sampled_from(OWNERS))
    def assign(self, data: st.DataObject, owner: str) -> None:
        cap = self.ring.capacity
        self._assign(data.draw(st.integers(1, cap + cap // 4 + 1), label="n"), owner)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        alloc_id = data.draw(st.sampled_from(sorted(self.model)), label="alloc_id")
        self.ring.free(alloc_id)
        del self.model[alloc_id]
        self.freed.append(alloc_id)
        self._broadcast()

    @rule(owner=st.sampled_from(OWNERS))
    def free_owner(self, owner: str) -> None:
        expected = [i for i, s in self.model.items() if self.ring.owner_of(i) == owner]
        assert self.ring.free_owner(owner) == expected
        for alloc_id in expected:
            del self.model[alloc_id]
        self.freed += expected
        self._broadcast()

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def bad_free(self, data: st.DataObject) -> None:
        alloc_id = data.draw(st.sampled_from([*self.freed[-5:], -1, 10**9]), label="bad id")
        with pytest.raises(ResourceError):
            self.ring.free(alloc_id)

    @rule(data=st.data())
    def drain_then_assign(self, data: st.DataObject) -> None:
        """The consumer drains in any order; a producer then assigned a slot must not wait."""
        for alloc_id in data.draw(st.permutations(sorted(self.model)), label="free order"):
            self.ring.free(alloc_id)
            del self.model[alloc_id]
            self.freed.append(alloc_id)
            self._broadcast()
        self._check_resumes(data.draw(st.integers(1, self.ring.capacity), label="n"))

    def _check_resumes(self, n: int) -> None:
        assert not self.model and len(self.ring) == 0
        got = self._assign(n, "late")
        if isinstance(got, RingSlot):
            assert self.writable_fn(got, self.heard), f"{got} waits forever on watermark {self.heard}"

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "ring"):
            return
        assert dict(self.ring.live) == self.model
        assert self.ring.used == sum(s.size for s in self.model.values())
        assert len(self.ring) == len(self.model)

    @invariant()
    def watermark_monotone_and_progress(self) -> None:
        if not hasattr(self, "ring"):
            return
        wm = self.ring.watermark()
        assert wm >= self.last_wm, f"watermark went back from {self.last_wm} to {wm}"
        self.last_wm = wm
        assert self.heard <= wm
        holding = self._holding()
        if holding:
            oldest = min(holding, key=lambda s: s.position)
            assert wm == oldest.position, f"watermark {wm}, oldest holding slot {oldest}"
            assert self.writable_fn(oldest, wm)
            assert self.writable_fn(oldest, self.heard), f"oldest {oldest} stuck under {self.heard}"
        else:
            assert wm == self.ring.head

    def _holding(self) -> list[RingSlot]:
        """The live slots the watermark must not pass (every one, here)."""
        return list(self.model.values())

    @invariant()
    def no_live_overlap_writable(self) -> None:
        """Safety, from byte ranges and rounds only: while an earlier overlapping slot is live,
        the later one is not writable (so no region is ever writable by two live slots)."""
        if not hasattr(self, "ring"):
            return
        wm = self.ring.watermark()
        slots = sorted(self.model.values(), key=lambda s: s.position)
        for i, early in enumerate(slots):
            for late in slots[i + 1 :]:
                if not _overlap(early, late):
                    continue
                assert early.round < late.round, f"{early} and {late} overlap in one round"
                assert not self.writable_fn(late, wm), f"{late} writable while {early} is live"
                assert not self.writable_fn(late, self.heard)

    def teardown(self) -> None:
        if not hasattr(self, "ring"):
            return
        ids = list(self.model)
        self.rng.shuffle(ids)
        for alloc_id in ids:
            self.ring.free(alloc_id)
            del self.model[alloc_id]
            self._broadcast()
            self.watermark_monotone_and_progress()
        self._check_resumes(self.rng.randint(1, self.ring.capacity))


TestRingMachine = RingMachine.TestCase
TestRingMachine.settings = STATEFUL


class StaleHeadRingMachine(RingMachine):
    ring_cls = StaleHeadRing


class LaxWritableRingMachine(RingMachine):
    writable_fn = staticmethod(_lax_writable)


@pytest.mark.parametrize(
    ("machine", "message"),
    [(StaleHeadRingMachine, "stuck under|waits forever"), (LaxWritableRingMachine, "writable while")],
)
def test_planted_ring_bugs_are_caught(machine: type[RingMachine], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        run_state_machine_as_test(
            machine,
            settings=settings(
                STATEFUL, max_examples=300, phases=[Phase.generate], database=None, print_blob=False
            ),
        )


# -- pinned pool ---------------------------------------------------------------------------------


def test_pinned_examples() -> None:
    pool = PinnedPool(1024, align=64)
    a = pool.reserve(100, "a")
    b = pool.reserve(64, "b")
    c = pool.reserve(1, "a")
    assert (a, b, c) == (Reservation(0, 0, 128), Reservation(1, 128, 64), Reservation(2, 192, 64))
    assert pool.used == 256 and pool.free_bytes == 768 and pool.fragmentation == 0.0
    pool.free(a.res_id)
    assert pool.free_ranges == ((0, 128), (256, 768))
    assert pool.largest_free == 768
    assert pool.fragmentation == pytest.approx(1 - 768 / 896)
    d = pool.reserve(65, "d")  # first fit: the hole at 0
    assert d == Reservation(3, 0, 128)
    assert pool.reserve(769, "e") is None  # fits the pool, not now: defer
    assert isinstance(pool.reserve(1025, "e"), PinnedRefused)
    assert pool.free_owner("a") == [c.res_id]
    assert pool.free_ranges == ((192, 832),)
    pool.free(b.res_id)  # merges both sides
    pool.free(d.res_id)
    assert pool.free_ranges == ((0, 1024),) and len(pool) == 0 and pool.fragmentation == 0.0
    with pytest.raises(ResourceError):
        pool.free(d.res_id)
    with pytest.raises(ResourceError):
        pool.reserve(0, "x")
    with pytest.raises(ResourceError):
        PinnedPool(0)
    full = PinnedPool(128, align=64)
    assert full.reserve(128, "x") is not None
    assert full.free_ranges == () and full.largest_free == 0 and full.fragmentation == 0.0
    # 1000 <= 1000 but 1024 aligned never fits: a refusal, not an endless deferral.
    assert isinstance(PinnedPool(1000, align=64).reserve(1000, "x"), PinnedRefused)


class PinnedMachine(RuleBasedStateMachine):
    """Random reserve / free / free_owner against a reference first-fit computed from live ranges."""

    @initialize(capacity=st.integers(1, 2048), align=st.sampled_from([1, 8, 64]))
    def setup(self, capacity: int, align: int) -> None:
        self.pool = PinnedPool(capacity, align)
        self.model: dict[int, Reservation] = {}
        self.owners: dict[int, str] = {}
        self.freed: list[int] = []

    def _gaps(self) -> list[tuple[int, int]]:
        gaps, pos = [], 0
        for res in sorted(self.model.values(), key=lambda r: r.offset):
            if res.offset > pos:
                gaps.append((pos, res.offset - pos))
            pos = res.end
        if pos < self.pool.capacity:
            gaps.append((pos, self.pool.capacity - pos))
        return gaps

    @rule(data=st.data(), owner=st.sampled_from(OWNERS))
    def reserve(self, data: st.DataObject, owner: str) -> None:
        cap = self.pool.capacity
        n = data.draw(st.integers(1, cap + cap // 8 + 1), label="n")
        size = -(-n // self.pool.align) * self.pool.align
        got = self.pool.reserve(n, owner)
        if size > cap:
            assert isinstance(got, PinnedRefused)
            return
        fit = next((off for off, gap in self._gaps() if gap >= size), None)
        if fit is None:
            assert got is None
            return
        assert isinstance(got, Reservation)
        assert (got.offset, got.size) == (fit, size)
        assert got.res_id not in self.model and got.res_id not in self.freed
        self.model[got.res_id] = got
        self.owners[got.res_id] = owner

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        res_id = data.draw(st.sampled_from(sorted(self.model)), label="res_id")
        self.pool.free(res_id)
        del self.model[res_id]
        self.freed.append(res_id)

    @rule(owner=st.sampled_from(OWNERS))
    def free_owner(self, owner: str) -> None:
        expected = sorted(i for i in self.model if self.owners[i] == owner)
        assert self.pool.free_owner(owner) == expected
        for res_id in expected:
            del self.model[res_id]
        self.freed += expected

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def bad_free(self, data: st.DataObject) -> None:
        with pytest.raises(ResourceError):
            self.pool.free(data.draw(st.sampled_from([*self.freed[-5:], -1]), label="bad id"))

    @invariant()
    def tiles_exactly(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        assert dict(pool.live) == self.model and len(pool) == len(self.model)
        assert pool.used == sum(r.size for r in self.model.values())
        assert pool.free_bytes == pool.capacity - pool.used
        free = pool.free_ranges
        assert all(size > 0 for _, size in free)
        assert all(a[0] + a[1] < b[0] for a, b in itertools.pairwise(free)), "not coalesced"
        assert free == tuple(self._gaps())
        spans = sorted([(r.offset, r.end) for r in self.model.values()] + [(o, o + s) for o, s in free])
        pos = 0
        for start, end in spans:
            assert start == pos, f"gap or overlap at {pos}: {spans}"
            pos = end
        assert pos == pool.capacity
        assert pool.largest_free == max((s for _, s in free), default=0)
        if len(free) <= 1:
            assert pool.fragmentation == 0.0
        else:
            assert pool.fragmentation == pytest.approx(1 - pool.largest_free / pool.free_bytes)

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for res_id in list(self.model):
            self.pool.free(res_id)
        assert self.pool.free_ranges == ((0, self.pool.capacity),)
        assert self.pool.used == 0 and len(self.pool) == 0


TestPinnedMachine = PinnedMachine.TestCase
TestPinnedMachine.settings = STATEFUL
