"""The `vllm` suite's rows beside a Llama forward: the connector's worker hooks (a `Replay` of
`vllm.py`) around the model's own layers, run by `integrations.lean.LeanRunner` (the model's
submodules and SDPA, no transformers' per-forward host cost). The model: `llama_rig.build_llama`
with random weights, the Llama-3-8B shape in bf16 on a GPU (a tiny Llama of the suite's tiny KV
shape on the CPU).

  ttft_hit <order> <n>          time to first token of an n-token prefix hit from the host tier:
                                handle_preemptions -> bind -> start_load_kv -> per layer
                                (wait_for_layer_load -> the layer over the NEW new tokens:
                                projections, SDPA over the layer's K, V gathered for the request's
                                blocks from vLLM's 4-D view of that layer [blocks, heads, tokens,
                                K||V] in logical order, MLP -> save_kv_layer, a no-op in kvtier)
                                -> wait_for_save -> get_finished ... -> the first token on the host;
                                on a GPU the forward's steps replay CUDA graphs (`GraphedTail`),
                                as vLLM replays its compiled forward, the hooks between them
  ttft_recompute <n>            the same model's prefill of all n + NEW tokens, to the first token
                                (one row per n: no cache, so no layout order)
  forward_beside_save <order>   a FORWARD-token prefill while the connector saves the smallest
                                request's chunks (1 GiB at 8K tokens) beside it vs the same
                                prefill alone; the row's GB/s is the save's during the prefill

TTFT: perf_counter from the first hook to the token on the host, one warm-up and 3 timed runs
(quick: 2), the device idle before each. Hit params: hit_ms, recompute_ms, recompute_over_hit
(recompute / hit), tail_ms (the same graphed forward alone, every layer in place: what a
hit costs past its load), new_tokens; `correct`: every run hit every chunk in the host tier and the
loaded blocks equal the saved ones bit for bit. The cache holds normal(0, 1) values for these
rows (random bits would put NaNs into the attention). forward_beside_save: device events on the
compute stream around each prefill (its own first kernel to its last) and on the save stream
after the save's copies; one warm-up and 8 timed pairs (quick: 3), alone and beside interleaved.
Params: forward_ms_alone, forward_ms_beside (medians), slowdown_pct, save_ms_beside,
save_gbps_beside, overlap_pct (the share of the save inside the prefill's span).
"""

from __future__ import annotations

import time
from functools import partial

import torch

from kvtier.bench.stats import summarize
from kvtier.bench.suite import Context

NEW, FORWARD = 64, 2048  # CPU: 16 and 256


class PagedPrefix:
    """A hit's prefix as vLLM's attention reads it: per layer, that layer's K and V of the
    request's first `blocks` blocks (default: all of them) gathered from the 4-D view vLLM hands
    the connector; saved=True reads the blocks the KV was saved from (`r.src`) instead of those it
    was loaded into (`r.dst`)."""

    def __init__(self, r, blocks: int | None = None, *, saved: bool = False):
        self.r = r
        blocks = r.blocks if blocks is None else blocks
        self.hit_tokens = blocks * r.kv.block_size
        # Made once, before any timed run: a device tensor made from a list waits for the stream.
        self.ids = torch.tensor((r.src if saved else r.dst)[:blocks], device=r.ctx.device)

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V of the request's blocks, queued on the current stream."""
        view = self.r.cache[layer].permute(1, 0, 2, 3)  # [H, blocks, N, C]
        kv = view[:, self.ids]  # one gather of the request's blocks
        kv = kv.reshape(1, kv.shape[0], -1, kv.shape[-1])  # [1, H, tokens, K||V]
        d = kv.shape[-1] // 2
        return kv[..., :d], kv[..., d:]


class GraphedTail:
    """A hit's forward over the new tokens the way vLLM runs it, compiled: CUDA graphs, one per
    step (the embedding, each decoder layer with its read of the prefix from vLLM's view, the final
    norm and lm_head), the connector's hook between them on the host: per layer,
    wait_for_layer_load, then that layer's replay. ~35 launches a hit instead of ~1,200 eager ones.
    The first hit runs the steps eagerly and captures them after; on a CPU device the same steps
    run eagerly through the same static inputs."""

    def __init__(self, lean, prefix: PagedPrefix, ids: torch.Tensor) -> None:
        hit, n, dev = prefix.hit_tokens, ids.shape[1], ids.device
        self.lean, self.prefix, self.hit = lean, prefix, hit
        self.ids = ids[:, hit:].clone()  # static input: rewritten per hit in stream order
        self.pos = torch.arange(hit, n, device=dev)[None]
        self.mask = lean.tail_mask(hit, n - hit, dev)
        self.layers = len(lean.inner.layers)
        self.x: list[torch.Tensor | None] = [None] * (self.layers + 1)
        self.cos = self.sin = self.out = None
        self.steps = [self._embed] + [partial(self._layer, i) for i in range(self.layers)] + [self._head]
        self.graphs: list | None = None

    def _embed(self) -> None:
        self.x[0], self.cos, self.sin = self.lean.embed(self.ids, self.pos)

    def _layer(self, i: int) -> None:
        self.x[i + 1] = self.lean.layer(
            i, self.x[i], self.cos, self.sin, partial(self.prefix.gather, i), self.mask
        )

    def _head(self) -> None:
        self.out = self.lean.head(self.x[-1])

    def _step(self, j: int) -> None:
        if self.graphs is None:
            self.steps[j]()
        else:
            self.graphs[j].replay()

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The last position's logits of this hit, queued on the compute stream."""
        r = self.prefix.r
        self.ids.copy_(ids[:, self.hit :])  # in stream order: the previous hit's replays read it before
        self._step(0)
        for i in range(self.layers):
            r.ws.wait_layer(r.names[i])  # wait_for_layer_load: layer i must not read blocks still landing
            if not r.ctx.on_gpu:
                r.dev.current_stream().synchronize()  # the host reads the layer next: its copies landed
            self._step(i + 1)
        self._step(self.layers + 1)
        return self.out.clone()  # the next hit's replay rewrites self.out

    def capture(self) -> None:
        """Capture every step as a CUDA graph (`lean.capture_steps`)."""
        from kvtier.integrations.lean import capture_steps

        # The eager hit before has run and its loads landed: the warm-up reads settled blocks.
        self.graphs = capture_steps(self.steps)


class Forward:
    """The model, its lean forward and the prompts, made once per suite run; the recompute
    timings per prefix length (`recompute_rows`)."""

    def __init__(self, ctx: Context, shape: dict):
        from kvtier.bench.llama_rig import build_llama
        from kvtier.integrations.lean import LeanRunner

        self.ctx, self.shape = ctx, shape
        over = {} if ctx.on_gpu else {"head_dim": shape["D"]}  # the tiny Llama of the tiny KV shape
        self.model = build_llama("llama-3-8b" if ctx.on_gpu else "tiny", ctx.device, shape["dtype"], **over)
        cfg, attn = self.model.config, self.model.model.layers[0].self_attn
        got = (cfg.num_hidden_layers, cfg.num_key_value_heads, attn.head_dim)
        if got != (shape["L"], shape["H"], shape["D"]):
            raise ValueError(f"the model's KV shape (L, H, D) = {got} is not the suite's {shape}")
        self.preset = "llama-3-8b" if ctx.on_gpu else "tiny"
        self.lean = LeanRunner(self.model, graphs=False)  # its own graphs: none (GraphedTail graphs a hit)
        self.new, self.forward_tokens = (NEW, FORWARD) if ctx.on_gpu else (16, 256)
        self.warmup, self.reps = 1, 2 if ctx.quick else 3
        self.pairs = 3 if ctx.quick else 8
        self.link = "h2d_pinned" if ctx.on_gpu else "host_memcpy"
        self.recompute: dict[int, float] = {}  # n -> median ms
        self._prompts: dict[int, torch.Tensor] = {}

    def prompt(self, tokens: int) -> torch.Tensor:
        if tokens not in self._prompts:
            g = torch.Generator().manual_seed(tokens)
            ids = torch.randint(1, self.model.config.vocab_size, (1, tokens), generator=g)
            self._prompts[tokens] = ids.to(self.ctx.device)
        return self._prompts[tokens]

    def kv_bytes(self, n: int) -> int:
        s = self.shape
        return n * s["L"] * s["H"] * 2 * s["D"] * s["dtype"].itemsize

    def params(self, n: int) -> dict:
        return dict(model=self.preset, prefix_tokens=n, new_tokens=self.new, runs=self.reps)

    def _runs(self, name: str, once, before=None):
        """One warm-up and `reps` timed runs of once() -> seconds; their Timing (perf_counter)."""
        if self.ctx.on_progress:
            self.ctx.on_progress(name)
        samples = []
        for i in range(self.warmup + self.reps):
            if before is not None:
                before()
            if self.ctx.on_gpu:
                torch.cuda.synchronize(self.ctx.device)  # earlier GPU work must not be billed to this run
            s = once()
            if i >= self.warmup:
                samples.append(s * 1e3)
        return summarize(samples, "perf_counter")

    # -- time to first token, hit vs recompute --------------------------------------------------

    def recompute_rows(self, n: int):
        """The row of recomputing an n-token prefix, once per n."""
        if n in self.recompute:
            return
        ids = self.prompt(n + self.new)

        def once() -> float:
            t0 = time.perf_counter()
            self.lean.first_token(ids)  # int(): the host has the token, so the GPU made it
            return time.perf_counter() - t0

        t = self._runs(f"vllm/ttft_recompute/{n}", once)
        self.recompute[n] = t.median_ms
        p = self.params(n) | {"path": "recompute: LeanRunner prefill of every token"}
        yield self.ctx.row(f"ttft_recompute {n} tokens", self.kv_bytes(n), t, self.link, **p)

    def hit_row(self, r, label: str, params: dict, name: str = "ttft_hit"):
        """The first token of a hit of the request's chunks from the host tier (`r` holds them);
        tail_ms: the same forward alone, every layer already in place (no load)."""
        n = r.blocks * r.kv.block_size
        yield from self.recompute_rows(n)
        r.settle()  # the host drops the earlier rows' chunks: the copies reading them have landed
        r.cache.normal_()  # finite KV: random bits would make the attention NaN
        r.step(r.meta(save=True))  # the chunks the hit loads, held by the host tier
        r.settle_saves()  # a load must not read a slot its save is still filling
        ids, prefix, load = self.prompt(n + self.new), PagedPrefix(r), r.meta(load=True)
        tail = GraphedTail(self.lean, prefix, ids)
        hits = []

        def once() -> float:
            t0 = time.perf_counter()
            logits, hit = self.hit(r, ids, tail, load)
            int(logits.argmax())  # the host has the token, so the GPU made it
            dt = time.perf_counter() - t0
            hits.append(hit)
            if self.ctx.on_gpu and tail.graphs is None:
                r.sync()  # the eager warm-up hit's loads landed: the capture reads settled blocks
                tail.capture()
            return dt

        t = self._runs(f"vllm/{name}/{label}", once, before=r.sync)  # no run's copies overlap the next
        r.sync()  # the last hit's loads landed before the blocks are compared
        ok = all(hits) and r.exact()
        r.ws.finished(set())  # the landed loads settle: the tail alone waits for none

        def alone() -> float:
            t0 = time.perf_counter()
            int(tail.logits(ids).argmax())
            return time.perf_counter() - t0

        tail_t = self._runs(f"vllm/{name}/{label}/tail", alone)
        rec = self.recompute[n]
        times = dict(
            hit_ms=t.median_ms,
            tail_ms=tail_t.median_ms,
            recompute_ms=rec,
            recompute_over_hit=rec / t.median_ms,
        )
        p = params | self.params(n) | times | {"path": "hit: the hooks + LeanRunner over the new tokens"}
        yield self.ctx.row(f"{name} {label}", r.nbytes, t, self.link, correct=ok, **p)

    def hit(self, r, ids: torch.Tensor, tail: GraphedTail, load) -> tuple[torch.Tensor, bool]:
        """One engine step of a hit through the worker's hooks in vLLM 0.33's order, `load` its
        metadata: (the first token's logits, queued; whether every chunk came from the host)."""
        ws = r.ws
        ws.handle_preemptions(load)
        ws.start_load(load)  # start_load_kv (bind_connector_metadata: the hooks read `load`)
        logits = tail.logits(ids)  # per layer: wait_for_layer_load, then the layer's replay
        ws.save(load)  # wait_for_save: no new full chunk
        ws.finished(set())  # get_finished
        errors = ws.load_errors()
        stats = ws.stats()
        ws.report()  # build_connector_worker_meta
        return logits, stats.get("hit_chunks_host", 0) == r.chunks and not errors

    # -- a forward beside a save ----------------------------------------------------------------

    def beside_save_row(self, r, label: str, params: dict):
        """A prefill alone vs beside the connector's save of `r`'s chunks (wait_for_save's copies)."""
        ctx, dev = self.ctx, r.dev
        save_end = dev.new_stream("save-end")  # marks the save's end: waits for its copies alone
        ids, save = self.prompt(self.forward_tokens), r.meta(save=True)
        if ctx.on_progress:
            ctx.on_progress(f"vllm/forward_beside_save/{label}")

        def prefill():
            start = dev.current_stream().record()
            self.lean.logits(ids)  # queued on the compute stream (synchronous on the CPU)
            return start, dev.current_stream().record()

        alone, beside, saves, overlap = [], [], [], []
        for i in range(self.warmup + self.pairs):
            r.sync()  # the pair starts on an idle device: no earlier work is billed to it
            start, end = prefill()
            end.synchronize()  # its time is known once it completed
            r.settle()  # an empty host: the save copies every chunk
            s0 = dev.current_stream().record()
            r.ws.save(save)  # wait_for_save: the copies wait for the compute stream's event, then run
            # Recorded before the prefill is launched: after every copy of the save, not after the
            # host finished launching the prefill too.
            r.ws.wait_saves("save", save_end)
            s1 = save_end.record()
            start_b, end_b = prefill()
            end_b.synchronize()  # times are known once the events completed
            s1.synchronize()  # and the save's end only once its copies have run
            if i < self.warmup:
                continue
            alone.append(start.elapsed_ms(end))
            beside.append(start_b.elapsed_ms(end_b))
            saves.append(s0.elapsed_ms(s1))
            inside = min(s1.time_s(), end_b.time_s()) - max(s0.time_s(), start_b.time_s())
            overlap.append(max(inside, 0.0) * 1e3 / max(saves[-1], 1e-6))
        r.settle()  # the last save landed and the host drops its chunks: the next rows start empty
        clock = "cuda_events" if ctx.on_gpu else "perf_counter"
        t, a, b = summarize(saves, clock), summarize(alone, clock), summarize(beside, clock)
        p = params | dict(
            model=self.preset,
            forward_tokens=self.forward_tokens,
            forward_ms_alone=a.median_ms,
            forward_ms_beside=b.median_ms,
            slowdown_pct=(b.median_ms / a.median_ms - 1) * 100,
            save_ms_beside=t.median_ms,
            save_gbps_beside=t.gbps(r.nbytes),
            overlap_pct=100 * sorted(overlap)[len(overlap) // 2],
            pairs=self.pairs,
            direction="save",
        )
        ceiling = "d2h_pinned" if ctx.on_gpu else "host_memcpy"
        yield ctx.row(f"forward_beside_save {label}", r.nbytes, t, ceiling, **p)
