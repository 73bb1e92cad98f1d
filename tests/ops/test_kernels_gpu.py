"""GPU-only: real sizes (Llama-3-8B shape), pinned host chunks through UVA, the staged paths on
their streams, and the waits that make them correct. Skipped without CUDA.

`pytest tests/test_kernels_gpu.py -k small` is the quick subset run under compute-sanitizer.
"""

import pytest
import torch

from kvtier import ops
from kvtier.reference import FORMATS, bits_equal, gather_ref, poison_, random_cache, scatter_ref, snapshot

pytestmark = pytest.mark.gpu
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


def chunk(kv, n, where):
    pinned = where == "pinned"
    t = torch.empty(kv.chunk_shape(n), dtype=kv.dtype, device="cpu" if pinned else "cuda", pin_memory=pinned)
    return poison_(t)


def streams():
    return torch.cuda.Stream(), torch.cuda.Stream()


def restore(kv, snap):
    for x, b in zip(kv.layers, snap, strict=True):
        x.view(b.dtype).copy_(b)


def check_scatter(kv, targets, src, num_tokens, run):
    """run() scatters `src` into `targets`; compare with the reference from the same start."""
    before = snapshot(kv)
    run()
    torch.cuda.synchronize()  # the copy was only submitted
    got = snapshot(kv)
    restore(kv, before)
    scatter_ref(kv, targets, src, num_tokens)
    assert all(torch.equal(a, b) for a, b in zip(got, snapshot(kv), strict=True))


@pytest.mark.parametrize("where", ["cuda", "pinned"])
def test_small_gather_scatter(where):
    kv = random_cache("vllm_flash", 2, 16, 16, 2, 128, torch.bfloat16, "cuda", seed=1)
    ids, tokens = [7, 0, 12, 3], 3 * 16 + 5
    dst = chunk(kv, 4, where)
    ops.gather(kv, ids, dst, num_tokens=tokens)
    torch.cuda.synchronize()  # submitted is not done: read the output once the copy completed
    assert bits_equal(dst.cuda(), gather_ref(kv, ids, tokens))
    check_scatter(
        kv, [1, 2, 5, 9], dst, tokens, lambda: ops.scatter(kv, [1, 2, 5, 9], dst, num_tokens=tokens)
    )


def test_small_staged():
    kv = random_cache("flashinfer_hnd", 2, 16, 16, 2, 64, torch.float16, "cuda", seed=2)
    ids, tokens = [9, 2, 4, 0, 7], 4 * 16 + 1
    host, bufs = chunk(kv, 5, "pinned"), ops.make_staging(kv, 2)
    gs, cs = streams()
    ops.save_staged(
        kv, ids, host, staging=bufs, gather_stream=gs, copy_stream=cs, num_tokens=tokens
    ).synchronize()  # the returned event: the last DMA has completed, the host chunk is whole
    assert bits_equal(host.cuda(), gather_ref(kv, ids, tokens))
    t = [1, 3, 5, 6, 8]
    run = lambda: ops.load_staged(
        kv, t, host, staging=bufs, copy_stream=cs, scatter_stream=gs, num_tokens=tokens
    )
    check_scatter(kv, t, host, tokens, run)


@pytest.mark.parametrize("where", ["cuda", "pinned"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_layouts_dtypes(fmt, dtype, where):
    kv = random_cache(fmt, 4, 64, 16, 4, 128, DTYPES[dtype], "cuda", seed=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(64, generator=g)[:20]
    dst = chunk(kv, 20, where)
    ops.gather(kv, ids, dst, num_tokens=19 * 16 + 7)
    torch.cuda.synchronize()  # submitted is not done: read the output once the copy completed
    assert bits_equal(dst.cuda(), gather_ref(kv, ids, 19 * 16 + 7))
    targets = torch.randperm(64, generator=g)[:20]
    check_scatter(kv, targets, dst, 310, lambda: ops.scatter(kv, targets, dst, num_tokens=310))


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256, 576])
@pytest.mark.parametrize("block_size", [1, 7, 16, 256])
def test_odd_shapes(block_size, head_dim):
    fmt = "mla" if head_dim == 576 else "flashinfer_hnd" if head_dim == 80 else "vllm_flash"
    kv = random_cache(fmt, 3, 24, block_size, 2, head_dim, torch.bfloat16, "cuda", seed=block_size)
    ids = torch.randperm(24)[:9]
    tokens = 8 * block_size + (block_size + 1) // 2
    dst = chunk(kv, 9, "pinned")
    ops.gather(kv, ids, dst, num_tokens=tokens)
    torch.cuda.synchronize()  # submitted is not done: read the output once the copy completed
    assert bits_equal(dst.cuda(), gather_ref(kv, ids, tokens))
    check_scatter(kv, ids.flip(0), dst, tokens, lambda: ops.scatter(kv, ids.flip(0), dst, num_tokens=tokens))


def test_61_layers_mla():
    kv = random_cache("mla", 61, 40, 64, 1, 576, torch.float8_e4m3fn, "cuda", seed=61)
    dst = chunk(kv, 7, "pinned")
    ops.gather(kv, [39, 0, 5, 6, 7, 20, 33], dst, num_tokens=6 * 64 + 1)
    torch.cuda.synchronize()  # submitted is not done: read the output once the copy completed
    assert bits_equal(dst.cuda(), gather_ref(kv, [39, 0, 5, 6, 7, 20, 33], 6 * 64 + 1))


@pytest.fixture(scope="module")
def llama():
    """Llama-3-8B KV: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks, vLLM layout;
    a pool of 2048 blocks per layer (4 GiB), 256 blocks (4096 tokens, 512 MiB) per request."""
    kv = random_cache("vllm_flash", 32, 2048, 16, 8, 128, torch.bfloat16, "cuda", seed=8)
    g = torch.Generator().manual_seed(8)
    perm = torch.randperm(2048, generator=g)
    yield kv, perm[:256], perm[256:512]
    del kv
    torch.cuda.empty_cache()


@pytest.mark.parametrize("max_ctas", [None, 8])
@pytest.mark.parametrize("where", ["cuda", "pinned"])
def test_llama_direct(llama, where, max_ctas):
    kv, ids, targets = llama
    dst = chunk(kv, 256, where)
    ops.gather(kv, ids, dst, num_tokens=4090, max_ctas=max_ctas)
    torch.cuda.synchronize()  # submitted is not done: read the output once the copy completed
    assert bits_equal(dst.cuda(), gather_ref(kv, ids, 4090))
    run = lambda: ops.scatter(kv, targets, dst, num_tokens=4090, max_ctas=max_ctas)
    check_scatter(kv, targets, dst, 4090, run)


@pytest.mark.parametrize("chunk_blocks", [1, 32, 100, 256])
def test_llama_staged_and_direct_share_the_format(llama, chunk_blocks):
    """A chunk saved by the staged path loads through the kernel, and the other way round."""
    kv, ids, targets = llama
    bufs, (gs, cs) = ops.make_staging(kv, chunk_blocks), streams()
    host = chunk(kv, 256, "pinned")
    ops.save_staged(
        kv, ids, host, staging=bufs, gather_stream=gs, copy_stream=cs, num_tokens=4090
    ).synchronize()  # the returned event: the last DMA has completed, the host chunk is whole
    direct = chunk(kv, 256, "pinned")
    ops.gather(kv, ids, direct, num_tokens=4090)
    torch.cuda.synchronize()  # submitted is not done: read the output once the copy completed
    assert bits_equal(host, direct)
    check_scatter(kv, targets, host, 4090, lambda: ops.scatter(kv, targets, host, num_tokens=4090))
    run = lambda: ops.load_staged(
        kv, targets, direct, staging=bufs, copy_stream=cs, scatter_stream=gs, num_tokens=4090
    )
    check_scatter(kv, targets, direct, 4090, run)


def test_staged_save_waits_for_the_compute_event(llama):
    """The save must see KV written on the compute stream after a long delay: without the wait
    it would copy the old values."""
    kv, ids, _ = llama
    compute, (gs, cs) = torch.cuda.Stream(), streams()
    bufs, host = ops.make_staging(kv, 32), chunk(kv, 256, "pinned")
    torch.cuda.synchronize()  # an idle GPU: only the `written` event orders the save after the write
    with torch.cuda.stream(compute):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the save is submitted long before the write
        for x in kv.layers:
            x.view(torch.int16)[:, ids] = 0x1234
        written = torch.cuda.Event()
        written.record(compute)
    ops.save_staged(
        kv, ids, host, staging=bufs, gather_stream=gs, copy_stream=cs, wait_event=written
    ).synchronize()  # the returned event: the last DMA has completed, the host chunk is whole
    assert bool((host.view(torch.int16) == 0x1234).all())


def test_gpu_block_ids_and_block_ids_object(llama):
    kv, ids, _ = llama
    want = gather_ref(kv, ids)
    for b in (ids.cuda(), ids.to(torch.int32).cuda(), ops.block_ids(kv, ids, unique=False)):
        dst = chunk(kv, 256, "cuda")
        ops.gather(kv, b, dst)
        torch.cuda.synchronize()  # submitted is not done
        assert bits_equal(dst, want)


def test_small_refuses_pageable_and_wrong_devices():
    kv = random_cache("vllm_flash", 1, 4, 16, 1, 64, torch.bfloat16, "cuda")
    pageable = torch.empty(kv.chunk_shape(1), dtype=kv.dtype)
    with pytest.raises(ValueError, match="pageable"):
        ops.gather(kv, [1], pageable)
    gs, cs = streams()
    with pytest.raises(ValueError, match="pinned host memory"):
        ops.save_staged(
            kv, [1], chunk(kv, 1, "cuda"), staging=ops.make_staging(kv, 1), gather_stream=gs, copy_stream=cs
        )
    with pytest.raises(ValueError, match="torch.cuda.Stream"):
        ops.save_staged(
            kv,
            [1],
            chunk(kv, 1, "pinned"),
            staging=ops.make_staging(kv, 1),
            gather_stream=None,
            copy_stream=cs,
        )
    cpu_kv = random_cache("vllm_flash", 1, 4, 16, 1, 64, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ops.gather(cpu_kv, [1], pageable)
