"""Deadline heap against a dict model, tombstones, and the timeout safety rules."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.core.deadlines import DeadlineHeap, Timeouts
from kvferry.core.kvpoll import KVPoll
from kvferry.core.proto_common import Tombstones

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H

ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.integers(0, 6), st.integers(0, 100)),
        st.tuples(st.just("cancel"), st.integers(0, 6), st.just(0)),
        st.tuples(st.just("pop"), st.just(0), st.integers(0, 100)),
    ),
    max_size=200,
)


@settings(max_examples=200)
@given(ops)
def test_heap_matches_a_dict_model(script: list[tuple[str, int, int]]) -> None:
    heap, model = DeadlineHeap(), {}
    for op, key, when in script:
        if op == "set":
            heap.set(key, when)
            model[key] = when
        elif op == "cancel":
            heap.cancel(key)
            model.pop(key, None)
        else:
            due = heap.pop_due(when)
            want = sorted((w, k) for k, w in model.items() if w <= when)
            assert sorted((model[k], k) for k in due) == want
            assert [model[k] for k in due] == sorted(model[k] for k in due)  # earliest first
            for k in due:
                del model[k]
        assert len(heap) == len(model)
        assert heap.next() == (min(model.values()) if model else None)
        assert len(heap._heap) <= max(64, 2 * len(model)) + 1  # stale entries are compacted


def test_tombstones_expire_and_late_failure_updates_them() -> None:
    t = Tombstones(ttl=10)
    t.add(1, "a", KVPoll.Success, 0)
    t.add(1, "b", KVPoll.Failed, 5)
    assert t.get(1, "a") is KVPoll.Success and t.latest(1) == ("b", KVPoll.Failed)
    assert t.fail(1, "a") and t.get(1, "a") is KVPoll.Failed
    assert not t.fail(1, "a") and not t.fail(2, "x")  # no change, unknown: nothing to record
    t.expire(10)
    assert t.get(1, "a") is None and t.latest(1) == ("b", KVPoll.Failed)
    t.expire(15)
    assert len(t) == 0 and t.latest(1) is None and t.next_deadline() is None


@given(ttl=st.integers(1, 10**9), ends=st.lists(st.integers(0, 10**9), min_size=1, max_size=20))
def test_tombstones_kept_at_least_ttl_and_expire_on_a_grid(ttl: int, ends: list[int]) -> None:
    """Each pair lives in [ttl, ttl + grid) past its end, and pairs ending within one grid step
    share one expiry (one wake-up for many rooms)."""
    t = Tombstones(ttl=ttl)
    for i, end in enumerate(ends):
        t.add(i, "x", KVPoll.Success, end)
    dues = []
    while (due := t.next_deadline()) is not None:
        dues.append(due)
        t.expire(due)
    assert len(dues) == len({(end + ttl + t.grid - 1) // t.grid for end in ends})
    t = Tombstones(ttl=ttl)
    for i, end in sorted(enumerate(ends), key=lambda p: p[1]):
        t.add(i, "x", KVPoll.Success, end)
        t.expire(end + ttl - 1)
        assert t.get(i, "x") is KVPoll.Success
        t.expire(end + t.longest)
        assert t.get(i, "x") is None


def test_timeout_safety_rules() -> None:
    assert H.TEST_TIMEOUTS.problems(H.MAX_MSG_DELAY, H.MAX_WRITE) == []
    assert Timeouts().problems(max_msg_delay_ns=1_000_000_000, max_write_ns=10_000_000_000) == []
    short_fence = Timeouts(fence_ns=10**9)
    assert any("fence_ns" in p for p in short_fence.problems(0, 0))
    assert any("heartbeat" in p for p in Timeouts(heartbeat_timeout_ns=1).problems(0, 0))
    assert any("tombstone" in p for p in Timeouts(tombstone_ns=10**9).problems(0, 0))
    assert any("positive" in p for p in Timeouts(waiting_ns=0).problems(0, 0))
