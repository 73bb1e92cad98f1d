"""A lean forward of kvtier's own over a transformers Llama-architecture model: the first token
of a prompt, with its prefix KV read from kvtier's paged blocks when there is a hit.

transformers' `generate` spends 30-50 ms of host time on any forward of an 8B model on the H200
(eager launches through its attention, mask and cache machinery; `benchmarks/profile_ttft.py`),
however little the forward computes: a host hit's first token cannot come sooner than that, while
serving engines (vLLM, SGLang) run the same forward in a few ms. `LeanRunner` calls only the
model's own submodules (embedding, norms, projections, MLP, rotary embedding) and SDPA, so a hit
costs the load and the tail's arithmetic, and a recompute the prefill's: like against like.

    lean = LeanRunner(model)
    token, logits = lean.first_token(ids)                          # recompute the whole prompt
    cache = kvt.cache(ids)                                         # a hit: loads start
    token, logits = lean.first_token(ids, cache)                   # layer i waits for its load
    cache.finish(None)

Batch 1, greedy, full attention (what `KVTier.for_model` accepts). With a cache, layer i reads
the loaded prefix through `KVTierCache._arrive` — the wait on layer i's load event and the read
that later loads into those blocks wait for — exactly as attention inside `generate` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LeanRunner:
    def __init__(self, model) -> None:
        inner = getattr(model, "model", None)
        parts = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, p) for p in parts) or not hasattr(model, "lm_head"):
            raise ValueError(
                f"model: expected a Llama-architecture causal LM (model.model.{{{','.join(parts)}}} and "
                f"lm_head), got {type(model).__name__}"
            )
        attn = inner.layers[0].self_attn
        if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")):
            raise ValueError(f"model: its attention ({type(attn).__name__}) has no q/k/v/o projections")
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.model, self.inner, self.rope = model, inner, apply_rotary_pos_emb
        self.head_dim = attn.head_dim

    def first_token(self, input_ids: torch.Tensor, cache=None) -> tuple[int, torch.Tensor]:
        """The greedy first new token of ``input_ids`` ([1, n]) and its logits (fp32 [vocab]).
        cache: a `KVTierCache` from ``kvt.cache(input_ids)``: its hit_tokens come from kvtier's
        blocks (none: the whole prompt is computed)."""
        logits = self.logits(input_ids, cache)
        return int(logits.argmax()), logits  # int(): the host waits for the GPU's token

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, cache=None) -> torch.Tensor:
        """The last position's logits (fp32 [vocab]), queued on the current stream: returns once
        the forward is launched, before the GPU has run it (`first_token` waits)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids: expected [1, n] (batch 1), got {tuple(input_ids.shape)}")
        hit = 0 if cache is None else cache.hit_tokens
        n = input_ids.shape[1]
        if not 0 <= hit < n:
            raise ValueError(f"cache: holds {hit} tokens of a {n}-token prompt; at least one must run")
        m, dev = n - hit, input_ids.device
        pos = torch.arange(hit, n, device=dev)[None]
        x = self.inner.embed_tokens(input_ids[:, hit:])
        cos, sin = self.inner.rotary_emb(x, pos)
        mask = None
        if hit:  # the tail's queries see the whole prefix and the tail up to themselves
            mask = torch.arange(n, device=dev)[None, :] <= pos[0, :, None]
        for i, layer in enumerate(self.inner.layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            q = att.q_proj(h).view(1, m, -1, self.head_dim).transpose(1, 2)
            k = att.k_proj(h).view(1, m, -1, self.head_dim).transpose(1, 2)
            v = att.v_proj(h).view(1, m, -1, self.head_dim).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            if hit:
                pk, pv = cache._arrive(i, k)  # waits for layer i's load event, then reads its blocks
                k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
            if k.shape[1] != q.shape[1]:  # grouped KV heads, expanded as transformers does (repeat_kv):
                g = q.shape[1] // k.shape[1]  # SDPA's flash / efficient kernels then apply at any length
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and m > 1,
                                               scale=att.scaling)  # fmt: skip
            x = x + att.o_proj(o.transpose(1, 2).reshape(1, m, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(self.inner.norm(x[:, -1:]))[0, -1].float()
