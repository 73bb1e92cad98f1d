"""The HF cache takes its KV shape from what the model's attention really caches: multi-query
models (one KV head, no `num_key_value_heads` in the config) run with tokens identical to
transformers' own cache; models it cannot hold (MLA, sliding windows, other layer kinds) are
refused up front by `KVTier.for_model`, with the reason. Tiny random models, no download."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier.device import SimDevice  # noqa: E402
from kvtier.hfconfig import cache_kv_shape  # noqa: E402
from kvtier.integrations.hf import KVTier, cache_kwarg  # noqa: E402

NEW = 4


def _generate(model, ids, cache=None):
    extra = {} if cache is None else {cache_kwarg(model): cache}
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **extra)


def _falcon(**kw):
    cfg = transformers.FalconConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        alibi=False, bias=False, **kw,
    )  # fmt: skip
    return cfg, transformers.FalconForCausalLM


def _bigcode():
    cfg = transformers.GPTBigCodeConfig(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256, multi_query=True
    )
    return cfg, transformers.GPTBigCodeForCausalLM


def test_shapes_read_from_configs():
    assert cache_kv_shape(_falcon(multi_query=True)[0]) == (1, 16)
    assert cache_kv_shape(_falcon(multi_query=False)[0]) == (4, 16)
    # Falcon-40B's layout broadcasts each KV group to every query head before caching
    assert cache_kv_shape(_falcon(new_decoder_architecture=True, num_kv_heads=2)[0]) == (4, 16)
    assert cache_kv_shape(_bigcode()[0]) == (1, 16)
    llama = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert cache_kv_shape(llama) == (2, 16)


@pytest.mark.parametrize(
    "arch", [lambda: _falcon(multi_query=True), _bigcode], ids=["falcon-multi-query", "gpt-bigcode-mqa"]
)
def test_multi_query_model_runs_with_one_kv_head_and_identical_tokens(arch):
    cfg, cls = arch()
    torch.manual_seed(0)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(1, 128, (1, 70), generator=g)
    a, b = (torch.cat([prefix, torch.randint(1, 128, (1, t), generator=g)], 1) for t in (5, 11))
    dev = SimDevice(copy_delay=(0.0, 0.001), seed=2)
    with KVTier.for_model(model, device=dev, chunk_tokens=32, num_blocks=32, block_size=8) as kvt:
        assert kvt.kv.layers[0].shape[-2:] == (1, 16)  # one KV head of 64 / 4
        for ids, hit in ((a, 0), (b, 64)):
            cache = kvt.cache(ids)
            out = _generate(model, ids, cache)
            cache.finish(out)
            assert cache.hit_tokens == hit
            assert torch.equal(out, _generate(model, ids))
    dev.close()


def _deepseek_v3():
    return transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
    )  # fmt: skip


def test_an_mla_model_is_refused_up_front_with_the_reason():
    cfg = _deepseek_v3()
    with pytest.raises(ValueError, match=r"kv_lora_rank=16 .*multi-head latent attention"):
        cache_kv_shape(cfg)
    dev = SimDevice()
    with pytest.raises(ValueError, match="kv_lora_rank=16"):
        KVTier.for_model(transformers.DeepseekV3ForCausalLM(cfg), device=dev)
    dev.close()


def test_a_sliding_window_model_is_refused_naming_the_window():
    cfg = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=4096,
    )  # fmt: skip
    dev = SimDevice()
    with pytest.raises(ValueError) as e:
        KVTier.for_model(transformers.MistralForCausalLM(cfg), device=dev)
    dev.close()
    msg = str(e.value)
    assert "sliding_window=4096" in msg and "layers 0..2" in msg and "full-attention layers only" in msg
    assert "got ['full_attention']" not in msg


def test_mixed_layer_types_name_the_layers_that_are_not_full_attention():
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=512,
        max_window_layers=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"sliding_window=512 \(layers 2\.\.3 use sliding-window"):
        cache_kv_shape(cfg)
    cfg.layer_types = ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"layers 1, 3 use 'linear_attention'"):
        cache_kv_shape(cfg)
