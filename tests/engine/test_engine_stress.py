"""Stress: many save/load jobs from threads with random delays, sanitizer on, every byte checked,
the pool fully free at the end."""

import random
import threading

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.lifecycle import Access
from kvtier.pool import PinnedPool
from kvtier.reference import gather_ref, random_cache

pytestmark = pytest.mark.usefixtures("slab")  # each test with the C and the Python bookkeeping

THREADS, ROUNDS, PER = 6, 20, 3  # each thread owns 2 * PER blocks: A (computed, saved), B (loaded)
L, BS, H, D = 2, 4, 2, 8


def expected_chunk(vals):
    """The chunk (n, L, 2, bs, H, D) of blocks written with vals[l] = (2, n, bs, H, D)."""
    return torch.stack([v.transpose(0, 1) for v in vals], dim=1)


def test_concurrent_jobs_every_byte_checked():
    dev = SimDevice(copy_delay=(0.0, 0.003), launch_delay=(0.0, 0.002), seed=3)
    kv = random_cache("vllm_flash", L, THREADS * 2 * PER, BS, H, D, torch.bfloat16, seed=2)
    pool = PinnedPool(dev, 4 * kv.chunk_nbytes(PER))  # 4 slots for 6 threads: back-pressure
    eng = TransferEngine(dev, kv, pool, EngineConfig(sanitize=True, staging_bytes=2 * kv.block_nbytes))
    compute = dev.current_stream()
    errors, checked = [], [0]
    lock = threading.Lock()

    def worker(t):
        rng = random.Random(t)
        gen = torch.Generator().manual_seed(t)
        a = list(range(t * 2 * PER, t * 2 * PER + PER))
        b = list(range(t * 2 * PER + PER, (t + 1) * 2 * PER))
        for r in range(ROUNDS):
            vals = [torch.randn(2, PER, BS, H, D, generator=gen).to(torch.bfloat16) for _ in range(L)]
            with lock:  # one submission at a time on the shared compute stream, as a model would
                waits = eng.blocks.waits_for(Access.WRITE, a, stream=compute)
                for e in waits:
                    compute.wait_event(e)  # new KV must not land while a save still reads the blocks

                def write(vals=vals):
                    for x, v in zip(kv.layers, vals, strict=True):
                        x[:, a] = v

                dev.launch(write, compute)
                e_write = compute.record(f"write{t}.{r}")
                eng.compute_write(a, e_write, waited=waits)
            path = rng.choice(["staged", "kernel"])
            save = eng.save(a, after=e_write, path=path, timeout=10)
            want = expected_chunk(vals)
            if rng.random() < 0.3:
                assert save.wait()
            assert save.wait(timeout=10)
            if not torch.equal(save.slot.view(kv.dtype, kv.chunk_shape(PER)), want):
                errors.append(f"thread {t} round {r}: saved slot differs")
            load = eng.load(save.slot, b, path=rng.choice(["staged", "kernel"]), per_layer=rng.random() < 0.5)
            out = {}
            with lock:
                load.wait_on(compute)  # attention over B only after the load landed
                dev.launch(lambda out=out: out.setdefault("b", gather_ref(kv, b).clone()), compute)
                eng.compute_read(b, compute.record(f"read{t}.{r}"))
            eng.release(save.slot)  # the owner is done: freed once e_load has completed
            compute.synchronize()
            if not torch.equal(out["b"], want):
                errors.append(f"thread {t} round {r}: loaded blocks differ")
            with lock:
                checked[0] += 2 * want.numel() * want.element_size()

    threads = [threading.Thread(target=lambda t=t: _guard(worker, t, errors)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    try:
        assert not errors, errors[:5]
        assert checked[0] == THREADS * ROUNDS * 2 * kv.chunk_nbytes(PER)
        eng.close()
        stats = pool.stats()
        assert stats.used == 0 and stats.in_flight == 0 and not eng.slots.live()
        pool.check_free_list()
    finally:
        dev.close()


def _guard(fn, t, errors):
    try:
        fn(t)
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        errors.append(f"thread {t}: {e!r}")
