"""KV page allocation in deployment runs (DeploySpec.page_allocator): SGLang's sorted free list
with pages for generated tokens by default, the original lowest-first heap on request."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import numpy as np
import pytest
from kvferry.sim.deploy import workload as wl
from kvferry.sim.deploy.run import build_scenario, collect, simulate
from kvferry.sim.deploy.spec import DeployError, DeploySpec
from kvferry.sim.deploy.world import DeployWorld
from kvferry.sim.pages import LowestFirst, SortedFreeList, pair_runs

# The NIC these golden numbers were computed on (the first 400 Gb/s model: vLLM-fitted posting).
BASE = DeploySpec(
    model="qwen3-8b", prefill_tp=4, decode_tp=4, gpu="h200", nic="nic-400g-vllm-fit", flow="direct"
)


def _tight_world(spec: DeploySpec, pages: int, n: int = 60, c: int = 8) -> tuple[DeployWorld, wl.Arrivals]:
    """A deployment whose servers hold only ``pages`` pages each: bench_serving's mixed lengths
    (1-256 input, 0-64 output tokens) churn them, so the sorted free list merges many times."""
    lengths = wl.random_lengths(n, 256, 64, 0.0, seed=5)
    s = build_scenario(spec, lengths)
    s = msgspec.structs.replace(
        s, topology=msgspec.structs.replace(s.topology, prefill_pages=pages, decode_pages=pages)
    )
    arrivals = wl.Arrivals(concurrency=c, total=n)
    return DeployWorld(spec, s, arrivals, lengths), arrivals


def test_lowest_first_keeps_the_original_allocation() -> None:
    """Mixed lengths (where the heap does fragment). Unequal TP: main's numbers at 8c0d985. Equal
    TP: main gave (11.5895554, 2.9961335883330804, 119.8851); since decode holds a delivered
    request's pages until its last token (main freed them at KV arrival, and the heap handed
    them to the next request), later grants are other ids and merge differently. Since the
    fewer-messages protocol (prefill's InfoAcks owed, core/info_acks.py) the TTFT means are 13 ns
    (TP 4) and 13 ns (TP 2) later than main's 11.888979025 / 72.66135875 and the e2e p50 of TP 2
    65 ns later (207.2187545), with the control messages; not traced further. The pins are every
    rank's run; one TP group (the default) draws fewer jitters, within 0.01 ms of them."""
    lens = wl.random_lengths(40, 256, 64, 0.0, seed=2)
    pins = [
        (11.888992024999999, 2.996114340870539, 119.885425),
        (72.66137175, 3.9870189177281836, 207.2188195),
    ]
    for every_rank in (True, False):
        got = []
        for dtp in (4, 2):
            spec = replace(BASE, decode_tp=dtp, page_allocator="lowest-first", every_rank=every_rank)
            r = simulate(spec, wl.Arrivals(concurrency=8, total=40), lens)
            assert r.completed == 40 and not r.violations
            got.append((r.ttft_ms.mean, r.tpot_ms.mean, r.e2e_ms.p50))
        if every_rank:
            assert got == pins
        else:
            assert [pytest.approx(g, abs=0.01) for g in got] == pins


@pytest.mark.parametrize("flow", ["direct", "ring", "pull"])
def test_fault_free_run_on_fragmented_pages_ends_every_request_success(flow: str) -> None:
    w, arrivals = _tight_world(replace(BASE, flow=flow), pages=150)
    w.run_deploy(3_600 * 10**9)
    r = collect(w, arrivals)
    assert [q.outcome for q in w.requests] == ["success"] * 60
    assert not w.violations and r.completed == 60 and r.failed == 0
    pre, dec = w.world.allocs["prefill0"][0], w.world.allocs["decode0"][0]
    assert isinstance(pre, SortedFreeList) and isinstance(dec, SortedFreeList)
    assert pre.merges > 1 and dec.merges > 1
    # The pages really were scattered, and everything (generated tokens' pages too) came back.
    pairs = [pair_runs(q.pre_pages, q.dec_pages) for q in w.requests]  # type: ignore[arg-type]
    assert max(pairs) >= 3 and np.mean(pairs) > 1.1
    assert r.page_runs["pair"] == pytest.approx(np.mean(pairs)) and r.page_runs["pair_max"] == max(pairs)
    assert pre.used == 0 and dec.used == 0 and w.memory.growth_short == 0


def test_scattered_pages_cost_the_direct_flow_descriptors() -> None:
    """Equal TP: the direct flow's descriptors merge within runs only, so the same requests on
    scattered pages post more of them than on a pool too large to wrap."""
    charged = []
    for pages in (150, 100_000):
        w, _ = _tight_world(BASE, pages=pages)
        w.run_deploy(3_600 * 10**9)
        assert not w.violations
        pairs = sum(pair_runs(q.pre_pages, q.dec_pages) for q in w.requests)  # type: ignore[arg-type]
        charged.append((w.fabric.stats.descriptors_charged, pairs))
    (frag_desc, frag_runs), (flat_desc, flat_runs) = charged
    assert flat_runs == 60 and frag_runs > 60
    assert frag_desc > flat_desc


def _one_request(kind: str) -> tuple[DeployWorld, int, list[int]]:
    """One request of 100 input and 60 output tokens; decode's most pages held, and when each
    free happened."""
    spec = replace(BASE, page_allocator=kind)
    req = (wl.DeployRequest(0, 100, 60),)
    w = DeployWorld(spec, build_scenario(spec, req), wl.Arrivals(concurrency=1, total=1), req)
    dec = w.world.allocs["decode0"][0]
    free = dec.free
    peak, when = [0], []

    def spy(ids: np.ndarray, key: int) -> None:
        peak[0] = max(peak[0], dec.used)
        when.append(int(w.env.now))
        free(ids, key)

    dec.free = spy  # type: ignore[method-assign]
    w.run_deploy(3_600 * 10**9)
    assert not w.violations and dec.used == 0
    return w, peak[0], when


@pytest.mark.parametrize(("kind", "pages"), [("sglang", 10), ("lowest-first", 7)])
def test_decode_takes_a_page_per_page_of_generated_tokens(kind: str, pages: int) -> None:
    # 100 input tokens hold 7 pages of 16; writing tokens 100..159 needs pages for 112, 128, 144.
    w, peak, when = _one_request(kind)
    assert peak == pages
    assert isinstance(w.world.allocs["decode0"][0], SortedFreeList if kind == "sglang" else LowestFirst)
    # Held until the last token, not given back when the KV arrived.
    assert min(when) == w.tracks[0].done_ns > w.tracks[0].first_token_ns


def test_bad_page_allocator_is_refused() -> None:
    with pytest.raises(DeployError, match="page_allocator: expected one of sglang, lowest-first"):
        replace(BASE, page_allocator="buddy").check()


def test_a_request_decode_can_never_hold_is_refused() -> None:
    """100 input + 60 output tokens on a decode pool of 7 pages of 16: SGLang would queue it
    forever (it must fit whole), so the simulator refuses the run up front."""
    spec = replace(BASE, page_allocator="sglang", decode_reserved_tokens=0)
    req = (wl.DeployRequest(0, 100, 60),)
    s = build_scenario(spec, req)
    s = msgspec.structs.replace(s, topology=msgspec.structs.replace(s.topology, decode_pages=7))
    with pytest.raises(DeployError, match="100 input and 60 output tokens never fits decode's 112 tokens"):
        DeployWorld(spec, s, wl.Arrivals(concurrency=1, total=1), req)
