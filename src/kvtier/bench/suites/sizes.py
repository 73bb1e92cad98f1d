"""The `sizes` suite: GB/s over the size of one transfer, 1 MiB to 1 GiB (--quick: to 64 MiB), the
sweep nvbandwidth's users read: where a copy reaches its ceiling, and where fixed costs rule.

  GPU  pinned copy h2d / d2h   one `copy_` of the size (the copy engine alone)    vs h2d / d2h_pinned
       staged save / load      kvtier's staged path (`ops.save_staged` /          vs d2h / h2d_pinned
                               `load_staged`): Llama-3-8B KV of the size,
                               random 16-token blocks <-> one pinned chunk
  CPU  memcpy                  one host `copy_` of the size                       vs host_memcpy
       engine save / load      `TransferEngine` on `SimDevice` (what kvtier runs   vs host_memcpy
                               without a GPU): Llama-3-8B KV of the size, random
                               16-token blocks <-> one pool slot, until it landed

Each kvtier row is checked bit for bit once on a poisoned output. A size smaller than one 16-token
block of that shape (2 MiB) takes smaller blocks (params block_size). The ceilings are this run's
probes at their own, larger size (`Context.ceiling_bytes`).
"""

from __future__ import annotations

import torch

from kvtier import layout, ops
from kvtier.bench.suite import Context, GiB, MiB, register
from kvtier.reference import bits_equal, gather_ref, poison_

SIZES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB)
QUICK_SIZES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
LAYERS, HEADS, DIM = 32, 8, 128  # the Llama-3-8B KV shape, bf16: 128 KiB per token
PER_TOKEN = LAYERS * 2 * HEADS * DIM * 2


def _label(n: int) -> str:
    return f"{n // GiB} GiB" if n >= GiB else f"{n // MiB} MiB"


class _Paged:
    """A paged cache twice the request, at the block size that fits `nbytes`, and a random request."""

    def __init__(self, ctx: Context, nbytes: int) -> None:
        tokens = nbytes // PER_TOKEN
        self.bs = min(16, tokens)
        blocks = 2 * tokens // self.bs
        pool = [
            torch.empty(2, blocks, self.bs, HEADS, DIM, dtype=torch.bfloat16, device=ctx.device)
            for _ in range(LAYERS)
        ]
        for t in pool:
            t.view(torch.uint8).random_(0, 256)  # random bits: never time or check on zeros
        self.kv = layout.vllm_flash(pool)
        perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(nbytes))
        self.n = tokens // self.bs
        self.src, self.dst = (
            ops.block_ids(self.kv, perm[: self.n]),
            ops.block_ids(self.kv, perm[self.n : 2 * self.n]),
        )


@register(
    "sizes", needs_gpu=False, description="GB/s over transfer size, 1 MiB - 1 GiB (nvbandwidth's sweep)"
)
def sizes(ctx: Context):
    for nbytes in QUICK_SIZES if ctx.quick else SIZES:
        yield from (_gpu_rows if ctx.on_gpu else _cpu_rows)(ctx, nbytes)
        if ctx.on_gpu:
            torch.cuda.empty_cache()  # this size's buffers go before the next, larger size's


def _cpu_rows(ctx: Context, nbytes: int):
    from kvtier.device import SimDevice
    from kvtier.engine import EngineConfig, TransferEngine
    from kvtier.pool import PinnedPool

    a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    a.random_(0, 256)
    label = _label(nbytes)
    t = ctx.time(lambda: b.copy_(a), name=f"memcpy/{label}")
    yield ctx.row(f"memcpy {label}", nbytes, t, "host_memcpy", path="memcpy (torch copy_)")
    p = _Paged(ctx, nbytes)
    dev = SimDevice(copy_delay=0.0)
    pool = PinnedPool(dev, max(2 * MiB, 2 * p.kv.chunk_nbytes(p.n)))
    eng = TransferEngine(
        dev, p.kv, pool, EngineConfig(staging_bytes=min(512 * MiB, 4 * p.kv.chunk_nbytes(1)))
    )
    try:
        ref = gather_ref(p.kv, p.src.cpu)
        job = eng.save(p.src.cpu, after=None)
        eng.wait(job)  # the slot holds the chunk only once the save's copies completed
        ok = bits_equal(job.slot.view(p.kv.dtype, p.kv.chunk_shape(p.n)), ref)
        _poison_blocks(p.kv, p.dst)
        eng.wait(eng.load(job.slot, p.dst.cpu))  # the blocks are read below only once it landed
        loaded = bits_equal(gather_ref(p.kv, p.dst.cpu), ref)
        eng.release(job.slot)

        def save() -> None:
            j = eng.save(p.src.cpu, after=None)
            eng.wait(j)  # timed until the copy landed, not until it was queued
            eng.release(j.slot)

        slot = eng.save(p.src.cpu, after=None).slot

        def load() -> None:
            eng.wait(eng.load(slot, p.dst.cpu))  # timed until the blocks hold the chunk

        size = p.kv.chunk_nbytes(p.n)
        for name, fn, good in (("save", save, ok), ("load", load, loaded)):
            t = ctx.time(fn, name=f"{name}/{label}")
            path = f"kvtier engine {name} (SimDevice: CPU threads as copy streams)"
            yield ctx.row(
                f"engine {name} {label}", size, t, "host_memcpy", correct=good, path=path, block_size=p.bs
            )
        eng.release(slot)
    finally:
        eng.close()
        pool.close()
        dev.close()


def _gpu_rows(ctx: Context, nbytes: int):
    from kvtier.bench.suites.kv import _staged

    dev = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).random_(0, 256)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    label = _label(nbytes)
    t = ctx.time(lambda: dev.copy_(host, non_blocking=True), name=f"h2d/{label}")
    yield ctx.row(f"pinned copy h2d {label}", nbytes, t, "h2d_pinned", path="pinned copy h2d (copy engine)")
    t = ctx.time(lambda: host.copy_(dev, non_blocking=True), name=f"d2h/{label}")
    yield ctx.row(f"pinned copy d2h {label}", nbytes, t, "d2h_pinned", path="pinned copy d2h (copy engine)")
    p = _Paged(ctx, nbytes)
    chunk = torch.empty(p.kv.chunk_shape(p.n), dtype=p.kv.dtype, pin_memory=True)
    size = chunk.numel() * chunk.element_size()
    blocks = max(1, min(p.n, 64 * MiB // p.kv.block_nbytes))  # staging buffers of up to 64 MiB
    torch.cuda.synchronize()  # the random cache and the ids have landed before the first copy
    for save in (True, False):
        run = _staged(p.kv, p.src if save else p.dst, chunk, blocks, save)
        if save:
            poison_(chunk)  # a byte the save did not write fails the check
        else:
            _poison_blocks(p.kv, p.dst)
        run()
        torch.cuda.synchronize()  # submitted is not done: check once the copies completed
        ok = (
            bits_equal(chunk.to(ctx.device), gather_ref(p.kv, p.src.cpu))
            if save
            else bits_equal(gather_ref(p.kv, p.dst.cpu), gather_ref(p.kv, p.src.cpu))
        )
        t = ctx.time(run, name=f"{'save' if save else 'load'}/{label}")
        path = "kvtier staged save (GPU -> pinned)" if save else "kvtier staged load (pinned -> GPU)"
        ceiling = "d2h_pinned" if save else "h2d_pinned"
        yield ctx.row(
            f"staged {'save' if save else 'load'} {label}",
            size,
            t,
            ceiling,
            correct=ok,
            path=path,
            block_size=p.bs,
        )


def _poison_blocks(kv, ids) -> None:
    idx = ids.dev.long()
    for layer in range(kv.num_layers):  # a block the load left as it was must fail the check
        kv.block_view(layer).view(torch.uint8)[:, idx] = 0xA5
