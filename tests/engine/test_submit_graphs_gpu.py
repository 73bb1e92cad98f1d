"""Staged replays on a GPU with the submit-path changes: ids through the pinned ring with many jobs
in flight (a ring buffer must not be rewritten before its copy ran), runtime-call launches vs
torch's, and two execs per graph over alternating slots -- every byte checked. Needs a GPU.

    pytest -m gpu tests/test_submit_graphs_gpu.py -v -s
"""

import random

import pytest
import torch

from kvtier.engine import EngineConfig, TransferEngine
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, random_cache

pytestmark = pytest.mark.gpu
BS = 16
SLEEP = 50_000_000  # GPU cycles (~25 ms): keeps the copy stream busy so jobs queue up behind it


def make(slots, n=8, **kw):
    from kvtier.device import CudaDevice

    dev = CudaDevice()
    kv = random_cache("vllm_flash", 4, 64, BS, 8, 128, torch.bfloat16, "cuda", seed=5)
    pool = PinnedPool(dev, slots * kv.chunk_nbytes(n))  # >= 2 MiB: registered, as in production
    kw.setdefault("staging_bytes", 2 * 3 * kv.block_nbytes)  # 3 blocks per buffer: both reused
    eng = TransferEngine(dev, kv, pool, EngineConfig(sanitize=True, **kw))
    torch.cuda.synchronize()  # the random cache was written on the compute stream: let it land
    return dev, kv, pool, eng


@pytest.mark.parametrize("fused", [True, False])
def test_many_queued_replays_keep_their_own_ids(fused):
    """Saves of one shape with different ids submitted back to back behind a busy copy stream:
    each replay's ids sit in a ring buffer until its copy ran; every slot gets its own blocks."""
    n, jobs = 8, 24
    dev, kv, pool, eng = make(slots=jobs + 1, n=n)
    g, rng = eng.mover.graphs, random.Random(3)
    g.fused = fused and g.fused  # the C helper's call, or the same runtime calls through ctypes
    first = eng.save(list(range(n)), after=None)  # eager + capture of the key
    assert first.wait()
    eng.release(first.slot)
    srcs = [rng.sample(range(64), n) for _ in range(jobs)]
    with torch.cuda.stream(dev.current_stream().raw):
        want = [gather_ref(kv, src) for src in srcs]  # before the sleep: its first kernel loads take ms
    out = []
    with torch.cuda.stream(eng.save_stream.raw):
        torch.cuda._sleep(SLEEP)  # the copies below all wait behind this: every ids copy is queued
    for src in srcs:
        out.append(eng.save(src, after=None))  # back to back: nothing else on the host meanwhile
    assert g.stats.replays == jobs and g.stats.failures == 0, g.stats
    ring = next(iter(g.cache.by_key.values())).ring
    print(f"\nring buffers {len(ring)} (grown {ring.grown}, host waits {ring.waited}); {g.stats}")
    assert len(ring) > 2  # the busy stream kept copies queued: the ring grew instead of overwriting
    for job, w in zip(out, want, strict=True):
        assert job.wait()
        assert bits_equal(job.slot.view(kv.dtype, kv.chunk_shape(n)).cuda(), w)
        eng.release(job.slot)
    eng.close()
    assert pool.stats().used == 0
    pool.close()


@pytest.mark.parametrize("slot_execs", [1, 2])
def test_alternating_slots_bit_exact(slot_execs):
    """Saves and loads alternating over slots (and a third slot now and then): with two execs per
    graph most jobs launch an exec already at their slot; slot bytes are poisoned before reuse."""
    n, ntok, rounds = 8, 8 * BS - 3, 16
    dev, kv, pool, eng = make(slots=4, n=n)
    g, compute, rng = eng.mover.graphs, dev.current_stream(), random.Random(11)
    g.slot_execs = slot_execs
    for c in pool.chunks:
        c.fill_(0xA5)
    held = []
    for i in range(rounds):
        src = rng.sample(range(32), n)
        with torch.cuda.stream(compute.raw):
            want = gather_ref(kv, src, ntok)
        save = eng.save(src, after=compute.record("e_src"), num_tokens=ntok)
        assert save.wait()
        assert bits_equal(save.slot.view(kv.dtype, kv.chunk_shape(n)).cuda(), want), i
        dst = rng.sample(range(32, 64), n)
        idx = torch.tensor(dst, device=kv.device)
        with torch.cuda.stream(compute.raw):
            for x in kv.layers:
                x.view(torch.uint8)[:, idx] = 0xA5
        eng.compute_write(dst, compute.record("e_poison"))  # the load lands after the poison
        load = eng.load(save.slot, dst, num_tokens=ntok)
        load.wait_on(compute)
        with torch.cuda.stream(compute.raw):
            got = gather_ref(kv, dst, ntok)
        eng.compute_read(dst, compute.record("e_check"))
        assert load.wait()
        torch.cuda.synchronize()
        assert bits_equal(got, want), i
        save.slot.tensor.fill_(0xA5)  # e_load completed: nothing reads it any more
        held.append(save.slot)
        if len(held) > (2 if i % 5 else 1):  # mostly two slots in turn, sometimes a third
            eng.release(held.pop(0))
        eng.poll()
    st = g.stats
    print(f"\nslot_execs={slot_execs}: {st}")
    assert st.failures == 0 and st.captures == 2 and st.replays == 2 * rounds - 2, st
    if slot_execs == 2:
        assert st.execs == 2  # one more exec per direction
    for s in held:
        eng.release(s)
    eng.close()
    assert pool.stats().used == 0
    pool.close()


def test_spare_id_arrays_across_queued_rounds_bit_exact():
    """Jobs of SPARE_MIN one-token blocks (the job's id array from spares, `engine/ids.py`) saved
    and loaded back from graph replays queued behind a busy copy stream, round after round: the
    arrays of finished rounds serve the next ones, and every slot and loaded block is bit-exact.
    Without the C helper (not built, or KVTIER_NATIVE=0) no spares are kept: the same jobs run
    through the numpy check, bytes checked alike."""
    from kvtier.device import CudaDevice
    from kvtier.engine.fastpath.fast import fast
    from kvtier.engine.ids import SPARE_MIN

    n, jobs, half = SPARE_MIN, 6, 2 * SPARE_MIN
    dev = CudaDevice()
    kv = random_cache("vllm_flash", 2, 2 * half, 1, 1, 8, torch.bfloat16, "cuda", seed=9)
    pool = PinnedPool(dev, max(2 << 20, (jobs + 1) * kv.chunk_nbytes(n)))
    eng = TransferEngine(
        dev, kv, pool, EngineConfig(path="staged", sanitize=True, staging_bytes=2 * 256 * kv.block_nbytes)
    )
    torch.cuda.synchronize()  # the random cache was written on the compute stream: let it land
    rng = random.Random(13)
    made = 0
    for r in range(4):
        srcs = [rng.sample(range(half), n) for _ in range(jobs)]  # the lower half: no load writes it
        with torch.cuda.stream(dev.current_stream().raw):
            want = [gather_ref(kv, s) for s in srcs]
        with torch.cuda.stream(eng.save_stream.raw):
            torch.cuda._sleep(SLEEP)  # the replays below queue behind it
        saves = [eng.save(torch.tensor(s), after=None) for s in srcs]
        for job, w in zip(saves, want, strict=True):
            assert job.wait()
            assert bits_equal(job.slot.view(kv.dtype, kv.chunk_shape(n)).cuda(), w), r
            dst = rng.sample(range(half, 2 * half), n)
            load = eng.load(job.slot, torch.tensor(dst))
            assert load.wait()
            torch.cuda.synchronize()
            assert bits_equal(gather_ref(kv, dst), w), r
            eng.release(job.slot)
        made = eng.spare_arrays().get(n, 0)  # {} without the C helper: spares are its own
        del saves, job, load
        eng.poll()
    print(f"\n{made} spare arrays for {4 * jobs * 2} jobs; {eng.graph_stats()}")
    assert eng.graph_stats().replays > 0 and eng.graph_stats().failures == 0
    assert made < 4 * jobs * 2 if fast is not None else made == 0
    eng.close()
    assert pool.stats().used == 0
    pool.close()
