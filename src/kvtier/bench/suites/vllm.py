"""kvtier's vLLM connector, worker side, replayed in vLLM 0.33's per-step call order on this
device's tensors (vLLM itself need not be installed: the hooks are `WorkerSide`'s, which
`KVTierConnector` delegates to one for one).

  vllm   per step: handle_preemptions -> bind metadata -> start_load_kv -> per layer
         (wait_for_layer_load -> attention stand-in reading the layer -> save_kv_layer) ->
         wait_for_save -> get_transfer_results (+ load errors, stats, worker metadata)

Per vLLM 0.33 layout order (LBHNC ... BHLNC) at the Llama-3-8B shape (32 layers, 8 KV heads,
head_size 128, bf16, 16-token blocks; 8K and 32K tokens, 32 and 128 chunks of 16 blocks; --quick:
8K only), rows:

- save: a step whose metadata saves the request's chunks, from the end of its forward (the
  point the save waits for: the KV written) until the copies completed, the save's hooks' host
  time included, vs the same-run pinned D2H ceiling; load: a step that loads them into other
  blocks (poisoned before each run), vs pinned H2D; the loaded KV checked bit for bit against
  the saved blocks.
  Params: `submit_us` (host time of the step that starts the save / load: it includes any wait
  of the host, e.g. on the staged graphs' ids ring when a step submits more jobs than it holds),
  `ring_waits` (those waits per step), `save_errors` (chunks per step the host pool could not
  take: a later miss) and `idle_step_us` (host time of a step with nothing to move: every hook,
  every layer).
- gather_d2d / scatter_d2d (the first token count): kvtier's gather and scatter kernels alone,
  the request's blocks to a contiguous GPU chunk and back, vs the same-run D2D copy (read + write
  counted), CUDA-graph replays, bit-exact.
- vllm_batch_save / vllm_batch_load: vLLM's own mechanism for the same bytes, one
  `cudaMemcpyBatchAsync` descriptor per page (a page: one block's contiguous run of one layer,
  or of every layer in a B-first order), with `submit_us` its CPU time to submit.
- ttft_hit / ttft_recompute / forward_beside_save: the hooks beside a Llama forward
  (`vllm_rows.py`).
- ttft_hit_full_graph / decode_full_graph (LBHNC, BLHNC): the same hit with the whole forward as
  one CUDA graph waiting per layer on the engine's landed flags, against the piecewise hit in
  the same run, and what the waits cost a decode step that loads nothing (`vllm_graphs.py`).
- The save, load and ttft_hit rows run the connector's default settings (`layerwise: true`: loads
  on the engine's layer-major path, a true event per layer); load_whole / ttft_hit_whole run the
  same request with `layerwise: false` (whole-job DMA loads: staged, or batch in a B-first order,
  one wait before the forward). Param `load_path`: the path the loads took.
- redis_killed_mid_load: a Redis tier killed in the middle of a load, then vLLM's recompute of
  what did not arrive, checked against a healthy hit of the same length
  (`vllm_failover.py`; skipped without redis-server and redis-py).
- load_failed_mid_request: a load failing in the middle of a request while the forward runs
  past it, through both halves of the connector; then the same prompt again: every chunk loaded,
  the KV equal bit for bit to what vLLM's recompute computed, the first token a recompute's
  (`vllm_failover.py`).

- decode_beside <mode> <order> <batch>: a graphed decode batch beside arrivals and departures
  (`vllm_decode.py`; orders LBHNC and BLHNC).
- ttft_hit hybrid <model> <n>: a hit's first token on a sliding-window model (a small random
  Gemma 3: five sliding-window layers to one full) with one store per KV cache group, against
  recomputing it (params.speedup; 8K and 32K tokens) (`vllm_hybrid.py`); and on a model with
  state layers (a small random Qwen3-Next: gated delta net layers, their state at the hit's end
  loaded, 8K tokens) (`vllm_hybrid_state.py`).
- choice <tier> <n>, option recompute|load|split <tier> <n>: the connector's choice per request
  against each option measured in the same run (params.vs_best), per tier (host, disk, redis,
  slow, stalled; $KVTIER_VLLM_TIERS) and prefix (2K, 8K, 32K); step_beside_read <tier> <n>: a
  decode step while a waiting request's prefix is read from the tier (params.slowdown_pct)
  (`vllm_choice.py`; in BLHNC where measured).

$KVTIER_VLLM_ORDERS (comma-separated, e.g. "LBHNC,BLHNC") measures only those orders, and
$KVTIER_VLLM_ROWS only those row families: transfers (save, load, vllm_batch, load_whole),
kernels (gather_d2d / scatter_d2d), ttft (ttft_hit, ttft_recompute, ttft_hit_whole), full_graph,
beside_save (forward_beside_save), failover (redis_killed_mid_load, load_failed_mid_request),
decode (decode_beside; on a CPU only when named), choice (choice, option), beside_read
(step_beside_read), hybrid (ttft_hit hybrid; on a CPU only when named).

On a CPU (`--quick`): a tiny shape on `SimDevice` (the forward rows: a tiny Llama of that KV
shape), timed on the host clock; the batched copy is skipped.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import torch

from kvtier import layout
from kvtier.bench.suite import Context, GiB, register
from kvtier.bench.suites.vllm_choice import choice_rows
from kvtier.bench.suites.vllm_decode import ORDERS as DECODE_ORDERS
from kvtier.bench.suites.vllm_decode import Memory as DecodeMemory
from kvtier.bench.suites.vllm_decode import decode_rows
from kvtier.bench.suites.vllm_failover import failed_load_row, killed_row
from kvtier.bench.suites.vllm_graphs import full_graph_rows
from kvtier.bench.suites.vllm_hybrid import hybrid_rows
from kvtier.bench.suites.vllm_hybrid_state import state_rows

LLAMA = dict(L=32, H=8, D=128, N=16, dtype=torch.bfloat16)  # Llama-3-8B's KV
TINY = dict(L=2, H=2, D=16, N=16, dtype=torch.bfloat16)
IDLE_REPS = 200
FAILOVER_TOKENS = 1280  # the failed-load row's least prompt: 5 chunks of 16 blocks
# $KVTIER_VLLM_ROWS: the row families a run measures (module docstring)
ROW_FAMILIES = (
    "transfers",
    "kernels",
    "ttft",
    "full_graph",
    "beside_save",
    "failover",
    "decode",
    "choice",
    "beside_read",
    "hybrid",
)
FORWARD_ROWS = {"ttft", "full_graph", "beside_save", "failover", "choice", "beside_read"}  # the Llama's
CHOICE_ORDER = "BLHNC"  # the choice rows' layout (what ``kv_layout: auto`` asks for), if measured
REPLAY_ROWS = {"transfers", "kernels", "ttft", "full_graph", "beside_save"}
HOST_SLACK_CHUNKS = 4  # host pool room past one request's chunks: a timed save never finds it full


class Replay:
    """One worker over a vLLM 0.33 cache in `order`, holding `blocks` blocks (two requests);
    tiers: its store's lower tiers (default none: the host alone; None: what the settings
    build); layerwise: the connector's setting (True, its default: layer-major loads; False:
    whole-job DMA loads); extra: more of the connector's settings (`VllmSettings`)."""

    def __init__(
        self,
        ctx: Context,
        order: str,
        shape: dict,
        tokens: int,
        tiers=(),
        layerwise: bool = True,
        extra: dict | None = None,
    ):
        from kvtier.integrations.vllm.settings import VllmSettings
        from kvtier.integrations.vllm.worker import WorkerSide

        self.ctx, self.order = ctx, order
        L, H, D, N = shape["L"], shape["H"], shape["D"], shape["N"]
        self.n = n = tokens // N
        sizes = dict(L=L, B=2 * n, H=H, N=N, C=2 * D)
        buf = torch.empty([sizes[a] for a in order], dtype=shape["dtype"], device=ctx.device)
        buf.view(torch.uint8).random_(0, 256)  # random bits: never time or check on zeros
        self.cache = buf.permute(*[order.index(a) for a in "LBHNC"])  # logical [L, B, H, N, C]
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
        g = torch.Generator().manual_seed(0)
        perm = torch.randperm(2 * n, generator=g).tolist()  # random ids, as a serving engine's
        self.src, self.dst = perm[:n], perm[n:]
        chunk_blocks = 16 if n >= 16 else max(1, n // 2)
        per_chunk = chunk_blocks * L * 2 * H * N * D * shape["dtype"].itemsize
        self.chunks = n // chunk_blocks
        s = VllmSettings(
            chunk_tokens=chunk_blocks * N,
            # the host holds one request's chunks at a time (each timed save starts from an empty
            # host, a second save of held chunks skips them): those, plus slack; the host index
            # keeps an eighth of the pool as headroom (`StoreConfig.host_capacity`)
            host_bytes=(self.chunks + HOST_SLACK_CHUNKS) * per_chunk * 8 // 7 + (64 << 20),
            staging_bytes=min(256 << 20, max(2 * per_chunk, 1 << 20)),
            layerwise=layerwise,
            **(extra or {}),
        )
        dev = None
        if not ctx.on_gpu:
            from kvtier.device import SimDevice

            dev = SimDevice()
        tiers = None if tiers is None else list(tiers)
        self.ws = WorkerSide(s, "replay", order=order, block_size=N, tiers=tiers, device=dev)
        self.ws.register({name: self.cache[i] for i, name in enumerate(self.names)})
        self.dev, self.kv = self.ws.dev, self.ws.kv
        self.ids = [i.to_bytes(32, "little") for i in range(self.chunks)]  # stand-ins for block hashes
        self.blocks = self.chunks * chunk_blocks
        self.nbytes = self.kv.chunk_nbytes(self.blocks)
        self.q = torch.randn(1, 2 * D, dtype=shape["dtype"], device=ctx.device)
        self.counts: Counter = Counter()  # the worker's stats of every step (vLLM's get_kv_connector_stats)
        self.last_errors: set[int] = set()  # the blocks the last step's loads did not deliver
        self._step = 0

    def close(self) -> None:
        self.ws.shutdown()  # every copy in flight lands before its slot goes back
        if not self.ctx.on_gpu:
            self.dev.close()  # the SimDevice is ours, not the worker's

    # -- one engine step, in vLLM 0.33's order --------------------------------------------------

    def step(self, meta) -> float:
        """One step's hooks; returns the host seconds they took (the attention stand-in excluded).
        On the CPU the step ends once the compute stream drained (the host clock times it)."""
        return self.forward(meta) + self.finish(meta)

    def forward(self, meta) -> float:
        """A step up to the end of its forward: handle_preemptions, bind_connector_metadata,
        start_load_kv, per layer wait_for_layer_load and the attention stand-in (save_kv_layer:
        kvtier saves a chunk whole after the forward, a no-op hook). The hooks' host seconds."""
        ws = self.ws
        t0 = time.perf_counter()
        ws.handle_preemptions(meta)
        ws.start_load(meta)  # bind_connector_metadata: the hooks read `meta`
        spent = time.perf_counter() - t0
        for i, name in enumerate(self.names):
            t1 = time.perf_counter()
            ws.wait_layer(name)
            spent += time.perf_counter() - t1
            self._attention(i)
        return spent

    def finish(self, meta) -> float:
        """The step's hooks after its forward: wait_for_save, get_transfer_results, the load
        errors, stats and worker metadata. Their host seconds."""
        ws, rid = self.ws, f"r{self._step}"
        self._step += 1
        t0 = time.perf_counter()
        ws.save(meta)
        ws.finished({rid})  # get_transfer_results
        self.last_errors = ws.load_errors()  # get_block_ids_with_load_errors
        self.counts.update(ws.stats())
        ws.report()  # build_connector_worker_meta
        spent = time.perf_counter() - t0
        if not self.ctx.on_gpu:
            self.dev.current_stream().synchronize()  # the host clock must see the waited copies land
        return spent

    def _attention(self, layer: int) -> None:
        """A small matmul reading the layer's first loaded block (after its wait)."""
        k = self.cache[layer, self.dst[0], 0]  # [N, C]
        if self.ctx.on_gpu:
            torch.matmul(self.q, k.transpose(0, 1))

    def meta(self, *, save: bool = False, load: bool = False, wait_saves: bool = False):
        from kvtier.integrations.vllm.metadata import ChunkRun, KVTierMetadata

        m = KVTierMetadata()
        if save:
            m.saves.append(ChunkRun("save", self.ids, self.src[: self.blocks]))
        if load:
            m.loads.append(ChunkRun("load", self.ids, self.dst[: self.blocks]))
        if wait_saves:
            m.preempted.add("save")  # later compute waits for the request's pending saves
        return m

    def settle(self) -> None:
        """Everything submitted has landed and been settled; the host holds no chunk."""
        self.settle_saves()
        self.ws.store.evict()

    def settle_saves(self) -> None:
        """Everything submitted has landed; the saved chunks are held by the host tier."""
        self.sync()
        self.ws.finished({"save"})

    def sync(self) -> None:
        self.ws.wait_submitted()  # the saver and loader threads queued what they were handed
        if self.ctx.on_gpu:
            torch.cuda.synchronize(self.ctx.device)
        else:
            self.dev.synchronize()  # every stream: compute, the loads' and each save lane's

    def ring_waits(self) -> int:
        """Host waits so far on the pinned ids buffers of the staged graphs (`fastpath.ring`): a
        step that submits more graph replays than a ring holds waits there for the oldest copy."""
        graphs = getattr(self.ws.store.engine.mover, "graphs", None)  # None: no graphs (SimDevice)
        if graphs is None:
            return 0
        return sum(e.ring.waited for e in graphs.cache.by_key.values() if e.ring is not None)

    def poison(self) -> None:
        self.cache[:, self.dst[: self.blocks]] = torch.tensor(-7.0, dtype=self.cache.dtype)

    def exact(self) -> bool:
        a = self.cache[:, self.dst[: self.blocks]].contiguous().view(torch.uint8)
        b = self.cache[:, self.src[: self.blocks]].contiguous().view(torch.uint8)
        return torch.equal(a, b)


def _save_rows(ctx: Context, r: Replay, label: str, params: dict):
    ceiling = "d2h_pinned" if ctx.on_gpu else "host_memcpy"
    stream_wait, save = r.meta(wait_saves=True), r.meta(save=True)
    submit, forward = [], []

    def forward_first():
        r.settle()
        forward.append(r.forward(save))  # untimed: the clock starts once the forward wrote the KV

    def save_step():
        spent = forward.pop() if forward else r.forward(save)  # warm-up runs have no setup
        submit.append(spent + r.finish(save))
        r.ws.handle_preemptions(stream_wait)  # the timer's end event follows the save's copies
        if not ctx.on_gpu:
            r.dev.current_stream().synchronize()  # the host clock: until the copies landed

    before = r.ring_waits(), r.counts["save_errors"]
    t = ctx.time(save_step, setup=forward_first, name=f"vllm/save/{label}")
    r.settle()
    yield ctx.row(
        f"save {label}",
        r.nbytes,
        t,
        ceiling,
        submit_us=_median_us(submit),
        **_host_waits(r, before, len(submit)),
        direction="save",
        **params,
    )


def _load_rows(ctx: Context, r: Replay, label: str, params: dict, name: str = "load"):
    ceiling = "h2d_pinned" if ctx.on_gpu else "host_memcpy"
    r.step(r.meta(save=True))  # the chunks the loads read, held by the host tier
    r.settle_saves()  # a load must not read a slot its save is still filling
    submit = []

    def load_step():
        submit.append(r.step(r.meta(load=True)))  # the stand-in waited for every layer

    def before():
        r.sync()
        r.poison()

    r.poison()
    load_step()
    r.sync()
    ok = r.exact()
    waits = r.ring_waits(), r.counts["save_errors"]
    submit.clear()
    t = ctx.time(load_step, setup=before, name=f"vllm/{name}/{label}")
    r.sync()
    ok = ok and r.exact()
    yield ctx.row(
        f"{name} {label}",
        r.nbytes,
        t,
        ceiling,
        correct=ok,
        submit_us=_median_us(submit),
        **_host_waits(r, waits, len(submit)),
        direction="load",
        **params,
    )


def _host_waits(r: Replay, before: tuple[int, int], steps: int) -> dict:
    """Per step since `before` (ring waits, save errors): what made a step wait on the host, or
    left chunks unsaved."""
    ring, errors = r.ring_waits() - before[0], r.counts["save_errors"] - before[1]
    return dict(ring_waits=round(ring / max(steps, 1), 2), save_errors=round(errors / max(steps, 1), 2))


def _idle_us(r: Replay) -> float:
    empty = r.meta()
    samples = []
    for _ in range(IDLE_REPS if r.ctx.on_gpu else 20):
        samples.append(r.step(empty))
    return _median_us(samples)


def _median_us(samples: list[float]) -> float:
    s = sorted(samples)
    return round(s[len(s) // 2] * 1e6, 2) if s else 0.0


def _pages(r: Replay, ids: list[int], host: torch.Tensor):
    """(paged addresses, host addresses, sizes) of vLLM's mechanism: one descriptor per page (the
    cache's pieces, merged where consecutive in both the cache and the chunk)."""
    from kvtier.engine.fastpath import batch

    return batch.pieces(r.kv, ids, r.kv.block_size, host.data_ptr())


def _batch_rows(ctx: Context, r: Replay, label: str, params: dict):
    from kvtier.engine.fastpath import batch

    case = f"vllm_batch {label}"
    if not ctx.on_gpu or not batch.available():
        ctx.skip(case, "cudaMemcpyBatchAsync needs a CUDA GPU and runtime >= 12.8")
        return
    host = torch.empty(r.nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream(ctx.device)
    paged, hostp, sizes = _pages(r, r.src[: r.blocks], host)
    dpaged, dhost, dsizes = _pages(r, r.dst[: r.blocks], host)
    cur = torch.cuda.current_stream(ctx.device)  # the timer's stream
    for direction, (dsts, srcs, sz) in (("save", (hostp, paged, sizes)), ("load", (dpaged, dhost, dsizes))):
        submit: list[float] = []

        def run(dsts=dsts, srcs=srcs, sz=sz, submit=submit):
            stream.wait_stream(cur)  # the copies start after the timer's start event
            t0 = time.perf_counter()
            batch.launch(dsts, srcs, sz, stream, ctx.device)
            submit.append(time.perf_counter() - t0)
            cur.wait_stream(stream)  # the timer's end event follows the copies

        if direction == "load":
            r.poison()
        t = ctx.time(run, name=f"vllm/batch_{direction}/{label}")
        torch.cuda.synchronize(ctx.device)
        ok = r.exact() if direction == "load" else None
        ceiling = "d2h_pinned" if direction == "save" else "h2d_pinned"
        yield ctx.row(
            f"vllm_batch_{direction} {label}",
            r.nbytes,
            t,
            ceiling,
            correct=ok,
            submit_us=_median_us(submit),
            descriptors=len(sz),
            page_bytes=int(sz.max()),
            direction=direction,
            mechanism="vllm_batch",
            **params,
        )


@register(
    "vllm", needs_gpu=False, description="the vLLM connector's worker hooks replayed per step, per layout"
)
def vllm(ctx: Context):
    """The vLLM connector's worker hooks replayed per step, per layout order."""
    if ctx.on_gpu:
        shape, token_counts = LLAMA, (8192,) if ctx.quick else (8192, 32768)  # quick: 1 GiB only
        ctx.ceiling("d2h_pinned", nbytes=GiB)
        ctx.ceiling("h2d_pinned", nbytes=GiB)
        ctx.ceiling("d2d_copy", nbytes=GiB)
    else:
        shape, token_counts = TINY, (128,)
    want = rows_asked(os.environ.get("KVTIER_VLLM_ROWS"), ctx.on_gpu)
    fwd = _forward(ctx, shape) if want & FORWARD_ROWS else None
    for order in orders_asked(os.environ.get("KVTIER_VLLM_ORDERS")):
        for tokens in token_counts:
            first = tokens == token_counts[0]
            if want & REPLAY_ROWS:
                yield from _replay_rows(ctx, fwd, want, order, shape, tokens, first)
            if "failover" in want and fwd is not None and first:
                yield from killed_row(ctx, fwd, Replay, order, shape, tokens)
                yield from failed_load_row(ctx, fwd, Replay, order, shape, max(tokens, FAILOVER_TOKENS))
            if ctx.on_gpu:
                torch.cuda.empty_cache()
    if want & {"choice", "beside_read"} and fwd is not None:
        asked = orders_asked(os.environ.get("KVTIER_VLLM_ORDERS"))
        order = CHOICE_ORDER if CHOICE_ORDER in asked else asked[0]
        yield from choice_rows(ctx, fwd, Replay, order, shape, want)
    del fwd
    if ctx.on_gpu:
        torch.cuda.empty_cache()  # the model's memory goes back before the decode batch's cache
    if "hybrid" in want:
        yield from hybrid_rows(ctx)
        yield from state_rows(ctx)
    if "decode" in want:
        memory = DecodeMemory()  # one cache buffer for every order's decode batch
        for order in orders_asked(os.environ.get("KVTIER_VLLM_ORDERS")):
            if order in DECODE_ORDERS:
                yield from decode_rows(ctx, order, shape, memory)
        del memory


def _replay_rows(ctx: Context, fwd, want: set[str], order: str, shape: dict, tokens: int, first: bool):
    """The rows over one `Replay` of `tokens` in `order` (the families `want` names)."""
    r = Replay(ctx, order, shape, tokens)
    try:
        run = layout.contiguous_block_run(r.kv)
        label = f"{order} {tokens} tokens"
        params = dict(
            order=order,
            tokens=r.blocks * shape["N"],
            chunks=r.chunks,
            layers=shape["L"],
            heads=shape["H"],
            head_size=shape["D"],
            block_size=shape["N"],
            dtype="bf16",
            block_run_bytes=run or 0,
            load_path=_load_path(r),
            idle_step_us=_idle_us(r),
        )
        if "transfers" in want:
            yield from _save_rows(ctx, r, label, params)
            yield from _load_rows(ctx, r, label, params)
            yield from _batch_rows(ctx, r, label, params)
        if "kernels" in want and first:
            yield from _kernel_rows(ctx, r, label, params)
        if fwd is not None:
            if "ttft" in want:
                yield from fwd.hit_row(r, label, params)
            if "full_graph" in want:
                yield from full_graph_rows(ctx, fwd, r, label, params, first)
            if "beside_save" in want and first:
                yield from fwd.beside_save_row(r, label, params)
    finally:
        r.close()
    if want & {"transfers", "ttft"}:
        yield from _whole_rows(ctx, fwd if "ttft" in want else None, order, shape, tokens, params, want)


def rows_asked(value: str | None, on_gpu: bool = True) -> set[str]:
    """The row families $KVTIER_VLLM_ROWS names (comma-separated; unset or empty: every one, but
    on a CPU the decode rows, whose batch of the tiny shape says nothing of a GPU's, and the
    hybrid rows, whose tiny model says nothing of a hit's speed)."""
    if not value:
        return set(ROW_FAMILIES) if on_gpu else set(ROW_FAMILIES) - {"decode", "hybrid"}
    asked = {x.strip().lower() for x in value.split(",") if x.strip()}
    bad = sorted(asked - set(ROW_FAMILIES))
    if bad:
        raise ValueError(f"KVTIER_VLLM_ROWS: unknown row families {bad}; known: {', '.join(ROW_FAMILIES)}")
    return asked


def _kernel_rows(ctx: Context, r: Replay, label: str, params: dict):
    """gather_d2d / scatter_d2d: kvtier's gather and scatter kernels alone, the request's blocks of
    the cache in this order to a contiguous chunk on the GPU and back into other blocks (vs the
    same-run D2D copy, read + write counted), timed as CUDA-graph replays with L2 flushed, checked
    bit for bit on a poisoned output. GPU only (the CPU tests run the same kernels interpreted)."""
    from kvtier import ops
    from kvtier.reference import bits_equal, gather_ref, poison_blocks_

    if not ctx.on_gpu:
        ctx.skip(f"gather_d2d {label}", "times CUDA-graph replays: GPU only")
        return
    kv, n = r.kv, r.blocks
    src, dst = ops.block_ids(kv, r.src[:n]), ops.block_ids(kv, r.dst[:n])
    out = torch.empty(kv.chunk_nbytes(n), dtype=torch.uint8, device=ctx.device)
    want = gather_ref(kv, r.src[:n])
    torch.cuda.synchronize(ctx.device)  # the ids landed: the kernels may be captured in a graph
    for name, run, poison, got in (
        ("gather_d2d", lambda: ops.gather(kv, src, out), lambda: out.fill_(0xA5), lambda: out),
        (
            "scatter_d2d",
            lambda: ops.scatter(kv, dst, out),
            lambda: poison_blocks_(kv, r.dst[:n]),
            lambda: gather_ref(kv, r.dst[:n]),
        ),
    ):
        poison()
        run()
        torch.cuda.synchronize(ctx.device)  # submitted is not done: read the output once it landed
        ok = bits_equal(got().view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
        t = ctx.time(run, flush_l2=True, graph=True, name=f"vllm/{name}/{label}")
        p = params | {"path": f"triton {name.split('_')[0]} GPU<->GPU", "launch": "graph"}
        yield ctx.row(f"{name} {label}", r.nbytes, t, "d2d_copy", traffic_factor=2, correct=ok, **p)


def _load_path(r: Replay) -> str:
    """The engine path the worker's loads take (its setting, else the engine's whole-job one)."""
    return r.ws.load_path() or r.ws.store.engine.load_path(per_layer=False).value


def _whole_rows(ctx: Context, fwd, order: str, shape: dict, tokens: int, params: dict, want: set[str]):
    """load_whole / ttft_hit_whole: the same request with ``layerwise: false`` (whole-job DMA
    loads, one wait before the forward), beside the default's layer-major rows."""
    r = Replay(ctx, order, shape, tokens, layerwise=False)
    try:
        label, p = f"{order} {tokens} tokens", params | {"load_path": _load_path(r), "layerwise": False}
        if "transfers" in want:
            yield from _load_rows(ctx, r, label, p, name="load_whole")
        if fwd is not None:
            yield from fwd.hit_row(r, label, p, name="ttft_hit_whole")
    finally:
        r.close()


def orders_asked(value: str | None) -> tuple[str, ...]:
    """The layout orders $KVTIER_VLLM_ORDERS names (comma-separated; unset or empty: all six)."""
    if not value:
        return layout.VLLM_ORDERS
    asked = tuple(o.strip().upper() for o in value.split(",") if o.strip())
    bad = [o for o in asked if o not in layout.VLLM_ORDERS]
    if bad:
        raise ValueError(
            f"KVTIER_VLLM_ORDERS: unknown order(s) {bad}; known: {', '.join(layout.VLLM_ORDERS)}"
        )
    return asked


def _forward(ctx: Context, shape: dict):
    """The Llama forward of the ttft_hit / ttft_recompute / forward_beside_save rows, or None with
    those rows skipped (transformers missing)."""
    try:
        from kvtier.bench.suites.vllm_rows import Forward

        return Forward(ctx, shape)
    except ImportError as exc:
        for case in ("ttft_hit", "ttft_recompute", "forward_beside_save"):
            ctx.skip(case, f"the Llama forward needs transformers: {exc}")
        return None
