"""GPU-only: the launch fast path (the compiled kernel's launcher called directly after the first
launch of a variant) copies exactly what the JIT entry does, for every alignment of ids and chunk;
GPU ids are checked on the device without the host waiting; host ids go through pinned slots."""

import time

import pytest
import torch

from kvtier import ops
from kvtier.reference import bits_equal, gather_ref, poison_, random_cache

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("where", ["cuda", "pinned"])
def test_fast_path_equals_reference_at_every_alignment(where):
    kv = random_cache("vllm_flash", 4, 64, 16, 2, 64, torch.bfloat16, "cuda", seed=11)
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:24].to(torch.int32).cuda()
    n = 8
    nb = kv.chunk_nbytes(n)
    pinned = where == "pinned"
    raw = torch.empty(nb + 64, dtype=torch.uint8, device="cpu" if pinned else "cuda", pin_memory=pinned)
    for rep in range(3):  # the first call compiles; the others take the fast path
        for off in (0, 2, 4, 8, 16):  # chunk addresses of every alignment class
            for s in (0, 1, 3, 4):  # ids slices: 4-byte and 16-byte aligned
                dst = poison_(raw[off : off + nb])
                part = ids[s : s + n]
                ops.gather(kv, part, dst, num_tokens=n * 16 - 5)
                torch.cuda.synchronize()  # submitted is not done
                want = gather_ref(kv, part.cpu(), n * 16 - 5)
                assert bits_equal(dst.cuda().view(kv.dtype).view(want.shape), want), (rep, off, s)
    ops.check(kv)


def test_gpu_ids_do_not_make_the_host_wait():
    kv = random_cache("vllm_flash", 2, 64, 16, 2, 64, torch.bfloat16, "cuda", seed=12)
    ids = torch.arange(8, device="cuda")
    dst = torch.empty(kv.chunk_shape(8), dtype=kv.dtype, device="cuda")
    ops.gather(kv, ids, dst)  # warm: compiled once
    ops.scatter(kv, ids + 8, dst)
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # the stream is busy for a while
    t0 = time.perf_counter()
    ops.gather(kv, ids, dst)
    ops.scatter(kv, ids + 8, dst)
    host_s = time.perf_counter() - t0
    done = torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert not done and host_s < 0.05, host_s  # returned while the stream was still asleep
    ops.check(kv)


def test_gpu_ids_bad_are_skipped_and_raised_at_check():
    kv = random_cache("vllm_flash", 2, 16, 16, 2, 64, torch.bfloat16, "cuda", seed=13)
    dst = poison_(torch.empty(kv.chunk_shape(3), dtype=kv.dtype, device="cuda"))
    ops.gather(kv, torch.tensor([1, 16, 3], device="cuda"), dst)
    torch.cuda.synchronize()
    assert bool((dst[1].view(torch.uint8) == 0xA5).all())
    assert bits_equal(dst[[0, 2]], gather_ref(kv, [1, 3]))
    with pytest.raises(ops.BlockIdError, match="1 out of range"):
        ops.check(kv)
    before = gather_ref(kv, [5])
    ops.scatter(kv, torch.tensor([5, 5, 6], device="cuda", dtype=torch.int32), dst)
    torch.cuda.synchronize()
    assert bits_equal(gather_ref(kv, [5]), before)  # named twice: not written at all
    with pytest.raises(ops.BlockIdError, match="1 repeated"):
        ops.check(kv)


def test_host_ids_through_pinned_slots_many_calls_in_flight():
    kv = random_cache("flashinfer_hnd", 2, 256, 16, 2, 64, torch.float16, "cuda", seed=14)
    g = torch.Generator().manual_seed(3)
    outs, idss = [], []
    torch.cuda._sleep(100_000_000)  # every call below is queued behind this
    for i in range(40):  # more calls than pinned slots: the ring waits, never overwrites
        ids = torch.randperm(256, generator=g)[: 1 + i * 3]
        out = torch.empty(kv.chunk_shape(len(ids)), dtype=kv.dtype, device="cuda")
        ops.gather(kv, ids.tolist() if i % 2 else ids, out)
        outs.append(out)
        idss.append(ids)
    torch.cuda.synchronize()
    for ids, out in zip(idss, outs, strict=True):
        assert bits_equal(out, gather_ref(kv, ids))


def test_staged_and_slots_with_gpu_ids():
    from kvtier.ops.slots import scatter_slots, slot_sources

    kv = random_cache("vllm_flash", 3, 64, 16, 2, 64, torch.bfloat16, "cuda", seed=15)
    perm = torch.randperm(64)
    ids, targets = perm[:10], perm[10:20]
    host = torch.empty(kv.chunk_nbytes(10), dtype=torch.uint8, pin_memory=True)
    gs, cs = torch.cuda.Stream(), torch.cuda.Stream()
    stg = ops.make_staging(kv, 3)
    ops.save_staged(kv, ids.cuda(), host, staging=stg, gather_stream=gs, copy_stream=cs).synchronize()
    assert bits_equal(host.cuda().view(kv.dtype).view(kv.chunk_shape(10)), gather_ref(kv, ids))
    chunk = host.view(kv.dtype).view(kv.chunk_shape(10))
    ops.load_staged(kv, targets.cuda(), host, staging=stg, copy_stream=cs, scatter_stream=gs).synchronize()
    assert bits_equal(gather_ref(kv, targets), chunk.cuda())
    src = slot_sources(kv, targets.flip(0).cuda(), [chunk[:4], chunk[4:]])
    for layer in range(kv.num_layers):
        scatter_slots(kv, src, layers=(layer, 1))
    torch.cuda.synchronize()
    assert bits_equal(gather_ref(kv, targets.flip(0)), chunk.cuda())
    ops.check(kv)
