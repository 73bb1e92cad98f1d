"""LLM shapes: presets, parameter counts, weight bytes and KV bytes per token. Pure Python.

KV bytes per token (one layer) = 2 (K and V) x kv_heads x head_dim x bytes per element for
standard / grouped-query attention; for MLA (DeepSeek-V2/V3) the cache holds one latent
vector of kv_lora_rank + qk_rope_head_dim elements per token and layer, shared by all heads.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


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


@dataclass(frozen=True, slots=True)
class MLA:
    kv_lora_rank: int  # latent width cached per token
    qk_rope_head_dim: int  # decoupled rotary key, cached beside the latent
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None


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
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}: must be positive, got {getattr(self, f)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {self.kv_heads} does not divide heads={self.heads}")

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

    def _mlp_params(self, layer: int, active: bool) -> int:
        h = self.hidden
        moe = self.moe
        if moe is None or layer < moe.first_dense_layers:
            return 3 * h * self.intermediate
        n = moe.experts_per_token if active else moe.num_experts
        return (n + moe.shared_experts) * 3 * h * moe.expert_intermediate + h * moe.num_experts  # + router

    def params(self, active: bool = False) -> int:
        """Parameter count; `active`: only the experts one token uses (MoE)."""
        per_layer = sum(
            self._attn_params() + self._mlp_params(i, active) + 2 * self.hidden for i in range(self.layers)
        )
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
