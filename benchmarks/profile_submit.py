"""Where the CPU time of submitting one engine job goes (P6): cProfile of save/load submits of
1 GiB of Llama-3-8B KV in 16-token blocks on a CUDA device. Prints the top functions.

    PYTHONPATH=src python3 benchmarks/profile_submit.py
"""

import cProfile
import pstats
import time

import torch

from kvtier import layout
from kvtier.device import CudaDevice
from kvtier.engine import TransferEngine
from kvtier.pool import PinnedPool

L, H, D, BS, NB, N = 32, 8, 128, 16, 2048, 512  # 512 blocks x 2 MiB = 1 GiB
dev = CudaDevice()
kv = layout.vllm_flash([torch.randn(2, NB, BS, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(L)])
pool = PinnedPool(dev, 2 * kv.chunk_nbytes(N))
eng = TransferEngine(dev, kv, pool)
src = torch.randperm(NB)[:N]
dst = torch.randperm(NB)[:N]


def one():
    t0 = time.perf_counter()
    job = eng.save(src, after=None)
    t1 = time.perf_counter()
    assert eng.wait(job)
    t2 = time.perf_counter()
    lj = eng.load(job.slot, dst)
    t3 = time.perf_counter()
    assert eng.wait(lj)
    eng.release(job.slot)
    eng.poll()
    return (t1 - t0) * 1e6, (t3 - t2) * 1e6


for _ in range(3):
    one()  # warm-up: Triton compiles, staging buffers
times = [one() for _ in range(10)]
print("submit us (save, load):", [(round(a), round(b)) for a, b in times])
prof = cProfile.Profile()
prof.enable()
for _ in range(10):
    one()
prof.disable()
st = pstats.Stats(prof)
st.sort_stats("tottime").print_stats(25)
eng.close()
pool.close()
