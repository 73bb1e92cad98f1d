"""gather / scatter kernels against the PyTorch reference, bit for bit, outputs poisoned first.

Runs on whatever the kernels run on: the GPU, or the CPU through Triton's interpreter
(`TRITON_INTERPRET=1`, set by `make test` without CUDA). Shapes stay small for the interpreter;
tests/test_kernels_gpu.py adds real sizes and pinned host memory.
"""

import pytest
import torch

from kvtier import ops
from kvtier.reference import FORMATS, bits_equal, gather_ref, poison_, random_cache, scatter_ref, snapshot

if not ops.INTERPRETING and not torch.cuda.is_available():
    pytest.skip("kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEV = "cpu" if ops.INTERPRETING else "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


def chunk_for(kv, n):
    return poison_(torch.empty(kv.chunk_shape(n), dtype=kv.dtype, device=DEV))


def check_roundtrip(kv, ids, num_tokens=None, **kw):
    """gather == reference; scatter into other blocks == reference scatter (rest untouched)."""
    n = len(ids)
    dst = chunk_for(kv, n)
    ops.gather(kv, ids, dst, num_tokens=num_tokens, **kw)
    expect = gather_ref(kv, ids, num_tokens)
    assert bits_equal(dst, expect)
    free = [b for b in range(kv.num_blocks) if b not in set(ids)]
    targets = free[:n] if len(free) >= n else list(reversed(ids))
    before = snapshot(kv)
    ops.scatter(kv, targets, dst, num_tokens=num_tokens, **kw)
    got = snapshot(kv)
    for x, b in zip(kv.layers, before, strict=True):
        x.view(b.dtype).copy_(b)
    scatter_ref(kv, targets, dst, num_tokens)
    for a, b in zip(got, snapshot(kv), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_layouts_and_dtypes(fmt, dtype):
    kv = random_cache(fmt, 3, 9, 7, 2, 64, DTYPES[dtype], DEV, seed=1)
    check_roundtrip(kv, [4, 0, 8], num_tokens=2 * 7 + 3)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256, 576])
@pytest.mark.parametrize("block_size", [1, 7, 16, 256])
def test_odd_shapes(block_size, head_dim):
    fmt = "mla" if head_dim == 576 else "flashinfer_hnd" if head_dim in (80, 256) else "vllm_flash"
    kv = random_cache(fmt, 1, 5, block_size, 1, head_dim, torch.bfloat16, DEV, seed=block_size + head_dim)
    tokens = None if block_size == 1 else 2 * block_size - block_size // 2
    check_roundtrip(kv, [3, 1], num_tokens=tokens)


@pytest.mark.parametrize("fmt", ["vllm_flash", "mla", "cross_layer"])
def test_61_layers(fmt):
    kv = random_cache(fmt, 61, 4, 4, 1, 32, torch.float16, DEV, seed=61)
    check_roundtrip(kv, [2, 0], num_tokens=5)


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 31, 32, None])
def test_token_counts(num_tokens):
    kv = random_cache("vllm_flash", 2, 6, 16, 2, 32, torch.float8_e4m3fn, DEV, seed=3)
    ids = [5, 2] if num_tokens is None or num_tokens > 16 else [5]
    check_roundtrip(kv, ids, num_tokens=num_tokens)


@pytest.mark.parametrize("offset", [1, 2, 4, 8])
def test_unaligned_chunk_buffer(offset):
    """A uint8 buffer at an odd address: narrower units, same bits."""
    kv = random_cache("flashinfer_hnd", 2, 5, 3, 2, 96, torch.bfloat16, DEV, seed=offset)
    nbytes = kv.chunk_nbytes(2)
    raw = torch.empty(nbytes + 16, dtype=torch.uint8, device=DEV)
    buf = poison_(raw[offset : offset + nbytes])
    ops.gather(kv, [1, 4], buf, num_tokens=5)
    assert bits_equal(buf.clone().view(kv.dtype).view(kv.chunk_shape(2)), gather_ref(kv, [1, 4], 5))
    before = snapshot(kv)
    ops.scatter(kv, [0, 2], buf, num_tokens=5)
    got = snapshot(kv)
    for x, b in zip(kv.layers, before, strict=True):
        x.view(b.dtype).copy_(b)
    scatter_ref(kv, [0, 2], buf, 5)
    assert all(torch.equal(a, b) for a, b in zip(got, snapshot(kv), strict=True))


@pytest.mark.parametrize("max_ctas", [1, 3])
def test_persistent_grid(max_ctas):
    kv = random_cache("vllm_flash", 2, 12, 4, 2, 64, torch.float32, DEV, seed=9)
    check_roundtrip(kv, [11, 3, 7, 0, 5], num_tokens=19, max_ctas=max_ctas)


def test_block_ids_forms():
    kv = random_cache("vllm_flash", 2, 8, 4, 1, 64, torch.bfloat16, DEV, seed=4)
    want = gather_ref(kv, [6, 1])
    for ids in ([6, 1], (6, 1), torch.tensor([6, 1]), torch.tensor([6, 1], dtype=torch.int32, device=DEV)):
        dst = chunk_for(kv, 2)
        ops.gather(kv, ids, dst)
        assert bits_equal(dst, want)


def test_empty_request_is_a_noop():
    kv = random_cache("vllm_flash", 1, 4, 4, 1, 64, torch.bfloat16, DEV)
    ops.gather(kv, [], torch.empty(kv.chunk_shape(0), dtype=kv.dtype, device=DEV), num_tokens=0)


@pytest.mark.parametrize("fmt", ["vllm_flash", "flashinfer_hnd", "mla"])
def test_staged_matches_direct(fmt):
    """Staged save/load (CPU: in order) writes and reads the same chunk as gather/scatter."""
    if not ops.INTERPRETING:
        pytest.skip("streams version in test_kernels_gpu.py")
    kv = random_cache(fmt, 2, 10, 5, 2, 64, torch.bfloat16, DEV, seed=5)
    ids, tokens = [9, 2, 4, 0, 7], 4 * 5 + 2
    bufs = ops.make_staging(kv, 2)
    host = chunk_for(kv, 5)
    ev = ops.save_staged(kv, ids, host, staging=bufs, gather_stream=None, copy_stream=None, num_tokens=tokens)
    assert ev is None
    assert bits_equal(host, gather_ref(kv, ids, tokens))
    before = snapshot(kv)
    targets = [1, 3, 5, 6, 8]
    ops.load_staged(kv, targets, host, staging=bufs, copy_stream=None, scatter_stream=None, num_tokens=tokens)
    got = snapshot(kv)
    for x, b in zip(kv.layers, before, strict=True):
        x.view(b.dtype).copy_(b)
    ops.scatter(kv, targets, host, num_tokens=tokens)
    assert all(torch.equal(a, b) for a, b in zip(got, snapshot(kv), strict=True))
