"""Decode's memory in deployment runs (sim/deploy/decode_memory.py): SGLang's admission with
reserved decode tokens, retraction when a step finds no page, and resumption."""

from __future__ import annotations

import itertools
from dataclasses import replace

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvferry.sim.deploy import workload as wl
from kvferry.sim.deploy.decode_memory import (
    CLIP_NEW_TOKENS,
    admits,
    allocatable_tokens,
    never_fits,
    retraction_order,
)
from kvferry.sim.deploy.run import build_scenario, collect
from kvferry.sim.deploy.spec import DeployError, DeploySpec
from kvferry.sim.deploy.world import DeployWorld

BASE = DeploySpec(model="qwen3-8b", prefill_tp=4, decode_tp=4, gpu="h200", nic="nic-400g", flow="direct")
PS = BASE.decode_page_size


# ---------------------------------------------------------------------- the pure rules
@given(st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 5000)), max_size=30))
def test_retraction_order_takes_the_fewest_generated_first(batch: list[tuple[int, int]]) -> None:
    order = retraction_order(batch)
    assert sorted(order) == list(range(len(batch)))
    for a, b in itertools.pairwise(order):
        (ia, ga), (ib, gb) = batch[a], batch[b]
        assert ga < gb or (ga == gb and (ia > ib or (ia == ib and a > b)))


running = st.lists(st.tuples(st.integers(1, 8000), st.integers(0, 8000), st.integers(1, 8000)), max_size=8)


@given(st.integers(0, 10**6), st.integers(0, 1024), st.integers(0, 300), running, st.integers(0, 10**5))
def test_allocatable_tokens_shrinks_with_every_promise(
    free: int, reserved: int, holders: int, batch: list[tuple[int, int, int]], retracted: int
) -> None:
    base = allocatable_tokens(free, reserved, holders, batch, retracted)
    assert allocatable_tokens(free + 1, reserved, holders, batch, retracted) == base + 1
    assert allocatable_tokens(free, reserved, holders + 1, batch, retracted) <= base
    assert allocatable_tokens(free, reserved, holders, batch, retracted + 1) == base - 1
    assert base <= free - reserved * holders - retracted


budgets = st.integers(-(10**6), 10**6)


@given(st.integers(1, 8000), st.integers(1, 10**5), st.integers(0, 1024), budgets, running)
def test_admission_needs_the_prompt_the_reserve_and_the_whole_request(
    inp: int, out: int, reserved: int, budget: int, batch: list[tuple[int, int, int]]
) -> None:
    prompt = -(-inp // PS) * PS
    ok = admits(prompt, inp, out, reserved, budget, batch)
    assert ok == (
        prompt + reserved <= budget
        and inp + min(out, CLIP_NEW_TOKENS) - sum(i + g for i, g, _ in batch) <= budget
    )
    if ok:
        assert admits(prompt, inp, out, reserved, budget + 1, batch)  # more room never refuses
    empty_pool_admits = admits(prompt, inp, out, reserved, budget, ())
    assert never_fits(prompt, inp, out, reserved, budget) == (not empty_pool_admits)


# ---------------------------------------------------------------------- runs
def _world(
    spec: DeploySpec, pages: int, lengths: tuple[wl.DeployRequest, ...], c: int
) -> tuple[DeployWorld, wl.Arrivals]:
    s = build_scenario(spec, lengths)
    s = msgspec.structs.replace(s, topology=msgspec.structs.replace(s.topology, decode_pages=pages))
    arrivals = wl.Arrivals(concurrency=c, total=len(lengths))
    return DeployWorld(spec, s, arrivals, lengths), arrivals


def _memory_problems(w: DeployWorld) -> list[str]:
    """What a finished run's decode memory must satisfy; each line a broken rule."""
    out = []
    dec = w.world.allocs["decode0"][0]
    if dec.used:
        out.append(f"{dec.used} decode pages still held")
    if w.memory.holders != [0] or any(w.memory.retracted) or any(w.memory.grown.values()):
        out.append(f"holders {w.memory.holders}, retracted {w.memory.retracted}, grown {len(w.memory.grown)}")
    if w.memory.growth_short:
        out.append(f"{w.memory.growth_short} generated-token pages found no page")
    for q in w.requests:
        t = w.tracks[q.key]
        if q.outcome != "success" or t.done_ns < 0 or t.tokens != t.req.output_tokens:
            out.append(f"request {q.key}: {q.outcome}, {t.tokens} of {t.req.output_tokens} tokens")
    return out


TIGHT = tuple(wl.DeployRequest(0, 100, 200) for _ in range(8))  # 7 prompt pages, 19 at the end


def test_a_pool_too_small_for_the_growth_retracts_and_still_finishes_every_request() -> None:
    spec = replace(BASE, decode_reserved_tokens=16)
    w, arrivals = _world(spec, pages=60, lengths=TIGHT, c=8)
    w.run_deploy(3_600 * 10**9)
    r = collect(w, arrivals)
    assert not w.violations and not _memory_problems(w)
    assert w.memory.retractions > 0 and w.memory.swap_ns > 0
    assert r.retractions == w.memory.retractions == sum(t.retractions for t in w.tracks.values())
    assert r.as_dict()["retractions"] == w.memory.retractions
    # The retracted requests paid for it: they finish later than any never retracted.
    hit = [t.done_ns for t in w.tracks.values() if t.retractions]
    spared = [t.done_ns for t in w.tracks.values() if not t.retractions]
    assert hit and spared and max(hit) > max(spared)


def test_a_pool_that_holds_every_request_whole_never_retracts() -> None:
    w, _ = _world(BASE, pages=8 * 19 + 8 * 32, lengths=TIGHT, c=8)
    w.run_deploy(3_600 * 10**9)
    assert not w.violations and not _memory_problems(w)
    assert w.memory.retractions == 0 and w.memory.swap_ns == 0


def test_the_reservation_bounds_how_many_requests_decode_holds() -> None:
    """Admission keeps ``reserved`` tokens for every holder: with 100 free pages (1,600 tokens)
    and 112 + 288 tokens a request, at most four are ever held at once."""
    spec = replace(BASE, decode_reserved_tokens=288)
    w, _ = _world(spec, pages=100, lengths=TIGHT, c=8)
    seen: list[int] = []
    admitted = w.admitted

    def spy(req) -> None:  # type: ignore[no-untyped-def]
        admitted(req)
        seen.append(w.memory.holders[0])

    w.admitted = spy  # type: ignore[method-assign]
    w.run_deploy(3_600 * 10**9)
    assert not w.violations and not _memory_problems(w)
    assert max(seen) == 4 and len(seen) == 8  # resumptions are not admissions


def test_a_planted_leak_is_caught() -> None:
    """The run checks above can fail: a retraction that forgets its generated tokens' pages."""
    spec = replace(BASE, decode_reserved_tokens=16)
    w, _ = _world(spec, pages=60, lengths=TIGHT, c=8)
    retract = w.memory.retract

    def leaky(j, t, k):  # type: ignore[no-untyped-def]
        w.memory.grown.pop(k, None)  # dropped, never freed
        return retract(j, t, k)

    w.memory.retract = leaky  # type: ignore[method-assign]
    w.run_deploy(3_600 * 10**9)
    assert any("decode pages still held" in p for p in _memory_problems(w))


def test_bad_reservation_is_refused() -> None:
    for bad in (-1, 1 << 21, 1.5, True):
        with pytest.raises(DeployError, match="decode_reserved_tokens must be in"):
            replace(BASE, decode_reserved_tokens=bad).check()  # type: ignore[arg-type]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=10),
    slack=st.integers(0, 80),
    reserved=st.sampled_from([0, 16, 64, 512]),
    c=st.integers(1, 10),
    seed=st.integers(0, 2**16),
)
def test_any_pool_that_fits_the_largest_request_finishes_every_request(
    lengths: list[tuple[int, int]], slack: int, reserved: int, c: int, seed: int
) -> None:
    """Whatever the lengths, load and reservation, a decode pool that can hold the largest
    request whole (plus ``slack`` pages) ends every request Success, every token generated,
    every page back, whatever was retracted on the way."""
    reqs = tuple(wl.DeployRequest(0, i, o) for i, o in lengths)
    need = max(max(-(-i // PS) * PS + reserved, i + o) for i, o in lengths)
    spec = replace(BASE, decode_reserved_tokens=reserved, seed=seed)
    w, _ = _world(spec, pages=-(-need // PS) + 1 + slack, lengths=reqs, c=c)
    w.run_deploy(3_600 * 10**9)
    assert not w.violations, f"seed {seed}: {w.violations}"
    assert not _memory_problems(w), f"seed {seed}: {_memory_problems(w)}"
