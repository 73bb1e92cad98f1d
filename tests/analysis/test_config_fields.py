"""A config.json whose MoE or MLA fields have the wrong type or an impossible value is refused
with a ConfigError naming the field (never a traceback, an OverflowError, a hang or a silent
acceptance); `ModelSpec` and its parts check themselves the same way."""

import json

import pytest

from kvtier.hfconfig import ConfigError, from_hf_config
from kvtier.models import MLA, ModelSpec, MoE

BASE = {
    "hidden_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "intermediate_size": 2048,
    "vocab_size": 1000,
}
DEEPSEEK = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
MLA_FIELDS = {"kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}

BAD = [
    # (extra fields, the field the message names)
    ({"num_local_experts": 8, "num_experts_per_tok": "2"}, "num_experts_per_tok"),
    ({"num_local_experts": 8, "num_experts_per_tok": 9}, "num_experts_per_tok"),  # top-k > experts
    ({"num_local_experts": 1}, "num_experts_per_tok"),  # one expert, and the default top-2
    ({"num_local_experts": -8}, "num_local_experts"),
    ({"num_local_experts": True}, "num_local_experts"),
    ({"num_local_experts": False}, "num_local_experts"),
    ({"num_local_experts": 8.0}, "num_local_experts"),
    ({"num_local_experts": 10**400}, "num_local_experts"),  # an OverflowError today
    (DEEPSEEK | {"n_shared_experts": "1"}, "n_shared_experts"),  # a TypeError today
    (DEEPSEEK | {"n_shared_experts": 1.5}, "n_shared_experts"),
    (DEEPSEEK | {"n_shared_experts": -1}, "n_shared_experts"),
    (DEEPSEEK | {"first_k_dense_replace": -1}, "first_k_dense_replace"),
    (DEEPSEEK | {"first_k_dense_replace": 5}, "first_k_dense_replace"),  # more than the 4 layers
    (DEEPSEEK | {"first_k_dense_replace": True}, "first_k_dense_replace"),
    (DEEPSEEK | {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    (DEEPSEEK | {"moe_intermediate_size": "64"}, "moe_intermediate_size"),
    (MLA_FIELDS | {"q_lora_rank": "x"}, "q_lora_rank"),  # a TypeError today
    (MLA_FIELDS | {"q_lora_rank": -3}, "q_lora_rank"),
    (MLA_FIELDS | {"q_lora_rank": 1.5}, "q_lora_rank"),
    (MLA_FIELDS | {"kv_lora_rank": True}, "kv_lora_rank"),
    (MLA_FIELDS | {"v_head_dim": 0}, "v_head_dim"),
    (MLA_FIELDS | {"qk_rope_head_dim": 2.0**70}, "qk_rope_head_dim"),
    ({"num_hidden_layers": 10**30}, "num_hidden_layers"),  # a hang today: a loop over layers
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings"),
    ({"attention_bias": 1}, "attention_bias"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
]


@pytest.mark.parametrize(("extra", "field"), BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_a_bad_field_is_refused_naming_it(extra, field, tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(BASE | extra))
    with pytest.raises(ConfigError, match=f"'{field}'") as e:
        from_hf_config(p)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_good_moe_and_mla_configs_still_read(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(
        json.dumps(BASE | DEEPSEEK | MLA_FIELDS | {"n_shared_experts": 1, "first_k_dense_replace": 1})
    )
    m = from_hf_config(p)
    assert m.moe == MoE(8, 2, 64, shared_experts=1, first_dense_layers=1)
    assert m.mla == MLA(64, 16, 32, 32) and m.kv_elems_per_token_layer() == 80
    p.write_text(json.dumps(BASE | {"num_local_experts": 0, "n_routed_experts": None}))  # written for dense
    assert from_hf_config(p).moe is None


def test_params_in_closed_form_equal_the_sum_over_layers():
    m = ModelSpec(
        "x", "x", 64, 5, 4, 2, 16, 128, 100, moe=MoE(8, 2, 32, shared_experts=1, first_dense_layers=2)
    )
    q, kv = 4 * 16, 2 * 16  # heads and kv heads of head_dim 16
    attn = 64 * (q + 2 * kv) + q * 64 + 2 * 64  # q, k, v and o projections; two norms
    dense, moe = 3 * 64 * 128, (8 + 1) * 3 * 64 * 32 + 64 * 8
    assert m.params() == 5 * attn + 2 * dense + 3 * moe + 100 * 64 * 2 + 64


def _spec(**kw) -> ModelSpec:
    return ModelSpec("x", "x", 64, 2, 4, 2, 16, 128, 100, **kw)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: MoE(8, 9, 32), "experts_per_token"),
        (lambda: MoE(8, 2, 32, shared_experts=-1), "shared_experts"),
        (lambda: MoE("8", 2, 32), "num_experts"),
        (lambda: MLA(64, 16, 32, 32, q_lora_rank="x"), "q_lora_rank"),
        (lambda: _spec(moe=MoE(8, 2, 32, first_dense_layers=3)), "first_dense_layers"),
        (lambda: ModelSpec("x", "x", 64, True, 4, 2, 16, 128, 100), "layers"),
        (lambda: _spec(tie_embeddings="no"), "tie_embeddings"),
    ],
)
def test_the_dataclasses_check_themselves(build, field):
    with pytest.raises(ValueError, match=field):
        build()
