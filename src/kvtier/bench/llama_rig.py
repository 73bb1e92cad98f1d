"""Random-weight Llama models for the suites that run a real model (`hf`, `ttft`).

    model = build_llama("llama-3-8b", "cuda", torch.bfloat16)   # the preset's shape, random weights
    model = build_llama("tiny", "cpu")                          # 2 layers, for CPU tests

A preset of `kvtier.models` gives the shape (hidden, layers, heads, KV heads, MLP, vocab). The
weights are created on the target device directly (no CPU copy of 16 GB), then filled with a
seeded normal(0, 0.02): no download, and greedy decoding is reproducible within one device.
"""

from __future__ import annotations

TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
)


def llama_config(shape: str = "llama-3-8b", max_positions: int = 32768 + 1024, **override):
    """A transformers LlamaConfig of preset `shape` (a key of kvtier.models) or "tiny"."""
    from transformers import LlamaConfig

    if not isinstance(shape, str):
        raise ValueError(f"shape: expected a model preset name or 'tiny', got {shape!r}")
    if shape == "tiny":
        kw = dict(TINY)
    else:
        from kvtier.models import get_model

        m = get_model(shape)  # raises naming the known presets
        if m.mla or m.moe:
            raise ValueError(f"shape: {shape!r} is not a dense Llama-architecture model")
        kw = dict(
            hidden_size=m.hidden,
            intermediate_size=m.intermediate,
            num_hidden_layers=m.layers,
            num_attention_heads=m.heads,
            num_key_value_heads=m.kv_heads,
            vocab_size=m.vocab,
            head_dim=m.head_dim,
        )
    return LlamaConfig(max_position_embeddings=max_positions, **(kw | override))


def build_llama(shape: str = "llama-3-8b", device="cpu", dtype=None, *, seed: int = 0, **override):
    """A LlamaForCausalLM of `shape` with seeded random weights on `device`, in eval mode."""
    import torch
    from transformers import LlamaForCausalLM

    dtype = dtype or torch.float32
    cfg = llama_config(shape, **override)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dtype)  # cast on meta: no fp32 copy is ever allocated
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)  # RMSNorm weights: ones, as a fresh model has them
            else:
                p.normal_(0.0, 0.02, generator=gen)
    # the rotary buffers were made on "meta" (no values): build them again on the device, in fp32
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    return model.eval()
