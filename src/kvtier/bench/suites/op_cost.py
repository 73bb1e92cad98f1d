"""A caller's cost per copy: kvtier's public ops called directly, the way a user writing their own
offload path calls them, per op and per kind of block ids.

  op_cost   gather, scatter (GPU <-> GPU), save_staged, load_staged (pinned host), scatter_slots;
            ids as a list of ints, a CPU int tensor, a `BlockIds`, a GPU int tensor

Each row's median is the GPU time of one call alone (the GPU idle before it, the host's launch
included), beside the same-run ceiling. Its params add `host_us` (host time of one call: what
the caller's thread spends), `queued_ms` (per call, 20 calls back to back), and two same-run
references on the same tensors: `index_select_ms`, one `torch.index_select` of the blocks (the
cache stacked as one tensor), and `copy_ms`, one contiguous copy of the same bytes (a pinned DMA
for the staged ops). Shapes: Llama-3-8B KV (32 layers, 8 KV heads, head_dim 128, bf16, 16-token
blocks; 512 blocks = 1 GiB) and a small one (2 layers, 2 heads, head_dim 64) with 512 and 8192
blocks; all layers, and one layer (`layers=(l, 1)`, what a per-layer loader calls). Without a GPU
the kernels run in Triton's interpreter on tiny shapes (`--quick`), timed on the host clock.
"""

from __future__ import annotations

import time

import torch

from kvtier import layout, ops
from kvtier.bench.suite import Context, MiB, register
from kvtier.ops.slots import scatter_slots, slot_sources
from kvtier.reference import bits_equal, gather_ref

QUEUED = 20  # calls back to back for `queued_ms`
HOST_REPS = 30  # single calls timed on the host clock, the GPU idle before each
STAGE_BYTES = 64 * MiB  # staged ops: bytes per staging buffer (one DMA)
ID_KINDS = ("list", "cpu_tensor", "block_ids", "gpu_tensor")


class Shape:
    """One paged cache (stacked: one tensor, so `index_select` takes it in one call) and a pool
    of ids 4x larger than the largest request."""

    def __init__(self, ctx: Context, name: str, layers: int, heads: int, head_dim: int, bs: int, max_n: int):
        self.ctx, self.name = ctx, name
        nb = 4 * max_n
        self.cache = torch.empty(layers, 2, nb, bs, heads, head_dim, dtype=torch.bfloat16, device=ctx.device)
        self.cache.view(torch.uint8).random_(0, 256)  # random bits: never time or check on zeros
        self.kv = layout.vllm_flash(self.cache)
        self.perm = torch.randperm(nb, generator=torch.Generator().manual_seed(0))
        self.params = dict(
            shape=name, layers=layers, heads=heads, head_dim=head_dim, block_size=bs, dtype="bf16"
        )

    def ids(self, n: int, kind: str, write: bool, offset: int = 0):
        p = self.perm[offset : offset + n]
        if kind == "list":
            return p.tolist()
        if kind == "cpu_tensor":
            return p.clone()
        if kind == "block_ids":
            return ops.block_ids(self.kv, p, unique=write)
        return p.to(self.ctx.device)


def _sync(ctx: Context) -> None:
    if ctx.on_gpu:
        torch.cuda.synchronize(ctx.device)  # the GPU idle: a call's host time is its own


def _host_us(ctx: Context, fn) -> float:
    """Median host time of one call, with nothing queued before it."""
    samples = []
    for _ in range(5 if ctx.quick else HOST_REPS):
        _sync(ctx)
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    _sync(ctx)
    samples.sort()
    return samples[len(samples) // 2] / 1e3


def _timed(ctx: Context, fn, name: str) -> dict:
    """(alone Timing, params: host_us, queued_ms)."""
    fn()  # warm: compile, plan, pinned slots
    _sync(ctx)
    alone = ctx.time(fn, name=f"{name}/alone")
    host = _host_us(ctx, fn)
    if ctx.on_gpu:

        def queued():
            for _ in range(QUEUED):
                fn()

        q = ctx.time(queued, name=f"{name}/queued").median_ms / QUEUED
    else:
        q = alone.median_ms  # no queue on the host: every call runs to the end before returning
    return alone, dict(host_us=round(host, 2), queued_ms=q)


def _refs(ctx: Context, s: Shape, n: int, host: bool) -> dict:
    """Same-run references for n blocks of `s`: index_select of the stacked cache, one copy."""
    idx = s.perm[:n].to(ctx.device)
    out = torch.empty(s.cache.shape[0], 2, n, *s.cache.shape[3:], dtype=s.cache.dtype, device=ctx.device)
    sel = ctx.time(lambda: torch.index_select(s.cache, 2, idx, out=out), name=f"index_select/{s.name}/{n}")
    flat = out.view(-1)
    if host and ctx.on_gpu:
        pinned = torch.empty_like(flat, device="cpu", pin_memory=True)
        copy = ctx.time(lambda: pinned.copy_(flat, non_blocking=True), name=f"dma/{s.name}/{n}")
    else:
        other = torch.empty_like(flat)
        copy = ctx.time(lambda: other.copy_(flat), name=f"copy/{s.name}/{n}")
    return dict(index_select_ms=sel.median_ms, copy_ms=copy.median_ms)


def _gpu_ops(ctx: Context, s: Shape, n: int, layer_modes):
    kv = s.kv
    chunk = torch.empty(kv.chunk_shape(n), dtype=kv.dtype, device=ctx.device)
    ceiling = "d2d_copy" if ctx.on_gpu else "host_memcpy"
    refs = _refs(ctx, s, n, host=False)
    for op in ("gather", "scatter"):
        write = op == "scatter"
        if write:
            ops.gather(kv, s.perm[:n], chunk)  # a chunk of real blocks to write back
        for layers in layer_modes:
            one = layers is not None
            nbytes = kv.chunk_nbytes(n) // (kv.num_layers if one else 1)
            correct = None
            for kind in ID_KINDS:
                case = f"{op} {s.name} n={n} {'one layer' if one else 'all layers'} {kind}"
                if kind == "gpu_tensor" and not ctx.on_gpu:
                    ctx.skip(case, "GPU ids need a CUDA GPU")
                    continue
                ids = s.ids(n, kind, write, offset=n if write else 0)
                f = getattr(ops, op)
                run = lambda f=f, ids=ids, layers=layers: f(kv, ids, chunk, layers=layers)  # noqa: E731
                if correct is None and not write and not one:
                    run()
                    _sync(ctx)
                    correct = bits_equal(chunk, gather_ref(kv, s.perm[:n]))
                t, p = _timed(ctx, run, f"{op}/{s.name}/{n}/{kind}/{layers}")
                yield ctx.row(
                    case,
                    nbytes,
                    t,
                    ceiling,
                    traffic_factor=2 if ctx.on_gpu else 1,
                    correct=correct if not one else None,
                    op=op,
                    ids=n,
                    id_kind=kind,
                    layer_range="one" if one else "all",
                    **p,
                    **refs,
                    **s.params,
                )
    # The slot scatter: chunks checked once (slot_sources), then one launch per call.
    halves = [chunk[: n // 2], chunk[n // 2 :]]
    src = slot_sources(kv, s.perm[n : 2 * n], halves)
    for layers in layer_modes:
        one = layers is not None
        nbytes = kv.chunk_nbytes(n) // (kv.num_layers if one else 1)
        run = lambda layers=layers: scatter_slots(kv, src, layers=layers)  # noqa: E731
        t, p = _timed(ctx, run, f"scatter_slots/{s.name}/{n}/{layers}")
        case = f"scatter_slots {s.name} n={n} {'one layer' if one else 'all layers'} slot_sources"
        yield ctx.row(
            case,
            nbytes,
            t,
            ceiling,
            traffic_factor=2 if ctx.on_gpu else 1,
            op="scatter_slots",
            ids=n,
            id_kind="slot_sources",
            layer_range="one" if one else "all",
            **p,
            **refs,
            **s.params,
        )


def _staged_ops(ctx: Context, s: Shape, n: int):
    kv = s.kv
    per = max(1, min(n, STAGE_BYTES // kv.block_nbytes))
    staging = ops.make_staging(kv, per)
    if ctx.on_gpu:
        host = torch.empty(kv.chunk_nbytes(n), dtype=torch.uint8, pin_memory=True)
        s1, s2 = torch.cuda.Stream(ctx.device), torch.cuda.Stream(ctx.device)
    else:
        host = torch.empty(kv.chunk_nbytes(n), dtype=torch.uint8)
        s1 = s2 = None
    refs = _refs(ctx, s, n, host=True)
    for op in ("save_staged", "load_staged"):
        save = op == "save_staged"
        ceiling = ("d2h_pinned" if save else "h2d_pinned") if ctx.on_gpu else "host_memcpy"
        for kind in ID_KINDS:
            case = f"{op} {s.name} n={n} all layers {kind}"
            if kind == "gpu_tensor" and not ctx.on_gpu:
                ctx.skip(case, "GPU ids need a CUDA GPU")
                continue
            ids = s.ids(n, kind, not save, offset=0 if save else n)

            def run(ids=ids, save=save):
                if save:
                    ev = ops.save_staged(kv, ids, host, staging=staging, gather_stream=s1, copy_stream=s2)
                else:
                    ev = ops.load_staged(kv, ids, host, staging=staging, copy_stream=s1, scatter_stream=s2)
                if ev is not None:
                    torch.cuda.current_stream(ctx.device).wait_event(ev)  # the timer's end event follows it

            t, p = _timed(ctx, run, f"{op}/{s.name}/{n}/{kind}")
            yield ctx.row(
                case,
                kv.chunk_nbytes(n),
                t,
                ceiling,
                op=op,
                ids=n,
                id_kind=kind,
                layer_range="all",
                chunk_blocks=per,
                **p,
                **refs,
                **s.params,
            )


@register(
    "op_cost", needs_gpu=False, description="a caller's cost per op call: host us, GPU time alone and queued"
)
def op_cost(ctx: Context):
    if ctx.on_gpu:
        shapes = [("llama3-8b", 32, 8, 128, 16, (512,)), ("small", 2, 2, 64, 16, (512, 8192))]
        modes = (None, (0, 1))
    else:
        shapes = [("tiny", 2, 1, 8, 4, (8, 32))]
        modes = (None, (1, 1))
    for name, layers, heads, dim, bs, counts in shapes:
        s = Shape(ctx, name, layers, heads, dim, bs, max(counts))
        for n in counts:
            yield from _gpu_ops(ctx, s, n, modes)
            yield from _staged_ops(ctx, s, n)
        del s
        if ctx.on_gpu:
            torch.cuda.empty_cache()
