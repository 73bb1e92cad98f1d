"""GPU-only: ids refused at the host check give their pinned slot back (nothing was enqueued), so
refusals never use the ring up; a lazily checked scatter claims its ids on every call, through
the JIT entry first and the kept claim kernel after, at every ids alignment."""

import pytest
import torch

from kvtier import ops
from kvtier.reference import bits_equal, gather_ref, random_cache, snapshot

pytestmark = pytest.mark.gpu


def test_refused_host_ids_free_their_pinned_slot():
    kv = random_cache("vllm_flash", 2, 64, 16, 2, 64, torch.bfloat16, "cuda", seed=21)
    dst = torch.empty(kv.chunk_shape(2), dtype=kv.dtype, device="cuda")
    for _ in range(3 * 16):  # more refusals than the ring has slots
        with pytest.raises(ValueError, match="out of range"):
            ops.gather(kv, [1, 64], dst)
        with pytest.raises(ValueError, match="duplicate"):
            ops.scatter(kv, [3, 3], dst)
        with pytest.raises(ValueError, match="num_tokens"):
            ops.gather(kv, [1, 2], dst, num_tokens=40)
    ops.gather(kv, [5, 9], dst)
    torch.cuda.synchronize()  # submitted is not done
    assert bits_equal(dst, gather_ref(kv, [5, 9]))


def test_gpu_ids_scatter_claims_on_every_call():
    kv = random_cache("vllm_flash", 2, 16, 16, 2, 64, torch.bfloat16, "cuda", seed=22)
    src = torch.randn(kv.chunk_shape(3), device="cuda").to(kv.dtype)
    keep = gather_ref(kv, [5])
    calls = 0
    for dt in (torch.int32, torch.int64):
        ids = torch.tensor([9, 5, 5, 6], device="cuda", dtype=dt)
        for s in (0, 1):  # ids slices at two alignments: two variants of the claim kernel
            for _ in range(3):  # the first call compiles; the others launch the kept kernel
                ops.scatter(kv, ids[s : s + 3], src)
                calls += 1
    torch.cuda.synchronize()  # the flag holds every call's count once they completed
    with pytest.raises(ops.BlockIdError, match=f"0 out of range and {calls} repeated"):
        ops.check(kv)  # one repeat per call: a stale stamp would flag 9 and 6 too
    assert bits_equal(gather_ref(kv, [5]), keep)  # named twice: never written
    assert bits_equal(gather_ref(kv, [9]), src[:1]) and bits_equal(gather_ref(kv, [6]), src[2:])
    before = snapshot(kv)
    ops.scatter(kv, torch.tensor([2, 3, 4], device="cuda"), src)
    torch.cuda.synchronize()
    ops.check(kv)  # good ids: nothing flagged
    assert not all(torch.equal(a, b) for a, b in zip(before, snapshot(kv), strict=True))
