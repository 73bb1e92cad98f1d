"""Suites of kvtier's own KV copy paths, beside the same-run ceilings (and a torch baseline).

  gather_d2d  paged GPU <-> contiguous GPU, one kernel for all layers      vs d2d_copy (x2: read + write)
  save_d2h    paged GPU -> pinned host: UVA kernel (full / capped grid), staged gather + DMA  vs d2h_pinned
  load_h2d    pinned host -> paged GPU: UVA kernel, staged DMA + scatter                      vs h2d_pinned
  shapes      head_dim x dtype at 16-token blocks, every direction

Shape: Llama-3-8B KV (32 layers, 8 KV heads, head_dim 128, bf16), vLLM flash layout per layer,
random block ids from a pool 4x larger than the request. Headline rows: 16-token blocks, 1 GiB;
then block sizes 1..256 and the shapes sweep, also at 1 GiB (the ceilings are 1-4 GiB copies).
Each row is checked bit-exact once against `kvtier.reference`, on a poisoned output. GPU-resident
rows are timed as CUDA-graph replays (the kernel, not Python's launch); host rows eagerly (tens of
ms), beside one pinned DMA of the same buffer.
"""

from __future__ import annotations

import torch

from kvtier import layout, ops
from kvtier.bench.suite import Context, GiB, MiB, SkipSuite, register
from kvtier.reference import bits_equal, gather_ref, poison_

BLOCK_SIZES = (1, 4, 8, 16, 32, 64, 128, 256)
HEAD_DIMS = (64, 80, 96, 128, 256, 576)  # 576: MLA latent (DeepSeek-V3: 61 layers, one latent)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}
STAGE_CHUNK = 64 * MiB  # staged path: bytes per DMA (per staging buffer)


class Work:
    """A random paged pool, viewed at any block size, and one request of `payload` bytes."""

    def __init__(self, ctx: Context, payload: int, *, layers=32, heads=8, head_dim=128, dtype=torch.bfloat16):
        self.ctx, self.mla = ctx, head_dim == 576
        if self.mla:
            layers, heads = 61, 1
        self.layers, self.heads, self.head_dim, self.dtype = layers, heads, head_dim, dtype
        self.nkv = 1 if self.mla else 2
        per_token = layers * self.nkv * heads * head_dim * dtype.itemsize
        self.tokens = max(256, payload // per_token // 256 * 256)
        self.payload = self.tokens * per_token
        self.pool_tokens = 4 * self.tokens
        self.pool = []
        for _ in range(layers):
            t = torch.empty(self.nkv * self.pool_tokens * heads * head_dim, dtype=dtype, device=ctx.device)
            t.view(torch.uint8).random_(0, 256)  # random bits: never time or check on zeros
            self.pool.append(t)
        self.gen = torch.Generator().manual_seed(0)

    def request(self, bs: int) -> tuple[layout.PagedKV, ops.BlockIds, ops.BlockIds]:
        """(cache at block size bs, ids of the request, other distinct ids to load into)."""
        nb = self.pool_tokens // bs
        if self.mla:
            kv = layout.mla([t.view(nb, bs, self.head_dim) for t in self.pool])
        else:
            kv = layout.vllm_flash([t.view(2, nb, bs, self.heads, self.head_dim) for t in self.pool])
        n = self.tokens // bs
        perm = torch.randperm(nb, generator=self.gen)
        src, dst = ops.block_ids(kv, perm[:n]), ops.block_ids(kv, perm[n : 2 * n])
        torch.cuda.synchronize(self.ctx.device)  # ids landed: the ops may be captured in a CUDA graph
        return kv, src, dst

    def params(self, bs: int, path: str, **kw) -> dict:
        name = next(k for k, v in DTYPES.items() if v == self.dtype)
        shape = dict(block_size=bs, head_dim=self.head_dim, heads=self.heads, layers=self.layers, dtype=name)
        return shape | dict(layout="mla" if self.mla else "vllm_flash", tokens=self.tokens, path=path, **kw)


def _chunk(kv, n, pinned: bool) -> torch.Tensor:
    if pinned:
        return torch.empty(kv.chunk_shape(n), dtype=kv.dtype, pin_memory=True)
    return torch.empty(kv.chunk_shape(n), dtype=kv.dtype, device=kv.device)


def _saved_ok(kv, ids, out, run) -> bool:
    poison_(out)
    run()
    torch.cuda.synchronize()  # submitted is not done: read the output after the copy completed
    return bits_equal(out.to(kv.device), gather_ref(kv, ids.cpu))


def _loaded_ok(kv, ids, src, run) -> bool:
    idx = ids.dev.long()
    for layer in range(kv.num_layers):  # poison the destination blocks: a block left as it was must fail
        kv.block_view(layer).view(torch.uint8)[:, idx] = 0xA5
    run()
    torch.cuda.synchronize()  # submitted is not done
    return bits_equal(gather_ref(kv, ids.cpu), src.to(kv.device))


def _staged(kv, ids, host, chunk_blocks, save: bool):
    bufs, s1, s2 = ops.make_staging(kv, chunk_blocks), torch.cuda.Stream(), torch.cuda.Stream()

    def run():
        cur = torch.cuda.current_stream()
        start = torch.cuda.Event()
        start.record(cur)  # the copy starts after what the timer queued before it (L2 flush)
        if save:
            ev = ops.save_staged(
                kv, ids, host, staging=bufs, gather_stream=s1, copy_stream=s2, wait_event=start
            )
        else:
            ev = ops.load_staged(
                kv, ids, host, staging=bufs, copy_stream=s1, scatter_stream=s2, wait_event=start
            )
        cur.wait_event(ev)  # the timer's end event must follow the last DMA / scatter

    return run


def _gpu_rows(ctx: Context, w: Work, bs: int, label: str, *, scatter=True, baseline=False, caps=()):
    """Gather (default grid, then each cap in `caps`) and scatter rows; with `baseline`, also the
    default gather timed eagerly (Python launch included) and torch's advanced-indexing gather."""
    kv, src, dst = w.request(bs)
    out = _chunk(kv, len(src), pinned=False)
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    checked = {}
    for cap in (None, *caps):
        run = lambda c=cap: ops.gather(kv, src, out, max_ctas=c)
        ok = checked[cap] = _saved_ok(kv, src, out, run)
        t = ctx.time(run, flush_l2=True, graph=True, name=f"gather/{label}/ctas{cap}")
        p = w.params(bs, "triton gather GPU->GPU", max_ctas=cap, ctas_per_sm=(cap or 0) / sms, launch="graph")
        case = f"gather {label}" + (f" ctas={cap}" if cap else "")
        yield ctx.row(case, w.payload, t, "d2d_copy", traffic_factor=2, correct=ok, **p)
    if scatter:
        run = lambda: ops.scatter(kv, dst, out)
        ok = _loaded_ok(kv, dst, out, run)
        t = ctx.time(run, flush_l2=True, graph=True, name=f"scatter/{label}")
        p = w.params(bs, "triton scatter GPU->GPU", launch="graph")
        yield ctx.row(f"scatter {label}", w.payload, t, "d2d_copy", traffic_factor=2, correct=ok, **p)
    if baseline:
        run = lambda: ops.gather(kv, src, out)
        t = ctx.time(run, flush_l2=True, name=f"gather_eager/{label}")
        p = w.params(bs, "triton gather GPU->GPU", launch="eager")
        ok = checked[None]  # the same call as the first row, checked there
        yield ctx.row(f"gather {label} eager", w.payload, t, "d2d_copy", traffic_factor=2, correct=ok, **p)
        idx = src.dev.long()
        views = [kv.block_view(layer) for layer in range(kv.num_layers)]

        def torch_gather():
            for layer, v in enumerate(views):
                out[:, layer] = v[:, idx].transpose(0, 1)

        ok = _saved_ok(kv, src, out, torch_gather)
        t = ctx.time(torch_gather, flush_l2=True, name=f"torch_gather/{label}")
        p = w.params(bs, "torch advanced indexing GPU->GPU", launch="eager")
        yield ctx.row(f"torch gather {label}", w.payload, t, "d2d_copy", traffic_factor=2, correct=ok, **p)


def _host_rows(ctx: Context, w: Work, bs: int, label: str, *, save: bool, uva=True, caps=(), chunks=None):
    kv, src, dst = w.request(bs)
    host = _chunk(kv, len(src), pinned=True)
    ceiling = "d2h_pinned" if save else "h2d_pinned"
    if not save:  # a chunk to load: the request's blocks
        ops.gather(kv, src, host)
        torch.cuda.synchronize()  # the chunk must be complete before it is loaded from
    ids = src if save else dst
    check = _saved_ok if save else _loaded_ok
    for cap in (None, *caps) if uva else ():
        op = ops.gather if save else ops.scatter
        run = lambda c=cap, op=op: op(kv, ids, host, max_ctas=c)
        ok = check(kv, ids, host, run)
        t = ctx.time(run, name=f"{'save' if save else 'load'}_uva/{label}/ctas{cap}")
        p = w.params(bs, f"triton UVA {'GPU->pinned' if save else 'pinned->GPU'}", max_ctas=cap)
        yield ctx.row(
            f"uva {label}" + (f" ctas={cap}" if cap else ""), w.payload, t, ceiling, correct=ok, **p
        )
    yield from _dma_row(ctx, w, bs, label, host, save, ceiling)
    for cb in chunks or (max(1, STAGE_CHUNK // kv.block_nbytes),):
        cb = min(cb, len(ids))
        run = _staged(kv, ids, host, cb, save)
        ok = check(kv, ids, host, run)
        t = ctx.time(run, name=f"{'save' if save else 'load'}_staged/{label}/chunk{cb}")
        path = "staged gather + pinned DMA" if save else "staged pinned DMA + scatter"
        p = w.params(bs, path, chunk_blocks=cb, chunk_mib=cb * kv.block_nbytes / MiB)
        yield ctx.row(f"staged {label} chunk={cb}", w.payload, t, ceiling, correct=ok, **p)


def _dma_row(ctx: Context, w: Work, bs: int, label: str, host: torch.Tensor, save: bool, ceiling: str):
    """One pinned DMA of the same bytes into (out of) the same host buffer: the rate this buffer
    allows, beside the ceiling (measured on a buffer of its own)."""
    flat = host.view(-1).view(torch.uint8)
    dev = torch.empty_like(flat, device=ctx.device).random_()
    run = (
        (lambda: flat.copy_(dev, non_blocking=True)) if save else (lambda: dev.copy_(flat, non_blocking=True))
    )
    t = ctx.time(run, name=f"{'save' if save else 'load'}_dma/{label}")
    p = w.params(bs, "one pinned DMA of the same buffer, contiguous (reference)")
    yield ctx.row(f"dma {label} same buffer", w.payload, t, ceiling, **p)


def _need_gpu(ctx: Context) -> None:
    if not ctx.on_gpu:
        raise SkipSuite("needs a CUDA GPU")


def _sizes(ctx: Context) -> tuple[int, int, tuple[int, ...]]:
    """(headline payload, sweep payload, block sizes)."""
    return (32 * MiB, 16 * MiB, (1, 16, 256)) if ctx.quick else (GiB, GiB, BLOCK_SIZES)


@register("gather_d2d", description="kvtier gather/scatter kernel, paged GPU <-> contiguous GPU")
def gather_d2d(ctx: Context):
    _need_gpu(ctx)
    head, sweep, sizes = _sizes(ctx)
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    w = Work(ctx, head, layers=2 if ctx.quick else 32)
    caps = (sms, 4 * sms, 16 * sms, 1 << 30)  # 1 << 30: one program per tile, no persistent loop
    yield from _gpu_rows(ctx, w, 16, "bs16 llama3-8b", baseline=True, caps=caps)
    del w
    w = Work(ctx, sweep, layers=2 if ctx.quick else 32)
    for bs in sizes:
        yield from _gpu_rows(ctx, w, bs, f"bs{bs} sweep")


def _host_suite(ctx: Context, save: bool):
    _need_gpu(ctx)
    head, sweep, sizes = _sizes(ctx)
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    w = Work(ctx, head, layers=2 if ctx.quick else 32)
    caps = (sms, 32, 1 << 30)  # fewer programs leave SMs to compute; 1 << 30: one per tile
    yield from _host_rows(ctx, w, 16, "bs16 llama3-8b", save=save, caps=caps, chunks=(16, 64, 128))
    del w
    w = Work(ctx, sweep, layers=2 if ctx.quick else 32)
    for bs in sizes:
        yield from _host_rows(ctx, w, bs, f"bs{bs} sweep", save=save)


@register("save_d2h", description="paged GPU -> pinned host: UVA kernel and staged gather + DMA")
def save_d2h(ctx: Context):
    yield from _host_suite(ctx, save=True)


@register("load_h2d", description="pinned host -> paged GPU: UVA kernel and staged DMA + scatter")
def load_h2d(ctx: Context):
    yield from _host_suite(ctx, save=False)


@register("shapes", description="head_dim x dtype sweep at 16-token blocks: GPU<->GPU, save, load")
def shapes(ctx: Context):
    _need_gpu(ctx)
    sweep = 16 * MiB if ctx.quick else GiB
    dims = (80, 576) if ctx.quick else HEAD_DIMS
    for head_dim in dims:
        for name, dtype in DTYPES.items():
            w = Work(ctx, sweep, head_dim=head_dim, dtype=dtype, layers=2 if ctx.quick else 32)
            label = f"d{head_dim} {name}"
            yield from _gpu_rows(ctx, w, 16, label)
            uva = name == "bf16"  # the UVA kernel once per head_dim; the staged path everywhere
            yield from _host_rows(ctx, w, 16, label, save=True, uva=uva)
            yield from _host_rows(ctx, w, 16, label, save=False, uva=uva)
            del w
            torch.cuda.empty_cache()
