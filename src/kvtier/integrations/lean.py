"""A lean forward of kvtier's own over a transformers Llama-architecture model: the first token of a
prompt, with its prefix KV read from kvtier's paged blocks when there is a hit.

transformers' `generate` spends tens of milliseconds of host time on any forward of an 8B model
(eager launches through its attention, mask and cache machinery), however little the forward
computes: a host hit's first token cannot come sooner than that, while serving engines (vLLM,
SGLang) run the same forward in a few ms. `LeanRunner` calls only the model's own submodules
(embedding, norms, projections, MLP, rotary embedding) and SDPA, so a hit costs the load and the
tail's arithmetic, and a recompute the prefill's: like against like.

    lean = LeanRunner(model)
    token, logits = lean.first_token(ids)                          # recompute the whole prompt
    cache = kvt.cache(ids)                                         # a hit: loads start
    token, logits = lean.first_token(ids, cache)                   # layer i waits for its load
    cache.finish(None)

Batch 1, greedy, full attention (what `KVTier.for_model` accepts). With a cache, layer i reads the
loaded prefix after the wait on layer i's load event, and the reads are noted for later loads into
those blocks (`KVTierCache._read`), exactly as attention inside `generate` does.

A hit's forward on CUDA runs as CUDA graphs, one per layer (``graphs=True``, the default there):
even eager launches alone cost more host time than the copy of an 8K prefix. The host queues, per
layer, the wait for its load event and the replay of its graph, so compute still starts layer i as
soon as layer i has landed. The first hit of each (prefix, prompt length) shape runs eagerly and
captures its graphs after; later hits of that shape replay them (`Pieces` below). Attention over a
prefix is flash attention with the causal diagonal at the bottom right over the grouped K/V heads
where torch offers it (`gqa_flash`), else the heads expanded and a boolean mask.
"""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvtier.integrations.hf import gather_blocks

# A split's front up to this many tokens runs as one CUDA graph (`prefill_kv`): there its eager
# launches (~1,000 for 32 layers) take the host longer than the GPU takes to compute it, and the
# host is what the load beside it and the tail after it wait for. Past it the GPU bounds the
# front and a graph would only hold the activations of a long prompt in its memory pool.
FRONT_GRAPH_TOKENS = 4096


class LeanRunner:
    def __init__(self, model, graphs: bool | None = None) -> None:
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
        dev = next(model.parameters()).device
        self.graphs = dev.type == "cuda" if graphs is None else bool(graphs)
        self.pieces: dict[tuple, object] = {}  # (KVTier, front, hit, n, blocks) -> Pieces; clear() frees
        self.fronts: dict[int, FrontGraph] = {}  # tokens -> the graphed forward of a split's front
        self.captures, self.capture_s = 0, 0.0  # shapes captured as CUDA graphs so far, seconds spent
        self.gqa_flash: bool | None = None  # None: not tried yet

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
        loaded = 0 if cache is None else cache.hit_tokens
        front = getattr(cache, "front_kv", None)  # a split's [0, s), computed by prefill_kv
        if front is None and getattr(cache, "front", 0):
            raise ValueError("cache: a split whose front the model computed: use split_first_token")
        hit, n = loaded + front_tokens(cache), input_ids.shape[1]
        if not 0 <= hit < n:
            raise ValueError(f"cache: holds {hit} tokens of a {n}-token prompt; at least one must run")
        if loaded and self.graphs and hasattr(cache, "_read"):
            return self._graphed(input_ids, cache)
        m = n - hit
        x, cos, sin = self.embed(input_ids[:, hit:], torch.arange(hit, n, device=input_ids.device)[None])
        mask = self.tail_mask(hit, m, input_ids.device)
        for i in range(len(self.inner.layers)):
            prefix = partial(self._prefix, cache, front, i, x) if hit else None
            x = self.layer(i, x, cos, sin, prefix, mask)
        return self.head(x)

    @staticmethod
    def _prefix(cache, front, i: int, like: torch.Tensor):
        """Layer i's (K, V) before the tail: a split's front, then what was loaded."""
        if cache.hit_tokens:
            k, v = cache._arrive(i, like)  # a hit: waits for layer i's load event, then reads its blocks
            if front is None:
                return k, v
            return torch.cat([front[i][0], k], 2), torch.cat([front[i][1], v], 2)
        return front[i]

    @torch.no_grad()
    def prefill_kv(self, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (K, V) of ``input_ids`` ([1, s], positions 0..s-1), queued on the current stream.

        With graphs, up to `FRONT_GRAPH_TOKENS` tokens: the first call of each length runs eagerly
        and captures one CUDA graph of the whole forward; later calls of that length replay it and
        return its static buffers, rewritten by the next call of the same length (on the same
        stream, so work queued before that call still reads this call's K/V)."""
        s = input_ids.shape[1]
        if not (self.graphs and input_ids.is_cuda and s <= FRONT_GRAPH_TOKENS):
            return self._prefill_kv(input_ids)
        front = self.fronts.get(s)
        if front is None:
            out = self._prefill_kv(input_ids)
            t0 = time.perf_counter()
            self.fronts[s] = FrontGraph(self, input_ids)
            self.captures, self.capture_s = self.captures + 1, self.capture_s + time.perf_counter() - t0
            return out
        return front.run(input_ids)

    def _prefill_kv(self, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, cos, sin = self.embed(input_ids, torch.arange(input_ids.shape[1], device=input_ids.device)[None])
        keep: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(len(self.inner.layers)):
            x = self.layer(i, x, cos, sin, keep=keep)
        return keep

    def split_first_token(self, kvt, input_ids: torch.Tensor, split_tokens: int):
        """A split hit of ``input_ids`` ([1, n], on the model's device; `hf_split.split_cache`):
        [0, s) computed here while [s, n) loads on a thread, then the tail over both.
        Returns (token, logits, cache); ``cache.finish(None)`` gives the blocks back."""
        from kvtier.integrations.hf_split import split_cache

        cache = split_cache(kvt, self.model, input_ids, split_tokens, front=self.prefill_kv)
        try:
            tok, logits = self.first_token(input_ids, cache)
        except BaseException:
            cache.finish(None)  # the blocks go back; the loads land first
            raise
        return tok, logits, cache

    def embed(self, ids: torch.Tensor, pos: torch.Tensor):
        x = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(x, pos)
        return x, cos, sin

    def tail_mask(self, hit: int, m: int, device) -> torch.Tensor | None:
        """The tail's queries see the whole prefix and the tail up to themselves (None: no prefix)."""
        if not hit:
            return None
        pos = torch.arange(hit, hit + m, device=device)
        return torch.arange(hit + m, device=device)[None, :] <= pos[:, None]

    def layer(self, i: int, x, cos, sin, prefix=None, mask=None, keep=None) -> torch.Tensor:
        """Decoder layer i over x [1, m, hidden]; prefix(): the (K, V) of the tokens before x;
        keep: a list to append x's own (K, V) to."""
        layer = self.inner.layers[i]
        att, m = layer.self_attn, x.shape[1]
        h = layer.input_layernorm(x)
        q = att.q_proj(h).view(1, m, -1, self.head_dim).transpose(1, 2)
        k = att.k_proj(h).view(1, m, -1, self.head_dim).transpose(1, 2)
        v = att.v_proj(h).view(1, m, -1, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, k, cos, sin)
        if keep is not None:
            keep.append((k, v))
        if prefix is not None:
            pk, pv = prefix()  # a hit: waits for layer i's load event, then reads its blocks
            k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
        o = self.attend(q, k, v, mask, att.scaling)
        x = x + att.o_proj(o.transpose(1, 2).reshape(1, m, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def attend(self, q, k, v, mask, scale) -> torch.Tensor:
        m, n = q.shape[2], k.shape[2]
        if mask is not None and q.is_cuda and self.gqa_flash is not False:
            # Flash attention with the causal diagonal at the bottom right (the tail's queries
            # end the keys) reads the grouped K/V heads as they are: no mask, no repeat.
            try:
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=causal_lower_right(m, n), scale=scale, enable_gqa=True
                )
                self.gqa_flash = True
                return o
            except (RuntimeError, TypeError):
                if self.gqa_flash:  # it ran before: this is a real error
                    raise
                self.gqa_flash = False  # this torch cannot: expand the heads and pass the mask
        if k.shape[1] != q.shape[1]:  # grouped KV heads, expanded as transformers does (repeat_kv):
            g = q.shape[1] // k.shape[1]  # SDPA's flash / efficient kernels then apply at any length
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and m > 1, scale=scale
        )

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.inner.norm(x[:, -1:]))[0, -1].float()

    def _graphed(self, input_ids: torch.Tensor, cache) -> torch.Tensor:
        key = (cache.owner, front_tokens(cache), cache.hit_tokens, input_ids.shape[1], len(cache.blocks))
        pieces = self.pieces.get(key)
        if pieces is None:  # a new shape: this hit runs its steps eagerly, then they are captured
            pieces = Pieces(self, cache, input_ids)
            out = pieces.run(cache, input_ids)
            if input_ids.is_cuda:
                t0 = time.perf_counter()
                pieces.capture()
                self.captures, self.capture_s = self.captures + 1, self.capture_s + time.perf_counter() - t0
            self.pieces[key] = pieces
            return out
        return pieces.run(cache, input_ids)


def front_tokens(cache) -> int:
    """Tokens of a split's front computed by `LeanRunner.prefill_kv` (0: none)."""
    front = getattr(cache, "front_kv", None)
    return front[0][0].shape[2] if front else 0


class Pieces:
    """A hit's tail forward through `LeanRunner` as CUDA graphs, one per step: the embedding, each
    decoder layer (its prefix read from kvtier's blocks included), the final norm and lm_head.

    Per hit the host queues on the compute stream: the copy of the tail's token ids and the hit's
    block ids into static inputs, the embedding's replay, then per layer the wait for that layer's
    load event and its replay (`KVTierCache._read`), then the head's replay: ~35 launches instead of
    ~1,200, and compute still starts layer i as soon as layer i has landed. Graphs are captured per
    (KVTier, split front, loaded prefix, prompt length, block count): they hold the addresses of the
    KVTier's pages. A split's front (`LeanRunner.split_first_token`) is copied into static buffers
    per hit, before each layer's replay.
    On a CPU device the same steps run through the same static inputs without capture (tested there).
    """

    def __init__(self, runner, cache, input_ids: torch.Tensor) -> None:
        front = getattr(cache, "front_kv", None)  # a split: [0, s) computed by the runner
        hit = cache.hit_tokens + front_tokens(cache)
        n, dev = input_ids.shape[1], input_ids.device
        self.runner, self.owner, self.hit = runner, cache.owner, hit
        # A split's front, copied in per hit (its tensors are the request's own, not static).
        self.front = [(torch.empty_like(k), torch.empty_like(v)) for k, v in front] if front else None
        self.num_layers = len(runner.inner.layers)
        # Static inputs, rewritten per hit in stream order (after the previous hit's replays read them).
        self.ids = torch.zeros(1, n - hit, dtype=torch.long, device=dev)
        self.blocks = torch.zeros(len(cache.blocks), dtype=torch.long, device=dev)
        self.pos = torch.arange(hit, n, device=dev)[None]
        self.mask = runner.tail_mask(hit, n - hit, dev)
        self.x: list[torch.Tensor | None] = [None] * (self.num_layers + 1)  # x[i]: layer i's input
        self.cos = self.sin = self.out = None
        self.steps = [self._embed] + [partial(self._layer, i) for i in range(self.num_layers)] + [self._head]
        self.graphs: list[torch.cuda.CUDAGraph] | None = None

    def _embed(self) -> None:
        self.x[0], self.cos, self.sin = self.runner.embed(self.ids, self.pos)

    def _layer(self, i: int) -> None:
        x = self.x[i]
        self.x[i + 1] = self.runner.layer(
            i, x, self.cos, self.sin, partial(self._prefix, i, x.dtype), self.mask
        )

    def _prefix(self, i: int, dtype: torch.dtype):
        k, v = gather_blocks(self.owner.kv, i, self.blocks, dtype)
        if self.front is None:
            return k, v
        return torch.cat([self.front[i][0], k], 2), torch.cat([self.front[i][1], v], 2)

    def _layer_step(self, front_kv, i: int) -> None:
        if self.front is not None:  # queued after the front's forward on this stream
            self.front[i][0].copy_(front_kv[i][0])
            self.front[i][1].copy_(front_kv[i][1])
        self._step(i + 1)

    def _head(self) -> None:
        self.out = self.runner.head(self.x[-1])

    @torch.no_grad()  # a CPU device runs steps on its stream's thread, outside the caller's no_grad
    def _step(self, j: int) -> None:
        if self.graphs is None:
            self.steps[j]()
        else:
            self.graphs[j].replay()

    def run(self, cache, input_ids: torch.Tensor) -> torch.Tensor:
        """The last position's logits of this hit, queued on the compute stream."""
        o, tail = cache.owner, input_ids[:, self.hit :]
        blocks = torch.as_tensor(cache.blocks, dtype=torch.long)

        def embed() -> None:
            self.ids.copy_(tail)
            # non_blocking from pageable memory: the driver has staged `blocks` when copy_ returns.
            self.blocks.copy_(blocks, non_blocking=True)
            self._step(0)

        o.device.launch(embed, o.compute)
        for i in range(self.num_layers):
            cache._read(
                i, partial(self._layer_step, cache.front_kv if self.front else None, i)
            )  # after its load
        out: list[torch.Tensor] = []

        def head() -> None:
            self._step(self.num_layers + 1)
            out.append(self.out.clone())  # the next hit's replay rewrites self.out

        o.device.launch(head, o.compute)
        if input_ids.device.type == "cpu":
            o.compute.record("lean-logits").synchronize()  # a CPU device runs the steps on its own thread
        return out[0]

    def capture(self) -> None:
        """Capture every step as a CUDA graph (`capture_steps`)."""
        # The eager hit that built these pieces has run: its loads landed, its blocks are still
        # held by its cache, so the warm-up reads the right bytes and races no load.
        self.graphs = capture_steps(self.steps)


@torch.no_grad()
def capture_steps(steps) -> list:
    """One CUDA graph per step of ``steps`` (callables), in one memory pool, to be replayed in
    the same order; each step runs once first, as a warm-up on a side stream, as torch asks."""
    torch.cuda.synchronize()  # what ran before (an eager hit, its loads) is done before the warm-up
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the warm-up reads inputs written on the caller's stream
    with torch.cuda.stream(side):
        for step in steps:
            step()
    torch.cuda.synchronize()  # the warm-up is done before its buffers are captured over
    pool, graphs = torch.cuda.graph_pool_handle(), []
    for step in steps:
        g = torch.cuda.CUDAGraph()
        # thread_local: the store's threads (a reader, the reaper) keep calling CUDA meanwhile.
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            step()
        graphs.append(g)
    return graphs


class FrontGraph:
    """`LeanRunner.prefill_kv` over a fixed number of tokens as one CUDA graph: static token ids
    in, static per-layer (K, V) out. Captured from a warm-up on a side stream, as torch asks."""

    @torch.no_grad()
    def __init__(self, runner: LeanRunner, input_ids: torch.Tensor) -> None:
        self.ids = input_ids.clone()
        torch.cuda.synchronize()  # the eager call before has run: nothing of it is captured over
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())  # the warm-up reads ids written on the caller's stream
        with torch.cuda.stream(side):
            runner._prefill_kv(self.ids)
        torch.cuda.synchronize()  # the warm-up is done before its buffers are captured over
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the store's threads (a reader, the reaper) keep calling CUDA meanwhile.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.kv = runner._prefill_kv(self.ids)

    def run(self, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.ids.copy_(input_ids)  # in stream order: the previous replay has read the ids before
        self.graph.replay()
        return self.kv
