"""The `vllm` suite's `hybrid` rows: a hit's first token on a sliding-window model through the
connector's worker hooks, one store per KV cache group (`integrations.vllm.groups`), against
recomputing the prompt.

  ttft_hit hybrid <model> <n>   an n-token prefix hit from the host tier: start_load_kv of a
                                background load (one run per group: the full-attention group's
                                every chunk, the sliding-window group's units covering the window
                                before the hit's end) -> get_finished until every group's run
                                landed (vLLM schedules the request then) -> the loaded blocks
                                gathered per layer into the K/V tensors of transformers' cache
                                (the window layers' older positions, never read, stay zero) ->
                                the model's forward over the next token -> the first token on
                                the host

The model: transformers' Gemma3ForCausalLM with random weights (seeded) from a small config
(`MODELS`: five sliding-window layers to one full-attention layer, as Gemma 3's), bf16 on a GPU,
fp32 on the CPU (tiny). The KV the hit loads is the prompt's own, computed by a prefill and laid
out as vLLM 0.33 lays out each group (LBHNC views [blocks, kv_heads, tokens, K||V]), saved
through the worker's hooks first.

Params: ``speedup`` (recompute over hit, medians), hit_ms, recompute_ms, its parts (medians):
load_ms (start_load to get_finished), gather_ms (the rig's copy of the loaded blocks into
transformers' dense cache, which vLLM's attention does not need: it reads the blocks), forward_ms
(the next token's forward and its token on the host), ``forward``: on a GPU "cuda graph", the
one-token forward captured once at set-up over a cache whose K/V tensors the gathers write in
place, as vLLM runs a one-token step (a graphed decode step); "eager" on the CPU, or where the
capture failed (``graph_error``); ``graph_matches_eager``: at set-up, the graph's next-token
logits over the prompt's own KV have an eager forward's top token and lie within GRAPH_TOL of
them, relative to the largest (``graph_logits_diff``; ``eager_logits_diff``: two eager forwards'
own difference; None without a graph). The recompute is transformers' eager prefill: at 32K its
launches hide under its GPU time. ``first_token_match``
(the hit's first token is the recompute's, every run), loaded_mb per group; ``correct``: every
run loaded every chunk from the host with no failed receipt, every group's loaded blocks equal
its saved ones bit for bit, and a graph matches an eager forward. One warm-up and 3
timed runs (quick: 2), perf_counter, the device idle before each.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvtier.bench.stats import summarize
from kvtier.bench.suite import Context

BLOCK = 16
MODELS = {  # transformers Gemma3TextConfig fields; layer_types: 5 sliding to 1 full
    "gemma3-small": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        sliding_window=1024,
        max_position_embeddings=40960,
    ),
    "gemma3-tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=64,
        max_position_embeddings=4096,
    ),
}
GPU_TOKENS, CPU_TOKENS = (8192, 32768), (256,)
# The graph's next-token logits against an eager forward's over the same KV, as a share of the
# largest: a few bf16 steps at the top logit. Captured matmuls may take other cuBLAS algorithms.
GRAPH_TOL = 1e-2
IDLE_STEP_S = 0.0005  # an idle engine step's own time while the request waits for its load


def hybrid_rows(ctx: Context):
    """The `hybrid` family: per token count, one ttft_hit row (a skip without transformers)."""
    try:
        from transformers import Gemma3ForCausalLM  # noqa: F401
    except ImportError as exc:
        ctx.skip("ttft_hit hybrid", f"the sliding-window model needs transformers: {exc}")
        return
    name = "gemma3-small" if ctx.on_gpu else "gemma3-tiny"
    counts = GPU_TOKENS[:1] if ctx.on_gpu and ctx.quick else GPU_TOKENS if ctx.on_gpu else CPU_TOKENS
    for n in counts:
        rig = HybridRig(ctx, name, n)
        try:
            yield rig.row()
        finally:
            rig.close()
        if ctx.on_gpu:
            torch.cuda.empty_cache()


def attention_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention layer ``layer``'s keys and values in ``cache`` ([1, H, tokens, D] each): its layer
    object's, else the per-layer lists (``key_cache``, ``value_cache``) of older transformers."""
    layers = getattr(cache, "layers", None)
    if layers is not None and getattr(layers[layer], "keys", None) is not None:
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


class GroupRig:
    """What the hybrid rows' rigs share: a `WorkerSide` ``ws`` over one store per group, a
    `GroupPlan` ``plan``, the prompt's ``chunk_ids`` (``chunks`` of them); each rig names the
    block tables a hit loads into (`load_tables`)."""

    ctx: Context
    ws: object
    plan: object
    groups: list
    chunk_ids: list[bytes]
    chunks: int
    _tag: int

    def load_tables(self) -> list[list[int]]:
        raise NotImplementedError

    def _sync(self) -> None:
        self.ws.wait_submitted()  # the saver and loader threads queued what they were handed
        if self.ctx.on_gpu:
            torch.cuda.synchronize(self.ctx.device)
        else:
            self.ws.dev.synchronize()

    def load_meta(self):
        from kvtier.integrations.vllm.metadata import ChunkRun, KVTierMetadata

        self._tag += 1
        tag = self._tag

        def make(g, c0, ids, bids, skip):
            return ChunkRun("hit", ids, bids, skip, tag, True, ("host",) * len(ids), group=g)

        runs = self.plan.loads(self.chunk_ids, self.load_tables(), 0, self.chunks, make)
        for r in runs:
            r.parts = len(runs)
        return KVTierMetadata(loads=runs, step=self._tag + 1)

    def load(self) -> bool:
        """A hit's background load, as vLLM drives it, until get_finished reports it; whether every
        chunk of every group came from the host with no failed receipt."""
        ws, meta = self.ws, self.load_meta()
        ws.handle_preemptions(meta)
        ws.start_load(meta)  # background: the loader thread copies, the request waits
        ws.save(meta)  # wait_for_save: nothing to save
        while not (ws.finished(set())[1] or set()) & {"hit"}:  # vLLM polls get_finished each step
            time.sleep(IDLE_STEP_S)
        return not ws.failed_receipts() and ws.stats().get("miss_chunks", 0) == 0

    def measure(self) -> tuple:
        """The recompute's first token and timing, then the hits' on poisoned blocks: (first
        token, recompute Timing, hit Timing, each hit's first token, every hit loaded and
        every group's loaded blocks equal to their saved ones)."""
        want = self.recompute()
        reps = 2 if self.ctx.quick else 3
        rec = timed_runs(self.ctx, self.recompute, reps)
        self.poison()  # only the loads can make the hit's blocks right
        hits, firsts = [], []

        def once() -> None:
            tok, ok = self.hit()
            hits.append(ok)
            firsts.append(tok)

        t = timed_runs(self.ctx, once, reps, before=self._sync)
        self._sync()
        return want, rec, t, firsts, all(hits) and self.exact()

    def loaded_mb(self) -> dict[str, float]:
        """Per group kind, the MB a hit loads."""
        return {
            f"loaded_mb_{g.kind}": sum(len(r.ids) for r in self.load_meta().loads if r.group == i)
            * self.ws.stores[i].fmt.nbytes
            / 1e6
            for i, g in enumerate(self.groups)
        }

    def close(self) -> None:
        self.ws.shutdown()


class HybridRig(GroupRig):
    """Model ``name`` of `MODELS`, its groups' caches (each holding the n-token prefix twice: the
    blocks it was saved from, the blocks a hit loads into) and a `WorkerSide` over them."""

    def __init__(self, ctx: Context, name: str, n: int, *, chunk_tokens: int | None = None) -> None:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        from kvtier.integrations.vllm.groups import FULL, WINDOW, Group, GroupPlan
        from kvtier.integrations.vllm.settings import VllmSettings
        from kvtier.integrations.vllm.worker import WorkerSide

        self.ctx, self.name, self.n = ctx, name, n
        self.dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
        spec = MODELS[name]
        layers = spec["num_hidden_layers"]
        kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        cfg = Gemma3TextConfig(**spec, layer_types=kinds)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        self.model = Gemma3ForCausalLM(cfg).to(ctx.device, self.dtype).eval()
        self.window = spec["sliding_window"]
        names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        sw = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
        full = [i for i, k in enumerate(kinds) if k == "full_attention"]
        self.groups = [
            Group(0, WINDOW, BLOCK, tuple(names[i] for i in sw), "SlidingWindowSpec", window=self.window),
            Group(1, FULL, BLOCK, tuple(names[i] for i in full), "FullAttentionSpec"),
        ]
        self.members = [sw, full]  # model layer indices of each group, in its order
        self.where = [(0, sw.index(i)) if i in sw else (1, full.index(i)) for i in range(layers)]
        self.nblk = n // BLOCK
        self.src = list(range(1, self.nblk + 1))  # block 0: vLLM's null block
        self.dst = list(range(self.nblk + 1, 2 * self.nblk + 1))
        heads, c = spec["num_key_value_heads"], 2 * spec["head_dim"]
        self.caches = [
            torch.zeros(len(m), 2 * self.nblk + 1, heads, BLOCK, c, dtype=self.dtype, device=ctx.device)
            for m in self.members
        ]  # per group [L, B, H, N, K||V]: LBHNC
        views = {}
        for g, m in enumerate(self.members):
            for pos, layer in enumerate(m):
                views[names[layer]] = self.caches[g][pos]
        views = {k: views[k] for k in names}  # the model's layer order, as vLLM's dict
        self._dst_ids = torch.tensor(self.dst, device=ctx.device)
        self._src_ids = torch.tensor(self.src, device=ctx.device)
        ct = chunk_tokens or 16 * BLOCK
        self.chunks = n // ct
        block_bytes = sum(x.element_size() * x[0, 0].numel() * x.shape[0] for x in self.caches)
        per_chunk = block_bytes * (ct // BLOCK)  # every group's blocks of a chunk (an upper bound)
        # Twice the chunks' bytes: each group's share of the pool holds every chunk it saves (a
        # host tier keeps an eighth of its pool free), so the hit finds every one.
        s = VllmSettings(chunk_tokens=ct, host_bytes=2 * (self.chunks + 8) * per_chunk, layerwise=False)
        self.ws = WorkerSide(
            s, f"hybrid-{name}", order="LBHNC", block_size=BLOCK, groups=self.groups, tiers=[]
        )
        self.ws.register(views)
        self.plan = GroupPlan(self.groups, ct)
        g = torch.Generator().manual_seed(n)
        self.ids = torch.randint(1, spec["vocab_size"], (1, n + 1), generator=g).to(ctx.device)
        self.chunk_ids = [f"{name}:{n}:{i}".encode() for i in range(self.chunks)]
        self._tag = 0
        self.phases: list[tuple[float, float, float]] = []  # per hit: load, gather, forward (ms)
        self._fill_and_save()
        self.first = self.plan.groups[0].first_needed(self.chunks, self.plan.bpcs[0])
        self.next_ids = self.ids[:, n:].clone()  # the next token: a graph's fixed input
        self.graph, self.graph_error, self.graph_matches_eager = None, None, None
        self.graph_diff = self.eager_diff = None
        self.cache = self._prefix_cache()
        self.kv = self._layers_kv()  # the prefix's K/V the gathers write (a graph's fixed input)
        if ctx.on_gpu:
            self._capture()

    # -- set-up ----------------------------------------------------------------------------------

    @torch.no_grad()
    def _fill_and_save(self) -> None:
        """The prompt's own KV of its first n tokens into the source blocks, saved through the
        hooks; then every chunk held by the hosts."""
        from transformers import DynamicCache

        from kvtier.integrations.vllm.metadata import ChunkRun, KVTierMetadata

        cache = DynamicCache()
        self.model(self.ids[:, : self.n], past_key_values=cache, use_cache=True)
        src = torch.tensor(self.src, device=self.ctx.device)
        for g, m in enumerate(self.members):
            for pos, layer in enumerate(m):
                lay = cache.layers[layer]
                kv = torch.cat([lay.keys, lay.values], -1)[0]  # [H, n, K||V]
                pages = kv.view(kv.shape[0], self.nblk, BLOCK, -1).permute(1, 0, 2, 3)
                self.caches[g][pos][src] = pages
        _, runs = self.plan.saves(
            self.chunk_ids, [self.src, self.src], 0, 0, lambda g, ids, b: ChunkRun("save", ids, b, group=g)
        )
        self.ws.save(KVTierMetadata(saves=runs, release={"save"}, step=1))
        self._sync()
        self.ws.finished(set())  # the saves settled: their chunks held

    def _prefix_cache(self):
        """transformers' cache of an n-token prefix, zeros: the hits' gathers write its K/V."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer, (g, _) in enumerate(self.where):
            _, _, heads, _, c = self.caches[g].shape
            z = torch.zeros(1, heads, self.n, c // 2, dtype=self.dtype, device=self.ctx.device)
            cache.update(z, z, layer)  # copies: each layer's keys and values are its own
        return cache

    def _gather(self, ids: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Blocks ``ids`` of every layer into its dense keys and values ``kv`` (a window layer's
        from the first block its window reads)."""
        for layer, (keys, values) in enumerate(kv):
            g, pos = self.where[layer]
            lo = self.first if g == 0 else 0
            blocks = self.caches[g][pos].index_select(0, ids[lo:])  # [blocks, H, N, K||V]
            d = blocks.shape[-1] // 2
            for dense, part in ((keys, blocks[..., :d]), (values, blocks[..., d:])):
                dense[0, :, lo * BLOCK :].unflatten(1, (-1, BLOCK)).copy_(part.permute(1, 0, 2, 3))

    def _layers_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [attention_kv(self.cache, i) for i in range(len(self.where))]

    def _copy_cache(self):
        """A cache of its own holding the prefix's K/V as they are now (an eager forward grows it)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer, (keys, values) in enumerate(self.kv):
            cache.update(keys, values, layer)  # copies
        return cache

    @torch.no_grad()
    def _capture(self) -> None:
        """The next token's forward as a CUDA graph over the cache's K/V tensors (first-use work,
        here at set-up); then its logits over the prompt's own KV against an eager forward's."""
        dev = self.ctx.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))  # the cache's zeros are written first
        with torch.cuda.stream(side):
            for _ in range(2):  # kernel choice and workspaces before the capture, on a side stream
                self.model(self.next_ids, past_key_values=self._copy_cache(), use_cache=True)
        torch.cuda.current_stream(dev).wait_stream(side)  # the warm-up's reads end before capture
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.out = self.model(self.next_ids, past_key_values=self.cache, use_cache=True).logits
        except Exception as exc:  # a forward the graph cannot hold: the row runs it eager
            self.graph_error = repr(exc)[:300]
            torch.cuda.synchronize(dev)  # the failed capture's stream state settles
            self.cache = self._prefix_cache()  # the capture may have grown some layers
            self.kv = self._layers_kv()
            return
        self.graph = graph
        self._gather(self._src_ids, self.kv)
        graph.replay()
        graphed = self.out[0, -1].float()
        eager = [self._eager()[0, -1].float() for _ in range(2)]
        scale = float(eager[0].abs().max())
        self.graph_diff = float((graphed - eager[0]).abs().max()) / scale
        self.eager_diff = float((eager[1] - eager[0]).abs().max()) / scale
        same_token = int(graphed.argmax()) == int(eager[0].argmax())
        self.graph_matches_eager = same_token and self.graph_diff <= GRAPH_TOL
        for layer, (keys, values) in enumerate(self.kv):
            lo = self.first if self.where[layer][0] == 0 else 0  # below it: zeros, never read
            keys[0, :, lo * BLOCK :] = -7.0  # only a hit's gather can make the graph's input right
            values[0, :, lo * BLOCK :] = -7.0

    def _forward(self) -> torch.Tensor:
        """The next token's logits over the cache: the graph's replay, else an eager forward."""
        if self.graph is not None:
            self.graph.replay()
            return self.out
        return self._eager()

    def _eager(self) -> torch.Tensor:
        return self.model(self.next_ids, past_key_values=self._copy_cache(), use_cache=True).logits

    # -- the row ---------------------------------------------------------------------------------

    @torch.no_grad()
    def recompute(self) -> int:
        return int(self.model(self.ids).logits[0, -1].argmax())

    def load_tables(self) -> list[list[int]]:
        return [self.dst, self.dst]

    @torch.no_grad()
    def hit(self) -> tuple[int, bool]:
        """One hit: (its first token, every chunk of every group delivered from the host)."""
        t0 = time.perf_counter()
        ok = self.load()
        t1 = time.perf_counter()
        self._gather(self._dst_ids, self.kv)
        if self.ctx.on_gpu:
            torch.cuda.synchronize(self.ctx.device)  # the gather's kernels are timed as the gather
        t2 = time.perf_counter()
        tok = int(self._forward()[0, -1].argmax())
        t3 = time.perf_counter()
        self.phases.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))
        return tok, ok

    def exact(self) -> bool:
        """Every group's blocks a hit loads equal, bit for bit, the blocks they were saved from."""
        for g, cache in enumerate(self.caches):
            lo = self.first if g == 0 else 0
            a = cache[:, self.dst[lo:]].contiguous().view(torch.uint8)
            b = cache[:, self.src[lo:]].contiguous().view(torch.uint8)
            if not torch.equal(a, b):
                return False
        return True

    def poison(self) -> None:
        for cache in self.caches:
            cache[:, self.dst] = torch.tensor(-7.0, dtype=self.dtype)

    def row(self):
        want, rec, t, firsts, ok = self.measure()
        timed = self.phases[1:]  # the warm-up's left out, as in t
        load_ms, gather_ms, forward_ms = (statistics.median(p[i] for p in timed) for i in range(3))
        mb = self.loaded_mb()
        nbytes = int(sum(mb.values()) * 1e6)
        link = "h2d_pinned" if self.ctx.on_gpu else "host_memcpy"
        return self.ctx.row(
            f"ttft_hit hybrid {self.name} {self.n}",
            max(nbytes, 1),
            t,
            link,
            correct=ok and self.graph_matches_eager is not False,
            model=self.name,
            prefix_tokens=self.n,
            window=self.window,
            chunk_tokens=self.plan.ct,
            hit_ms=t.median_ms,
            recompute_ms=rec.median_ms,
            speedup=rec.median_ms / t.median_ms,
            first_token_match=all(f == want for f in firsts),
            load_ms=load_ms,
            gather_ms=gather_ms,
            forward_ms=forward_ms,
            forward="cuda graph" if self.graph is not None else "eager",
            graph_matches_eager=self.graph_matches_eager,
            graph_logits_diff=self.graph_diff,
            eager_logits_diff=self.eager_diff,
            **({"graph_error": self.graph_error} if self.graph_error else {}),
            path="hit: background load per group, then transformers' forward of the next token",
            **mb,
        )


def timed_runs(ctx: Context, once, reps: int, before=None):
    """One warm-up and ``reps`` timed runs of once(); their Timing (perf_counter)."""
    samples = []
    for i in range(1 + reps):
        if before is not None:
            before()
        if ctx.on_gpu:
            torch.cuda.synchronize(ctx.device)  # earlier GPU work must not be billed to this run
        t0 = time.perf_counter()
        once()
        if ctx.on_gpu:
            torch.cuda.synchronize(ctx.device)
        if i:
            samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples, "perf_counter")
