"""KV-cache geometry: what a model's KV cache looks like and how one TP rank's paged pool holds it.

Pure and frozen. Three layers of description:

- ``ModelGeometry``: layers, total KV heads, head_dim, dtype, MLA or not.
- ``PoolGeometry``: one rank's pool: TP size and rank, page size, page count, memory layout. It
  derives the rank's head range, its regions (one per layer and K|V, or per layer for MLA) and the
  byte offset of every (page, token-in-page, local head, element) inside a region.
- Topology (``links``, ``senders_for``, ``receivers_for``): which prefill rank sends which global
  heads to which decode rank, and which prefill ranks are dummies.

Head ownership: with ``H`` KV heads and TP size ``P``, rank ``p`` holds heads
``[p*H/P, (p+1)*H/P)`` when ``P <= H`` (``H % P == 0``); when ``P > H`` (``P % H == 0``) the
``P/H`` *consecutive* ranks ``[h*P/H, (h+1)*P/H)`` all hold head ``h`` (replication by division,
never modulo). MLA is the ``H == 1`` case: every rank holds the whole latent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache

import numpy as np
from kvferry.core.errors import GeometryError

__all__ = [
    "PRESETS",
    "DType",
    "KVKind",
    "Layout",
    "Link",
    "ModelGeometry",
    "PoolGeometry",
    "RegionSpec",
    "head_range",
    "links",
    "make_pools",
    "receivers_for",
    "senders_for",
    "validate_tp",
]


class DType(StrEnum):
    """KV-cache element types. The value is the CLI spelling."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    FP32 = "fp32"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.BF16: 2,
    DType.FP16: 2,
    DType.FP8_E4M3: 1,
    DType.FP8_E5M2: 1,
    DType.FP32: 4,
}


class KVKind(StrEnum):
    """What a region holds: keys, values, or an MLA latent (keys and values compressed together)."""

    K = "K"
    V = "V"
    LATENT = "LATENT"


# Region kinds per layer, built once: ``kinds`` and ``num_regions`` are read several times per
# chunk, and each ``KVKind.K`` is an enum attribute lookup through the metaclass.
_KINDS_KV = (KVKind.K, KVKind.V)
_KINDS_LATENT = (KVKind.LATENT,)


class Layout(StrEnum):
    """Memory layout of one region (one layer's K, V or latent buffer) of a rank's pool.

    SGLANG_NHD: ``[slots, heads_per_rank, head_dim]`` with slot = page * page_size + token_in_page.
    VLLM_NHD: ``[blocks, block_size, heads, head_dim]``; byte-identical to SGLANG_NHD.
    VLLM_HND: ``[blocks, heads, block_size, head_dim]``: within a block, one head's tokens are
    contiguous, so a token's heads are not.
    """

    SGLANG_NHD = "sglang_nhd"
    VLLM_NHD = "vllm_nhd"
    VLLM_HND = "vllm_hnd"

    @property
    def head_major_in_page(self) -> bool:
        return self is Layout.VLLM_HND


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """A model's KV cache, independent of how it is sharded.

    MLA: ``num_kv_heads == 1`` and ``head_dim`` is the latent width (576 for deepseek-v3); one
    latent region per layer, no head split across TP ranks.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.BF16
    is_mla: bool = False
    # What compute needs (sim/deploy's rooflines); 0 = unknown. Never part of the KV layout.
    hidden_size: int = 0
    intermediate_size: int = 0  # dense MLP width (a MoE model's leading dense layers)
    num_attention_heads: int = 0  # query heads
    vocab_size: int = 0
    attn_params: int = 0  # attention weights per layer; 0: GQA's, from the heads and head_dim
    attn_dim: int = 0  # q.k plus v width per query head; 0: 2 x head_dim
    moe_intermediate_size: int = 0  # one expert's MLP width (0: dense model)
    experts_per_token: int = 0  # experts a token runs through, shared ones included
    num_experts: int = 0  # routed + shared experts per MoE layer
    shared_experts: int = 0  # of those, the ones every token runs (every expert-parallel rank holds them)
    dense_layers: int = 0  # leading layers with a dense MLP in a MoE model
    # A hybrid model's linear-attention layers (Gated DeltaNet): no per-token KV, so no regions
    # here (``num_layers`` counts only the layers that keep per-token KV), but they carry weights
    # and a fixed-size recurrent state per request. 0: not a hybrid model.
    linear_layers: int = 0
    linear_attn_params: int = 0  # token-mixer weights of one linear-attention layer
    linear_state_bytes: int = 0  # one request's recurrent state in one linear layer, all heads
    # K and V side by side per head and token (vLLM's per-layer KV view: its content axis holds
    # both), so one region per layer whose heads are ``head_dim`` wide (K then V), split across
    # TP ranks by heads as K and V are. Not with ``is_mla``.
    fused_kv: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            try:
                object.__setattr__(self, "dtype", DType(self.dtype))
            except ValueError:
                raise GeometryError(
                    f"unknown dtype {self.dtype!r}; expected one of {[d.value for d in DType]}"
                ) from None
        for fname in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, fname)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GeometryError(f"{fname} must be a positive integer, got {value!r}")
        if self.is_mla and self.fused_kv:
            raise GeometryError("is_mla and fused_kv exclude each other (one latent, or fused K and V)")
        if self.is_mla and self.num_kv_heads != 1:
            raise GeometryError(
                f"MLA keeps one latent per token (num_kv_heads == 1), got {self.num_kv_heads}"
            )

    @classmethod
    def preset(cls, name: str) -> ModelGeometry:
        try:
            return PRESETS[name]
        except KeyError:
            raise GeometryError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None

    @property
    def kinds(self) -> tuple[KVKind, ...]:
        """Region kinds per layer, in region order."""
        return _KINDS_LATENT if self.is_mla or self.fused_kv else _KINDS_KV

    @property
    def num_regions(self) -> int:
        return self.num_layers * len(self.kinds)

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token in one region."""
        return self.head_dim * self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token over all heads, layers and kinds (the whole model, unsharded)."""
        return self.num_regions * self.num_kv_heads * self.head_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's recurrent state over all linear layers (whole model, unsharded)."""
        return self.linear_layers * self.linear_state_bytes

    @property
    def total_layers(self) -> int:
        """Every layer the forward runs: those with per-token KV and the linear-attention ones."""
        return self.num_layers + self.linear_layers

    def same_kv_shape(self, other: ModelGeometry) -> str | None:
        """None if ``other`` lays out identical KV bytes, else a sentence saying what differs."""
        if other is self:
            return None  # the usual case (both sides' pools of one model), asked per planned chunk
        for fname in ("num_layers", "num_kv_heads", "head_dim", "dtype", "is_mla", "fused_kv"):
            a, b = getattr(self, fname), getattr(other, fname)
            if a != b:
                return f"{fname} differs: {a!r} vs {b!r}"
        return None


# deepseek-v3's MLA attention weights per layer, from its config.json (hidden 7168, 128 heads,
# q_lora_rank 1536, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v_head_dim 128):
# q_a 7168x1536 + q_b 1536x(128x192) + kv_a 7168x(512+64) + kv_b 512x(128x(128+128)) + o (128x128)x7168.
_DSV3_ATTN = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168

# Qwen3.5-397B-A17B (hybrid: 60 layers, every 4th full gated attention, the other 45 Gated
# DeltaNet), from NVIDIA/Megatron-LM examples/mimo/configs/qwen35_vlm.py (commit 1e38b879,
# "all values match the HuggingFace text_config") and THUDM/slime
# scripts/models/qwen3.5-397B-A17B.sh (commit aa84536b): hidden 4096, 32 query heads, 2 KV
# heads of head_dim 256, attention output gate; 512 routed experts of width 1024, 10 per token,
# plus one shared expert of width 1024; linear attention with 16 key heads and 64 value heads of
# dims 128, conv kernel 4; vocab 248320 (slime).
# Full attention layer: q with its output gate 4096 x (32 x 256 x 2), k and v 4096 x (2 x 256)
# each, o (32 x 256) x 4096.
_Q35_ATTN = 4096 * 32 * 256 * 2 + 2 * 4096 * 2 * 256 + 32 * 256 * 4096
# Gated DeltaNet layer: in_proj_qkv 4096 x (2 x 16 x 128 + 64 x 128), in_proj_z 4096 x (64 x 128),
# in_proj_b and in_proj_a 4096 x 64 each, out_proj (64 x 128) x 4096, conv1d 12288 x 4.
_Q35_CONV_DIM = 2 * 16 * 128 + 64 * 128
_Q35_LINEAR = 4096 * _Q35_CONV_DIM + 4096 * 64 * 128 + 2 * 4096 * 64 + 64 * 128 * 4096 + _Q35_CONV_DIM * 4
# One request's state in one Gated DeltaNet layer, as SGLang's mamba pool keeps it (conv_state
# [conv_dim, kernel - 1] and temporal_state [value heads, key dim, value dim], sglang PR 22263):
# the temporal state in float32 (assumption: SGLang's default --mamba-ssm-dtype), the conv state in
# bf16: 64 x 128 x 128 x 4 + 12288 x 3 x 2 = 4,268,032 bytes.
_Q35_STATE = 64 * 128 * 128 * 4 + _Q35_CONV_DIM * 3 * 2

PRESETS: dict[str, ModelGeometry] = {
    g.name: g
    for g in (
        # Qwen/Qwen3-8B config.json: hidden_size 4096, intermediate_size 12288, 32 attention heads,
        # 8 KV heads, head_dim 128, 36 layers, vocab 151936.
        ModelGeometry(
            "qwen3-8b",
            num_layers=36,
            num_kv_heads=8,
            head_dim=128,
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            vocab_size=151936,
        ),
        # meta-llama/Llama-3.1-70B config.json: hidden_size 8192, intermediate_size 28672,
        # 64 attention heads, 8 KV heads, 80 layers, vocab 128256.
        ModelGeometry(
            "llama-3.1-70b",
            num_layers=80,
            num_kv_heads=8,
            head_dim=128,
            hidden_size=8192,
            intermediate_size=28672,
            num_attention_heads=64,
            vocab_size=128256,
        ),
        # deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, intermediate_size 18432 (the first
        # 3 layers are dense), moe_intermediate_size 2048, 256 routed + 1 shared experts, 8 routed
        # per token (+ the shared one), 128 attention heads, vocab 129280; the KV cache is one
        # 512 + 64 = 576-wide latent per token and layer.
        ModelGeometry(
            "deepseek-v3",
            num_layers=61,
            num_kv_heads=1,
            head_dim=576,
            is_mla=True,
            hidden_size=7168,
            intermediate_size=18432,
            num_attention_heads=128,
            vocab_size=129280,
            attn_params=_DSV3_ATTN,
            attn_dim=192 + 128,
            moe_intermediate_size=2048,
            experts_per_token=9,
            num_experts=257,
            shared_experts=1,
            dense_layers=3,
        ),
        # Only the 15 full-attention layers keep per-token KV: 15 x (K, V) = 30 regions, 2 heads of
        # 256 in bf16 (the -FP8 checkpoint quantizes weights, not the KV cache) = 30,720 bytes a
        # token. Experts: 10 routed + 1 shared of the same width per token, 512 + 1 per layer, every
        # layer MoE. Active weights come to ~16.2e9 plus the 1.0e9 embedding (the published 17B).
        ModelGeometry(
            "qwen3.5-397b-a17b",
            num_layers=15,
            num_kv_heads=2,
            head_dim=256,
            hidden_size=4096,
            num_attention_heads=32,
            vocab_size=248320,
            attn_params=_Q35_ATTN,
            moe_intermediate_size=1024,
            experts_per_token=11,
            num_experts=513,
            shared_experts=1,
            linear_layers=45,
            linear_attn_params=_Q35_LINEAR,
            linear_state_bytes=_Q35_STATE,
        ),
    )
}


def validate_tp(model: ModelGeometry, tp_size: int) -> None:
    """Raise GeometryError unless ``tp_size`` either divides the heads or replicates them evenly."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise GeometryError(f"TP size must be a positive integer, got {tp_size!r}")
    h = model.num_kv_heads
    if tp_size <= h:
        if h % tp_size:
            raise GeometryError(f"TP {tp_size} does not divide {h} KV heads of {model.name}")
    elif tp_size % h:
        raise GeometryError(
            f"TP {tp_size} > {h} KV heads of {model.name} but is not a multiple of them "
            "(replication needs every head held by the same number of ranks)"
        )


def head_range(model: ModelGeometry, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``(first global head, number of heads)`` that ``tp_rank`` holds."""
    validate_tp(model, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise GeometryError(f"TP rank {tp_rank} out of range for TP size {tp_size}")
    h = model.num_kv_heads
    if tp_size <= h:
        per = h // tp_size
        return tp_rank * per, per
    # Replication: tp_size/h consecutive ranks share one head (division, not modulo).
    return tp_rank // (tp_size // h), 1


@dataclass(frozen=True, slots=True)
class RegionSpec:
    """One registered memory region of a rank's pool: one layer's K, V or latent buffer."""

    region_id: int
    layer: int
    kind: KVKind
    nbytes: int


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """One TP rank's paged KV pool.

    Descriptors address it as (region_id, byte offset inside the region); region ids are
    ``layer * len(model.kinds) + kind_index``, so the same (layer, kind) has the same id on every
    rank and both sides of a transfer.
    """

    model: ModelGeometry
    tp_size: int
    tp_rank: int
    page_size: int
    num_pages: int
    layout: Layout = Layout.SGLANG_NHD
    _heads: tuple[int, int] = field(init=False, repr=False, compare=False)
    # (head_bytes, token_bytes, token_stride, head_stride): read per chunk by the planner and the
    # simulator, so derived once here instead of through a chain of properties on every read.
    _sizes: tuple[int, int, int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.layout, Layout):
            try:
                object.__setattr__(self, "layout", Layout(self.layout))
            except ValueError:
                raise GeometryError(
                    f"unknown layout {self.layout!r}; expected one of {[x.value for x in Layout]}"
                ) from None
        for fname in ("page_size", "num_pages"):
            value = getattr(self, fname)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GeometryError(f"{fname} must be a positive integer, got {value!r}")
        heads = head_range(self.model, self.tp_size, self.tp_rank)
        object.__setattr__(self, "_heads", heads)
        hb = self.model.head_bytes
        tb = heads[1] * hb
        head_major = self.layout.head_major_in_page
        strides = (hb, tb, hb if head_major else tb, self.page_size * hb if head_major else hb)
        object.__setattr__(self, "_sizes", strides)

    # --- heads ---------------------------------------------------------------------------------

    @property
    def head_start(self) -> int:
        """First global KV head this rank holds."""
        return self._heads[0]

    @property
    def heads_per_rank(self) -> int:
        return self._heads[1]

    @property
    def head_end(self) -> int:
        return self._heads[0] + self._heads[1]

    @property
    def replication(self) -> int:
        """How many ranks of this TP group hold each of this rank's heads (1: no replication)."""
        return max(1, self.tp_size // self.model.num_kv_heads)

    # --- sizes and strides (bytes) ---------------------------------------------------------------

    @property
    def head_bytes(self) -> int:
        return self._sizes[0]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of this rank in one region (all its heads)."""
        return self._sizes[1]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one region."""
        return self.page_size * self._sizes[1]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def region_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def page_stride(self) -> int:
        return self.page_size * self._sizes[1]

    @property
    def token_stride(self) -> int:
        """Bytes between token i and i+1 of the same page and head."""
        return self._sizes[2]

    @property
    def head_stride(self) -> int:
        """Bytes between local head j and j+1 of the same token."""
        return self._sizes[3]

    @property
    def regions(self) -> tuple[RegionSpec, ...]:
        kinds = self.model.kinds
        nbytes = self.region_bytes
        return tuple(
            RegionSpec(layer * len(kinds) + k, layer, kind, nbytes)
            for layer in range(self.model.num_layers)
            for k, kind in enumerate(kinds)
        )

    @property
    def total_bytes(self) -> int:
        return self.model.num_regions * self.region_bytes

    def region_id(self, layer: int, kind: KVKind) -> int:
        kinds = self.model.kinds
        if not 0 <= layer < self.model.num_layers or kind not in kinds:
            raise GeometryError(f"no region for layer {layer} kind {kind} in {self.model.name}")
        return layer * len(kinds) + kinds.index(kind)

    def byte_offset(
        self,
        page: np.ndarray | int,
        token_in_page: np.ndarray | int,
        local_head: np.ndarray | int = 0,
        element: np.ndarray | int = 0,
    ) -> np.ndarray:
        """Byte offset inside any region of (page, token-in-page, local head, element); vectorised.

        No range checks here (hot path); the planner validates page ids before calling it.
        """
        page = np.asarray(page, dtype=np.int64)
        tip = np.asarray(token_in_page, dtype=np.int64)
        head = np.asarray(local_head, dtype=np.int64)
        elem = np.asarray(element, dtype=np.int64)
        return (
            page * self.page_stride
            + tip * self.token_stride
            + head * self.head_stride
            + elem * self.model.dtype.itemsize
        )


def make_pools(
    model: ModelGeometry,
    tp_size: int,
    page_size: int,
    num_pages: int,
    layout: Layout = Layout.SGLANG_NHD,
) -> tuple[PoolGeometry, ...]:
    """The pools of every rank of one server (all ranks share page ids, as in SGLang and vLLM)."""
    validate_tp(model, tp_size)
    return tuple(PoolGeometry(model, tp_size, r, page_size, num_pages, layout) for r in range(tp_size))


# --- topology -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Link:
    """A prefill rank that a decode rank pairs with for every room.

    ``is_dummy``: the prefill rank sends no bytes (its heads come from another replica, or it has
    none this decode rank needs) but must still be told about the room and reach a terminal state.
    ``head_start``/``num_heads``: the global heads it writes (``num_heads == 0`` for a dummy).
    """

    prefill_rank: int
    decode_rank: int
    head_start: int
    num_heads: int

    @property
    def is_dummy(self) -> bool:
        return self.num_heads == 0


@lru_cache(maxsize=256)
def links(model: ModelGeometry, prefill_tp: int, decode_tp: int) -> tuple[Link, ...]:
    """Every (prefill rank, decode rank) pairing of a deployment, sorted by (decode, prefill).

    For each decode rank and each global head it holds, exactly one of the prefill ranks holding
    that head sends it. Among the ``R`` replicas of head ``h`` and the ``Q`` decode ranks needing
    it (the ``j``-th of them in order), replica ``j * R // Q`` sends: this spreads senders over
    replicas and, for MLA with P > D, makes the first prefill rank of each decode rank's group the
    one real sender. A prefill rank that sends to nobody is attached as a dummy to decode rank
    ``p * D // P``, so every prefill rank hears of every room exactly as often as it must.
    """
    validate_tp(model, prefill_tp)
    validate_tp(model, decode_tp)
    h = model.num_kv_heads
    sends: dict[tuple[int, int], list[int]] = {}
    for head in range(h):
        replicas = [p for p in range(prefill_tp) if _holds(model, prefill_tp, p, head)]
        needers = [d for d in range(decode_tp) if _holds(model, decode_tp, d, head)]
        for j, d in enumerate(needers):
            p = replicas[j * len(replicas) // len(needers)]
            sends.setdefault((p, d), []).append(head)
    result: list[Link] = []
    for (p, d), heads in sends.items():
        # One rank's heads are contiguous and each head is sent by one replica per decode rank,
        # so what p sends d is a contiguous range; checked, since offsets below rely on it.
        if heads != list(range(heads[0], heads[0] + len(heads))):
            raise GeometryError(f"non-contiguous heads {heads} from prefill {p} to decode {d}")
        result.append(Link(p, d, heads[0], len(heads)))
    senders = {p for p, _ in sends}
    for p in range(prefill_tp):
        if p not in senders:
            result.append(Link(p, p * decode_tp // prefill_tp, 0, 0))
    result.sort(key=lambda link: (link.decode_rank, link.prefill_rank))
    return tuple(result)


def _holds(model: ModelGeometry, tp_size: int, rank: int, head: int) -> bool:
    start, n = head_range(model, tp_size, rank)
    return start <= head < start + n


def senders_for(model: ModelGeometry, prefill_tp: int, decode_tp: int, decode_rank: int) -> tuple[Link, ...]:
    """The prefill ranks decode rank ``decode_rank`` pairs with (real senders and dummies)."""
    if not 0 <= decode_rank < decode_tp:
        raise GeometryError(f"decode rank {decode_rank} out of range for TP {decode_tp}")
    return tuple(x for x in links(model, prefill_tp, decode_tp) if x.decode_rank == decode_rank)


def receivers_for(
    model: ModelGeometry, prefill_tp: int, decode_tp: int, prefill_rank: int
) -> tuple[Link, ...]:
    """The decode ranks prefill rank ``prefill_rank`` pairs with (one dummy link if it sends nothing)."""
    if not 0 <= prefill_rank < prefill_tp:
        raise GeometryError(f"prefill rank {prefill_rank} out of range for TP {prefill_tp}")
    return tuple(x for x in links(model, prefill_tp, decode_tp) if x.prefill_rank == prefill_rank)
