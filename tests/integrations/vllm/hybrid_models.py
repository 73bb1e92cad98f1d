"""Hybrid models' KV cache configs as vLLM 0.33 builds them, from each model's own config.json
(shipped under ``data/``, no weights): the per-layer specs as the model's attention layers make
them, then vLLM's own grouping (`get_global_kv_cache_groups`, `get_kv_cache_configs`) and the
engine core's resolution of the block sizes (a model with state layers: first the platform's
growth of the attention block to the state page, as on a GPU).

    MODELS                               name -> data folder
    hybrid_vllm_config(tmp, name, extra)  a VllmConfig of that model with kvtier's connector
    layer_specs(cfg)                     {layer name: KVCacheSpec} as the model's layers make them
    hybrid_kv_cache_config(cfg, blocks)  (the workers' KVCacheConfig, the scheduler's, scheduler
                                         block size, hash block size)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

DATA = Path(__file__).parent / "data"
MODELS = {
    "gpt-oss-20b": "gpt-oss-20b",
    "gemma-3-4b": "gemma-3-4b-it",
    "deepseek-v3.2": "DeepSeek-V3.2",
    "qwen3-next": "Qwen3-Next-80B-A3B-Instruct",
    # Nemotron-H 8B's shape: transformers' NemotronHConfig defaults (its hidden, attention and
    # Mamba2 sizes) with the model's published 52-layer pattern, written as the hub's file is
    # (``hybrid_override_pattern``): M Mamba2, * attention, - MLP
    "nemotron-h": "Nemotron-H-8B",
    # Jamba v0.1: transformers' JambaConfig, whose defaults are that model's (Mamba1 layers,
    # attention every eighth from the fifth)
    "jamba": "Jamba-v0.1",
}
BLOCK = 16


def hybrid_vllm_config(
    tmp: Path,
    name: str,
    extra: dict,
    *,
    max_model_len: int = 2048,
    batched: int = 2048,
    tp_size: int = 1,
    prefix_caching: bool = True,
):
    from vllm.config import ModelConfig
    from vllm_utils import engine_config

    folder = tmp / MODELS[name]
    if not folder.exists():
        shutil.copytree(DATA / MODELS[name], folder)
    # Gemma 3's multimodal class needs torchvision to be inspected; its language model is vLLM's
    # Gemma3ForCausalLM over the same text_config (the KV cache is the language model's alone).
    over = {"architectures": ["Gemma3ForCausalLM"]} if name.startswith("gemma") else {}
    mc = ModelConfig(
        model=str(folder),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=max_model_len,
        hf_overrides=over,
    )
    cfg = engine_config(
        mc,
        {"choice": "load", **extra},
        hybrid=True,
        tp_size=tp_size,
        max_num_batched_tokens=batched,
        prefix_caching=prefix_caching,
    )
    cfg.cache_config.kv_cache_layout = "LBHNC"  # the engine core's resolution, done here
    cfg.scheduler_config.async_scheduling = False
    if mc.is_hybrid:
        _align_state_pages(cfg)
    return cfg


def _align_state_pages(cfg) -> None:
    """What vLLM's executor does at start for a model with Mamba or linear-attention layers
    (`Platform.update_block_size_for_backend`), as on a GPU with FlashAttention: the attention
    block grown until its page holds a layer's state, the state pages padded to it, and under
    prefix caching (mamba_cache_mode "align") the state group's block the attention block."""
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    Platform._align_hybrid_block_size(cfg, FlashAttentionBackend)


def layer_specs(cfg) -> dict:
    """Each attention layer's KVCacheSpec as vLLM 0.33's model code makes it (`Attention`'s,
    `MLAAttention`'s, the DSA indexer cache's, the gated delta net's, Mamba2's and Mamba1's
    `get_kv_cache_spec`), for the architecture of ``cfg``'s config.json, at its TP size (each
    rank its share of the KV heads; MLA's latent and the indexer's keys on every rank), KV cache
    dtype "auto"."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    hf = cfg.model_config.hf_text_config
    arch = cfg.model_config.architectures[0]
    bs, dtype = cfg.cache_config.block_size, torch.bfloat16
    tp = cfg.parallel_config.tensor_parallel_size
    specs: dict = {}
    if arch in ("GptOssForCausalLM", "Gemma3ForCausalLM"):
        head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        prefix = "model.layers"
        for i, kind in enumerate(hf.layer_types):
            kv_heads = max(1, hf.num_key_value_heads // tp)
            common = dict(block_size=bs, num_kv_heads=kv_heads, head_size=head, dtype=dtype)
            name = f"{prefix}.{i}.self_attn.attn"
            if kind == "sliding_attention":
                specs[name] = SlidingWindowSpec(sliding_window=hf.sliding_window, **common)
            else:
                specs[name] = FullAttentionSpec(**common)
    elif arch == "DeepseekV32ForCausalLM":
        from vllm.v1.kv_cache_interface import SparseCacheRole

        indexer = hf.index_head_dim + hf.index_head_dim // 128 * 4  # fp8 keys and their fp32 scales
        for i in range(hf.num_hidden_layers):
            specs[f"model.layers.{i}.self_attn.mla_attn"] = MLAAttentionSpec(
                block_size=bs,
                num_kv_heads=1,
                max_tp_shards=1,
                head_size=hf.kv_lora_rank + hf.qk_rope_head_dim,
                dtype=dtype,
                cache_dtype_str="auto",
                is_index_group_leader=True,
            )
            specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
                block_size=bs,
                num_kv_heads=1,
                max_tp_shards=1,
                head_size=indexer,
                dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER,
            )
    elif arch in STATE_MODELS:
        specs = _state_model_specs(cfg, arch)
    else:
        raise ValueError(f"no layer specs for {arch}")
    return specs


def _qwen3_next(hf):
    for i, kind in enumerate(hf.layer_types):
        attn = kind == "full_attention"
        yield (f"model.layers.{i}.self_attn.attn" if attn else f"model.layers.{i}.linear_attn"), attn


def _nemotron_h(hf):
    for i, kind in enumerate(hf.hybrid_override_pattern):  # "-": an MLP, no cache
        if kind in "*M":
            yield f"model.layers.{i}.mixer" + (".attn" if kind == "*" else ""), kind == "*"


def _jamba(hf):
    for i, kind in enumerate(hf.layers_block_type):
        attn = kind == "attention"
        yield (f"model.layers.{i}.attn" if attn else f"model.layers.{i}.mixer"), attn


# Models with state layers: architecture -> (vLLM's model module, its state layers' backend,
# (layer name, whether it is an attention layer) of each layer with a cache, in order)
STATE_MODELS = {
    "Qwen3NextForCausalLM": ("qwen3_next", "GDN_ATTN", _qwen3_next),
    "NemotronHForCausalLM": ("nemotron_h", "MAMBA2", _nemotron_h),
    "JambaForCausalLM": ("jamba", "MAMBA1", _jamba),
}


def _state_model_specs(cfg, arch: str) -> dict:
    """A state model's specs: its attention layers' `FullAttentionSpec`, its state layers'
    `MambaSpec` of the shapes and dtypes its vLLM model class gives, under the platform's block
    sizes and vLLM's mamba_cache_mode."""
    import importlib

    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    module, backend, layers = STATE_MODELS[arch]
    model = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), arch)
    hf, cc = cfg.model_config.hf_text_config, cfg.cache_config
    attention = FullAttentionSpec(
        block_size=cc.block_size,
        num_kv_heads=max(1, hf.num_key_value_heads // cfg.parallel_config.tensor_parallel_size),
        head_size=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        dtype=torch.bfloat16,
    )
    state = MambaSpec(
        shapes=tuple(model.get_mamba_state_shape_from_config(cfg)),
        dtypes=tuple(model.get_mamba_state_dtype_from_config(cfg)),
        block_size=cc.mamba_block_size or cc.block_size,
        page_size_padded=cc.mamba_page_size_padded,
        mamba_type=MambaAttentionBackendEnum[backend],
        mamba_cache_mode=cc.mamba_cache_mode,
    )
    return {name: attention if attn else state for name, attn in layers(hf)}


def hybrid_kv_cache_config(cfg, num_blocks: int):
    """vLLM's KVCacheConfig for ``cfg``'s model with about ``num_blocks`` blocks, resolved as
    vLLM's engine core resolves it: (the workers' config, the scheduler's (one spec per group),
    scheduler block size, hash block size)."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )

    specs = layer_specs(cfg)
    groups = get_global_kv_cache_groups(cfg, [specs])
    page = max(s.page_size_bytes for g in groups for s in _specs_in(g.kv_cache_spec))
    memory = page * max(len(g.layer_names) for g in groups) * num_blocks  # the groups overlay
    kccs = get_kv_cache_configs(cfg, [specs], [memory], groups)
    for k in kccs:
        k.kv_cache_layout = cfg.cache_config.kv_cache_layout
    kcc = generate_scheduler_kv_cache_config(kccs)
    cfg.cache_config.num_gpu_blocks = kcc.num_blocks
    cfg.cache_config.block_size = min(g.kv_cache_spec.block_size for g in kcc.kv_cache_groups)
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kcc, cfg)
    align = resolve_cache_hit_alignment_tokens(kcc, cfg, sched_bs, hash_bs)
    for k in (*kccs, kcc):
        k.hash_block_size, k.cache_hit_alignment_tokens = hash_bs, align
    return kccs[0], kcc, sched_bs, hash_bs


def _specs_in(spec) -> list:
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, dict) else [spec]
