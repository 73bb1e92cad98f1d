"""TransferEngine.save_slots(stream=): a save on a stream of its own completes while a save queued
earlier on another stream is stuck (its event waits only for its own stream), both bit for bit;
close() waits for every stream a save used; a stream that is no Stream is refused."""

import threading

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, random_cache

L, NB, BS, H, D = 2, 16, 4, 2, 8


@pytest.mark.parametrize("path", ["staged", "kernel", "batch"])
def test_a_save_on_its_own_stream_does_not_wait_for_another(path):
    dev = SimDevice(batch_copy=True)
    kv = random_cache("vllm_flash", L, NB, BS, H, D, torch.bfloat16, seed=4)
    pool = PinnedPool(dev, 8 * kv.chunk_nbytes(2))
    eng = TransferEngine(dev, kv, pool, EngineConfig(sanitize=True, staging_bytes=4 * kv.block_nbytes))
    gate = threading.Event()
    try:
        stuck = dev.new_stream("stuck")
        dev.launch(lambda: gate.wait(10), stuck)  # whatever is queued on it waits
        a = eng.save_slots([1, 2, 3, 4], [2, 2], after=None, path=path, stream=stuck)
        b = eng.save_slots([5, 6], [2], after=None, path=path, stream=dev.new_stream("own"))
        assert b[0].wait(5), "the save on its own stream waited for the stuck one"
        assert not a[0].done()
        gate.set()
        assert all(j.wait(5) for j in a)
        for jobs, src in ((a, [1, 2, 3, 4]), (b, [5, 6])):
            got = torch.cat([j.slot.tensor for j in jobs]).view(kv.dtype).view(kv.chunk_shape(len(src)))
            assert bits_equal(got, gather_ref(kv, src))
        with pytest.raises(ValueError, match="stream"):
            eng.save_slots([7], [1], after=None, stream="save")
        for j in a + b:
            eng.release(j.slot)
        eng.close()
        assert pool.stats().used == 0
    finally:
        gate.set()
        dev.close()
