"""Read a transformers `config.json` into a `ModelSpec`, and a transformers config object into
the shape its attention caches (`cache_kv_shape`). Pure Python (json only, no transformers)."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.models import MAX_DIM, MLA, MODELS, ModelSpec, MoE, count_range, get_model, short_repr


class ConfigError(ValueError):
    """A config.json that cannot describe a model."""


def _int(cfg: dict, key: str, where: str, default: int | None = None, least: int = 1) -> int:
    """Field `key` as an int within [least, MAX_DIM] (bools, strings and floats refused)."""
    value = cfg.get(key)
    if value is None:
        value = default
    if value is None:
        raise ConfigError(f"{where}: missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_DIM:
        raise ConfigError(f"{where}: field {key!r} must be {count_range(least)}, got {short_repr(value)}")
    return value


def _bool(cfg: dict, key: str, where: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: field {key!r} must be true or false, got {short_repr(value)}")
    return value


def _set(cfg: dict, key: str) -> bool:
    """Whether optional field `key` turns its feature on: absent, null and a plain 0 do not
    (transformers writes those for dense models); anything else must then be a valid count."""
    value = cfg.get(key)
    return value is not None and not (type(value) is int and value == 0)


def _not_above(got: dict[str, int], small: str, big: str, where: str) -> None:
    if got[small] > got[big]:
        raise ConfigError(f"{where}: field {small!r} ({got[small]}) exceeds {big!r} ({got[big]})")


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
    except (OSError, ValueError) as e:  # ValueError: bad JSON, bad UTF-8, an int too long to read
        raise ConfigError(f"{where}: not valid JSON ({e})") from None
    return from_hf_dict(cfg, where, key=p.parent.name or p.stem, fallback_name=p.parent.name)


def from_hf_dict(cfg: object, where: str, *, key: str = "dict", fallback_name: str = "") -> ModelSpec:
    """A ModelSpec from a config's fields as a dict (what `from_hf_config` reads from a file, or
    what ``PretrainedConfig.to_dict()`` gives in a process that has the config loaded already).
    where: how errors name the config. key: the spec's key is ``config:<key>``."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg

    hidden = _int(cfg, "hidden_size", where)
    layers = _int(cfg, "num_hidden_layers", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv_heads = _int(cfg, "num_key_value_heads", where, heads)
    if heads % kv_heads:
        raise ConfigError(
            f"{where}: field 'num_key_value_heads' ({kv_heads}) does not divide "
            f"'num_attention_heads' ({heads})"
        )
    head_dim = _int(cfg, "head_dim", where, hidden // heads if hidden % heads == 0 else None)
    inter = _int(cfg, "intermediate_size", where)
    vocab = _int(cfg, "vocab_size", where)

    moe = None
    if _set(cfg, "num_local_experts"):  # Mixtral
        got = {
            "num_local_experts": _int(cfg, "num_local_experts", where),
            "num_experts_per_tok": _int(cfg, "num_experts_per_tok", where, 2),
        }
        _not_above(got, "num_experts_per_tok", "num_local_experts", where)
        moe = MoE(*got.values(), inter)
    elif _set(cfg, "n_routed_experts"):  # DeepSeek-V2/V3
        got = {
            key: _int(cfg, key, where, default, least)
            for key, default, least in (
                ("n_routed_experts", None, 1),
                ("num_experts_per_tok", None, 1),
                ("moe_intermediate_size", None, 1),
                ("n_shared_experts", 0, 0),
                ("first_k_dense_replace", 0, 0),
            )
        }
        _not_above(got, "num_experts_per_tok", "n_routed_experts", where)
        _not_above(got | {"num_hidden_layers": layers}, "first_k_dense_replace", "num_hidden_layers", where)
        moe = MoE(*got.values())
    mla = None
    if _set(cfg, "kv_lora_rank"):
        mla = MLA(
            _int(cfg, "kv_lora_rank", where),
            _int(cfg, "qk_rope_head_dim", where),
            _int(cfg, "qk_nope_head_dim", where),
            _int(cfg, "v_head_dim", where),
            _int(cfg, "q_lora_rank", where) if cfg.get("q_lora_rank") is not None else None,
        )
    tie = _bool(cfg, "tie_word_embeddings", where, False)
    bias = _bool(cfg, "attention_bias", where, cfg.get("model_type") == "qwen2")
    name = cfg.get("_name_or_path") or cfg.get("model_type") or fallback_name or "custom"
    try:
        return ModelSpec(
            key=f"config:{key}",
            name=str(name),
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=inter,
            vocab=vocab,
            tie_embeddings=tie,
            qkv_bias=bias,
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


# ---- what a transformers model caches ---------------------------------------------------------


def cache_kv_shape(config) -> tuple[int, int]:
    """(KV heads, head_dim): the shape per layer and token of the K and of the V that a
    transformers model's attention puts into its `Cache`, read from its config object (or its
    text config). ValueError, naming the field and the reason, for a model whose cache kvtier's
    paged layout cannot hold: layers that are not full attention (a sliding window, linear or
    chunked attention), and MLA, whose K and V differ in width.

    >>> cache_kv_shape(transformers.FalconConfig(hidden_size=64, num_attention_heads=4))
    (1, 16)
    """
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    _full_attention_only(cfg)
    rank = getattr(cfg, "kv_lora_rank", None)
    if rank:
        rope, nope, v = (getattr(cfg, k, "?") for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
        raise ValueError(
            f"model: kv_lora_rank={rank} (multi-head latent attention, DeepSeek-V2/V3 style): its "
            f"cache holds a K and a V of different widths (the latent, {rank}, and the rotary key, "
            f"{rope}; or per head K of {nope} + {rope} and V of {v}), and kvtier's paged cache needs "
            "K and V of one shape (heads x head_dim): MLA models are not supported"
        )
    heads = getattr(cfg, "num_attention_heads", None)
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    if getattr(cfg, "new_decoder_architecture", False):
        kv = heads  # Falcon-40B style: each KV group is broadcast to its query heads, then cached
    elif getattr(cfg, "multi_query", False):
        kv = 1  # multi-query (Falcon-7B, GPTBigCode): one K and one V head, whatever the config's kv count
    else:
        kv = getattr(cfg, "num_key_value_heads", None) or heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model: config field {name!r} must be a positive integer, got {value!r}")
    return kv, head_dim


def _full_attention_only(cfg) -> None:
    """ValueError naming the layers that are not full attention, and the window if they slide."""
    layers = getattr(cfg, "num_hidden_layers", None)
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if not types:
        if not window or getattr(cfg, "use_sliding_window", True) is False:
            return
        types = ["sliding_attention"] * (layers or 1)  # one window for every layer
    odd: dict[str, list[int]] = {}
    for i, kind in enumerate(types):
        if kind != "full_attention":
            odd.setdefault(kind, []).append(i)
    if not odd:
        return
    parts = []
    for kind, idx in odd.items():
        which = f"layer {idx[0]} uses" if len(idx) == 1 else f"layers {_ranges(idx)} use"
        if kind == "sliding_attention":
            parts.append(f"sliding_window={window} ({which} sliding-window attention)")
        else:
            parts.append(f"{which} {kind!r}")
    raise ValueError(f"model: {'; '.join(parts)}: kvtier's cache holds full-attention layers only")


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> "0..2, 5"."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}..{b}" if b > a else str(a) for a, b in runs)
