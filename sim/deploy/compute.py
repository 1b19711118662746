"""Rooflines of a forward step from the model geometry: time = max(FLOPs / achieved FLOP/s,
bytes / achieved HBM bytes/s) + a fixed per-step overhead, on one TP group.

Per token and layer, the linear layers cost 2 FLOPs per active weight, and attention
2 x heads x attn_dim FLOPs per token of context it attends to. A step reads every weight the
batch touches once (a MoE decode step touches up to batch x experts_per_token experts) and the
KV cache of the context it attends to. TP splits both the FLOPs and the bytes evenly (an
assumption: no communication cost is charged).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvferry.core.geometry import ModelGeometry
from kvferry.sim.deploy.hardware import GpuProfile

__all__ = ["Roofline", "weights"]


@dataclass(frozen=True, slots=True)
class Weights:
    """Per-layer weights (element counts) of a model, and the model's total."""

    attn: int  # attention weights per layer
    dense_mlp: int  # a dense layer's MLP
    expert: int  # one expert's MLP (0: dense model)
    experts_per_token: int
    num_experts: int
    dense_layers: int  # layers with a dense MLP (all of a dense model's)
    moe_layers: int
    embed: int  # embedding + LM head

    def active_per_token(self) -> int:
        """Weights one token runs through (2 FLOPs each)."""
        return (
            self.dense_layers * (self.attn + self.dense_mlp)
            + self.moe_layers * (self.attn + self.experts_per_token * self.expert)
            + self.embed // 2  # the LM head; the embedding is a lookup
        )

    def read_per_step(self, tokens: int) -> int:
        """Weights a step over ``tokens`` tokens reads (each expert at most once)."""
        experts = min(self.num_experts, tokens * self.experts_per_token)
        return (
            self.dense_layers * (self.attn + self.dense_mlp)
            + self.moe_layers * (self.attn + experts * self.expert)
            + self.embed // 2
        )


def weights(m: ModelGeometry) -> Weights:
    if not (m.hidden_size and m.num_attention_heads and (m.intermediate_size or m.moe_intermediate_size)):
        raise ValueError(
            f"model {m.name} lacks compute geometry (hidden_size, intermediate_size, "
            "num_attention_heads): use a preset or give them"
        )
    h = m.hidden_size
    attn = m.attn_params or (
        h * m.num_attention_heads * m.head_dim * 2 + h * m.num_kv_heads * m.head_dim * 2
    )  # q and o, k and v
    moe = m.moe_intermediate_size > 0
    dense_layers = m.dense_layers if moe else m.num_layers
    return Weights(
        attn=attn,
        dense_mlp=3 * h * m.intermediate_size,  # gate, up, down
        expert=3 * h * m.moe_intermediate_size,
        experts_per_token=m.experts_per_token if moe else 0,
        num_experts=m.num_experts if moe else 0,
        dense_layers=dense_layers,
        moe_layers=m.num_layers - dense_layers,
        embed=2 * h * m.vocab_size,
    )


class Roofline:
    """Step times of one TP group of ``gpu`` running ``model``."""

    __slots__ = ("_active", "gpu", "model", "tp", "w", "weight_bytes")

    def __init__(self, model: ModelGeometry, gpu: GpuProfile, tp: int, weight_bytes: int = 2) -> None:
        self.model, self.gpu, self.tp, self.weight_bytes = model, gpu, tp, weight_bytes  # BF16 weights
        self.w = weights(model)
        self._active = self.w.active_per_token()

    def _attn_flops(self, token_ctx: int) -> float:
        """Attention FLOPs of all layers for ``token_ctx`` (query token x context token) pairs."""
        m = self.model
        dim = m.attn_dim or 2 * m.head_dim
        return 2.0 * m.num_attention_heads * dim * token_ctx * m.num_layers

    def _kv_bytes(self, ctx_tokens: int) -> float:
        return float(ctx_tokens * self.model.token_bytes)

    def _time_ns(self, flops: float, nbytes: float, overhead_us: float) -> int:
        g = self.gpu
        t = max(flops / (g.flops * self.tp), nbytes / (g.hbm_bps * self.tp))
        return int(t * 1e9 + overhead_us * 1000)

    def prefill_ns(self, tokens: int, ctx_start: int) -> int:
        """One prefill step computing ``tokens`` new tokens after ``ctx_start`` already cached."""
        return self.prefill_batch_ns(((tokens, ctx_start),))

    def prefill_batch_ns(self, parts: Sequence[tuple[int, int]]) -> int:
        """One prefill step over several requests' chunks, each ``(new tokens, cached before)``:
        the weights are read once for the whole batch, the step overhead paid once."""
        w = self.w
        tokens = sum(t for t, _ in parts)
        # Each new token attends to its request's cached context and to the new tokens before it.
        pairs = sum(t * ctx + t * (t + 1) // 2 for t, ctx in parts)
        flops = 2.0 * w.active_per_token() * tokens + self._attn_flops(pairs)
        kv = sum(ctx + t for t, ctx in parts)
        nbytes = self.weight_bytes * w.read_per_step(tokens) + self._kv_bytes(kv)
        return self._time_ns(flops, nbytes, self.gpu.prefill_step_overhead_us)

    def decode_ns(self, batch: int, ctx_total: int) -> int:
        """One decode step of ``batch`` sequences attending to ``ctx_total`` tokens in all."""
        if batch <= 0:
            return 0
        w = self.w
        flops = 2.0 * self._active * batch + self._attn_flops(ctx_total)
        nbytes = self.weight_bytes * w.read_per_step(batch) + self._kv_bytes(ctx_total)
        return self._time_ns(flops, nbytes, self.gpu.decode_step_overhead_us)

    def weight_bytes_per_rank(self) -> int:
        w = self.w
        total = (
            w.dense_layers * (w.attn + w.dense_mlp)
            + w.moe_layers * (w.attn + w.num_experts * w.expert)
            + w.embed
        )
        return self.weight_bytes * total // self.tp
