"""Baselines: the ways peers move paged KV today, measured beside the same-run ceilings.

Suites (each a block-size sweep, so the plot has a line per path):
  baseline_gather       torch.index_select per layer, paged GPU -> contiguous GPU  vs d2d_copy (x2 traffic)
  baseline_gather_d2h   the same gather into a GPU buffer, then one pinned D2H copy  vs d2h_pinned
  baseline_swap_blocks  one cudaMemcpyAsync per block from native code (vLLM swap_blocks), D2H and H2D
                        vs d2h_pinned / h2d_pinned; params.submit_ms is the CPU time to submit them
  baseline_host_gather  index_select in host memory (runs without a GPU)               vs host_memcpy

Shape: Llama-3-8B KV (32 layers, 8 KV heads, head_dim 128, bf16), vLLM layout per layer
(2, num_blocks, block_size, heads, head_dim): 8192 tokens (1 GiB) picked by random block ids
from a pool of 65536 tokens (4096 blocks of 16). Every row is checked bit-exact against torch
advanced indexing, on a poisoned output.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from kvtier.bench import Context, SkipSuite, register

BLOCK_SIZES = (1, 4, 16, 64, 256)


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int = 32
    heads: int = 8
    head_dim: int = 128
    tokens: int = 8192  # gathered per run
    pool_tokens: int = 65536  # per layer: 4096 blocks of 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def token_elems(self) -> int:
        return self.heads * self.head_dim

    @property
    def payload(self) -> int:
        """Bytes gathered per run: K and V of `tokens` tokens in every layer."""
        return self.layers * 2 * self.tokens * self.token_elems * self.dtype.itemsize


GPU_FULL, GPU_QUICK = Shape(), Shape(layers=2, tokens=256, pool_tokens=1024)
HOST_FULL, HOST_QUICK = Shape(tokens=2048, pool_tokens=8192), GPU_QUICK


class Workload:
    """A random paged KV pool (one tensor per layer) and a flat output buffer of `payload` bytes."""

    def __init__(self, shape: Shape, device: torch.device, *, pinned_out: bool = False, out_device=None):
        self.shape, self.device = shape, device
        g = torch.Generator(device="cpu").manual_seed(0)
        self.pool = []
        for _ in range(shape.layers):
            layer = torch.empty(
                2, shape.pool_tokens, shape.heads, shape.head_dim, dtype=shape.dtype, device=device
            )
            layer.view(torch.int16).random_()  # random bits: never time or check on zeros
            self.pool.append(layer)
        n = shape.payload // shape.dtype.itemsize
        out_dev = out_device or device
        self.out = torch.empty(n, dtype=shape.dtype, device=out_dev, pin_memory=pinned_out)
        self._gen = g

    def blocks(self, bs: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(per-layer pool views (2, blocks, bs, heads, dim), random block ids on the device, out view
        (layers, 2, n, bs, heads, dim)) for block size `bs` tokens."""
        s = self.shape
        if s.pool_tokens % bs or s.tokens % bs:
            raise ValueError(f"bs: {bs} must divide tokens ({s.tokens}) and pool_tokens ({s.pool_tokens})")
        views = [p.view(2, s.pool_tokens // bs, bs, s.heads, s.head_dim) for p in self.pool]
        ids = torch.randperm(s.pool_tokens // bs, generator=self._gen)[: s.tokens // bs]
        out = self.out.view(s.layers, 2, s.tokens // bs, bs, s.heads, s.head_dim)
        return views, ids.to(self.device), out

    def matches(self, out: torch.Tensor, views: list[torch.Tensor], ids: torch.Tensor) -> bool:
        """Bit-exact: out[l] == views[l][:, ids] for every layer (int16 views: NaN bits compare equal)."""
        ids = ids.to(self.device)
        for layer, v in enumerate(views):
            got = out[layer].to(self.device).view(torch.int16)
            if not torch.equal(got, v[:, ids].view(torch.int16)):
                return False
        return True


def _sizes(ctx: Context) -> tuple[int, ...]:
    return (4, 16) if ctx.quick else BLOCK_SIZES


def _params(shape: Shape, bs: int, path: str) -> dict:
    return dict(
        block_size=bs,
        head_dim=shape.head_dim,
        heads=shape.heads,
        layers=shape.layers,
        tokens=shape.tokens,
        dtype="bf16",
        path=path,
    )


def _sync(ctx: Context) -> None:
    if ctx.on_gpu:
        torch.cuda.synchronize(ctx.device)  # the copies were only submitted; read the output after they end


def _poison(t: torch.Tensor) -> None:
    t.view(torch.int16).fill_(-1)  # a stale output must fail the check, not pass it by luck


def index_select_all(views, ids, out) -> None:
    for layer, v in enumerate(views):
        torch.index_select(v, 1, ids, out=out[layer])


@register("baseline_gather", description="torch.index_select per layer, paged GPU -> contiguous GPU")
def gather(ctx: Context):
    shape = GPU_QUICK if ctx.quick else GPU_FULL
    w = Workload(shape, ctx.device)
    for bs in _sizes(ctx):
        views, ids, out = w.blocks(bs)
        run = lambda: index_select_all(views, ids, out)  # noqa: B023 - used before the loop moves on
        t = ctx.time(run, flush_l2=True, name=f"index_select/bs{bs}")
        _poison(out)
        run()
        _sync(ctx)
        ok = w.matches(out, views, ids)
        yield ctx.row(
            f"index_select bs={bs}",
            shape.payload,
            t,
            "d2d_copy",
            traffic_factor=2,
            correct=ok,
            **_params(shape, bs, "torch index_select GPU->GPU"),
        )


@register("baseline_gather_d2h", description="torch gather into a GPU buffer, then one pinned D2H copy")
def gather_d2h(ctx: Context):
    shape = GPU_QUICK if ctx.quick else GPU_FULL
    w = Workload(shape, ctx.device, pinned_out=True, out_device="cpu")
    stage = torch.empty_like(w.out, device=ctx.device)
    for bs in _sizes(ctx):
        views, ids, host = w.blocks(bs)
        staged = stage.view(host.shape)

        def run() -> None:
            index_select_all(views, ids, staged)  # noqa: B023
            w.out.copy_(stage, non_blocking=True)  # one large DMA into pinned memory

        t = ctx.time(run, name=f"gather_d2h/bs{bs}")
        _poison(w.out)
        run()
        _sync(ctx)
        ok = w.matches(host, views, ids)
        yield ctx.row(
            f"gather+copy bs={bs}",
            shape.payload,
            t,
            "d2h_pinned",
            correct=ok,
            **_params(shape, bs, "torch gather + 1 pinned copy D2H"),
        )


def _submit_ms(ctx: Context, plan, reps: int) -> float:
    """CPU time to submit all copies of `plan`, median of `reps`, each from an idle GPU queue."""
    times = []
    for _ in range(reps):
        _sync(ctx)  # start from an empty queue: a full one would make submission wait for the GPU
        t0 = time.perf_counter()
        plan()
        times.append((time.perf_counter() - t0) * 1e3)  # submitted, not done: this is the CPU cost
    _sync(ctx)
    return statistics.median(times)


@register("baseline_swap_blocks", description="one cudaMemcpyAsync per block from C++ (vLLM swap_blocks)")
def swap_blocks(ctx: Context):
    from lab.native import NativeBuildError, SwapPlan

    shape = GPU_QUICK if ctx.quick else GPU_FULL
    w = Workload(shape, ctx.device, pinned_out=True, out_device="cpu")
    for bs in _sizes(ctx):
        if ctx.profiling and bs < 16:  # 10^5-10^6 memcpy events per run would swamp the trace
            ctx.skip(f"swap_blocks bs={bs}", "not traced: too many copies per run for a readable timeline")
            continue
        views, ids, host = w.blocks(bs)
        ids_cpu = ids.cpu()
        order = torch.arange(len(ids_cpu))
        pairs_out = [(views[layer][k], host[layer][k]) for layer in range(shape.layers) for k in range(2)]
        try:
            save = SwapPlan(pairs_out, torch.stack([ids_cpu, order], 1))
            load = SwapPlan([(d, s) for s, d in pairs_out], torch.stack([order, ids_cpu], 1))
        except NativeBuildError as e:
            raise SkipSuite(str(e)) from None
        params = _params(shape, bs, "")
        params |= {"copies": save.copies, "copy_bytes": bs * shape.token_elems * 2, "native": save.built_with}

        t = ctx.time(save, name=f"swap_d2h/bs{bs}")
        submit = _submit_ms(ctx, save, 3)
        _poison(w.out)
        save()
        _sync(ctx)
        ok = w.matches(host, views, ids)
        params["path"] = "swap_blocks D2H (1 memcpy/block)"
        yield ctx.row(
            f"swap_blocks d2h bs={bs}", shape.payload, t, "d2h_pinned", correct=ok, submit_ms=submit, **params
        )

        # load writes back the blocks it saved: the pool keeps its contents for the next block size
        t = ctx.time(load, name=f"swap_h2d/bs{bs}")
        submit = _submit_ms(ctx, load, 3)
        for v in views:
            v.view(torch.int16).index_fill_(1, ids, -1)  # poison the destination blocks
        load()
        _sync(ctx)
        ok = w.matches(host, views, ids)
        params["path"] = "swap_blocks H2D (1 memcpy/block)"
        yield ctx.row(
            f"swap_blocks h2d bs={bs}", shape.payload, t, "h2d_pinned", correct=ok, submit_ms=submit, **params
        )


@register("baseline_host_gather", needs_gpu=False, description="torch.index_select in host memory (CPU)")
def host_gather(ctx: Context):
    shape = HOST_QUICK if ctx.quick else HOST_FULL
    cpu = torch.device("cpu")
    w = Workload(shape, cpu)
    for bs in _sizes(ctx):
        views, ids, out = w.blocks(bs)
        run = lambda: index_select_all(views, ids, out)  # noqa: B023
        t = ctx.time(run, flush_l2=True, name=f"host_gather/bs{bs}", host=True)
        _poison(out)
        run()
        ok = w.matches(out, views, ids)
        yield ctx.row(
            f"host index_select bs={bs}",
            shape.payload,
            t,
            "host_memcpy",
            correct=ok,
            threads=torch.get_num_threads(),
            **_params(shape, bs, "torch index_select host"),
        )
