"""RuntimeConfig's two bounds on a lost peer's late writes: decode's write quarantine
(``write_quarantine_s``: how long past the fence a failed room's pages wait for its writers'
Stopped) and the agents' drain (``lost_peer_drain_s``: how long a lost peer's transfers are kept
until they end). Defaults derive from the deadlines; explicit values win; a bad value is one
line naming the field; an endpoint hands both to the core and the agent."""

from __future__ import annotations

import math

import pytest
from kvferry.backends.runtime import DecodeEndpoint, PrefillEndpoint, RuntimeConfig
from kvferry.core.deadlines import SEC, Timeouts
from kvferry.core.geometry import ModelGeometry, PoolGeometry

MODEL = ModelGeometry("late", num_layers=1, num_kv_heads=2, head_dim=8)


def test_defaults_follow_the_fence() -> None:
    c = RuntimeConfig()
    fence_s = c.timeouts.fence_ns / 1e9
    assert c.write_quarantine() == fence_s and c.lost_peer_drain() == 2 * fence_s
    short = RuntimeConfig(timeouts=Timeouts(fence_ns=17 * SEC, tombstone_ns=40 * SEC))
    assert short.write_quarantine() == 17.0 and short.lost_peer_drain() == 34.0
    # Explicit values win; the drain's default follows the quarantine it is given.
    assert RuntimeConfig(write_quarantine_s=0.0).lost_peer_drain() == fence_s
    tcp = RuntimeConfig(write_quarantine_s=900.0, lost_peer_drain_s=900.0)
    assert tcp.write_quarantine() == 900.0 and tcp.lost_peer_drain() == 900.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("write_quarantine_s", -1.0),
        ("write_quarantine_s", math.nan),
        ("write_quarantine_s", math.inf),
        ("write_quarantine_s", 8 * 86400.0),
        ("lost_peer_drain_s", 0.0),
        ("lost_peer_drain_s", math.nan),
    ],
)
def test_a_bad_bound_is_refused_in_one_line_naming_it(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be None or in \[") as e:
        RuntimeConfig(**{field: value})
    assert "\n" not in str(e.value)


def test_endpoints_hand_the_bounds_to_the_core_and_the_agents() -> None:
    timeouts = Timeouts(fence_ns=17 * SEC, tombstone_ns=40 * SEC)
    pre = PrefillEndpoint("P", PoolGeometry(MODEL, 1, 0, 4, 4), config=RuntimeConfig(timeouts=timeouts))
    pre.start()
    try:
        assert pre.transport.agent.drain_s == 34.0  # fence + the default quarantine
        cfg = RuntimeConfig(timeouts=timeouts, write_quarantine_s=900.0, lost_peer_drain_s=901.0)
        pool = PoolGeometry(MODEL, 1, 0, 4, 4)
        dec = DecodeEndpoint("D", pool, prefill_server="P", prefill_addresses=[pre.address], config=cfg)
        dec.start()
        try:
            with dec.lock:  # the engine only under its endpoint's lock
                assert dec.engine.quarantine_ns == 900 * SEC
            assert dec.transport.agent.drain_s == 901.0
        finally:
            assert dec.close() == []
    finally:
        assert pre.close() == []
