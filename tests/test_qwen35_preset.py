"""The hybrid Qwen3.5-397B-A17B preset (SGLang PR 22536's model): only its full-attention layers keep
per-token KV, its linear-attention layers add weights and a per-request recurrent state, and a
DEP4 deployment of it (GB200, FP8 weights, experts over the four decode ranks) runs clean."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from kvferry.core.geometry import PRESETS, links, make_pools
from kvferry.core.planner import plan_room
from kvferry.sim.deploy import hardware
from kvferry.sim.deploy import workload as wl
from kvferry.sim.deploy.compute import Roofline, weights
from kvferry.sim.deploy.run import simulate
from kvferry.sim.deploy.spec import DeployError, DeploySpec

Q35 = PRESETS["qwen3.5-397b-a17b"]

# SGLang PR 22536's deployment: TP 4 prefill, DEP4 decode (four attention-DP ranks, experts over them).
DEP4 = DeploySpec(
    model="qwen3.5-397b-a17b",
    prefill_tp=4,
    decode_tp=1,
    decode_instances=4,
    decode_ep=4,
    gpu="gb200",
    nic="nic-400g",
    weight_bytes=1,
    max_batch=256,
    chunk_tokens=8192,
)


def test_only_the_full_attention_layers_carry_per_token_kv() -> None:
    # 60 layers, every 4th full attention: 15 x (K, V) regions, 2 KV heads of 256 in bf16.
    assert (Q35.num_layers, Q35.linear_layers, Q35.total_layers) == (15, 45, 60)
    assert Q35.num_regions == 30
    assert Q35.token_bytes == 15 * 2 * 2 * 256 * 2 == 30_720
    # The recurrent state: float32 temporal state (64 value heads x 128 x 128) and the bf16 conv
    # state (q|k|v channels 2 x 16 x 128 + 64 x 128, kernel 4 - 1) in each of the 45 layers.
    assert Q35.state_bytes == 45 * (64 * 128 * 128 * 4 + (2 * 16 * 128 + 64 * 128) * 3 * 2)
    # At ISL 1000 the state is ~6x the request's KV: what a hybrid model moves is mostly state.
    assert 6 < Q35.state_bytes / (1000 * Q35.token_bytes) < 7


def test_weights_come_to_the_published_397b_total_and_17b_active() -> None:
    w = weights(Q35)
    assert abs(w.held() / 1e9 - 397) / 397 < 0.03
    # Active: the 16.2e9 a token computes with, plus the 1.0e9 embedding it looks up.
    active = w.active_per_token() + w.embed // 2
    assert abs(active / 1e9 - 17) / 17 < 0.03


def test_direct_descriptors_tp4_to_tp1_count_tokens_times_kv_regions() -> None:
    # 2 KV heads over TP 4: ranks 0-1 replicate head 0, ranks 2-3 head 1; one of each pair sends.
    senders = [x for x in links(Q35, 4, 1) if not x.is_dummy]
    assert [(x.prefill_rank, x.head_start, x.num_heads) for x in senders] == [(0, 0, 1), (2, 1, 1)]
    src = make_pools(Q35, 4, 16, 128)
    dst = make_pools(Q35, 1, 16, 128)
    tokens = 1000
    pages = np.arange(-(-tokens // 16))
    direct = plan_room(src, dst, pages, pages, 0, tokens, coalesce=False)
    real = [p for p in direct.pairs if p.count]
    assert len(real) == 2
    # One 512-byte head slice per token and region: qwen3-8b's TP 4 -> 1 posts 72 per token from
    # each of four ranks, this model 30 from each of two.
    for p in real:
        assert p.count == tokens * Q35.num_regions
        assert p.total_bytes == tokens * Q35.num_regions * 256 * 2
    # Decode holds both heads in each token's slot, so a single head's slice never merges across
    # tokens: merging does not help either (that is what the staging ring is for).
    merged = plan_room(src, dst, pages, pages, 0, tokens)
    assert all(p.count == tokens * Q35.num_regions for p in merged.pairs if p.count)


def test_expert_parallelism_divides_the_routed_experts_across_decode_ranks() -> None:
    gpu = hardware.gpu("gb200")
    one = Roofline(Q35, gpu, 1, weight_bytes=1)
    four = Roofline(Q35, gpu, 1, weight_bytes=1, ep=4)
    # 397 GB of FP8 weights on one rank, ~106 GB with the 512 routed experts over four.
    assert one.weight_bytes_per_rank() > 390e9
    assert 100e9 < four.weight_bytes_per_rank() < 110e9
    # A large batch reads every expert a rank holds: a quarter of them under EP 4.
    assert four.decode_ns(256, 256 * 1500) < one.decode_ns(256, 256 * 1500)
    with pytest.raises(ValueError, match="routed experts"):
        Roofline(Q35, gpu, 1, ep=3)
    with pytest.raises(DeployError, match="decode_ep"):
        replace(DEP4, decode_ep=3).check()
    with pytest.raises(DeployError, match="decode_ep"):
        replace(DEP4, model="qwen3-8b", decode_ep=2).check()


def test_the_recurrent_state_takes_hbm_and_decode_bandwidth() -> None:
    DEP4.check()
    # Each decode rank sets aside max_batch requests' state (~49 GB for 256) before KV pages.
    assert DEP4.state_bytes_per_rank("decode") == 256 * Q35.state_bytes
    assert DEP4.state_bytes_per_rank("prefill") == 256 * Q35.state_bytes // 4
    fewer = replace(DEP4, max_batch=128)
    assert fewer.pages("decode") > DEP4.pages("decode")
    # On an H200 the weights and that state do not fit a decode rank: refused, saying why.
    with pytest.raises(DeployError, match="recurrent state of 256 requests"):
        replace(DEP4, gpu="h200").pages("decode")
    # A decode step reads and writes each request's state: it grows with the batch even at no context.
    r = DEP4.roofline("decode")
    extra_ns = r.decode_ns(256, 0) - r.decode_ns(128, 0)
    assert extra_ns >= 2 * 128 * Q35.state_bytes / hardware.gpu("gb200").hbm_bps * 1e9 * 0.99


@pytest.mark.parametrize("flow", ["ring", "direct"])
def test_a_short_dep4_run_completes_every_room(flow: str) -> None:
    r = simulate(replace(DEP4, flow=flow), *wl.closed_loop(8, 16, 1000, 50, seed=1))
    assert r.violations == [], f"seed {r.seed}"
    assert (r.completed, r.failed, r.unfinished) == (16, 0, 0)
    routed = [int(v["requests"]) for k, v in r.instances.items() if k.startswith("decode")]
    assert len(routed) == 4 and min(routed) > 0 and sum(routed) == 16
