"""The `vllm` suite's rows of layer-wise loads inside ONE CUDA graph of the whole forward, through
the engine's per-layer "landed" flags (`kvtier.engine.flags`), beside today's piecewise graphs.

  ttft_hit_full_graph <order> <n>  a hit's first token with the whole forward (embedding, all
                                   layers, head) as one CUDA graph captured once: per layer a flag
                                   wait, then the layer over the new tokens with the prefix read
                                   from vLLM's view of the layer. Per hit, the hooks' load part as
                                   the connector runs it with flags: re-arm (`LayerFlags.arm`, the
                                   load's zeroing event), the store's loads joining the step, the
                                   seal; then one replay, then the token on the host. Interleaved,
                                   run for run, with the suite's piecewise hit (`ttft_hit`: a graph
                                   per layer, the connector's wait_for_layer_load between them).
  decode_full_graph <order>        a decode step (one new token over the prefix) as one graph with
                                   the flag waits and no load, against the same graph without them:
                                   what the waits cost a step that loads nothing; the waits inline
                                   (before each layer's read: the row's time, slowdown_pct) and on a
                                   side branch forked at the forward's start (slowdown_pct_branch)

Orders LBHNC and BLHNC (the layer-first and the block-first cache), every token count of the suite
for the hit, the first for decode. The blocks hold the prompt's own KV (its prefill, written into
the request's source blocks and saved to the host), so a hit's first token is a recompute's.

Params of a hit row: full_graph_ms, piecewise_ms (medians of the interleaved runs), tail_ms (the
full graph replayed alone, no load: what a hit costs past its load),
`vs_piecewise` (full_graph_ms / piecewise_ms), recompute_ms and the first tokens (token_full_graph,
token_piecewise; token_recompute: the same forward over the blocks the prompt's prefill wrote, no
load; token_prefill: a whole prefill's, with prefill_margin_std, its top-2 logit gap in std: in bf16
a whole prefill rounds apart from a forward over a cached prefix, so it is reported, not required;
tokens_stable: every run gave the same one); `correct`: every run hit every chunk in the host
tier, the loaded blocks equal the saved ones bit for bit (poisoned before each run) and the full
graph's and the piecewise hit's tokens are the recompute's. Decode: with_waits_ms, branch_waits_ms,
without_waits_ms (CUDA-event medians of interleaved replays), `slowdown_pct` (inline),
slowdown_pct_branch, waits (flag waits in the graph).

On a CPU (`--quick`, SimDevice): nothing is captured; the same steps run eagerly, and each flag wait
is followed by the host waiting for the compute stream (the host runs the layer next), as the
piecewise tail does there. GPU-only: the capture itself and the event timings.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from kvtier.bench.stats import summarize
from kvtier.bench.suites.ttft_checks import MARGIN, margin
from kvtier.bench.suites.vllm_rows import GraphedTail, PagedPrefix

ORDERS = ("LBHNC", "BLHNC")
PROMPT_TRIES = 8  # prompts drawn at most, for a first token no rounding can flip
DECODE_PAIRS = 50  # interleaved replays with and without the waits (quick: 10; CPU: 3)


class FullGraph:
    """A hit's forward over the tokens after its prefix as one CUDA graph: the embedding, every
    decoder layer (its prefix read from vLLM's view of the layer), the final norm and lm_head.
    Static input: the new tokens' ids, copied in per hit.

    waits: where the graph waits for each layer's flag. "inline": `flags.wait(layer)` right before
    the layer's read (what a connector's wait_for_layer_load captures); "branch": every wait on a
    side branch forked at the forward's start, layer l's read joined to its wait (a set flag then
    costs the compute chain no node); None: no waits (the reference a decode step is timed against).
    """

    def __init__(self, lean, prefix: PagedPrefix, ids: torch.Tensor, flags, *, waits: str | None = "inline"):
        if waits not in ("inline", "branch", None):
            raise ValueError(f"waits: expected 'inline', 'branch' or None, got {waits!r}")
        hit, n, dev = prefix.hit_tokens, ids.shape[1], ids.device
        self.lean, self.prefix, self.flags, self.waits, self.hit = lean, prefix, flags, waits, hit
        self.on_gpu = dev.type == "cuda"
        self.ids = ids[:, hit:].clone()
        self.pos = torch.arange(hit, n, device=dev)[None]
        self.mask = lean.tail_mask(hit, n - hit, dev)
        self.layers = len(lean.inner.layers)
        self.out: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self._joins: list = []  # "branch": per layer, the event its read waits for
        if waits == "branch":
            self._side = torch.cuda.Stream(dev) if self.on_gpu else flags.device.new_stream("flag-branch")

    def _fork(self) -> None:
        """The branch of the flag waits, forked from the forward's stream: wait l, then event l."""
        if self.on_gpu:
            cur, side, joins = torch.cuda.current_stream(), self._side, []
            side.wait_stream(cur)  # the branch starts with the forward (a fork inside the capture)
            with torch.cuda.stream(side):
                for layer in range(self.layers):
                    self.flags.wait(layer)  # on the branch: no compute node queues behind it
                    joins.append(torch.cuda.Event())
                    joins[-1].record(side)
            self._joins = joins
            return
        cur, side = self.flags.current_stream(), self._side
        side.wait_event(cur.record())  # the branch starts with the forward
        joins = []
        for layer in range(self.layers):
            self.flags.wait(layer, side)
            joins.append(side.record(f"flag-branch:layer{layer}"))
        self._joins = joins

    def _prefix(self, layer: int):
        # Attention of `layer` reads its blocks only once every load of the step landed them: on
        # CUDA a node of the graph (the capturing stream is torch's current one), or an edge from
        # the branch's wait.
        if self.waits == "inline":
            self.flags.wait(layer)
        elif self.waits == "branch":
            if self.on_gpu:
                torch.cuda.current_stream().wait_event(self._joins[layer])
            else:
                self.flags.current_stream().wait_event(self._joins[layer])
        if self.waits is not None and not self.on_gpu:
            self.flags.current_stream().synchronize()  # the host runs the layer next
        return self.prefix.gather(layer)

    @torch.no_grad()
    def forward(self) -> None:
        lean = self.lean
        if self.waits == "branch":
            self._fork()
        x, cos, sin = lean.embed(self.ids, self.pos)
        for i in range(self.layers):
            x = lean.layer(i, x, cos, sin, partial(self._prefix, i), self.mask)
        self.out = lean.head(x)

    def capture(self) -> None:
        """The whole forward as one CUDA graph (GPU only): a warm-up on a side stream, as torch asks,
        with every flag set (no load pending), then the capture."""
        torch.cuda.synchronize()  # what ran before is done before the warm-up reads the blocks
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward()
        torch.cuda.synchronize()  # the warm-up is done before its buffers are captured over
        g = torch.cuda.CUDAGraph()
        # thread_local: the store's threads (a reader, the reaper) keep calling CUDA meanwhile.
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            self.forward()
        self.graph = g

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """This hit's last-position logits, queued on the compute stream (one replay on CUDA)."""
        self.ids.copy_(ids[:, self.hit :])  # in stream order: the previous replay read it before
        if self.graph is None:
            self.forward()
        else:
            self.graph.replay()
        return self.out.clone()  # the next replay rewrites self.out


def write_prompt_kv(r, lean, ids: torch.Tensor) -> None:
    """The prompt's own KV (its prefill over the prefix) into the request's source blocks, as
    vLLM's attention writes them: per layer [blocks, heads, tokens, K||V] in logical order."""
    nb, n = r.blocks, r.blocks * r.kv.block_size
    src = torch.tensor(r.src[:nb], device=r.cache.device)
    for layer, (k, v) in enumerate(lean.prefill_kv(ids[:, :n])):
        h = k.shape[1]
        pages = torch.cat([k, v], -1)[0].view(h, nb, r.kv.block_size, -1).permute(1, 0, 2, 3)
        r.cache[layer][src] = pages.to(r.cache.dtype)


def pick_prompt(fwd, n: int) -> tuple[torch.Tensor, int, float]:
    """[1, n + new] token ids whose recomputed first token has a top-2 logit gap >= MARGIN std
    (the best of PROMPT_TRIES draws otherwise): (ids, that token, its margin)."""
    best = None
    for attempt in range(PROMPT_TRIES):
        g = torch.Generator().manual_seed(7000 * n + attempt)
        ids = torch.randint(1, fwd.model.config.vocab_size, (1, n + fwd.new), generator=g).to(fwd.ctx.device)
        logits = fwd.lean.logits(ids)  # the recompute: every token's prefill
        got = (ids, int(logits.argmax()), margin(logits))
        if best is None or got[2] > best[2]:
            best = got
        if got[2] >= MARGIN:
            break
    return best


class FlagHit:
    """One hit step through the flags: the connector's start_load with flags (re-arm, the loads
    joining the step, the seal), then the full graph's replay."""

    def __init__(self, r, graph: FullGraph):
        self.r, self.graph = r, graph
        self.flags = r.ws.store.engine.layer_flags()  # at start: made once
        self.handles: list = []

    def __call__(self, ids: torch.Tensor, load) -> tuple[torch.Tensor, bool]:
        r, store = self.r, self.r.ws.store
        r.ws.handle_preemptions(load)
        handles = self.handles = []
        with self.flags.arm(r.dev.current_stream()) as step:  # start_load_kv: re-arm, then the loads
            for run in load.loads:
                # vLLM zeroes new blocks on the compute stream before the forward: the copy follows.
                store.engine.compute_write(run.block_ids, step.armed)
                handles.append(store.load(run.ids, run.block_ids, path=r.ws.load_path(), flags=step))
        logits = self.graph.logits(ids)  # per layer: the flag wait inside the graph, then the layer
        want = r.blocks * r.kv.block_size
        hit = len(handles) == len(load.loads) and all(
            h.tokens == want and set(h.tiers) == {"host"} for h in handles
        )
        return logits, hit

    def settle(self) -> bool:
        """After the device drained: the loads' pins drop (each e_load completed)."""
        return all(h.done() for h in self.handles)


def full_graph_rows(ctx, fwd, r, label: str, params: dict, first: bool):
    """ttft_hit_full_graph (and, for the first token count, decode_full_graph) rows of `r`'s order."""
    if r.order not in ORDERS:
        return
    n = r.blocks * r.kv.block_size
    r.settle()  # the host drops earlier rows' chunks: this row saves the prompt's own KV
    ids, token, gap = pick_prompt(fwd, n)
    write_prompt_kv(r, fwd.lean, ids)
    r.step(r.meta(save=True))  # the chunks the hits load, held by the host tier
    r.settle_saves()  # a load must not read a slot its save is still filling
    yield from _hit_row(ctx, fwd, r, label, params, ids, token, gap)
    if first:
        yield from _decode_row(ctx, fwd, r, label, params, ids)


def _hit_row(ctx, fwd, r, label, params, ids, token, gap):
    load, prefix = r.meta(load=True), PagedPrefix(r)
    flags = r.ws.store.engine.layer_flags()
    full = FullGraph(fwd.lean, prefix, ids, flags)
    flag_hit, piece = FlagHit(r, full), GraphedTail(fwd.lean, prefix, ids)
    if ctx.on_progress:
        ctx.on_progress(f"vllm/ttft_hit_full_graph/{label}")
    times: dict[str, list[float]] = {"full": [], "piecewise": []}
    tokens: dict[str, set[int]] = {"full": set(), "piecewise": set()}
    ok = True
    for i in range(fwd.warmup + fwd.reps):
        for kind in ("piecewise", "full"):  # interleaved: both see the same clocks and neighbours
            r.sync()
            r.poison()  # only this run's loads can make the blocks right
            r.sync()  # earlier GPU work must not be billed to this run
            t0 = time.perf_counter()
            if kind == "full":
                logits, hit = flag_hit(ids, load)
            else:
                logits, hit = fwd.hit(r, ids, piece, load)
            tok = int(logits.argmax())  # the host has the token, so the GPU made it
            dt = time.perf_counter() - t0
            r.sync()  # the run's loads landed before the blocks are compared
            ok = ok and hit and r.exact()
            r.ws.finished(set())  # the piecewise hooks' loads settle
            ok = flag_hit.settle() and ok
            tokens[kind].add(tok)
            if i >= fwd.warmup:
                times[kind].append(dt * 1e3)
            elif ctx.on_gpu and kind == "full" and full.graph is None:
                full.capture()  # after its eager run: the capture reads settled blocks
            elif ctx.on_gpu and kind == "piecewise" and piece.graphs is None:
                piece.capture()
    tail = []  # the same graph alone, no load: every flag set, every layer in place
    for i in range(fwd.warmup + fwd.reps):
        r.sync()
        t0 = time.perf_counter()
        int(full.logits(ids).argmax())
        if i >= fwd.warmup:
            tail.append((time.perf_counter() - t0) * 1e3)
    # The first token a recompute gives from the prompt's own KV: the same forward over the blocks the
    # prefill wrote (no load). A whole prefill in bf16 rounds apart from a forward over a cached
    # prefix, and random weights' top logits lie closer than that: its token is reported, not required.
    r.sync()
    reference = GraphedTail(fwd.lean, PagedPrefix(r, saved=True), ids).logits(ids)
    ref_token = int(reference.argmax())
    t, pw = summarize(times["full"], "perf_counter"), summarize(times["piecewise"], "perf_counter")
    rec = fwd.recompute.get(r.blocks * r.kv.block_size)
    p = params | fwd.params(r.blocks * r.kv.block_size)
    p |= dict(
        full_graph_ms=t.median_ms,
        piecewise_ms=pw.median_ms,
        tail_ms=summarize(tail, "perf_counter").median_ms,
        vs_piecewise=t.median_ms / pw.median_ms,
        recompute_ms=rec,
        token_full_graph=min(tokens["full"]),
        token_piecewise=min(tokens["piecewise"]),
        token_recompute=ref_token,
        token_prefill=token,
        tokens_stable=len(tokens["full"]) == len(tokens["piecewise"]) == 1,  # every run, the same token
        prefill_margin_std=gap,
        graph="one CUDA graph of the whole forward" if full.graph is not None else "eager (no CUDA)",
        path="hit: re-arm, store loads joining the step, seal; one replay waiting per layer on its flag",
    )
    correct = ok and tokens["full"] == tokens["piecewise"] == {ref_token}
    yield ctx.row(f"ttft_hit_full_graph {label}", r.nbytes, t, fwd.link, correct=correct, **p)


def _decode_row(ctx, fwd, r, label, params, ids):
    """One new token over the prefix, as one graph without waits, with them inline, and with them
    on a side branch; no load. Replays interleaved, each timed alone."""
    n = r.blocks * r.kv.block_size
    step_ids, prefix = ids[:, : n + 1], PagedPrefix(r)
    flags = r.ws.store.engine.layer_flags()
    kinds = ("inline", "branch", None)
    graphs = {w: FullGraph(fwd.lean, prefix, step_ids, flags, waits=w) for w in kinds}
    if ctx.on_progress:
        ctx.on_progress(f"vllm/decode_full_graph/{r.order}")
    if ctx.on_gpu:
        for g in graphs.values():
            g.capture()
    pairs = DECODE_PAIRS if ctx.on_gpu and not ctx.quick else 10 if ctx.on_gpu else 3
    samples: dict[str | None, list[float]] = {w: [] for w in kinds}
    for i in range(1 + pairs):
        for w in kinds:  # interleaved: clock changes hit each alike
            start, end = _stamps(ctx, r)
            start()
            graphs[w].logits(step_ids)
            ms = end()
            if i:
                samples[w].append(ms)
    clock = "cuda_events" if ctx.on_gpu else "perf_counter"
    inline, branch, bare = (summarize(samples[w], clock) for w in kinds)
    weights = sum(p.numel() * p.element_size() for p in fwd.model.parameters())
    nbytes = weights + fwd.kv_bytes(n)  # what a decode step reads: the weights, the prefix's KV
    p = params | dict(
        model=fwd.preset,
        prefix_tokens=n,
        with_waits_ms=inline.median_ms,
        without_waits_ms=bare.median_ms,
        slowdown_pct=(inline.median_ms / bare.median_ms - 1) * 100,
        branch_waits_ms=branch.median_ms,
        slowdown_pct_branch=(branch.median_ms / bare.median_ms - 1) * 100,
        waits=fwd.model.config.num_hidden_layers,
        pairs=pairs,
        graph="one CUDA graph of the whole forward" if ctx.on_gpu else "eager (no CUDA)",
    )
    ceiling = "d2d_copy" if ctx.on_gpu else "host_memcpy"
    yield ctx.row(f"decode_full_graph {r.order}", nbytes, inline, ceiling, **p)


def _stamps(ctx, r):
    """(start, end) of one timed replay: CUDA events on the compute stream (end() returns ms once
    they completed), or the host clock after the compute stream drained (CPU)."""
    if ctx.on_gpu:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def end() -> float:
            e.record()
            e.synchronize()  # its time is known once it completed
            return s.elapsed_time(e)

        return s.record, end
    t = [0.0]

    def start() -> None:
        t[0] = time.perf_counter()

    def end_host() -> float:
        r.dev.current_stream().synchronize()  # the flag waits on the simulated stream passed
        return (time.perf_counter() - t[0]) * 1e3

    return start, end_host
