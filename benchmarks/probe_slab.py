"""What the pool's C bookkeeping (`kvtier._slab`) does to a hot save (P6), on one box at one time:
two engines on the same cache, one whose pool runs the C slab and one the Python reference
(`slab.PySlab`), their hot pairs (an untimed save, then the timed one, both waited) taken in
turn, sample by sample, so the host's drift hits both alike. Prints per side the hot submit's
median and quartiles, then the traced phases' medians of a second set of pairs (the "slot"
phase is the one the slab changes).

    PYTHONPATH=src python benchmarks/probe_slab.py [--reps 60] [--block-size 16]

Without a GPU it runs on SimDevice as a check of the script (not figures).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvtier import layout
from kvtier import slab as slab_mod
from kvtier.device import CudaDevice, SimDevice
from kvtier.engine import TransferEngine
from kvtier.engine.jobs import SubmitTrace
from kvtier.pool import PinnedPool


def engines(bs: int, gpu: bool):
    """(device, ids, {"c": (engine, pool), "py": (engine, pool)}) over one 1 GiB cache of the 8B
    shape (a tiny one on the simulator)."""
    n = 8192 // bs
    layers, heads, dim, where = (32, 8, 128, "cuda") if gpu else (2, 1, 8, "cpu")
    g = torch.Generator(device=where).manual_seed(bs)
    shape = (2, n, bs, heads, dim)
    kv = layout.vllm_flash(
        [torch.randn(shape, dtype=torch.bfloat16, device=where, generator=g) for _ in range(layers)]
    )
    dev = CudaDevice() if gpu else SimDevice()
    sides = {}
    for kind in ("c", "py"):
        pool = PinnedPool(dev, 3 * kv.chunk_nbytes(n), native=kind == "c")
        sides[kind] = (TransferEngine(dev, kv, pool, path="staged"), pool)
    return dev, torch.arange(n), sides


def pair(eng, ids, trace=None) -> float:
    """One hot pair: an untimed save, the timed one right after; both waited and released. The
    timed submit's microseconds."""
    first = eng.save(ids, after=None)
    eng.trace = trace
    t0 = time.perf_counter()
    job = eng.save(ids, after=None)
    us = (time.perf_counter() - t0) * 1e6
    eng.trace = None
    for j in (first, job):
        eng.wait(j)  # a slot is released only once its copy completed
        eng.release(j.slot)
    return us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--block-size", type=int, default=16, choices=(1, 4, 16, 64, 256))
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    gpu = torch.cuda.is_available()
    dev, ids, sides = engines(args.block_size, gpu)
    if slab_mod.Slab is None:
        print(f"the C slab is not available ({slab_mod.why}): both sides would be Python")
        return 2
    try:
        for eng, _ in sides.values():
            for _ in range(5):  # graphs captured, execs made, spares and rings warm
                pair(eng, ids)
        hot: dict[str, list[float]] = {k: [] for k in sides}
        traces = {k: SubmitTrace() for k in sides}
        for i in range(args.reps):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for k in order:
                hot[k].append(pair(sides[k][0], ids))
            for k in order:
                pair(sides[k][0], ids, traces[k])
        where = "cuda" if gpu else "sim (a check of the script, not figures)"
        print(
            f"## hot save of {len(ids)} blocks of {args.block_size} tokens, {args.reps} pairs each, {where}"
        )
        for k, xs in hot.items():
            q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
            med, native = statistics.median(xs), sides[k][1].native
            print(f"{k:3s} (pool.native={native}): median {med:7.1f} us  p25 {q[0]:7.1f}  p75 {q[2]:7.1f}")
        for k, tr in traces.items():
            phases = tr.medians("save")
            print(f"{k:3s} traced: " + "  ".join(f"{p} {v:.1f}" for p, v in phases.items()))
    finally:
        for eng, pool in sides.values():
            eng.close()
            pool.close()
        if not gpu:
            dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
