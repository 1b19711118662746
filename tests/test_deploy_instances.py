"""P prefill and D decode instances in one deployment world: the router, each instance's own
scheduler and batch, and the checks that catch a router or a batch loop crossing instances."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.sim.deploy import workload as wl
from kvferry.sim.deploy.router import Router
from kvferry.sim.deploy.run import build_scenario, collect, deploy_world, run_world, simulate
from kvferry.sim.deploy.spec import DeployError, DeploySpec
from kvferry.sim.deploy.world import DeployWorld

SPEC = DeploySpec(model="qwen3-8b", prefill_tp=4, decode_tp=2, chunk_tokens=512)


def _spec(p: int, d: int, flow: str = "ring") -> DeploySpec:
    return replace(SPEC, flow=flow, prefill_instances=p, decode_instances=d)


def _closed(c: int, n: int) -> tuple[wl.Arrivals, tuple[wl.DeployRequest, ...]]:
    return wl.closed_loop(c, n, 600, 8, seed=1)


def _run(w: DeployWorld, arrivals: wl.Arrivals):  # type: ignore[no-untyped-def]
    return collect(w, arrivals, run_world(w, arrivals))


# ---- the router ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(1, 5),
    loads=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=5), min_size=1, max_size=30),
)
def test_router_round_robins_prefill_and_picks_a_least_loaded_decode(p: int, loads: list[list[int]]) -> None:
    d = len(loads[0])
    loads = [(x * d)[:d] for x in loads]  # every arrival sees D loads
    a, b = Router(p, d), Router(p, d)
    for i, now in enumerate(loads):
        got = a.route(now)
        assert got == b.route(now)  # the same arrivals, the same routes
        assert got[0] == i % p
        assert now[got[1]] == min(now)


def test_router_spreads_an_idle_deployment_over_every_decode_instance() -> None:
    r = Router(1, 4)
    assert [r.route((0, 0, 0, 0))[1] for _ in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="instances on both sides"):
        Router(0, 1)


# ---- whole runs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "d"), [(1, 4), (2, 1), (3, 2)])
@pytest.mark.parametrize("flow", ["ring", "direct"])
def test_every_request_completes_on_its_own_two_instances(p: int, d: int, flow: str) -> None:
    arrivals, lengths = _closed(6, 18)
    w = deploy_world(_spec(p, d, flow), arrivals, lengths)
    r = _run(w, arrivals)
    assert r.violations == [], r.violations
    assert (r.completed, r.failed, r.unfinished) == (18, 0, 0)
    assert w.loads.load == [0] * d  # every routed request finished and left its decode instance
    assert sum(x["requests"] for k, x in r.instances.items() if k.startswith("decode")) == 18
    assert all(x["requests"] > 0 and 0 < x["busy"] <= 1 for x in r.instances.values()), r.instances
    for req in w.requests:
        # The room was opened on its own servers' ranks and nowhere else.
        own = w.world.room_nodes(req, "prefill") + w.world.room_nodes(req, "decode")
        assert set(req.inc) == set(own)
        assert own[0].startswith("prefill") and own[-1].startswith("decode")


@settings(max_examples=6, deadline=None)
@given(p=st.integers(1, 3), d=st.integers(1, 3), c=st.integers(1, 8), seed=st.integers(0, 3))
def test_conservation_and_no_violation_for_any_small_deployment(p: int, d: int, c: int, seed: int) -> None:
    arrivals = wl.Arrivals(requests=wl.poisson(50.0, 3 * c, 400, 4, seed=seed))
    r = simulate(replace(_spec(p, d), seed=seed + 1), arrivals)
    assert r.violations == []
    assert r.completed + r.failed + r.unfinished == r.requests == 3 * c
    assert r.completed == r.requests


def test_routing_is_deterministic_per_seed() -> None:
    arrivals = wl.Arrivals(requests=wl.poisson(80.0, 24, 600, 8, seed=4))

    def routes() -> tuple[list[tuple[int, int]], float]:
        w = deploy_world(_spec(3, 2), arrivals)
        r = _run(w, arrivals)
        return [(q.pre_inst, q.dec_inst) for q in w.requests], r.ttft_ms.p99

    first = routes()
    assert first == routes()
    assert {pd[0] for pd in first[0]} == {0, 1, 2} and {pd[1] for pd in first[0]} == {0, 1}


def test_more_decode_instances_take_decode_load_off_one_prefill() -> None:
    # One prefill instance feeding one decode instance, against the same prefill feeding four:
    # the decode batch per instance shrinks, so its steps (and TPOT) get shorter.
    arrivals, lengths = wl.closed_loop(32, 64, 600, 32, seed=1)
    one = simulate(_spec(1, 1), arrivals, lengths)
    four = simulate(_spec(1, 4), arrivals, lengths)
    assert one.violations == four.violations == []
    assert four.tpot_ms.p50 < one.tpot_ms.p50


# ---- planted bugs: the checks must catch them ------------------------------------------------------


class _OneTooManyRouter(Router):
    """Planted bug: decode round-robin over D + 1 instances (one that does not exist)."""

    def route(self, loads: Sequence[int]) -> tuple[int, int]:
        p, _ = super().route(loads)
        self._n = getattr(self, "_n", -1) + 1
        return p, self._n % (len(loads) + 1)


def test_a_route_to_a_missing_instance_is_a_violation_and_the_request_fails() -> None:
    arrivals, lengths = _closed(4, 8)
    spec = _spec(1, 2)
    w = deploy_world(spec, arrivals, lengths, router=_OneTooManyRouter(1, 2))
    r = _run(w, arrivals)
    bad = [v for v in r.violations if v.startswith("routing:")]
    assert bad and "decode instance 2 of 1P2D" in bad[0]
    assert r.failed > 0 and r.completed + r.failed + r.unfinished == r.requests


def _stealing(w: DeployWorld) -> DeployWorld:
    """Planted bug: a decode loop takes the next instance's waiting requests before its own."""
    decode, honest = w.decode, w.decode.take

    def take(j: int) -> int | None:
        other = decode.waiting[(j + 1) % len(decode.waiting)]
        return other.popleft() if other else honest(j)

    decode.take = take  # type: ignore[method-assign]
    return w


def test_a_batch_taking_another_instances_request_is_a_violation() -> None:
    arrivals, lengths = _closed(8, 16)
    spec = _spec(1, 2)
    w = _stealing(DeployWorld(spec, build_scenario(spec, lengths), arrivals, lengths))
    r = _run(w, arrivals)
    assert any(v.startswith("routing:") and "batched request" in v for v in r.violations), r.violations
    # The honest world, same inputs: no such violation.
    assert _run(deploy_world(spec, arrivals, lengths), arrivals).violations == []


# ---- the spec ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "d", "needle"),
    [
        (0, 1, "prefill_instances must be in [1, 64], got 0"),
        (1, 65, "decode_instances must be in [1, 64], got 65"),
        (2, True, "decode_instances must be in [1, 64], got True"),
    ],
)
def test_bad_instance_counts_are_clear_errors(p: int, d: int, needle: str) -> None:
    with pytest.raises(DeployError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        _spec(p, d).check()
    _spec(3, 2).check()  # unequal counts are a deployment like any other


def test_servers_are_named_apart_and_each_has_its_own_memory() -> None:
    from kvferry.sim.world import World

    s = build_scenario(replace(SPEC, every_rank=True), _closed(1, 1)[1])
    one = World(s)
    assert sorted(one.ranks) == ["decode0", "decode1", "prefill0", "prefill1", "prefill2", "prefill3"]
    many = World(s, instances=(2, 3))
    assert len(many.ranks) == 2 * 4 + 3 * 2 and "prefill1.3" in many.ranks and "decode2.1" in many.ranks
    # Each server its own allocators: one rank's pages are not another server's.
    assert many.allocs["decode0.0"] is many.allocs["decode0.1"] is not many.allocs["decode1.0"]
    # The counts go into the world's scenario: a swarm or a saved failure sees the same servers.
    assert (many.scenario.topology.prefill_instances, many.scenario.topology.decode_instances) == (2, 3)
    with pytest.raises(ValueError, match="decode instances must be >= 1, got 0"):
        World(s, instances=(1, 0))
