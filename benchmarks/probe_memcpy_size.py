"""What does the host pay to enqueue one small pinned H2D copy, by size? (The ids copy of a replay.)

A graph replay copies the job's int32 block ids (2 KiB for 512 blocks, 32 KiB for 8192) from a
pinned buffer to the device before launching the graph; the 8192-block rows of P6 spend 10-20 us
more in that step than the 512-block ones (2026-11-30-12). If the driver writes small copies
into its command buffer itself, the host's cost grows with the bytes. This probe times the
`cudaMemcpyAsync` call alone (ctypes into the libcudart torch loaded) for each size, the sizes
interleaved sample by sample, with the copy stream idle and with a 1 GiB device-to-host copy
running on another stream (as in the suite's hot pair). Each copy is checked bit-exact.

    PYTHONPATH=src python benchmarks/probe_memcpy_size.py [--reps 100]

Needs a CUDA GPU; without one it says so and exits 2.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import torch

SIZES_KIB = (2, 8, 16, 32, 64, 128, 1024)
H2D = 1  # cudaMemcpyHostToDevice


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    if args.reps < 1:
        raise SystemExit("--reps: at least 1")
    if not torch.cuda.is_available():
        print("probe_memcpy_size needs a CUDA GPU")
        return 2
    from kvtier.device.cudart import runtime

    lib = runtime()[0]
    lib.cudaMemcpyAsync.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    stream, side = torch.cuda.Stream(), torch.cuda.Stream()
    src = {k: torch.randint(0, 1 << 30, (k * 256,), dtype=torch.int32).pin_memory() for k in SIZES_KIB}
    dst = {k: torch.empty(k * 256, dtype=torch.int32, device="cuda") for k in SIZES_KIB}
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big_host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    ok = True
    for beside in (False, True):
        us = {k: [] for k in SIZES_KIB}
        for i in range(args.reps + 5):
            for k in SIZES_KIB:
                dst[k].fill_(-1)  # poisoned: a copy that did not land shows
                torch.cuda.synchronize()  # the poison landed before the copy is enqueued
                if beside:
                    with torch.cuda.stream(side):
                        big_host.copy_(big, non_blocking=True)  # a 1 GiB D2H DMA while the call runs
                t0 = time.perf_counter_ns()
                rc = lib.cudaMemcpyAsync(
                    dst[k].data_ptr(), src[k].data_ptr(), k * 1024, H2D, stream.cuda_stream
                )
                t = (time.perf_counter_ns() - t0) / 1e3
                if rc != 0:
                    raise RuntimeError(f"cudaMemcpyAsync returned {rc}")
                stream.synchronize()  # the copy landed before it is compared
                ok = ok and torch.equal(dst[k].cpu(), src[k])
                if i >= 5:  # warm-up samples dropped
                    us[k].append(t)
        torch.cuda.synchronize()  # the side DMA ended before the next mode
        label = "beside a 1 GiB D2H" if beside else "copy engines idle"
        cols = "  ".join(f"{k} KiB {statistics.median(v):5.1f}" for k, v in us.items())
        print(f"{label:20s} median us per cudaMemcpyAsync call: {cols}", flush=True)
    print(f"checked: every copy bit-exact: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
