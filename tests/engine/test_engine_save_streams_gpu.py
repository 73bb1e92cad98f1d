"""TransferEngine.save_slots(stream=) on CUDA: staged saves alternating between two streams share
the staging buffers, so each waits for the other stream's DMAs out of them: every slot bit for
bit, many rounds (a race would mix two saves' bytes). Skipped without a GPU."""

import pytest
import torch
from test_engine_gpu import PATHS, make, need

from kvtier.reference import bits_equal, gather_ref

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", PATHS)
def test_saves_alternating_between_streams_are_exact(path):
    need(path)
    dev, kv, pool, eng = make(slots=16, n=8)  # staging: 3 blocks a buffer, several DMAs per save
    streams = [dev.new_stream("lane-a"), dev.new_stream("lane-b")]
    for _ in range(5):
        jobs = []
        for i in range(8):
            src = [(i * 7 + k) % kv.num_blocks for k in range(8)]
            jobs.append((src, eng.save_slots(src, [4, 4], after=None, path=path, stream=streams[i % 2])))
        for src, js in jobs:
            assert all(j.wait() for j in js)
            got = torch.cat([j.slot.tensor for j in js]).view(kv.dtype).view(kv.chunk_shape(8))
            assert bits_equal(got.cuda(), gather_ref(kv, src))
            for j in js:
                eng.release(j.slot)
    eng.close()
    assert pool.stats().used == 0
    pool.close()
