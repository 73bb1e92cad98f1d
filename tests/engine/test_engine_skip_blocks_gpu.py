"""TransferEngine.load(skip_blocks=k) on CUDA, every path: a slot's blocks k.. into fewer blocks,
twice in a row with different skips (a staged graph captured for one must not replay the other),
bit for bit on poisoned blocks, the blocks around untouched. Skipped without a GPU; the CPU version
is test_engine_skip_blocks.py."""

import pytest
import torch
from test_engine_gpu import PATHS, make, need

from kvtier.reference import bits_equal, gather_ref, poison_blocks_

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt", ["vllm_flash", "mla"])
@pytest.mark.parametrize("path", PATHS)
def test_a_load_skipping_a_slots_first_blocks(fmt, path):
    need(path)
    dev, kv, pool, eng = make(fmt)
    src = [9, 2, 40, 7, 0, 33, 5]
    save = eng.save(src, after=dev.current_stream().record(), path=path)
    assert save.wait()
    for _ in range(2):  # the second round: graph replays where the path captures them
        for skip, dst in ((1, [1, 3, 4, 6, 8, 10]), (5, [11, 12])):
            others = [b for b in range(kv.num_blocks) if b not in dst]
            before = gather_ref(kv, others)
            poison_blocks_(kv, dst)
            torch.cuda.synchronize()
            job = eng.load(save.slot, dst, skip_blocks=skip, path=path)
            assert job.wait()
            assert bits_equal(gather_ref(kv, dst), gather_ref(kv, src[skip:]))
            assert bits_equal(gather_ref(kv, others), before)
    eng.release(save.slot)
    eng.close()
    assert pool.stats().used == 0
    pool.close()
