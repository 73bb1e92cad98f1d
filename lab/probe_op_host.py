"""What one op call costs the host before its copy runs (issue #29's host side).

1. The id step of a call with host ids, on any machine: `kvtier.ops.host_ids.HostIds.fill` (read,
   range-checked, repeat-checked for writes, written as int32 where the copy to the GPU reads
   them) per kind of ids and count, with the C helper and with numpy alone.
2. On a GPU: each public op's host time per call, back to back (hot) and after the GPU went idle
   (cold, as `kvtier bench --suite op_cost` times it), per kind of ids, at the Llama-3-8B shape
   and the small one of op_cost.

    PYTHONPATH=src:. python lab/probe_op_host.py [--reps N]

Medians of N calls, in microseconds. Without a GPU only the first table prints.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvtier import layout, ops
from kvtier.ops.host_ids import HostIds
from kvtier.ops.slots import scatter_slots, slot_sources

STAGE_BYTES = 64 << 20  # op_cost's staging buffer size


def median_us(fn, reps: int, before=None) -> float:
    fn()  # warm: plans, compiled kernels, pinned slots
    samples = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return samples[len(samples) // 2] / 1e3


def id_step(reps: int) -> None:
    print("id step (HostIds.fill), us per call; read: gather's check, write: scatter's (+ repeats)")
    head = ("native read", "native write", "numpy read", "numpy write")
    print(f"{'ids':>5} {'kind':<8} " + " ".join(f"{h:>12}" for h in head))
    nb = 4 * 8192
    kv = layout.vllm_flash(torch.empty(1, 2, nb, 1, 1, 8, dtype=torch.bfloat16))
    perm = np.random.default_rng(0).permutation(nb)
    for n in (512, 8192):
        p = perm[:n]
        kinds = {"list": p.tolist(), "tensor": torch.from_numpy(p.copy()), "numpy": p.copy()}
        for kind, ids in kinds.items():
            row = [
                fill_us(HostIds(kv, native=nat), ids, uniq, reps) for nat in (True, False) for uniq in (0, 1)
            ]
            print(f"{n:>5} {kind:<8} " + " ".join(f"{x:>12.1f}" for x in row))


def fill_us(h: HostIds, ids, unique: bool, reps: int) -> float:
    n = h.count(ids)
    out = np.empty(n, dtype=np.int32)
    return median_us(lambda: h.fill(ids, n, unique, out), reps)


def gpu_ops(reps: int) -> None:
    print("\nops, host us per call: hot (back to back) / cold (after the GPU went idle)")
    for name, layers, heads, dim, counts in (
        ("llama3-8b", 32, 8, 128, (512,)),
        ("small", 2, 2, 64, (512, 8192)),
    ):
        nb = 4 * max(counts)
        cache = torch.empty(layers, 2, nb, 16, heads, dim, dtype=torch.bfloat16, device="cuda")
        for n in counts:
            shape_rows(name, layout.vllm_flash(cache), n, reps)
        del cache
        torch.cuda.empty_cache()


def shape_rows(name: str, kv, n: int, reps: int) -> None:
    def idle():
        torch.cuda.synchronize()  # cold: the GPU idle before the call, as op_cost times it

    def row(case: str, kind: str, fn) -> None:
        hot, cold = median_us(fn, reps), median_us(fn, reps, before=idle)
        print(f"{name:>10} n={n:<5} {case:<12} {kind:<11} {hot:8.1f} / {cold:8.1f}")

    perm = torch.randperm(kv.num_blocks, generator=torch.Generator().manual_seed(0))
    chunk = torch.empty(kv.chunk_shape(n), dtype=kv.dtype, device="cuda")
    host = torch.empty(kv.chunk_nbytes(n), dtype=torch.uint8, pin_memory=True)
    staging = ops.make_staging(kv, max(1, min(n, STAGE_BYTES // kv.block_nbytes)))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    p = perm[:n]
    kinds = {
        "list": (p.tolist(), p.tolist()),
        "cpu_tensor": (p.clone(), p.clone()),
        "block_ids": (ops.block_ids(kv, p, unique=False), ops.block_ids(kv, p)),
        "gpu_tensor": (p.cuda(), p.cuda()),
    }

    def kind_rows(kind: str, r, w) -> None:
        """r: ids for reads, w: for writes (a BlockIds made unique)."""
        row("gather all", kind, lambda: ops.gather(kv, r, chunk))
        row("gather one", kind, lambda: ops.gather(kv, r, chunk, layers=(0, 1)))
        row("scatter all", kind, lambda: ops.scatter(kv, w, chunk))
        row("scatter one", kind, lambda: ops.scatter(kv, w, chunk, layers=(0, 1)))
        save = dict(staging=staging, gather_stream=s1, copy_stream=s2)
        row("save_staged", kind, lambda: ops.save_staged(kv, r, host, **save))
        load = dict(staging=staging, copy_stream=s1, scatter_stream=s2)
        row("load_staged", kind, lambda: ops.load_staged(kv, w, host, **load))

    for kind, (r, w) in kinds.items():
        kind_rows(kind, r, w)
    src = slot_sources(kv, perm[n : 2 * n], [chunk[: n // 2], chunk[n // 2 :]])
    row("slots all", "sources", lambda: scatter_slots(kv, src))
    row("slots one", "sources", lambda: scatter_slots(kv, src, layers=(0, 1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="also: where a call's host time goes (cProfile)")
    args = ap.parse_args()
    id_step(args.reps)
    if torch.cuda.is_available():
        gpu_ops(args.reps)
        if args.profile:
            profile_calls(args.reps)


def profile_calls(reps: int) -> None:
    """cProfile of `reps` back-to-back one-layer gathers at the Llama-3-8B shape, per kind of ids:
    the functions a call's host time is spent in (tottime: their own time)."""
    import cProfile
    import pstats

    cache = torch.empty(32, 2, 2048, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    kv = layout.vllm_flash(cache)
    p = torch.randperm(kv.num_blocks, generator=torch.Generator().manual_seed(0))[:512]
    chunk = torch.empty(kv.chunk_shape(512), dtype=kv.dtype, device="cuda")
    for kind, ids in (("block_ids", ops.block_ids(kv, p, unique=False)), ("list", p.tolist())):
        for _ in range(20):
            ops.gather(kv, ids, chunk, layers=(0, 1))  # warm: plans, launcher, pinned slots
        torch.cuda.synchronize()  # nothing queued: the profile holds these calls alone
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(reps):
            ops.gather(kv, ids, chunk, layers=(0, 1))
        prof.disable()
        torch.cuda.synchronize()  # the calls' kernels ran before the cache goes
        print(f"\ncProfile: {reps} one-layer gathers, ids as {kind} (per call: tottime / {reps})")
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
