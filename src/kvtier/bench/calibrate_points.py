"""The measurements of `kvtier calibrate` (see `calibrate` for what each one is): one `Point` per
case, kvtier's prediction beside the timed figure, for the pinned copies (h2d, d2h), a decode step
of the random-weight model (`decode_step_fn`, its attention `grouped_attention`) and a prefill
forward; and the forward floor of `generate` (`floor_ms`, not fitted). `calibrate.run` picks the
cases, fits the points and writes the document; `calibrate` re-exports these names.
"""

from __future__ import annotations

import torch

from kvtier.bench.calibrate_fit import Point

MiB = 1 << 20


def roofline_dtypes(model) -> tuple[str, str]:
    """(weights dtype, KV dtype) names for the roofline. fp32 (the CPU dry run) counts its KV
    at 4 bytes; its weights are counted at bf16's 2 (the roofline has no fp32 matmul rate)."""
    kv = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[model.dtype]
    return ("fp16" if kv == "fp16" else "bf16"), kv


def _point(q: str, case: str, predicted_ms: float, t, **params) -> Point:
    return Point(
        q,
        case,
        predicted_ms,
        t.median_ms,
        t.min_ms,
        t.max_ms,
        t.spread * 100,
        params | {"clock": t.clock, "runs": t.count},
    )


def transfer_points(device: torch.device, gpu, ceilings, sizes_mib, timer) -> list[Point]:
    """One pinned copy each way per size (CPU: a host memcpy stands in for each direction)."""
    from kvtier.path import build_path
    from kvtier.planner import tier_path
    from kvtier.specs import get_link, measured_host_link

    down = measured_host_link(get_link(f"pcie{gpu.pcie_gen}"), ceilings, "d2h")
    paths = {"h2d": tier_path(gpu, "host", ceilings), "d2h": build_path(gpu, "host", down, "save")}
    out = []
    for mib in sizes_mib:
        n = mib * MiB
        g = torch.empty(n, dtype=torch.uint8, device=device).random_()  # never time zeros
        h = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda").random_()
        copies = {"h2d": (g, h), "d2h": (h, g)}  # (destination, source)
        for q, (dst, src) in copies.items():
            t = timer.time(lambda d=dst, s=src: d.copy_(s, non_blocking=True), name=f"calibrate/{q}/{mib}MiB")
            out.append(_point(q, f"{q} {mib} MiB", paths[q].transfer_ms(n), t, bytes=n, device=device.type))
    return out


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of q (b, kv_heads, group, d) over k, v (b, kv_heads, ctx, d): the `group` query
    heads of a KV head as `group` rows. Two batched matmuls over the whole context (cuBLAS spreads
    them over every SM), not SDPA, whose kernels give batch 1 one block per head: ~8 blocks
    reading 4 GiB at 32K tokens."""
    w = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    return torch.matmul(torch.softmax(w, dim=-1).to(v.dtype), v)


def decode_step_fn(model, batch: int, context: int):
    """One decode step of ``model`` (a transformers Llama) for ``batch`` requests whose KV holds
    ``context`` random tokens per layer, ``(batch, kv_heads, context, head_dim)`` for K and V:
    embedding, per layer norm + q/k/v/o projections + attention over the static KV + MLP, final
    norm, LM head. The group of query heads sharing a KV head is one query of `group` rows, so
    grouped-query attention needs no copy of K/V. No CPU sync inside: it can be graph-captured."""
    cfg, inner = model.config, model.model
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dev, dt, group = model.device, model.dtype, heads // kv_heads
    gen = torch.Generator(device=dev).manual_seed(0)
    kv = [
        torch.randn((2, batch, kv_heads, context, d), generator=gen, device=dev, dtype=dt)
        for _ in inner.layers
    ]
    ids = torch.randint(0, cfg.vocab_size, (batch,), generator=gen, device=dev)

    @torch.no_grad()
    def step():
        h = inner.embed_tokens(ids)  # (batch, hidden)
        for layer, (k, v) in zip(inner.layers, kv, strict=True):
            att, x = layer.self_attn, layer.input_layernorm(h)
            q = att.q_proj(x).view(batch, kv_heads, group, d)  # query heads of KV head j: rows j*g..
            att.k_proj(x), att.v_proj(x)  # the new token's K and V: weights read, not stored
            o = grouped_attention(q, k, v)  # (batch, kv_heads, group, d): every KV byte read once
            h = h + att.o_proj(o.reshape(batch, heads * d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return model.lm_head(inner.norm(h))

    return step


def decode_points(model, gpu, spec, shapes, timer) -> list[Point]:
    from kvtier.bench.timing import TimingError
    from kvtier.roofline import decode_step

    wdt, kvdt = roofline_dtypes(model)
    out = []
    for b, c in shapes:
        step = decode_step_fn(model, b, c)
        try:  # a graph replays the step without Python launch overhead: the GPU's own time
            t = timer.time(step, graph=timer.on_cuda, name=f"calibrate/decode/b{b}c{c}")
        except TimingError:
            t = timer.time(step, name=f"calibrate/decode/b{b}c{c}")
        bound = decode_step(spec, gpu, b, c, wdt, kvdt)
        kv = b * c * spec.kv_bytes_per_token(kvdt)
        p = dict(batch=b, context=c, kv_share=kv / bound.bytes, bound=bound.bound, device=model.device.type)
        out.append(_point("decode", f"decode b{b} c{c}", bound.ms, t, **p))
        del step
        if timer.on_cuda:
            torch.cuda.empty_cache()  # this shape's KV buffers go before the next shape's
    return out


def prefill_points(model, gpu, spec, lengths, timer) -> list[Point]:
    import inspect

    from kvtier.roofline import prefill

    wdt, kvdt = roofline_dtypes(model)
    last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    gen = torch.Generator(device=model.device).manual_seed(1)
    out = []
    for n in lengths:
        ids = torch.randint(1, model.config.vocab_size, (1, n), generator=gen, device=model.device)

        @torch.no_grad()
        def forward(ids=ids):
            model(ids, use_cache=False, **last)

        t = timer.time(forward, name=f"calibrate/prefill/{n}")
        b = prefill(spec, gpu, n, 0, wdt, kvdt)
        out.append(
            _point("prefill", f"prefill {n}", b.ms, t, tokens=n, bound=b.bound, device=model.device.type)
        )
    return out


FLOOR_PREFIX = 256  # cached tokens under the floor's tail: short, so the GPU has little to do


def floor_ms(model, tail: int, timer) -> float:
    """Median ms of `generate` (one new token) over a DynamicCache holding FLOOR_PREFIX tokens, with
    `tail` prompt tokens after them, host clock, device synchronized (see `calibrate`'s docstring)."""
    from transformers import DynamicCache

    from kvtier.integrations.hf import cache_kwarg

    gen = torch.Generator(device=model.device).manual_seed(2)
    ids = torch.randint(
        1, model.config.vocab_size, (1, FLOOR_PREFIX + tail), generator=gen, device=model.device
    )
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :FLOOR_PREFIX], **{cache_kwarg(model): cache}, use_cache=True)

    @torch.no_grad()
    def first_token():
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0, **{cache_kwarg(model): cache})
        extra = cache.get_seq_length() - FLOOR_PREFIX
        if extra > 0:
            cache.crop(-extra)  # back to the prefix alone for the next run (negative: any version)

    return timer.time(first_token, name=f"calibrate/floor/{tail}").median_ms
