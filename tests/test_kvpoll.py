"""KVPoll order, monotone advance with Failed absorbing, and the MIN view across ranks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvferry.core.kvpoll import KVPoll, advance, is_terminal, min_status

statuses = st.sampled_from(list(KVPoll))


def test_numeric_order_is_the_contract() -> None:
    assert [int(s) for s in KVPoll] == [0, 1, 2, 3, 4]
    assert (
        KVPoll.Failed < KVPoll.Bootstrapping < KVPoll.WaitingForInput < KVPoll.Transferring < KVPoll.Success
    )


@given(st.lists(statuses, max_size=20))
def test_advance_is_monotone_and_failed_sticks(proposals: list[KVPoll]) -> None:
    cur = KVPoll.Bootstrapping
    failed = False
    for p in proposals:
        nxt = advance(cur, p)
        failed = failed or p is KVPoll.Failed
        if failed:
            assert nxt is KVPoll.Failed
        else:
            assert nxt >= cur and nxt == max(cur, p)
        cur = nxt


@given(st.lists(statuses, min_size=1, max_size=8))
def test_min_view(ranks: list[KVPoll]) -> None:
    view = min_status(ranks)
    assert view == min(ranks)
    assert (view is KVPoll.Failed) == (KVPoll.Failed in ranks)
    assert (view is KVPoll.Success) == all(r is KVPoll.Success for r in ranks)


def test_min_of_nothing_and_terminal() -> None:
    with pytest.raises(ValueError):
        min_status([])
    assert [is_terminal(s) for s in KVPoll] == [True, False, False, False, True]
