"""Roofline arithmetic for LLM serving: balance point, decode and prefill bounds, Amdahl,
and load-vs-recompute of a KV prefix (break-even length, split point). Pure Python.

Every time here is a lower bound at the given rates: max(bytes / bandwidth, FLOPs / peak).
`efficiency` scales the compute peak (e.g. a probed matmul rate over the datasheet's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.models import ModelSpec, dtype_bytes
from kvtier.specs import GPU


@dataclass(frozen=True, slots=True)
class Bound:
    """One step's bytes and FLOPs against the GPU's two ceilings (times in ms)."""

    bytes: float
    flops: float
    memory_ms: float
    compute_ms: float

    @property
    def ms(self) -> float:
        return max(self.memory_ms, self.compute_ms)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_ms >= self.compute_ms else "compute"

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte."""
        return self.flops / self.bytes if self.bytes else math.inf

    def to_json(self) -> dict:
        return {
            "bytes": self.bytes,
            "flops": self.flops,
            "intensity_flop_per_byte": self.intensity,
            "memory_ms": self.memory_ms,
            "compute_ms": self.compute_ms,
            "bound_ms": self.ms,
            "bound": self.bound,
        }


def _bound(gpu: GPU, nbytes: float, flops: float, dtype: str, efficiency: float) -> Bound:
    peak = gpu.peak_tflops(dtype) * 1e12 * efficiency
    return Bound(nbytes, flops, nbytes / (gpu.mem_bw_gbps * 1e9) * 1e3, flops / peak * 1e3)


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"{name}: must be positive, got {v!r}")


def expected_experts_touched(num_experts: int, per_token: int, tokens: int) -> float:
    """Expected distinct experts a layer reads when `tokens` tokens each pick `per_token` at random."""
    return num_experts * (1.0 - (1.0 - per_token / num_experts) ** tokens)


def decode_weight_bytes(model: ModelSpec, batch: int, dtype: str) -> float:
    """Weight bytes one decode step must read: all of a dense model; touched experts of a MoE."""
    total = model.weight_bytes(dtype)
    moe = model.moe
    if moe is None:
        return total
    expert = 3 * model.hidden * moe.expert_intermediate * dtype_bytes(dtype)
    moe_layers = model.layers - moe.first_dense_layers
    untouched = moe.num_experts - expected_experts_touched(moe.num_experts, moe.experts_per_token, batch)
    return total - moe_layers * untouched * expert


def decode_step(
    model: ModelSpec,
    gpu: GPU,
    batch: int,
    context: int,
    dtype: str = "bf16",
    kv_dtype: str = "bf16",
    efficiency: float = 1.0,
) -> Bound:
    """One decode step of `batch` requests with `context` tokens each: weights + every KV read once."""
    _check_positive(batch=batch, efficiency=efficiency)
    if context < 0:
        raise ValueError(f"context: must be >= 0, got {context}")
    nbytes = decode_weight_bytes(model, batch, dtype) + batch * context * model.kv_bytes_per_token(kv_dtype)
    flops = 2.0 * model.matmul_params(active=True) * batch + model.attn_flops_per_pair() * context * batch
    return _bound(gpu, nbytes, flops, dtype, efficiency)


def prefill_flops(model: ModelSpec, tokens: int, prefix: int = 0) -> float:
    """FLOPs to prefill `tokens` new tokens after `prefix` cached ones (causal attention).

    Token i attends to prefix + i + 1 keys: the quadratic term. The LM head runs for the last
    token only (what serving engines do to produce the first output token).
    """
    lm_head = 2.0 * model.vocab * model.hidden
    linear = (2.0 * model.matmul_params(active=True) - lm_head) * tokens + lm_head
    pairs = tokens * prefix + tokens * (tokens + 1) / 2
    return linear + model.attn_flops_per_pair() * pairs


def prefill(
    model: ModelSpec,
    gpu: GPU,
    tokens: int,
    prefix: int = 0,
    dtype: str = "bf16",
    kv_dtype: str = "bf16",
    efficiency: float = 1.0,
) -> Bound:
    _check_positive(tokens=tokens, efficiency=efficiency)
    nbytes = model.weight_bytes(dtype) + (prefix + tokens) * model.kv_bytes_per_token(kv_dtype)
    return _bound(gpu, nbytes, prefill_flops(model, tokens, prefix), dtype, efficiency)


def turning_batch(
    model: ModelSpec,
    gpu: GPU,
    context: int = 0,
    dtype: str = "bf16",
    kv_dtype: str = "bf16",
    limit: int = 1 << 20,
) -> int | None:
    """Smallest batch at which a decode step becomes compute-bound; None if it never does
    (long contexts: KV bytes grow with the batch as fast as FLOPs do)."""
    if decode_step(model, gpu, limit, context, dtype, kv_dtype).bound == "memory":
        return None
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi) // 2
        if decode_step(model, gpu, mid, context, dtype, kv_dtype).bound == "compute":
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True, slots=True)
class MemoryFit:
    """Whether the weights and the KV of `batch` requests of `context` tokens each fit one GPU's
    memory (bytes; a lower bound on what serving needs: activations, the CUDA context and
    fragmentation are not counted), and what would fit if not."""

    memory_bytes: float
    weights_bytes: float
    kv_bytes: float
    batch: int
    context: int
    max_batch: int | None  # the largest batch whose KV fits beside the weights (None: no KV, context 0)
    gpus_for_weights: int  # GPUs the weights alone need, split evenly (tensor parallel)
    gpus_needed: int  # GPUs the weights and this batch's KV need, split evenly
    max_context: int | None = None  # the longest context of `batch` requests beside the weights

    @property
    def fits(self) -> bool:
        return self.weights_bytes + self.kv_bytes <= self.memory_bytes

    def to_json(self) -> dict:
        return {
            "fits": self.fits,
            "memory_bytes": self.memory_bytes,
            "weights_bytes": self.weights_bytes,
            "kv_bytes": self.kv_bytes,
            "total_bytes": self.weights_bytes + self.kv_bytes,
            "batch": self.batch,
            "context": self.context,
            "max_batch": self.max_batch,
            "gpus_for_weights": self.gpus_for_weights,
            "gpus_needed": self.gpus_needed,
            "max_context": self.max_context,
        }


def memory_fit(
    model: ModelSpec, gpu: GPU, batch: int, context: int, dtype: str = "bf16", kv_dtype: str = "bf16"
) -> MemoryFit:
    """Do the weights plus `batch` x `context` tokens of KV fit `gpu`'s memory? If not: the largest
    batch at this context and the longest context at this batch on one GPU, and the GPUs the
    weights (and the KV) need."""
    _check_positive(batch=batch)
    if context < 0:
        raise ValueError(f"context: must be >= 0, got {context}")
    memory = gpu.mem_gb * 1e9
    weights = model.weight_bytes(dtype)
    per_request = context * model.kv_bytes_per_token(kv_dtype)
    kv = batch * per_request
    max_batch = int(max(0.0, memory - weights) // per_request) if per_request else None
    per_token = batch * model.kv_bytes_per_token(kv_dtype)
    max_context = int(max(0.0, memory - weights) // per_token) if per_token else None
    return MemoryFit(
        memory_bytes=memory,
        weights_bytes=weights,
        kv_bytes=kv,
        batch=batch,
        context=context,
        max_batch=max_batch,
        gpus_for_weights=max(1, math.ceil(weights / memory)),
        gpus_needed=max(1, math.ceil((weights + kv) / memory)),
        max_context=max_context,
    )


def amdahl(fraction: float, speedup: float) -> float:
    """End-to-end speedup when a part taking `fraction` of the time gets `speedup` times faster."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction: must be within [0, 1], got {fraction}")
    _check_positive(speedup=speedup)
    return 1.0 / ((1.0 - fraction) + fraction / speedup)
