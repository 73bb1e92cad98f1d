"""Why does the scatter (contiguous -> paged GPU) run ~2 points below the gather? Time both with
random, sorted and contiguous block ids (Llama-3-8B shape, 1 GiB, 16-token blocks), beside a D2D
copy of the same bytes measured in the same run. CUDA-graph replays, L2 flushed, bit-exact check.

    PYTHONPATH=src python3 benchmarks/scatter_locality.py
"""

import torch

from kvtier import layout, ops
from kvtier.bench.timing import Timer
from kvtier.reference import bits_equal, gather_ref

L, H, D, BS, NB, N = 32, 8, 128, 16, 2048, 512
kv = layout.vllm_flash([torch.randn(2, NB, BS, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(L)])
timer = Timer("cuda", warmup=3, min_reps=20, budget_s=2.0)
payload = kv.chunk_nbytes(N)
a = torch.empty(payload, dtype=torch.uint8, device="cuda").random_()
b = torch.empty_like(a)
copy = timer.time(lambda: b.copy_(a), flush_l2=True)
ceiling = 2 * payload / copy.median_s / 1e9
print(f"d2d copy of {payload >> 20} MiB: {ceiling:,.0f} GB/s (read + write)")
chunk = torch.empty(kv.chunk_shape(N), dtype=kv.dtype, device="cuda")
perm = torch.randperm(NB)[:N]
for name, ids in (("random", perm), ("sorted", perm.sort().values), ("contiguous", torch.arange(N))):
    bid = ops.block_ids(kv, ids.cuda(), unique=True)
    ops.gather(kv, bid, chunk)
    torch.cuda.synchronize()
    ok = bits_equal(chunk, gather_ref(kv, ids))
    tg = timer.time(lambda bid=bid: ops.gather(kv, bid, chunk), flush_l2=True, graph=True)
    ts = timer.time(lambda bid=bid: ops.scatter(kv, bid, chunk), flush_l2=True, graph=True)
    for op, t in (("gather", tg), ("scatter", ts)):
        r = 2 * payload / t.median_s / 1e9 / ceiling
        gbps = payload / t.median_s / 1e9
        print(f"{op:8s} {name:10s} {gbps:8,.0f} GB/s payload = {r:6.1%} of copy  bit-exact={ok}")
