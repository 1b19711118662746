"""Rooflines of a forward step from the model geometry: time = max(FLOPs / achieved FLOP/s,
bytes / achieved HBM bytes/s) + a fixed per-step overhead, on one TP group.

Per token and layer, the linear layers cost 2 FLOPs per active weight, and attention
2 x heads x attn_dim FLOPs per token of context it attends to. A step reads every weight the
batch touches once (a MoE decode step touches up to batch x experts_per_token experts) and the
KV cache of the context it attends to. TP splits both the FLOPs and the bytes evenly (an
assumption: no communication cost is charged).

A hybrid model's linear-attention layers (``ModelGeometry.linear_layers``) run their own token
mixer's weights and an MLP like any layer, attend to no context, and read and write each request's
recurrent state once a step; the recurrence's own FLOPs (about four per state element and token,
~1% of the layer's weight FLOPs for Qwen3.5-397B-A17B) are left out. Expert parallelism (``ep``)
spreads the experts over ``ep`` ranks that each run their own batch (DEP: attention data-parallel):
a rank holds and reads ``num_experts / ep`` of them; the all-to-all between the ranks is not charged.
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
    attn_layers: int  # layers with (full) attention over the context
    linear: int  # a linear-attention layer's token mixer (0: none)
    linear_layers: int
    dense_mlp: int  # a dense layer's MLP
    expert: int  # one expert's MLP (0: dense model)
    experts_per_token: int
    num_experts: int
    shared_experts: int
    dense_layers: int  # layers with a dense MLP (all of a dense model's)
    moe_layers: int
    embed: int  # embedding + LM head

    def _with_experts(self, experts: int) -> int:
        """Every token mixer, dense MLP and the LM head, plus ``experts`` experts per MoE layer."""
        return (
            self.attn_layers * self.attn
            + self.linear_layers * self.linear
            + self.dense_layers * self.dense_mlp
            + self.moe_layers * experts * self.expert
            + self.embed // 2  # the LM head; the embedding is a lookup
        )

    def active_per_token(self) -> int:
        """Weights one token runs through (2 FLOPs each)."""
        return self._with_experts(self.experts_per_token)

    def experts_held(self, ep: int = 1) -> int:
        """Experts per MoE layer on one of ``ep`` expert-parallel ranks: the shared ones and an
        even share of the routed ones."""
        return self.shared_experts + (self.num_experts - self.shared_experts) // ep

    def read_per_step(self, tokens: int, ep: int = 1) -> int:
        """Weights a step over ``tokens`` tokens reads on one of ``ep`` expert-parallel ranks
        (each of its experts at most once)."""
        return self._with_experts(min(self.experts_held(ep), tokens * self.experts_per_token))

    def held(self, ep: int = 1) -> int:
        """Weights one of ``ep`` expert-parallel ranks holds (before TP), the embedding included."""
        return self._with_experts(self.experts_held(ep)) + self.embed // 2


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
    dense_layers = m.dense_layers if moe else m.total_layers
    return Weights(
        attn=attn,
        attn_layers=m.num_layers,
        linear=m.linear_attn_params,
        linear_layers=m.linear_layers,
        dense_mlp=3 * h * m.intermediate_size,  # gate, up, down
        expert=3 * h * m.moe_intermediate_size,
        experts_per_token=m.experts_per_token if moe else 0,
        num_experts=m.num_experts if moe else 0,
        shared_experts=m.shared_experts if moe else 0,
        dense_layers=dense_layers,
        moe_layers=m.total_layers - dense_layers,
        embed=2 * h * m.vocab_size,
    )


class Roofline:
    """Step times of one TP group of ``gpu`` running ``model``."""

    __slots__ = (
        "_active", "_attn_c", "_decode_batch", "_flops", "_hbm_bps", "_state", "_token_bytes", "ep",
        "gpu", "model", "tp", "w", "weight_bytes",
    )  # fmt: skip

    def __init__(
        self, model: ModelGeometry, gpu: GpuProfile, tp: int, weight_bytes: int = 2, ep: int = 1
    ) -> None:
        self.model, self.gpu, self.tp, self.weight_bytes = model, gpu, tp, weight_bytes  # BF16 weights
        self.w = weights(model)
        routed = self.w.num_experts - self.w.shared_experts
        if ep < 1 or (ep > 1 and (not routed or routed % ep)):
            raise ValueError(f"expert parallelism {ep} needs a MoE model whose routed experts it divides")
        self.ep = ep
        self._active = self.w.active_per_token()
        # The model's and the GPU's derived figures, read once: both are frozen, and each is a
        # chain of properties a decode step (the deployment replay's hot loop) would walk again.
        self._token_bytes, self._state = model.token_bytes, model.state_bytes
        self._flops, self._hbm_bps = gpu.flops, gpu.hbm_bps
        # Attention FLOPs per (query token, context token) pair and layer (``_attn_flops``; the
        # decode step, the hot loop, multiplies it out inline).
        self._attn_c = 2.0 * model.num_attention_heads * (model.attn_dim or 2 * model.head_dim)
        # Per batch size: a decode step's terms that depend on the batch alone (the hot loop of
        # the deployment replay asks ~10 steps a request; a handful of sizes recur).
        self._decode_batch: dict[int, tuple[float, int, float]] = {}

    def _attn_flops(self, token_ctx: int) -> float:
        """Attention FLOPs of all layers for ``token_ctx`` (query token x context token) pairs."""
        return self._attn_c * token_ctx * self.model.num_layers

    def _kv_bytes(self, ctx_tokens: int) -> float:
        return float(ctx_tokens * self._token_bytes)

    def _state_bytes(self, requests: int) -> float:
        """A step reads and writes back each request's recurrent state once (hybrid models)."""
        return 2.0 * requests * self._state

    def _time_ns(self, flops: float, nbytes: float, overhead_us: float) -> int:
        t = max(flops / (self._flops * self.tp), nbytes / (self._hbm_bps * self.tp))
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
        nbytes = (
            self.weight_bytes * w.read_per_step(tokens, self.ep)
            + self._kv_bytes(kv)
            + self._state_bytes(len(parts))
        )
        return self._time_ns(flops, nbytes, self.gpu.prefill_step_overhead_us)

    def decode_ns(self, batch: int, ctx_total: int) -> int:
        """One decode step of ``batch`` sequences attending to ``ctx_total`` tokens in all.

        The helpers' arithmetic inlined, operation for operation (the same floats): this is the
        deployment replay's hot loop."""
        if batch <= 0:
            return 0
        terms = self._decode_batch.get(batch)
        if terms is None:
            terms = self._decode_batch[batch] = (
                2.0 * self._active * batch,
                self.weight_bytes * self.w.read_per_step(batch, self.ep),
                self._state_bytes(batch),
            )
        flops = terms[0] + self._attn_c * ctx_total * self.model.num_layers
        nbytes = terms[1] + float(ctx_total * self._token_bytes) + terms[2]
        tp = self.tp
        t = max(flops / (self._flops * tp), nbytes / (self._hbm_bps * tp))
        return int(t * 1e9 + self.gpu.decode_step_overhead_us * 1000)

    def weight_bytes_per_rank(self) -> int:
        return self.weight_bytes * self.w.held(self.ep) // self.tp
