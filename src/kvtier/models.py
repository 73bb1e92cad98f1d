"""LLM shapes: presets, parameter counts, weight bytes and KV bytes per token. Pure Python.

KV bytes per token (one layer) = 2 (K and V) x kv_heads x head_dim x bytes per element for
standard / grouped-query attention; for MLA (DeepSeek-V2/V3) the cache holds one latent
vector of kv_lora_rank + qk_rope_head_dim elements per token and layer, shared by all heads.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
MAX_DIM = 1 << 24  # the largest count or width a shape field takes: far above any model, and
# small enough that products of a few of them stay exact in a float (no overflow, no huge loops)


def check_count(name: str, value: object, least: int = 1) -> int:
    """`value` if it is an int (not a bool) within [least, MAX_DIM]; else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_DIM:
        raise ValueError(f"{name}: must be {count_range(least)}, got {short_repr(value)}")
    return value


def count_range(least: int) -> str:
    """What `check_count` accepts, in words: "a positive integer (at most 16777216)"."""
    kind = "a positive integer" if least == 1 else f"an integer >= {least}"
    return f"{kind} (at most {MAX_DIM})"


def short_repr(value: object, most: int = 40) -> str:
    """repr(value), cut to about `most` characters: an error message stays one readable line."""
    r = repr(value)
    return r if len(r) <= most else f"{r[: most - 12]}... ({len(r)} chars)"


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True, slots=True)
class MoE:
    num_experts: int  # routed experts per MoE layer
    experts_per_token: int
    expert_intermediate: int
    shared_experts: int = 0
    first_dense_layers: int = 0  # leading layers with a dense MLP (DeepSeek: first_k_dense_replace)

    def __post_init__(self) -> None:
        for f in ("num_experts", "experts_per_token", "expert_intermediate"):
            check_count(f, getattr(self, f))
        check_count("shared_experts", self.shared_experts, 0)
        check_count("first_dense_layers", self.first_dense_layers, 0)
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token: {self.experts_per_token} exceeds num_experts={self.num_experts}"
            )


@dataclass(frozen=True, slots=True)
class MLA:
    kv_lora_rank: int  # latent width cached per token
    qk_rope_head_dim: int  # decoupled rotary key, cached beside the latent
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        for f in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            check_count(f, getattr(self, f))
        if self.q_lora_rank is not None:
            check_count("q_lora_rank", self.q_lora_rank)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    key: str
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (gated: 3 matrices)
    vocab: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    moe: MoE | None = None
    mla: MLA | None = None
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            check_count(f, getattr(self, f))
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {self.kv_heads} does not divide heads={self.heads}")
        for f in ("tie_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f}: must be True or False, got {getattr(self, f)!r}")
        if self.moe is not None and not isinstance(self.moe, MoE):
            raise ValueError(f"moe: must be a MoE or None, got {self.moe!r}")
        if self.mla is not None and not isinstance(self.mla, MLA):
            raise ValueError(f"mla: must be an MLA or None, got {self.mla!r}")
        if self.moe is not None and self.moe.first_dense_layers > self.layers:
            raise ValueError(
                f"moe.first_dense_layers: {self.moe.first_dense_layers} exceeds layers={self.layers}"
            )

    # ---- parameters -------------------------------------------------------------------
    def _attn_params(self) -> int:
        h, d = self.hidden, self.head_dim
        if self.mla:
            m = self.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            q = (
                h * self.heads * qk
                if m.q_lora_rank is None
                else (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * self.heads * qk)
            )
            kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            kv += m.kv_lora_rank * self.heads * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + self.heads * m.v_head_dim * h
        q, kv = self.heads * d, self.kv_heads * d
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return h * (q + 2 * kv) + bias + q * h

    def _mlp_params(self, active: bool) -> int:
        """MLP parameters of all layers: the dense ones, then the MoE ones (closed form)."""
        h, moe = self.hidden, self.moe
        dense = 3 * h * self.intermediate
        if moe is None:
            return self.layers * dense
        n = moe.experts_per_token if active else moe.num_experts
        routed = (n + moe.shared_experts) * 3 * h * moe.expert_intermediate + h * moe.num_experts  # + router
        return moe.first_dense_layers * dense + (self.layers - moe.first_dense_layers) * routed

    def params(self, active: bool = False) -> int:
        """Parameter count; `active`: only the experts one token uses (MoE)."""
        per_layer = self.layers * (self._attn_params() + 2 * self.hidden) + self._mlp_params(active)
        embed = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return per_layer + embed + self.hidden

    def matmul_params(self, active: bool = True) -> int:
        """Parameters that take part in matmuls per token (the embedding lookup does not)."""
        return self.params(active) - self.vocab * self.hidden * (0 if self.tie_embeddings else 1)

    def weight_bytes(self, dtype: str = "bf16") -> float:
        return self.params() * dtype_bytes(dtype)

    # ---- KV cache ----------------------------------------------------------------------
    def kv_elems_per_token_layer(self) -> int:
        if self.mla:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.kv_heads * self.head_dim

    def kv_bytes_per_token_layer(self, kv_dtype: str = "bf16") -> float:
        return self.kv_elems_per_token_layer() * dtype_bytes(kv_dtype)

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> float:
        return self.layers * self.kv_bytes_per_token_layer(kv_dtype)

    # ---- FLOPs -------------------------------------------------------------------------
    def attn_flops_per_pair(self) -> float:
        """FLOPs of QK^T and PV for one (query token, key token) pair, all layers and heads."""
        if self.mla:
            dqk = self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
            return 2.0 * self.layers * self.heads * (dqk + self.mla.v_head_dim)
        return 4.0 * self.layers * self.heads * self.head_dim


def _llama(key, name, hidden, layers, heads, kv, inter, vocab=128256, **kw) -> ModelSpec:
    return ModelSpec(key, name, hidden, layers, heads, kv, hidden // heads, inter, vocab, **kw)


HF = "the model's config.json on its Hugging Face model card"

MODELS: dict[str, ModelSpec] = {
    m.key: m
    for m in (
        _llama("llama-3-8b", "Llama-3-8B", 4096, 32, 32, 8, 14336, source=HF),
        _llama("llama-3-70b", "Llama-3-70B", 8192, 80, 64, 8, 28672, source=HF),
        _llama("llama-3.1-405b", "Llama-3.1-405B", 16384, 126, 128, 8, 53248, source=HF),
        _llama("qwen2.5-7b", "Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, qkv_bias=True, source=HF),
        _llama("qwen2.5-72b", "Qwen2.5-72B", 8192, 80, 64, 8, 29568, 152064, qkv_bias=True, source=HF),
        _llama("mistral-7b", "Mistral-7B-v0.1", 4096, 32, 32, 8, 14336, 32000, source=HF),
        _llama(
            "mixtral-8x7b", "Mixtral-8x7B", 4096, 32, 32, 8, 14336, 32000, moe=MoE(8, 2, 14336), source=HF
        ),
        ModelSpec(
            "deepseek-v3",
            "DeepSeek-V3",
            hidden=7168,
            layers=61,
            heads=128,
            kv_heads=128,
            head_dim=128,
            intermediate=18432,
            vocab=129280,
            moe=MoE(256, 8, 2048, shared_experts=1, first_dense_layers=3),
            mla=MLA(
                kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536
            ),
            source=HF + " (multi-token-prediction layer not counted)",
        ),
    )
}


def get_model(key: str) -> ModelSpec:
    model = MODELS.get(key.lower())
    if model is None:
        raise ValueError(f"model: unknown model {key!r}; known: {', '.join(MODELS)} (or a config.json path)")
    return model
