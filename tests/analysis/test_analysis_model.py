"""specs, models, hfconfig: the figures and derivations the analysis rests on."""

import json
import math

import pytest

from kvtier.ceilings import Ceilings, CeilingsError
from kvtier.hfconfig import ConfigError, from_hf_config, resolve_model
from kvtier.models import MODELS, get_model
from kvtier.specs import GPUS, LINKS, apply_ceilings, get_gpu, get_link, gpu_from_device_name


def test_specs_cover_the_required_gpus_and_links_with_sources():
    for key in ("h100-sxm", "h100-pcie", "h200", "a100-80gb", "l40s", "b200"):
        g = GPUS[key]
        assert g.sms > 0 and g.l2_mb > 0 and g.mem_gb > 0 and g.mem_bw_gbps > 0 and g.bf16_tflops > 0
        assert g.pcie_gen in (4, 5, 6) and g.source
    for key in (
        "pcie3",
        "pcie4",
        "pcie5",
        "pcie6",
        "nvlink4",
        "nvlink5",
        "nic100",
        "nic200",
        "nic400",
        "nvme",
    ):
        x = LINKS[key]
        assert 0 < x.typical_gbps <= x.theoretical_gbps and x.source


def test_h100_balance_is_the_seeds_295():
    assert get_gpu("h100-sxm").balance == pytest.approx(295, abs=1)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="gpu: unknown gpu 'x100'.*h100-sxm"):
        get_gpu("x100")
    with pytest.raises(ValueError, match="link: .*pcie4"):
        get_link("pcie9")
    with pytest.raises(ValueError, match="model: .*llama-3-8b"):
        get_model("gpt-9")


def test_driver_names_map_to_specs():
    assert gpu_from_device_name("NVIDIA H200").key == "h200"
    assert gpu_from_device_name("NVIDIA H100 80GB HBM3").key == "h100-sxm"
    assert gpu_from_device_name("NVIDIA H100 PCIe").key == "h100-pcie"
    assert gpu_from_device_name("Tesla T4") is None


def test_llama3_8b_derived_figures():
    m = MODELS["llama-3-8b"]
    assert m.params() == pytest.approx(8.03e9, rel=0.005)
    assert m.weight_bytes("bf16") == pytest.approx(16.06e9, rel=0.005)
    assert m.kv_bytes_per_token() == 128 * 1024
    assert m.kv_bytes_per_token_layer() == 4096
    assert m.kv_bytes_per_token("fp8") == 64 * 1024


@pytest.mark.parametrize(
    ("key", "billions"),
    [
        ("llama-3-70b", 70.6),
        ("llama-3.1-405b", 405.9),
        ("qwen2.5-7b", 7.62),
        ("qwen2.5-72b", 72.7),
        ("mistral-7b", 7.24),
        ("mixtral-8x7b", 46.7),
        ("deepseek-v3", 671.0),
    ],
)
def test_parameter_counts_match_published_sizes(key, billions):
    assert MODELS[key].params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_moe_active_params_and_mla_latent_kv():
    assert MODELS["mixtral-8x7b"].params(active=True) / 1e9 == pytest.approx(12.9, rel=0.01)
    ds = MODELS["deepseek-v3"]
    assert ds.params(active=True) / 1e9 == pytest.approx(37.5, rel=0.02)
    assert ds.kv_bytes_per_token_layer() == (512 + 64) * 2  # one latent, not per-head K and V
    assert ds.kv_bytes_per_token() == 61 * 1152


def test_from_hf_config_reads_a_llama_config(tmp_path):
    cfg = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = from_hf_config(tmp_path)
    ref = MODELS["llama-3-8b"]
    assert m.params() == ref.params() and m.kv_bytes_per_token() == ref.kv_bytes_per_token()
    assert resolve_model(str(tmp_path / "config.json")).params() == ref.params()


def test_from_hf_config_reads_deepseek_mla(tmp_path):
    cfg = {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "vocab_size": 129280,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
    }
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = from_hf_config(p)
    assert m.params() == MODELS["deepseek-v3"].params()
    assert m.kv_bytes_per_token() == MODELS["deepseek-v3"].kv_bytes_per_token()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"hidden_size": 64}', "missing required field 'num_hidden_layers'"),
        (
            '{"hidden_size": -1, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 8, '
            '"vocab_size": 10}',
            "'hidden_size' must be a positive integer",
        ),
    ],
)
def test_malformed_config_is_a_clear_error(tmp_path, text, match):
    p = tmp_path / "config.json"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        from_hf_config(p)


def test_ceilings_override_datasheet(tmp_path):
    c = Ceilings({"d2d_copy_gbps": 4237.0, "bf16_tflops": 700.0, "h2d_pinned_gbps": 55.4}, gpu="NVIDIA H200")
    path = tmp_path / "c.json"
    c.save(path)
    loaded = Ceilings.load(path)
    g = apply_ceilings(get_gpu("h200"), loaded)
    assert (
        g.mem_bw_gbps == 4237.0
        and g.bf16_tflops == 700.0
        and set(g.measured) == {"mem_bw_gbps", "bf16_tflops"}
    )
    assert math.isclose(g.balance, 700e12 / 4237e9)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"figures": {}}, "not a kvtier ceilings file"),
        ({"kvtier_ceilings": 1, "figures": {"warp_gbps": 1.0}}, "unknown figure 'warp_gbps'"),
        ({"kvtier_ceilings": 1, "figures": {"h2d_pinned_gbps": -3}}, "positive number"),
    ],
)
def test_bad_ceilings_are_rejected(data, match):
    with pytest.raises(CeilingsError, match=match):
        Ceilings.from_json(data)
