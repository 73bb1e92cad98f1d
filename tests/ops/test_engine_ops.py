"""The layer range of the copy kernel (`layers=(first, count)`), which per-layer loads use:
checked against the reference in Triton's interpreter (TRITON_INTERPRET=1) on the CPU."""

import pytest
import torch

from kvtier.reference import bits_equal, gather_ref, poison_, random_cache, scatter_ref, snapshot

ops = pytest.importorskip("kvtier.ops")
if not ops.INTERPRETING:
    pytest.skip(
        "needs TRITON_INTERPRET=1 (CPU) — the GPU runs it in test_engine_gpu.py", allow_module_level=True
    )


@pytest.mark.parametrize("fmt", ["vllm_flash", "flashinfer_hnd", "mla", "cross_layer"])
def test_layer_range_scatter_and_gather(fmt):
    L = 4
    kv = random_cache(fmt, L, 10, 4, 2, 8, torch.bfloat16, seed=3)
    ids, ntok = [6, 1, 8], 2 * 4 + 2
    chunk = gather_ref(kv, [0, 2, 3], ntok).contiguous()
    before = snapshot(kv)
    ops.scatter(kv, ids, chunk, num_tokens=ntok, layers=(1, 2))  # layers 1 and 2 only
    got = snapshot(kv)
    for x, b in zip(kv.layers, before, strict=True):
        x.view(b.dtype).copy_(b)
    expect_chunk = gather_ref(kv, ids)  # untouched layers keep the cache's bytes
    expect_chunk[:, 1:3] = chunk[:, 1:3]
    scatter_ref(kv, ids, expect_chunk, ntok)
    assert all(torch.equal(a, b) for a, b in zip(got, snapshot(kv), strict=True))
    out = poison_(torch.empty(kv.chunk_shape(3), dtype=kv.dtype))
    ops.gather(kv, ids, out, num_tokens=ntok, layers=(3, 1))
    assert bits_equal(out[:, 3], gather_ref(kv, ids, ntok)[:, 3])
    assert bool((out[:, :3].view(torch.uint8) == 0xA5).all())  # other layers not written


def test_layer_range_checked():
    kv = random_cache("vllm_flash", 2, 4, 4, 1, 8, torch.float16)
    out = torch.empty(kv.chunk_shape(1), dtype=kv.dtype)
    for bad in [(2, 1), (0, 0), (1, 2), (-1, 1), [0, 1], (0.0, 1)]:
        with pytest.raises(ValueError, match="layers"):
            ops.gather(kv, [0], out, layers=bad)
