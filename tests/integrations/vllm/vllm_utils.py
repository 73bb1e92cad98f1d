"""Equivalents of vLLM's connector test utilities (`tests/v1/kv_connector/unit/utils.py`) for
kvtier's connector on vLLM 0.33, from a local config.json (no download, no accelerator):

    create_vllm_config(tmp, extra, ...)   a VllmConfig of a tiny Llama with kvtier's connector
    create_kv_cache_config(num_blocks)    one full-attention group over every layer
    create_scheduler(cfg, kcc)            `Scheduler`, or `AsyncScheduler` when cfg asks for it
    create_request(rid, tokens, ...)      a Request with vLLM's block hasher (sha256, over
                                          hash_block_size tokens, as the engine core's)
    create_model_runner_output(...)       a ModelRunnerOutput of sampled tokens and KV output
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no accelerator: vLLM's CPU platform

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
    "head_dim": 16,
}
NUM_LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 16, 16


def create_vllm_config(
    tmp: Path,
    extra: dict,
    *,
    tp_size: int = 1,
    policy: str = "recompute",
    async_scheduling: bool = False,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 8,
    max_model_len: int = 2048,
):
    from vllm.config import ModelConfig

    if "kvtier" not in extra and "choice" not in extra:
        # The stand-in models cost about the same per step whatever its tokens, so the planner
        # would rightly recompute every hit: the rig loads what is held unless a test asks for
        # the planner's choice (the choice's own tests, with a model whose prefill costs time).
        extra = {"choice": "load", **extra}
    (tmp / "model").mkdir(exist_ok=True)
    (tmp / "model" / "config.json").write_text(json.dumps(CONFIG))
    mc = ModelConfig(
        model=str(tmp / "model"), skip_tokenizer_init=True, dtype="float16", max_model_len=max_model_len
    )
    cfg = engine_config(
        mc,
        extra,
        hybrid=False,
        tp_size=tp_size,
        policy=policy,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
    )
    # vLLM's CPU platform turns async scheduling off; the scheduler's behaviour is what we test.
    cfg.scheduler_config.async_scheduling = async_scheduling
    return cfg


def engine_config(
    mc,
    extra: dict,
    *,
    hybrid: bool,
    tp_size: int = 1,
    policy: str = "recompute",
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 8,
    prefix_caching: bool = True,
):
    """vLLM's config over model config ``mc`` with kvtier's connector (``extra``: its settings),
    prefix caching on (or as ``prefix_caching`` says), vLLM's hybrid KV cache manager on or off
    (``hybrid``)."""
    from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, SchedulerConfig, VllmConfig

    return VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=mc.max_model_len,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=not hybrid,
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy=policy,
        ),
    )


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def create_kv_cache_config(num_blocks: int):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
    page, names = spec.page_size_bytes, layer_names()
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks * NUM_LAYERS,
                layers=names,
                layer_stride=page * num_blocks,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def create_scheduler(cfg, kcc):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    cfg.cache_config.num_gpu_blocks = kcc.num_blocks
    cls = AsyncScheduler if cfg.scheduler_config.async_scheduling else Scheduler
    return cls(cfg, kcc, StructuredOutputManager(cfg), block_size=BLOCK, log_stats=True)


def create_request(rid: str, tokens: list[int], max_tokens: int = 2, hash_block_size: int = BLOCK):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(
        rid, list(tokens), sp, None, block_hasher=get_request_block_hasher(hash_block_size, sha256)
    )


def create_model_runner_output(req_ids: list[str], sampled: dict[str, list[int]], kv_output):
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=list(req_ids),
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[sampled.get(r, []) for r in req_ids],
        kv_connector_output=kv_output,
    )


def _computed_of(so, rid: str) -> int:
    """The tokens ``rid`` had computed when scheduler output ``so`` was made."""
    for new in so.scheduled_new_reqs:
        if new.req_id == rid:
            return new.num_computed_tokens
    cr = so.scheduled_cached_reqs
    return cr.num_computed_tokens[cr.req_ids.index(rid)]
