"""Why a hot submit (P6) is sometimes twice its usual time: per-sample phases of the timed submit.

The submit_overhead suite's hot sample is a pair: an untimed save (load), then the timed one right
after it; the pair is waited for before the next. On some boxes the median of 1 GiB saves sits
near twice the fastest samples. This probe repeats that pair on the 8B shape (1 GiB of 16-token
blocks, staged path, CUDA graphs), traces every timed submit (`SubmitTrace`), and prints for each
variant the distribution and the phase medians of the fastest and the slowest quarter of the
samples, so the phase that swells is named:

  pair        as the suite: untimed submit, timed submit, wait both
  pair-nogc   the same with Python's collector off during the pair (is it a collection?)
  triple      two untimed submits before the timed one (is the second still cold?)
  cross       the untimed job is one of the other direction: a 1 GiB load before a timed save
              (a host-to-device DMA runs during the submit), a save before a timed load (device-
              to-host: the DMA writes host memory while the submit runs)
  small       the untimed job is of one block (the same Python, a 2 MiB DMA, over at once): no
              large DMA runs during the timed submit

    PYTHONPATH=src python benchmarks/probe_hot_submit.py [--reps 60] [--block-size 16]

Without a GPU it runs on SimDevice as a check of the script. At the end a load of the saved
slot is checked bit-exact against the source blocks.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from kvtier import layout
from kvtier.device import CudaDevice, SimDevice
from kvtier.engine import TransferEngine
from kvtier.engine.jobs import SaveJob, SubmitTrace
from kvtier.pool import PinnedPool

VARIANTS = ("pair", "pair-nogc", "triple", "cross", "small")


def make_engine(bs: int, gpu: bool):
    """1 GiB of the 8B shape (32 layers x 8 heads x 128 dims bf16 per 8192 tokens) on a GPU; a
    tiny cache on the simulator (a check of this script, not figures)."""
    n = 8192 // bs
    layers, heads, dim, where = (32, 8, 128, "cuda") if gpu else (2, 1, 8, "cpu")
    g = torch.Generator(device=where).manual_seed(bs)
    shape = (2, 3 * n, bs, heads, dim)  # src, dst, spare
    kv = layout.vllm_flash(
        [torch.randn(shape, dtype=torch.bfloat16, device=where, generator=g) for _ in range(layers)]
    )
    dev = CudaDevice() if gpu else SimDevice()
    pool = PinnedPool(dev, 5 * kv.chunk_nbytes(n))
    eng = TransferEngine(dev, kv, pool, path="staged")
    ids = [torch.arange(i * n, (i + 1) * n) for i in range(3)]
    return dev, kv, pool, eng, ids


def run(eng, ids, direction: str, variant: str, reps: int, src_slot, small_slot) -> list[dict]:
    src, dst = ids[0], ids[1]

    def call(kind=direction, small=False):  # as the suite: every load into the same blocks
        if kind == "save":
            return eng.save(src[:1] if small else src, after=None)
        return eng.load(small_slot, dst[:1]) if small else eng.load(src_slot, dst)

    def untimed():
        if variant == "cross":
            return [call("load" if direction == "save" else "save")]
        return [call(small=variant == "small") for _ in range(2 if variant == "triple" else 1)]

    recs, tr = [], SubmitTrace()
    for _ in range(reps):
        off = variant == "pair-nogc" and gc.isenabled()
        if off:
            gc.disable()
        try:
            before = untimed()
            eng.trace = tr
            t0 = time.perf_counter()
            job = call()
            us = (time.perf_counter() - t0) * 1e6
            eng.trace = None
        finally:
            if off:
                gc.enable()
        rec = dict(tr.records[-1])
        rec["wall_us"] = us
        recs.append(rec)
        for j in [*before, job]:
            eng.wait(j)  # a save's slot is released only after its copy completed
            if isinstance(j, SaveJob):
                eng.release(j.slot)
    return recs


def report(direction: str, variant: str, recs: list[dict]) -> None:
    wall = sorted(r["wall_us"] for r in recs)
    q = max(1, len(wall) // 4)
    print(
        f"{direction} {variant:10s} wall us: min {wall[0]:6.1f} p25 {wall[q]:6.1f} median "
        f"{statistics.median(wall):6.1f} p75 {wall[-q]:6.1f} max {wall[-1]:6.1f}"
    )
    ranked = sorted(recs, key=lambda r: r["wall_us"])
    phases = [k for k in dict.fromkeys(k for r in recs for k in r) if k not in ("job", "wall_us", "total")]
    for name, part in (("fastest 1/4", ranked[:q]), ("slowest 1/4", ranked[-q:])):
        cols = " ".join(f"{k}={statistics.median(r.get(k, 0) for r in part) / 1e3:.1f}" for k in phases)
        print(f"    {name}: {cols}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--block-size", type=int, default=16, choices=(1, 4, 16, 64, 256))
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    if not gpu:
        print("no CUDA GPU: a check of this script on SimDevice (tiny cache), not figures")
    dev, kv, pool, eng, ids = make_engine(args.block_size, gpu)
    first, small = eng.save(ids[0], after=None), eng.save(ids[0][:1], after=None)
    eng.wait(first)  # the loads read these slots only after their saves completed
    eng.wait(small)
    for direction in ("save", "load"):
        for variant in args.variants:
            slots = first.slot, small.slot
            run(eng, ids, direction, variant, 5, *slots)  # warm-up: graphs captured, execs made
            report(direction, variant, run(eng, ids, direction, variant, args.reps, *slots))
    lj = eng.load(first.slot, ids[1])
    eng.wait(lj)  # the blocks are compared only after e_load
    ok = all(torch.equal(x[:, ids[1]], x[:, ids[0]]) for x in kv.layers)
    gs = eng.graph_stats
    print(f"checked: load of the saved slot equals the source blocks: {ok}; graph stats {gs and vars(gs)}")
    eng.release(first.slot)
    eng.release(small.slot)
    eng.close()
    pool.close()
    dev.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
