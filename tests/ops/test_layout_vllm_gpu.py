"""GPU-only: vLLM 0.33's six KV-cache orders (`layout.vllm_paged`) at Llama-3-8B's shape and odd
ones, caches allocated the way vLLM does, chunks in GPU and pinned host memory, the staged ops on
their streams and the engine on `CudaDevice`: bit-exact against `kvtier.reference`. Skipped
without CUDA (the CPU runs the same checks in test_layout_vllm.py).
"""

import pytest
import torch

from kvtier import layout, ops
from kvtier.reference import bits_equal, gather_ref, poison_, poison_blocks_, scatter_ref, snapshot

pytestmark = pytest.mark.gpu
ORDERS = layout.VLLM_ORDERS
HEAD_MAJOR = ("LBHNC", "LHBNC", "BLHNC", "BHLNC")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8, "fp32": torch.float32}
LLAMA = (32, 256, 8, 16, 128)  # layers, blocks, kv heads, block_size, head_size: 64 KiB pages in bf16
ODD = {
    "bs1_h3_d64_l5": (5, 40, 3, 1, 64),
    "bs3_h1_d80_l2": (2, 40, 1, 3, 80),
    "bs7_h3_d80_l5": (5, 40, 3, 7, 80),
}


def vllm_cache(order, L, B, H, N, C, dtype, *, seed=0, pad=0):
    """Per-layer [B, H, N, C] views of one raw int8 buffer on the GPU in physical `order`, as
    vLLM 0.33 allocates them (buffer -> physical shape -> permuted to [L, B, H, N, C] -> per
    layer `.view(dtype)`), random bytes; `pad` bytes after each block of a B-first order."""
    es = dtype.itemsize
    sizes = {"L": L, "B": B, "H": H, "N": N, "C": C * es}
    phys = [sizes[a] for a in order]
    g = torch.Generator(device="cuda").manual_seed(seed)
    if order[0] == "B":
        block = L * H * N * C * es
        raw = torch.randint(-128, 128, (B, block + pad), dtype=torch.int8, generator=g, device="cuda")
        buf = raw[:, :block].view(*phys)
    else:
        raw = torch.randint(
            -128, 128, (L * B * H * N * C * es,), dtype=torch.int8, generator=g, device="cuda"
        )
        buf = raw.view(*phys)
    logical = buf.permute(*[order.index(a) for a in "LBHNC"])
    return {f"model.layers.{i}.self_attn.attn": logical[i].view(dtype) for i in range(L)}


def kv_of(order, shape, dtype, **kw):
    L, B, H, N, D = shape
    views = vllm_cache(order, L, B, H, N, 2 * D, dtype, **kw)
    return views, layout.vllm_paged(views, order)


def chunk(kv, n, where):
    pinned = where == "pinned"
    t = torch.empty(kv.chunk_shape(n), dtype=kv.dtype, device="cpu" if pinned else "cuda", pin_memory=pinned)
    return poison_(t)


def as_arg(kv, c):
    return c.view(-1).view(torch.uint8) if kv.dtype == torch.uint8 else c


def expected_block(views, order, b):
    xs = [x[b] if order in HEAD_MAJOR else x[b].transpose(0, 1) for x in views.values()]
    return torch.stack(xs).contiguous()


def check_scatter(kv, targets, src, num_tokens, run):
    poison_blocks_(kv, targets)
    before = snapshot(kv)
    run()
    torch.cuda.synchronize()  # the copy was only submitted
    got = snapshot(kv)
    for x, b in zip(kv.layers, before, strict=True):
        x.view(b.dtype).copy_(b)
    scatter_ref(kv, targets, src.cuda(), num_tokens)
    assert all(torch.equal(a, b) for a, b in zip(got, snapshot(kv), strict=True))


def ids_for(B, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(B, generator=g)[:n], torch.randperm(B, generator=g)[:n]


@pytest.mark.parametrize("where", ["cuda", "pinned"])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("order", ORDERS)
def test_llama_gather_scatter(order, dt, where):
    views, kv = kv_of(order, LLAMA, DTYPES[dt], seed=1)
    ids, targets = ids_for(kv.num_blocks, 64, 1)
    ntok = 63 * 16 + 5
    dst = chunk(kv, 64, where)
    ops.gather(kv, ids, as_arg(kv, dst), num_tokens=ntok)
    torch.cuda.synchronize()  # submitted is not done: read the output once the copy completed
    assert bits_equal(dst.cuda(), gather_ref(kv, ids, ntok))
    want = expected_block(views, order, int(ids[0]))
    assert bits_equal(dst[0].cuda().reshape(want.shape), want)
    repeats = ids[:4].repeat(3)  # gathers may read a block many times
    dup = chunk(kv, 12, where)
    ops.gather(kv, repeats, as_arg(kv, dup))
    torch.cuda.synchronize()
    assert bits_equal(dup.cuda(), gather_ref(kv, repeats))
    check_scatter(kv, targets, dst, ntok, lambda: ops.scatter(kv, targets, as_arg(kv, dst), num_tokens=ntok))


@pytest.mark.parametrize("dt", ["bf16", "fp8"])
@pytest.mark.parametrize("order", ORDERS)
def test_llama_staged(order, dt):
    _, kv = kv_of(order, LLAMA, DTYPES[dt], seed=2)
    ids, targets = ids_for(kv.num_blocks, 100, 2)
    ntok = 99 * 16 + 1
    host, bufs = chunk(kv, 100, "pinned"), ops.make_staging(kv, 32)
    gs, cs = torch.cuda.Stream(), torch.cuda.Stream()
    ops.save_staged(
        kv, ids, as_arg(kv, host), staging=bufs, gather_stream=gs, copy_stream=cs, num_tokens=ntok
    ).synchronize()  # the last DMA completed: the host chunk is whole
    assert bits_equal(host.cuda(), gather_ref(kv, ids, ntok))
    run = lambda: ops.load_staged(  # noqa: E731
        kv, targets, as_arg(kv, host), staging=bufs, copy_stream=cs, scatter_stream=gs, num_tokens=ntok
    )
    check_scatter(kv, targets, host, ntok, run)


@pytest.mark.parametrize("shape", ODD)
@pytest.mark.parametrize("order", ORDERS)
def test_odd_shapes(order, shape):
    _, kv = kv_of(order, ODD[shape], torch.bfloat16, seed=3)
    N = kv.block_size
    ids, targets = ids_for(kv.num_blocks, 9, 3)
    ntok = 8 * N + (N + 1) // 2
    dst = chunk(kv, 9, "pinned")
    ops.gather(kv, ids, dst, num_tokens=ntok)
    torch.cuda.synchronize()
    assert bits_equal(dst.cuda(), gather_ref(kv, ids, ntok))
    check_scatter(kv, targets, dst, ntok, lambda: ops.scatter(kv, targets, dst, num_tokens=ntok))


@pytest.mark.parametrize("order", ORDERS)
def test_mla_and_padded_blocks(order):
    views = vllm_cache(order, 61, 40, 1, 64, 656, torch.uint8, seed=4, pad=256 if order[0] == "B" else 0)
    kv = layout.vllm_paged(views, order, mla=True)  # fp8_ds_mla: a 656-byte blob per token
    ids, targets = ids_for(40, 7, 4)
    dst = chunk(kv, 7, "pinned")
    ops.gather(kv, ids, as_arg(kv, dst), num_tokens=6 * 64 + 1)
    torch.cuda.synchronize()
    assert bits_equal(dst.cuda(), gather_ref(kv, ids, 6 * 64 + 1))
    check_scatter(kv, targets, dst, None, lambda: ops.scatter(kv, targets, as_arg(kv, dst)))


@pytest.mark.parametrize("path", ["staged", "kernel"])
@pytest.mark.parametrize("order", ORDERS)
def test_engine_round_trip(order, path):
    from kvtier.device import CudaDevice
    from kvtier.engine import EngineConfig, TransferEngine
    from kvtier.pool import PinnedPool

    _, kv = kv_of(order, (4, 64, 8, 16, 128), torch.bfloat16, seed=5)
    dev = CudaDevice()
    pool = PinnedPool(dev, 4 * kv.chunk_nbytes(8))
    eng = TransferEngine(
        dev, kv, pool, EngineConfig(path=path, sanitize=True, staging_bytes=6 * kv.block_nbytes)
    )
    torch.cuda.synchronize()  # the random cache was written on the compute stream: let it land
    try:
        src, dst, ntok = [9, 2, 40, 7, 0, 33, 5, 61], [1, 3, 4, 6, 8, 10, 11, 12], 7 * 16 + 5
        want = gather_ref(kv, src, ntok)
        poison_blocks_(kv, dst)  # the load must overwrite them
        torch.cuda.synchronize()
        save = eng.save(src, after=dev.current_stream().record(), num_tokens=ntok)
        assert save.wait()
        assert bits_equal(save.slot.view(kv.dtype, kv.chunk_shape(8)).cuda(), want)
        load = eng.load(save.slot, dst, num_tokens=ntok)
        assert load.wait()
        assert bits_equal(gather_ref(kv, dst, ntok), want)
        eng.release(save.slot)
    finally:
        eng.close()
        pool.close()
        dev.close()
