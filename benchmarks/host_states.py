"""Which host states make a submit slow? Times one yardstick -- an `IdCheck.check` of 512 ids, the
first step of every save / load -- and the two-call floor of a GPU submit (a 2 KiB pinned H2D +
an event record, ctypes into libcudart) in one host state after another:

    tight         back to back (the fastest this host runs them)
    after_sleep   right after time.sleep(20 ms)            (the thread idled: the vCPU may halt)
    after_busy    right after 20 ms of a Python busy loop  (time passed, the CPU never idled)
    after_block   right after a 20 ms GPU wait in cudaEventSynchronize (torch's event)
    after_poll    right after a 20 ms GPU wait polling cudaEventQuery (the thread never sleeps)
    after_calls   right after the two calls (no bulk copy in flight)
    after_dma     right after enqueueing a 1 GiB D2H copy (pinned): a hot submit's state
    during_d2h    back to back while a 1 GiB D2H copy streams (counted only while it runs)
    during_h2d    the same while a 1 GiB H2D copy streams
    during_bidir  the same while both stream

Each figure is a median (us) with the thread's own CPU time beside it (`cpu`: less than the wall
time when the thread was descheduled). Run it again with OMP_NUM_THREADS=1 to see whether torch's
idle worker threads matter. Needs a CUDA GPU (~15 s).

    PYTHONPATH=src python benchmarks/host_states.py [--reps 30]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from kvtier.bench.hostref import _matmul_s
from kvtier.engine.ids import IdCheck

GIB = 1 << 30


def _timed(fn) -> tuple[float, float]:
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e3, (time.thread_time_ns() - c0) / 1e3


def _median(pairs) -> str:
    wall = statistics.median(p[0] for p in pairs)
    cpu = statistics.median(p[1] for p in pairs)
    return f"{wall:8.1f} us (cpu {cpu:7.1f}, n={len(pairs)})"


class Rig:
    def __init__(self):
        from kvtier.device.cudart import runtime

        lib = runtime()[0]
        if lib is None:
            raise SystemExit("no CUDA runtime")
        vp = ctypes.c_void_p
        self._memcpy = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, ctypes.c_size_t, ctypes.c_int, vp)(
            ("cudaMemcpyAsync", lib)
        )
        self._record = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp)(("cudaEventRecord", lib))
        self._ev = vp(0)
        assert lib.cudaEventCreateWithFlags(ctypes.byref(self._ev), 2) == 0  # cudaEventDisableTiming
        self.small_src = torch.zeros(512, dtype=torch.int32).pin_memory()
        self.small_dst = torch.empty(512, dtype=torch.int32, device="cuda")
        self.stream = torch.cuda.Stream()
        self.bulk_stream = torch.cuda.Stream()
        self.h2d_stream = torch.cuda.Stream()
        self.host_a = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
        self.host_b = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
        self.dev_a = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        self.dev_b = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        self.chk, self.ids = IdCheck(512, 16), torch.randperm(512)
        self.mat = torch.randn(4096, 4096, device="cuda")

    def check(self) -> None:
        self.chk.check(self.ids, False)

    def calls(self) -> None:
        self._memcpy(self.small_dst.data_ptr(), self.small_src.data_ptr(), 2048, 1, self.stream.cuda_stream)
        self._record(self._ev, self.stream.cuda_stream)

    def d2h(self) -> torch.cuda.Event:
        with torch.cuda.stream(self.bulk_stream):
            self.host_a.copy_(self.dev_a, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()  # marks: the bulk copy done (the "during" loop stops there)
        return ev

    def h2d(self) -> torch.cuda.Event:
        with torch.cuda.stream(self.h2d_stream):
            self.dev_b.copy_(self.host_b, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()  # marks: the bulk copy done
        return ev

    def gpu_work(self, ms: float) -> torch.cuda.Event:
        for _ in range(max(1, round(ms / self.matmul_ms))):
            self.mat @ self.mat
        ev = torch.cuda.Event()
        ev.record()  # marks: the GPU work done
        return ev

    def calibrate(self) -> None:
        self.matmul_ms = _matmul_s(self.mat) * 1e3  # hostref's: one `mat @ mat` after a warm-up


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    x = 0
    while time.perf_counter() < end:
        x += 1


def during(rig: Rig, start, op) -> list:
    """`op` back to back while the bulk copies `start()` enqueued are still running."""
    evs = start()
    out = []
    while not all(e.query() for e in evs):
        out.append(_timed(op))
    torch.cuda.synchronize()  # the next state starts with the link idle
    return out[:-1]  # the last one may have outlived the copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    rig = Rig()
    rig.calibrate()
    for _ in range(3):  # warm-up: the copies' first runs map and touch their memory
        rig.d2h().synchronize()
        rig.h2d().synchronize()
        rig.calls()
    torch.cuda.synchronize()
    print("device:", torch.cuda.get_device_name(0), "torch threads", torch.get_num_threads())
    for name, op in (("512-id check", rig.check), ("two calls", rig.calls)):
        print(f"== {name}")
        rows = {"tight": [_timed(op) for _ in range(2000)][100:]}
        befores = {
            "after_sleep": lambda: time.sleep(0.02),
            "after_busy": lambda: busy(20),
            "after_block": lambda: rig.gpu_work(20).synchronize(),
            "after_poll": lambda: _poll(rig.gpu_work(20)),
            "after_calls": rig.calls,
            "after_dma": rig.d2h,
        }
        for state, before in befores.items():
            pairs = []
            for _ in range(args.reps):
                before()
                pairs.append(_timed(op))
                torch.cuda.synchronize()  # the next rep starts with the GPU idle
            rows[state] = pairs
        rows["during_d2h"] = during(rig, lambda: [rig.d2h()], op)
        rows["during_h2d"] = during(rig, lambda: [rig.h2d()], op)
        rows["during_bidir"] = during(rig, lambda: [rig.d2h(), rig.h2d()], op)
        for state, pairs in rows.items():
            print(f"  {state:13s} {_median(pairs) if pairs else 'none (the copy ended first)'}")


def _poll(ev) -> None:
    while not ev.query():
        pass


if __name__ == "__main__":
    main()
