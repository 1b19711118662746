"""Serial pull (vLLM's proxy order): decode's side of a room starts only after prefill finished,
the proxy hop and decode's running step; with the option off nothing changes."""

from __future__ import annotations

import bisect
from dataclasses import replace

import pytest
from kvferry.sim.deploy import workload as wl
from kvferry.sim.deploy.run import collect, deploy_world, run_world, simulate
from kvferry.sim.deploy.spec import DeployError, DeploySpec

MS = 1_000_000
# TP 4 -> 2 pull with 512-token chunks (two chunks a request), four users: every run below is this
# deployment, so the golden numbers and the serial runs compare like with like.
# The NIC these golden numbers were computed on (the first 400 Gb/s model: vLLM-fitted posting).
BASE = DeploySpec(
    model="qwen3-8b",
    prefill_tp=4,
    decode_tp=2,
    gpu="h200",
    nic="nic-400g-vllm-fit",
    flow="pull",
    chunk_tokens=512,
)


def _loop(c: int = 4, n: int = 8, osl: int = 16):  # type: ignore[no-untyped-def]
    return wl.closed_loop(c, n, 1024, osl, seed=3)


def test_option_off_reproduces_the_overlapped_pull() -> None:
    """Golden numbers from main at 0473e44 (before serial pull existed), moved 0.47 us (TTFT mean,
    1142.88152525 before) and 0.85 us (e2e p50, 1202.741868) by the fewer-messages protocol (prefill's
    InfoAcks owed: core/info_acks.py). Off, the hop is unused: 0 ms and the default give the same run.
    The pins are every rank's run; one TP group (the default) draws fewer jitters, within 0.01 ms."""
    pins = (1142.881991875, 3.9906726000000003, 1202.742718)
    for hop in (0.0, BASE.proxy_hop_ms):
        r = simulate(replace(BASE, proxy_hop_ms=hop, every_rank=True), *_loop())
        assert r.completed == 8 and not r.violations
        assert (r.ttft_ms.mean, r.tpot_ms.mean, r.e2e_ms.p50) == pins
        one = simulate(replace(BASE, proxy_hop_ms=hop), *_loop())
        assert (one.ttft_ms.mean, one.tpot_ms.mean, one.e2e_ms.p50) == pytest.approx(pins, abs=0.01)


@pytest.mark.parametrize("hop_ms", [0.0, 3.0])
def test_serial_decode_opens_after_prefill_and_hop_at_a_step_boundary(hop_ms: float) -> None:
    # Equal TP: transfers are quick, so decode keeps stepping while later requests finish prefill
    # (at TP 4 -> 2 the READs are slow enough that decode idles between requests).
    spec = replace(BASE, prefill_tp=2, decode_tp=2, pull_orchestration="serial", proxy_hop_ms=hop_ms)
    arrivals, lengths = _loop(c=8, n=24, osl=64)
    w = deploy_world(spec, arrivals, lengths)
    w.decode.step_log = []
    run_world(w, arrivals)
    assert collect(w, arrivals).violations == []
    starts = [(s, e) for _, s, e in sorted(w.decode.step_log)]  # one decode instance
    ends = {e for _, e in starts}
    waited = 0
    for key, t in w.tracks.items():
        opened = w.decode_open_ns[key]
        earliest = t.chunk_ready_ns[-1] + round(hop_ms * MS)
        assert opened >= earliest
        # Never inside a running step: the last step started at or before the open ended by then.
        i = bisect.bisect_right(starts, (opened, float("inf"))) - 1
        assert i < 0 or starts[i][1] <= opened or starts[i][0] == opened
        if opened > earliest:
            waited += 1
            assert opened in ends  # it waited for exactly the end of the running step
    assert waited > 0, "no request met a running decode step: the alignment went untested"


def test_serial_pull_costs_the_hop_and_other_flows_ignore_it() -> None:
    arrivals, lengths = _loop(c=1, n=4)
    ttft = [
        simulate(replace(BASE, pull_orchestration="serial", proxy_hop_ms=h), arrivals, lengths).ttft_ms.mean
        for h in (0.0, 5.0, 20.0)
    ]
    overlapped = simulate(BASE, arrivals, lengths).ttft_ms.mean
    assert overlapped <= ttft[0] < ttft[1] < ttft[2]
    assert ttft[2] - ttft[1] == pytest.approx(15.0, abs=0.5)  # one user: the hop adds itself
    push = replace(BASE, flow="push")
    assert (
        simulate(push, arrivals, lengths).ttft_ms.mean
        == simulate(replace(push, pull_orchestration="serial"), arrivals, lengths).ttft_ms.mean
    )


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("pull_orchestration", "eager", "pull_orchestration: expected one of overlapped, serial"),
        ("proxy_hop_ms", -1.0, "proxy_hop_ms must be in"),
        ("proxy_hop_ms", float("nan"), "proxy_hop_ms must be in"),
    ],
)
def test_bad_orchestration_is_refused(field: str, value: object, needle: str) -> None:
    with pytest.raises(DeployError, match=needle):
        replace(BASE, **{field: value}).check()
