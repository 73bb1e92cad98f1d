"""What does one `cudaGraphLaunch` of a staged save graph cost the host, against simpler graphs?
Times the launch call alone (ctypes into libcudart), back to back and right after a 20 ms host
sleep, for: the engine's staged save graph of 1 GiB (512 blocks of 16 tokens: gathers on a helper
stream forked and joined inside, DMAs on the copy stream), a graph of one empty kernel, and a
graph of eight copies on one stream (no fork). Tells whether a replay's cost is the graph's
shape or the driver's floor. Needs a CUDA GPU (~20 s).

    PYTHONPATH=src python benchmarks/probe_graph_launch.py
"""

from __future__ import annotations

import statistics
import time

import profile_submit as ps  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import torch

from kvtier.device import CudaDevice
from kvtier.engine import TransferEngine
from kvtier.engine.graph_nodes import Launcher
from kvtier.pool import PinnedPool


def timed_launches(launcher: Launcher, handle: int, stream: torch.cuda.Stream, after_sleep: bool) -> float:
    """Median us of the launch call: 20 launches back to back (then one sync), or each after the
    stream went idle and the host slept 20 ms."""
    us = []
    for _ in range(20):
        if after_sleep:
            stream.synchronize()  # idle GPU, and the host then sleeps as between jobs
            time.sleep(0.02)
        t0 = time.perf_counter_ns()
        launcher.launch(handle, stream.cuda_stream)
        us.append((time.perf_counter_ns() - t0) / 1e3)
    stream.synchronize()  # every launch ran before the next measurement
    return statistics.median(us[2:])


def captured(fn, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture
        stream.synchronize()  # the warm-up ran before the capture starts
        g.capture_begin(capture_error_mode="relaxed")
        fn()
        g.capture_end()
    return g


def main() -> None:
    dev = CudaDevice()
    kv = ps.make_cache("cuda", 16, 512, True)
    nbytes = kv.chunk_nbytes(512)
    pool = PinnedPool(dev, 3 * nbytes, chunk_bytes=nbytes)
    eng = TransferEngine(dev, kv, pool, path="staged")
    src = torch.arange(512)
    for k in range(3):  # eager, capture, replay; the last slot stays allocated: the probe's launches write it
        job = eng.save(src, after=None)
        assert eng.wait(job)  # its slot is released only after its copy completed
        if k < 2:
            eng.release(job.slot)
    g = eng.mover.graphs
    keys = g.cache.keys()  # the LRU's keys, oldest first: one graph here
    (entry,) = [g.cache.get(k) for k in keys]
    stream = entry.stream
    launcher = Launcher()
    dst = torch.empty(8, 1 << 20, dtype=torch.uint8, device="cuda")
    srcs = torch.empty(8, 1 << 20, dtype=torch.uint8, device="cuda")
    empty = captured(lambda: torch.cuda._sleep(1), stream)
    copies = captured(lambda: [dst[i].copy_(srcs[i]) for i in range(8)], stream)
    graphs = {
        "staged save, 1 GiB (engine)": entry.main.handle,
        "one empty kernel": int(empty.raw_cuda_graph_exec()),
        "eight 1 MiB D2D copies, one stream": int(copies.raw_cuda_graph_exec()),
    }
    print("device:", torch.cuda.get_device_name(0))
    for name, h in graphs.items():
        hot = timed_launches(launcher, h, stream, False)
        cold = timed_launches(launcher, h, stream, True)
        print(f"{name:38s} launch {hot:7.1f} us back to back, {cold:7.1f} us after a 20 ms sleep")
    eng.close()
    pool.close()


if __name__ == "__main__":
    main()
