"""TransferEngine on CUDA: round trips per path, the waits on real streams, per-layer events,
submit cost. Skipped without a GPU.

    pytest -m gpu tests/test_engine_gpu.py -v -s
"""

import pytest
import torch

from kvtier.engine import EngineConfig, TransferEngine
from kvtier.engine.fastpath.batch import available as batch_available
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, poison_blocks_, random_cache

pytestmark = pytest.mark.gpu
PATHS = ["staged", "kernel", "batch"]
SLEEP = 50_000_000  # GPU cycles (~25 ms): a slow kernel on the compute stream


def make(fmt="vllm_flash", layers=4, blocks=64, bs=16, heads=8, dim=128, slots=4, n=8, **kw):
    from kvtier.device import CudaDevice

    dev = CudaDevice()
    kv = random_cache(fmt, layers, blocks, bs, heads, dim, torch.bfloat16, "cuda", seed=1)
    pool = PinnedPool(dev, slots * kv.chunk_nbytes(n))
    kw.setdefault("staging_bytes", 2 * 3 * kv.block_nbytes)  # 3 blocks per buffer: several DMAs per job
    eng = TransferEngine(dev, kv, pool, EngineConfig(sanitize=True, **kw))
    torch.cuda.synchronize()  # the random cache was written on the compute stream: let it land
    return dev, kv, pool, eng


def need(path):
    if path == "batch" and not batch_available():
        pytest.skip("batch path unavailable here (cudaMemcpyBatchAsync / cuda-bindings / not implemented)")


@pytest.mark.parametrize("fmt", ["vllm_flash", "flashinfer_hnd", "mla"])
@pytest.mark.parametrize("path", PATHS)
def test_round_trip(fmt, path):
    need(path)
    dev, kv, pool, eng = make(fmt)
    src, dst, ntok = [9, 2, 40, 7, 0, 33, 5], [1, 3, 4, 6, 8, 10, 11], 6 * 16 + 5
    want = gather_ref(kv, src, ntok)
    poison_blocks_(kv, dst)  # the load must overwrite them
    save = eng.save(src, after=dev.current_stream().record(), num_tokens=ntok, path=path)
    assert save.wait()
    assert bits_equal(save.slot.view(kv.dtype, kv.chunk_shape(7)).cuda(), want)
    load = eng.load(save.slot, dst, num_tokens=ntok, path=path)
    assert load.wait()
    assert bits_equal(gather_ref(kv, dst, ntok), want)
    eng.release(save.slot)
    eng.close()
    assert pool.stats().used == 0
    pool.close()


@pytest.mark.parametrize("path", ["staged", "kernel"])
def test_save_waits_for_slow_compute_write(path):
    dev, kv, pool, eng = make()
    compute = dev.current_stream()
    with torch.cuda.stream(compute.raw):
        torch.cuda._sleep(SLEEP)  # the KV lands late on the compute stream
        for x in kv.layers:
            x[:, [3, 4]] = 5.0
    job = eng.save([3, 4], after=compute.record("e_compute"), path=path)
    assert job.wait()
    assert bool((job.slot.view(kv.dtype, kv.chunk_shape(2)) == 5.0).all())


@pytest.mark.parametrize("path", ["staged", "kernel"])
def test_load_waits_for_slow_compute_reader(path):
    dev, kv, pool, eng = make()
    compute = dev.current_stream()
    save = eng.save([0, 1], after=None)
    assert save.wait()
    for x in kv.layers:
        x[:, [7, 8]] = 3.0
    with torch.cuda.stream(compute.raw):
        torch.cuda._sleep(SLEEP)  # attention still reading blocks 7, 8
        seen = torch.stack([x[:, [7, 8]].clone() for x in kv.layers])
    eng.compute_read([7, 8], compute.record("e_read"))
    load = eng.load(save.slot, [7, 8], path=path)
    assert load.wait()
    torch.cuda.synchronize()
    assert bool((seen == 3.0).all())  # the load did not overwrite the blocks under the reader
    assert bits_equal(gather_ref(kv, [7, 8]), save.slot.view(kv.dtype, kv.chunk_shape(2)).cuda())


def test_per_layer_events_in_order_with_their_bytes():
    dev, kv, pool, eng = make(layers=8, compute_beside=False)
    save = eng.save(list(range(8)), after=None)
    assert save.wait()
    want = save.slot.view(kv.dtype, kv.chunk_shape(8)).cuda()
    dst = list(range(20, 28))
    poison_blocks_(kv, dst)  # the load must overwrite them
    torch.cuda.synchronize()  # the poison (compute stream) must land before the load writes
    load = eng.load(save.slot, dst, per_layer=True)
    assert load.path == "kernel"  # auto: nothing computes beside, per-layer asked
    assert len({id(e) for e in load.layer_events}) == 8 and load.layer_events[-1] is load.event
    compute = dev.current_stream()
    outs = []
    for layer in range(8):
        load.wait_layer(layer, compute)  # layer i may start once layer i arrived
        with torch.cuda.stream(compute.raw):
            outs.append(gather_ref(kv, dst)[:, layer].clone())
    assert load.wait()
    torch.cuda.synchronize()
    for layer in range(8):
        assert bits_equal(outs[layer], want[:, layer])
    times = [e.time_s() for e in load.layer_events]
    assert times == sorted(times)


def test_submit_cost_reported():
    # Llama-3-8B shape: 32 layers, 8 KV heads, dim 128, 16-token blocks (2 MiB per block).
    dev, kv, pool, eng = make(layers=32, blocks=160, slots=1, n=128, staging_bytes=128 << 20)
    for path in ("staged", "kernel"):  # warm-up: the first job of a path compiles its kernels
        save = eng.save(list(range(16)), after=None, path=path)
        assert save.wait()
        load = eng.load(save.slot, list(range(32, 48)), path=path, per_layer=False)
        assert load.wait()
        eng.release(save.slot)
    for n in (16, 128):
        for path in ("staged", "kernel"):
            save = eng.save(list(range(n)), after=None, path=path)
            assert save.wait()
            load = eng.load(save.slot, list(range(32, 32 + n)), path=path, per_layer=False)
            assert load.wait()
            eng.release(save.slot)
            us = save.submit_s * 1e6, load.submit_s * 1e6
            print(f"{path} n={n}: submit save {us[0]:.0f} us, load {us[1]:.0f} us")
            assert save.submit_s < 0.05 and load.submit_s < 0.05
    eng.close()
    pool.close()


def test_many_jobs_both_directions_every_byte():
    """Saves and loads in flight together on both copy streams, paths mixed, sanitizer on."""
    import random

    dev, kv, pool, eng = make(blocks=64, slots=6, n=4)
    rng = random.Random(0)
    compute = dev.current_stream()
    pending = []
    for _ in range(30):
        src = rng.sample(range(32), 4)  # saved from the low half, loaded into the high half
        p_save, p_load = rng.choice(["staged", "kernel"]), rng.choice(["staged", "kernel"])
        want = gather_ref(kv, src)
        save = eng.save(src, after=compute.record(), path=p_save, timeout=10)
        assert save.wait()
        dst = rng.sample(range(32, 64), 4)
        load = eng.load(save.slot, dst, path=p_load, per_layer=rng.random() < 0.5)
        eng.release(save.slot)  # freed by the engine once the load has read it
        load.wait_on(compute)  # the check below reads the blocks on the compute stream
        got = gather_ref(kv, dst)
        eng.compute_read(dst, compute.record())
        pending.append((got, want))
    torch.cuda.synchronize()
    assert all(bits_equal(g, w) for g, w in pending)
    eng.close()
    assert pool.stats().used == 0
    pool.close()
