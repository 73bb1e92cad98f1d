"""Read a transformers `config.json` into a `ModelSpec`. Pure Python (json only)."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.models import MLA, MODELS, ModelSpec, MoE, get_model


class ConfigError(ValueError):
    """A config.json that cannot describe a model."""


def _int(cfg: dict, key: str, where: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ConfigError(f"{where}: missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
    return value


def from_hf_config(path: str | Path) -> ModelSpec:
    """Build a ModelSpec from a transformers config.json (a file, or a folder holding one).

    Understands Llama/Mistral/Qwen2-style dense models, Mixtral-style MoE
    (`num_local_experts`), and DeepSeek-V2/V3 (`kv_lora_rank`, `n_routed_experts`).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    where = str(p)
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg

    hidden = _int(cfg, "hidden_size", where)
    layers = _int(cfg, "num_hidden_layers", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv_heads = _int(cfg, "num_key_value_heads", where, heads)
    head_dim = _int(cfg, "head_dim", where, hidden // heads if hidden % heads == 0 else None)
    inter = _int(cfg, "intermediate_size", where)
    vocab = _int(cfg, "vocab_size", where)

    moe = None
    if cfg.get("num_local_experts"):
        moe = MoE(_int(cfg, "num_local_experts", where), _int(cfg, "num_experts_per_tok", where, 2), inter)
    elif cfg.get("n_routed_experts"):
        moe = MoE(
            _int(cfg, "n_routed_experts", where),
            _int(cfg, "num_experts_per_tok", where),
            _int(cfg, "moe_intermediate_size", where),
            shared_experts=cfg.get("n_shared_experts") or 0,
            first_dense_layers=cfg.get("first_k_dense_replace") or 0,
        )
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = MLA(
            _int(cfg, "kv_lora_rank", where),
            _int(cfg, "qk_rope_head_dim", where),
            _int(cfg, "qk_nope_head_dim", where),
            _int(cfg, "v_head_dim", where),
            cfg.get("q_lora_rank"),
        )
    name = cfg.get("_name_or_path") or cfg.get("model_type") or p.parent.name or "custom"
    try:
        return ModelSpec(
            key=f"config:{p.parent.name or p.stem}",
            name=str(name),
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=inter,
            vocab=vocab,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            moe=moe,
            mla=mla,
            source=where,
        )
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset key, or a path to a config.json / model folder."""
    if name_or_path.lower() in MODELS:
        return get_model(name_or_path)
    p = Path(name_or_path)
    if p.suffix == ".json" or p.is_dir() or p.exists():
        return from_hf_config(p)
    return get_model(name_or_path)  # raises with the list of known models
