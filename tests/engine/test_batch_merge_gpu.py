"""The batch path through a TransferEngine on CUDA, for vLLM 0.33's B-first orders at Llama-3-8B's
page (32 layers, 8 KV heads, 16 tokens, 128 dims: a 2 MiB block in bf16, 1 MiB in fp8): `auto`
takes it where a block is one run in the chunk's order (BLHNC, BLNHC, MLA), and every byte of a
save and a load equals the reference, on poisoned outputs. Skipped without a GPU.

    pytest -m gpu tests/engine/test_batch_merge_gpu.py -v -s
"""

import pytest
import torch
from test_batch_merge import vllm_cache

from kvtier import layout
from kvtier.engine import EngineConfig, Path, TransferEngine
from kvtier.engine.fastpath import batch
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, poison_blocks_, scatter_ref, snapshot

pytestmark = pytest.mark.gpu
B_FIRST = ("BLHNC", "BLNHC", "BHLNC")
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.uint8}
IDS = {  # (saved blocks, loaded-into blocks)
    "spread": ([9, 2, 30, 7, 0, 33, 5], [1, 3, 11, 6, 8, 13, 15]),
    "consecutive": (list(range(16, 23)), list(range(24, 31))),  # joined across blocks
    "descending": (list(range(22, 15, -1)), list(range(30, 23, -1))),  # adjacent in the cache only
}


def make(order, dtype, *, pad=0, mla=False, blocks=40):
    from kvtier.device import CudaDevice

    if not batch.available():
        pytest.skip(f"batch path unavailable here: {batch.why_unavailable()}")
    if mla:  # DeepSeek's latent (512 + 64), 16 layers of 64-token blocks: a block of over 1 MiB
        kv = vllm_cache(order, 16, blocks, 1, 64, 576, dtype, pad=pad, mla=True, device="cuda")
    else:
        kv = vllm_cache(order, 32, blocks, 8, 16, 256, dtype, pad=pad, device="cuda")
    torch.cuda.synchronize()  # the random cache was written on the compute stream: let it land
    dev = CudaDevice()
    pool = PinnedPool(dev, 2 * kv.chunk_nbytes(8))
    eng = TransferEngine(dev, kv, pool, EngineConfig(sanitize=True))
    return dev, kv, pool, eng


def round_trip(dev, kv, eng, src, dst, ntok, path):
    """Save `src`, load the slot into poisoned `dst`; both against the reference, every byte of the cache."""
    n = len(src)
    save = eng.save(src, after=dev.current_stream().record(), num_tokens=ntok, path=path)
    assert save.wait()
    assert save.path == "batch"
    want = gather_ref(kv, src, ntok)  # zeros past num_tokens
    chunk = save.slot.view(kv.dtype, kv.chunk_shape(n))
    assert bits_equal(chunk.cuda(), want)
    poison_blocks_(kv, dst)  # a load that missed a byte leaves the poison
    before = snapshot(kv)
    torch.cuda.synchronize()  # the poison and the snapshot (compute stream) land before the load writes
    load = eng.load(save.slot, dst, num_tokens=ntok, path=path)
    assert load.wait()
    assert load.path == "batch"
    got = snapshot(kv)
    for x, b in zip(kv.layers, before, strict=True):
        x.view(b.dtype).copy_(b)  # the poisoned cache again: now the reference loads into it
    scatter_ref(kv, dst, chunk.cuda(), ntok)
    for a, b in zip(got, snapshot(kv), strict=True):
        assert bits_equal(a, b)  # dst as the reference writes it; past num_tokens and elsewhere untouched
    eng.release(save.slot)  # the load completed (waited above): no copy reads the slot any more


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("order", B_FIRST)
def test_auto_takes_batch_where_a_block_is_one_run(order, dtype):
    dev, kv, pool, eng = make(order, dtype)
    try:
        one_run = layout.contiguous_block_run(kv) is not None
        assert one_run == (order != "BHLNC")  # BHLNC's block is [H, L, N, C], the chunk's [L, H, N, C]
        want = Path.BATCH if one_run else Path.STAGED
        assert eng.load_path() is want and eng.load_path(per_layer=True) is want
    finally:
        eng.close()
        pool.close()


@pytest.mark.parametrize("ntok", [None, 6 * 16 + 5], ids=["full", "partial"])
@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("order", B_FIRST)
def test_round_trip(order, dtype, ids, ntok):
    dev, kv, pool, eng = make(order, dtype)
    try:
        path = None if order != "BHLNC" else "batch"  # auto where it takes batch; asked for elsewhere
        round_trip(dev, kv, eng, *ids, ntok, path)
    finally:
        eng.close()
        pool.close()


@pytest.mark.parametrize("order", ["BLHNC", "BLNHC"])
def test_round_trip_padded_block_stride(order):
    dev, kv, pool, eng = make(order, torch.bfloat16, pad=4096)
    try:
        for ids in IDS.values():
            round_trip(dev, kv, eng, *ids, 6 * 16 + 5, None)
    finally:
        eng.close()
        pool.close()


@pytest.mark.parametrize("order", B_FIRST)
def test_round_trip_mla(order):
    dev, kv, pool, eng = make(order, torch.bfloat16, mla=True)
    try:
        assert eng.load_path() is Path.BATCH  # H = 1: every B-first order keeps a block in the chunk's order
        for ids in IDS.values():
            round_trip(dev, kv, eng, *ids, 6 * 64 + 5, None)
    finally:
        eng.close()
        pool.close()
