"""What a submit's small steps cost when the host's caches are cold (P6 on the slow passes): each
step timed right after a call of itself (hot) and right after a 64 MiB host write that pushes the
caches out (cold, the stand-in for a 1 GiB DMA passing through the last-level cache between two
submits). Steps: an empty call, single torch and numpy attribute reads, the id check (tensor and
numpy input, and its C call alone), and a whole save on SimDevice split by the engine's trace
(ids, slot, tracker_wait, event, tracker_begin; its "mover" is the simulator's, not CUDA's).

The samples of the steps are interleaved (one of each per cycle, shuffled): the host's drift
hits them alike. Any machine; on the CI CPU it says which steps are code-heavy (torch's
accessors, many Python frames) -- those a submit core in C would drop.

    PYTHONPATH=src python benchmarks/probe_cold_steps.py [--reps 60] [--flush-mib 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import numpy as np
import torch

from kvtier.device import SimDevice
from kvtier.engine import TransferEngine
from kvtier.engine.fast import fast
from kvtier.engine.ids import IdCheck
from kvtier.engine.jobs import SubmitTrace
from kvtier.pool import PinnedPool
from kvtier.reference import random_cache


def single_steps(n: int = 64, num_blocks: int = 1024) -> dict:
    t = torch.from_numpy(np.random.default_rng(0).permutation(num_blocks)[:n])
    a, out, chk = t.numpy(), np.empty(n, np.int32), IdCheck(num_blocks, 16)
    steps = {
        "nothing": lambda: None,
        "t.data_ptr()": lambda: t.data_ptr(),
        "t.is_contiguous()": t.is_contiguous,
        "t.dtype": lambda: t.dtype,
        "t.shape": lambda: t.shape,
        "t.is_cpu": lambda: t.is_cpu,
        "a.shape[0]": lambda: a.shape[0],
        "a.dtype": lambda: a.dtype,
        "checked(tensor)": lambda: chk.checked(t, False),
        "checked(numpy)": lambda: chk.checked(a, False),
    }
    if fast is not None:
        steps["check_ids (C)"] = lambda: fast.check_ids(a, 1, n, num_blocks, None, out)
    return steps


def sample(op, flush: np.ndarray | None) -> float:
    op()  # hot: the step just ran
    if flush is not None:
        flush += 1  # cold: every cache line of the host's caches replaced
    t0 = time.perf_counter_ns()
    op()
    return (time.perf_counter_ns() - t0) / 1e3


def traced_save(reps: int, flush: np.ndarray | None) -> dict:
    """Median us per traced phase of a SimDevice save of 64 blocks, hot or after the flush."""
    dev = SimDevice()
    kv = random_cache("vllm_flash", 2, 1024, 16, 2, 16, torch.bfloat16, seed=0)
    pool = PinnedPool(dev, 8 * kv.chunk_nbytes(64))
    eng = TransferEngine(dev, kv, pool, path="staged")
    ids, tr = torch.from_numpy(np.random.default_rng(1).permutation(1024)[:64]), SubmitTrace()
    try:
        for _ in range(reps):
            first = eng.save(ids, after=None)
            if flush is not None:
                flush += 1
            eng.trace = tr
            job = eng.save(ids, after=None)
            eng.trace = None
            for j in (first, job):
                eng.wait(j)  # a slot is released only once its copy completed
                eng.release(j.slot)
        return tr.medians("save")
    finally:
        eng.close()
        pool.close()
        dev.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--flush-mib", type=int, default=64)
    args = ap.parse_args()
    if args.reps < 1 or args.flush_mib < 1:
        ap.error("--reps and --flush-mib must be >= 1")
    flush = np.ones(args.flush_mib << 20, np.uint8)
    steps, rng = single_steps(), random.Random(0)
    got: dict = {(k, s): [] for k in steps for s in ("hot", "cold")}
    keys = list(got)
    for _ in range(args.reps):
        rng.shuffle(keys)
        for name, state in keys:
            got[(name, state)].append(sample(steps[name], flush if state == "cold" else None))
    print(f"median us, {args.reps} samples each, cold = after a {args.flush_mib} MiB host write")
    for name in steps:
        hot, cold = (statistics.median(got[(name, s)]) for s in ("hot", "cold"))
        print(f"{name:18s} hot {hot:7.2f}  cold {cold:7.2f}")
    for state, fl in (("hot", None), ("cold", flush)):
        phases = traced_save(args.reps, fl)
        print(f"save phases {state:4s} " + "  ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
