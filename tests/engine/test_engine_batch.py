"""The batch path's piece list (engine/batch.py), checked on the CPU: the (dst, src, size)
triples it hands cudaMemcpyBatchAsync, executed here by memmove, give the reference chunk."""

import ctypes

import pytest
import torch

from kvtier.reference import bits_equal, gather_ref, poison_, random_cache

batch = pytest.importorskip("kvtier.engine.fastpath.batch")


def run(dsts, srcs, sizes):
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)  # what the copy engine does, one piece at a time


@pytest.mark.parametrize("fmt", ["vllm_flash", "vllm_hnd_memory", "flashinfer_hnd", "mla", "cross_layer"])
@pytest.mark.parametrize("ntok", [None, 2 * 4 + 3])
def test_batch_pieces_round_trip(fmt, ntok):
    kv = random_cache(fmt, 3, 10, 4, 2, 8, torch.bfloat16, seed=5)
    src, dst = torch.tensor([7, 2, 5]), torch.tensor([0, 9, 4])
    valid = 4 if ntok is None else ntok - 8
    host = poison_(torch.empty(kv.chunk_nbytes(3), dtype=torch.uint8))
    run(*batch.prepare(kv, src, valid, host, save=True))
    want = gather_ref(kv, src.tolist(), ntok)
    assert bits_equal(host.view(kv.dtype).view(kv.chunk_shape(3)), want)
    others = [b for b in range(10) if b not in (0, 9, 4)]
    before = gather_ref(kv, others)
    last_before = gather_ref(kv, [4])
    run(*batch.prepare(kv, dst, valid, host, save=False))
    assert bits_equal(gather_ref(kv, dst.tolist(), ntok), want)
    tail = 3 + kv.token_dim  # tokens past num_tokens in the last block stay as they were
    last = gather_ref(kv, [4])
    assert bits_equal(last.narrow(tail, valid, 4 - valid), last_before.narrow(tail, valid, 4 - valid))
    assert bits_equal(gather_ref(kv, others), before)  # no other block written
