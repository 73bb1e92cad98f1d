"""Which runtime calls cost the host more right after a large copy was enqueued, and for how long?

`probe_memcpy_size.py` (2026-11-30-18) found one small pinned H2D `cudaMemcpyAsync` at 5-8 us with
the copy engines idle and 20-28 us right after a 1 GiB device-to-host copy was enqueued on another
stream. A hot submit is issued right after the job before it (the suite's hot pair), so its three
runtime calls (ids copy, graph launch, event record) may each pay that. This probe enqueues a
1 GiB D2H (on another stream, or on the timed calls' own stream, as two saves in a row), waits
`gap` us on the host, then times four calls one by one: a 2 KiB pinned H2D copy, an event record,
the copy again, the record again. Modes and gaps are interleaved sample by sample. Tells whether
the extra cost is each call's or the first call's only, and how fast it fades; if each call's,
folding the ids copy into the graph saves its whole cost, else little.

    PYTHONPATH=src python benchmarks/probe_enqueue_beside.py [--reps 60] [--gaps 0 50 500]

Needs a CUDA GPU; without one it says so and exits 2.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import torch

H2D, DISABLE_TIMING = 1, 2  # cudaMemcpyHostToDevice, cudaEventDisableTiming
CALLS = ("copy", "record", "copy again", "record again")
MODES = ("idle", "D2H other stream", "D2H same stream")


def spin_us(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--gaps", type=float, nargs="+", default=[0.0, 50.0, 500.0])
    args = ap.parse_args()
    if args.reps < 1 or any(g < 0 for g in args.gaps):
        raise SystemExit("--reps: at least 1; --gaps: us >= 0")
    if not torch.cuda.is_available():
        print("probe_enqueue_beside needs a CUDA GPU")
        return 2
    from kvtier.device.cudart import runtime

    lib = runtime()[0]
    p = ctypes.c_void_p
    lib.cudaMemcpyAsync.argtypes = [p, p, ctypes.c_size_t, ctypes.c_int, p]
    lib.cudaEventRecord.argtypes = [p, p]
    lib.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(p), ctypes.c_uint]
    ev = p()
    if lib.cudaEventCreateWithFlags(ctypes.byref(ev), DISABLE_TIMING) != 0:
        raise RuntimeError("cudaEventCreateWithFlags failed")
    stream, side = torch.cuda.Stream(), torch.cuda.Stream()
    src = torch.randint(0, 1 << 30, (512,), dtype=torch.int32).pin_memory()  # 2 KiB: 512 block ids
    dst = torch.empty(512, dtype=torch.int32, device="cuda")
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big_host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    h = stream.cuda_stream
    copy = (dst.data_ptr(), src.data_ptr(), src.numel() * 4, H2D, h)
    us = {(m, g): {c: [] for c in CALLS} for m in MODES for g in args.gaps}
    ok = True
    for i in range(args.reps + 3):
        for mode in MODES:
            for gap in args.gaps:
                dst.fill_(-1)  # poisoned: a copy that did not land shows
                torch.cuda.synchronize()  # nothing runs before this sample starts
                if mode != "idle":
                    with torch.cuda.stream(side if mode == "D2H other stream" else stream):
                        big_host.copy_(big, non_blocking=True)  # 1 GiB D2H: ~20 ms on the copy engine
                spin_us(gap)
                got = []
                for call in CALLS:
                    t0 = time.perf_counter_ns()
                    rc = lib.cudaMemcpyAsync(*copy) if call.startswith("copy") else lib.cudaEventRecord(ev, h)
                    got.append((time.perf_counter_ns() - t0) / 1e3)
                    if rc != 0:
                        raise RuntimeError(f"{call}: cudaError {rc}")
                torch.cuda.synchronize()  # the copies landed before they are compared
                ok = ok and torch.equal(dst.cpu(), src)
                if i >= 3:  # warm-up samples dropped
                    for call, t in zip(CALLS, got, strict=True):
                        us[(mode, gap)][call].append(t)
    print("median us per call (a 2 KiB pinned H2D copy and an event record on one stream):")
    for (mode, gap), calls in us.items():
        cols = "  ".join(f"{c} {statistics.median(v):5.1f}" for c, v in calls.items())
        print(f"  {mode:17s} gap {gap:6.0f} us: {cols}", flush=True)
    print(f"checked: every copy bit-exact: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
