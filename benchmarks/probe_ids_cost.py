"""Why a hot submit of many blocks costs more (P6 "flat in block count"): the per-id steps of a
submit of 8192 one-token blocks (1 GiB of the 8B shape), timed alone in the host state a hot
submit runs in -- right after an untimed 1 GiB save, as the submit_overhead suite's hot pair --
and in a tight loop:

  check_fresh   the id check into a new int32 array (np.empty + the C check, spares off)
  check_reused  the same check into one array made once (no new memory touched)
  idcheck_new   IdCheck.checked as a save calls it, spares off (a new array per job)
  idcheck_spare the same with spares (the job's array from those no job holds: a submit now)
  unique_avx2   a load's check (repeats too) of rising ids into one array, the AVX2 pass
  unique_scalar the same, the scalar pass (a copy loop, then a second pass for the rising check)
  random_small  IdCheck.checked as a load calls it, random distinct ids of this cache (its mask)
  random_1m     the same in a cache of 2**20 blocks (one-token pages of a big HBM): 128 KiB of mask
  empty         np.empty of the job's array alone
  fill          the job's int32 ids into a pinned buffer (the replay's first step), numpy
  read_src      one pass over the caller's ids (np.max): the source read alone
  torch_reads   the torch reads `IdCheck` makes of a tensor (dtype, shape, is_cpu, is_contiguous,
                data_ptr: five since session 15)
  torch_reads6  the six it made before (ndim and shape[0] apart)
  stream_props  the copy stream's torch properties (cuda_stream, device_index: what the fused
                replay read before session 15; on SimDevice: two attribute reads of a stand-in)
  stream_ints   the same two ints read off kvtier's device stream (what it reads now)
  nothing       an empty call: the floor of every figure here

Variants are interleaved sample by sample (shuffled per cycle). A step that costs far more when
its memory is new (check_fresh against check_reused plus empty) points at page / TLB misses
rather than at the instructions.

    PYTHONPATH=src python benchmarks/probe_ids_cost.py [--reps 80] [--block-size 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import numpy as np
import torch
from probe_hot_submit import make_engine
from probe_py_cost import interleaved, tight_us

from kvtier.engine.fast import fast
from kvtier.engine.ids import IdCheck


def steps(num_blocks: int, src: torch.Tensor, stream=None) -> dict:
    n, p = src.shape[0], src.data_ptr()
    reused = np.empty(n, np.int32)
    pinned = torch.empty(n, dtype=torch.int32, pin_memory=torch.cuda.is_available()).numpy()
    held: list = []  # new arrays stay alive a while, as jobs keep their ids

    def check_fresh():
        a = np.empty(n, np.int32)
        if fast.check_ids(p, 1, n, num_blocks, None, a):
            raise SystemExit("ids out of range")
        held.append(a)
        if len(held) > 4:
            held.pop(0)

    def check_reused():
        if fast.check_ids(p, 1, n, num_blocks, None, reused):
            raise SystemExit("ids out of range")

    def keep(a):  # as jobs keep their ids a while
        held.append(a)
        if len(held) > 4:
            held.pop(0)

    new, spare = IdCheck(num_blocks, 1, spares=False), IdCheck(num_blocks, 1)
    bits = np.zeros((num_blocks + 63) // 64, np.uint64)

    def unique(simd: bool):
        was = fast.set_simd(simd)
        try:
            if fast.check_ids(p, 1, n, num_blocks, bits, reused):
                raise SystemExit("ids out of range or repeated")
        finally:
            fast.set_simd(was)

    rng = np.random.default_rng(0)
    small, big = IdCheck(num_blocks, 1), IdCheck(1 << 20, 1)
    ids_small = torch.from_numpy(rng.permutation(num_blocks)[:n])
    ids_big = torch.from_numpy(rng.permutation(1 << 20)[:n])

    def torch_reads():
        return src.dtype, src.shape, src.is_cpu, src.is_contiguous(), src.data_ptr()

    def torch_reads6():
        return src.dtype, src.is_cpu, src.ndim, src.is_contiguous(), src.shape[0], src.data_ptr()

    raw = getattr(stream, "raw", None) if torch.cuda.is_available() else None
    if raw is None:  # no torch stream here: a stand-in with the same two attributes
        raw = type("RawStream", (), {"cuda_stream": 0, "device_index": 0})()
    dev_stream = stream if hasattr(stream, "index") else type("DevStream", (), {"handle": 0, "index": 0})()

    return {
        "torch_reads": torch_reads,
        "torch_reads6": torch_reads6,
        "stream_props": lambda: (raw.cuda_stream, raw.device_index),
        "stream_ints": lambda: (dev_stream.handle, dev_stream.index),
        "nothing": lambda: None,
        "check_fresh": check_fresh,
        "random_small": lambda: keep(small.checked(ids_small, True).ids),
        "random_1m": lambda: keep(big.checked(ids_big, True).ids),
        "idcheck_new": lambda: keep(new.checked(src, False).ids),
        "idcheck_spare": lambda: keep(spare.checked(src, False).ids),
        "unique_avx2": lambda: unique(True),
        "unique_scalar": lambda: unique(False),
        "check_reused": check_reused,
        "empty": lambda: held.append(np.empty(n, np.int32)) or (len(held) > 4 and held.pop(0)),
        "fill": lambda: np.copyto(pinned, reused),
        "read_src": lambda: src.numpy().max(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=80)
    ap.add_argument("--block-size", type=int, default=1, choices=(1, 4, 16, 64, 256))
    args = ap.parse_args()
    if fast is None:
        print("the C helper is not built (`make`): nothing to time")
        return 1
    gpu = torch.cuda.is_available()
    if not gpu:
        print("no CUDA GPU: a check of this script on SimDevice (tiny cache), not figures")
    dev, kv, pool, eng, ids = make_engine(args.block_size, gpu)
    src = ids[0].contiguous()
    ops = steps(kv.num_blocks, src, eng.save_stream)
    print(f"{src.shape[0]} ids ({src.shape[0] * 8 // 1024} KiB as int64), cache of {kv.num_blocks} blocks")
    for name, op in ops.items():
        print(f"tight loop   {name:14s} {tight_us(op, 300, skip=50):7.2f} us")

    def after_save(name: str) -> float:
        job = eng.save(src, after=None)  # the hot pair's untimed save: the host state
        t0 = time.perf_counter()
        ops[name]()
        us = (time.perf_counter() - t0) * 1e6
        eng.wait(job)  # its slot is released only after the copy completed
        eng.release(job.slot)
        return us

    got = interleaved(ops, args.reps, after_save, random.Random(0))
    for name, us in got.items():
        q1, q3 = np.percentile(us, [25, 75])
        print(f"after a save {name:14s} {statistics.median(us):7.2f} us (p25 {q1:6.2f}, p75 {q3:6.2f})")
    eng.close()
    pool.close()
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
