"""TransferEngine.load_slots on CUDA: pinned slots from separate saves into a request's blocks,
one UVA launch per layer for all of them; bit for bit, poisoned first; compute that waits for
layer l's event reads layer l complete while later layers may still be in flight. Skipped
without a GPU; the CPU versions are in test_engine_load_slots.py and test_kernels_slots.py."""

import pytest
import torch
from test_engine_gpu import make

from kvtier.reference import bits_equal, gather_ref, poison_blocks_

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt", ["vllm_flash", "flashinfer_hnd", "mla"])
def test_load_slots_round_trip(fmt):
    dev, kv, pool, eng = make(fmt, slots=6, n=8, compute_beside=False)
    groups = [[9, 2, 40, 7], [0, 33, 5, 12], [50, 51, 60]]
    src = [b for g in groups for b in g]
    dst = [1, 3, 4, 6, 8, 10, 11, 13, 14, 15, 16]
    ntok = 10 * 16 + 5  # the last block holds 5 tokens
    want = gather_ref(kv, src, ntok)
    tokens = [None, None, ntok - 8 * 16]
    jobs = [eng.save(g, after=None, num_tokens=t) for g, t in zip(groups, tokens, strict=True)]
    assert all(j.wait() for j in jobs)
    poison_blocks_(kv, dst)  # the load must overwrite them
    torch.cuda.synchronize()
    loads = eng.load_slots([j.slot for j in jobs], dst, num_tokens=ntok)
    assert len(loads) == 3 and len({id(j.event) for j in loads}) == 1
    assert all(j.wait() for j in loads)
    assert bits_equal(gather_ref(kv, dst, ntok), want)
    for j in jobs:
        eng.release(j.slot)
    eng.close()
    assert pool.stats().used == 0
    pool.close()


def test_compute_waiting_for_layer_0_reads_it_complete():
    dev, kv, pool, eng = make(layers=16, blocks=512, slots=8, n=64, compute_beside=False)
    groups = [list(range(i * 64, (i + 1) * 64)) for i in range(4)]
    dst = list(range(256, 512))
    want = gather_ref(kv, [b for g in groups for b in g])
    saves = [eng.save(g, after=None) for g in groups]
    assert all(j.wait() for j in saves)
    for _ in range(3):
        poison_blocks_(kv, dst)
        torch.cuda.synchronize()
        loads = eng.load_slots([j.slot for j in saves], dst)
        compute = dev.current_stream()
        loads[-1].wait_layer(0, compute)  # layer 0 of every slot, one event
        got0 = gather_ref(kv, dst)[:, 0].clone()  # queued on the compute stream after the wait
        torch.cuda.current_stream().synchronize()
        assert bits_equal(got0, want[:, 0])
        assert all(j.wait() for j in loads)
        assert bits_equal(gather_ref(kv, dst), want)
    eng.close()
    pool.close()
