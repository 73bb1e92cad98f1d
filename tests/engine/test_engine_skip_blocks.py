"""TransferEngine.load(skip_blocks=k) on SimDevice: a slot's blocks k.. into fewer blocks (the
cache holds the first k already), on every path, twice in a row (a graph keyed on the first must
not replay the second), bit for bit on poisoned blocks; the blocks around are untouched, the slot
READY again after e_load; a bad skip is refused before anything is submitted."""

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, poison_blocks_, random_cache

L, NB, BS, H, D = 3, 24, 4, 2, 8


@pytest.mark.parametrize("path", ["staged", "kernel", "batch"])
@pytest.mark.parametrize("per_layer", [True, False])
def test_a_load_skipping_a_slots_first_blocks(path, per_layer):
    dev = SimDevice(copy_delay=0.002, launch_delay=0.002, batch_copy=True)
    kv = random_cache("vllm_flash", L, NB, BS, H, D, torch.bfloat16, seed=3)
    pool = PinnedPool(dev, 4 * kv.chunk_nbytes(4))
    eng = TransferEngine(dev, kv, pool, EngineConfig(sanitize=True, staging_bytes=4 * kv.block_nbytes))
    try:
        src = [7, 1, 4, 9]
        save = eng.save(src, after=None)
        assert save.wait()
        for skip, dst in ((1, [12, 13, 14]), (3, [20])):
            others = [b for b in range(NB) if b not in dst]
            before = gather_ref(kv, others)
            poison_blocks_(kv, dst)
            job = eng.load(save.slot, dst, skip_blocks=skip, per_layer=per_layer, path=path)
            assert job.wait()
            assert bits_equal(gather_ref(kv, dst), gather_ref(kv, src[skip:]))
            assert bits_equal(gather_ref(kv, others), before)
        with pytest.raises(ValueError, match="skip_blocks"):
            eng.load(save.slot, [12, 13], skip_blocks=-1)
        with pytest.raises(ValueError, match="after 1 skipped"):
            eng.load(save.slot, [12, 13], skip_blocks=1)  # 1 + 2 blocks: not the slot's 4
        eng.release(save.slot)
        eng.close()
        assert pool.stats().used == 0
    finally:
        dev.close()
