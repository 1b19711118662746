"""A scenario key typed as a plain value under a near key's name gets a "did you mean"."""

from __future__ import annotations

import pytest
from kvferry.sim import scenario as sc


def test_room_as_a_number_suggests_rooms() -> None:
    with pytest.raises(
        sc.ScenarioError, match=r"\[workload\]\.room: expected an array, got 24 \(did you mean 'rooms'\?\)"
    ):
        sc.parse({"workload": {"room": 24}}, where="t.toml")


def test_an_array_key_with_no_near_neighbour_gets_no_guess() -> None:
    with pytest.raises(sc.ScenarioError) as e:
        sc.parse({"faults": {"event": 3}}, where="t.toml")
    assert "expected an array, got 3" in str(e.value)
