"""Where a GPU 0 -> GPU 1 handoff spends its time (two GPUs): the host time of `send`, each stage
alone with device events (gather, peer copy, scatter whole / per layer), and a torch.profiler
table of one job. Llama-3-8B KV, 16-token blocks, random ids.

    PYTHONPATH=src python benchmarks/profile_handoff.py [tokens]
"""

import statistics
import sys
import time

import torch

from kvtier import ops
from kvtier.bench.suites.multi import BLOCK, _caches
from kvtier.device import CudaDevice
from kvtier.engine import Handoff


def gpu_ms(dev: int, fn, reps: int = 5) -> float:
    """Median device-event ms of fn on GPU `dev`'s current stream."""
    out = []
    for _ in range(reps + 1):
        s = torch.cuda.current_stream(dev)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(s)
        fn()
        e1.record(s)
        e1.synchronize()  # elapsed time is valid only once the end event completed
        out.append(e0.elapsed_time(e1))
    return statistics.median(out[1:])


def main(tokens: int) -> None:
    da, db = CudaDevice(0), CudaDevice(1)
    ka, kb = _caches(tokens)
    n = tokens // BLOCK
    g = torch.Generator().manual_seed(0)
    src, dst = torch.randperm(n, generator=g), torch.randperm(n, generator=g)
    print(f"{tokens} tokens, {n} blocks, {ka.chunk_nbytes(n) / 2**30:.2f} GiB")
    for piece in (128 << 20, 512 << 20, ka.chunk_nbytes(n)):
        h = Handoff(ka, kb, src_device=da, dst_device=db, piece_bytes=piece)
        for per_layer in (True, False):
            for _ in range(2):
                h.send(src, dst, after=None, per_layer=per_layer).wait()  # warm-up: compiles, allocates
            host, total = [], []
            for _ in range(5):
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)  # both idle: the job starts from the same state each time
                t0 = time.perf_counter()
                job = h.send(src, dst, after=None, per_layer=per_layer)
                t1 = time.perf_counter()
                job.wait()
                t2 = time.perf_counter()
                host.append((t1 - t0) * 1e3)
                total.append((t2 - t0) * 1e3)
            print(
                f"piece {piece >> 20:5d} MiB per_layer={per_layer!s:5}: send() host "
                f"{statistics.median(host):7.3f} ms, submit->done {statistics.median(total):7.3f} ms"
            )
        h.close()
    chunk_a = torch.empty(ka.chunk_shape(n), dtype=ka.dtype, device="cuda:0")
    chunk_b = torch.empty(kb.chunk_shape(n), dtype=kb.dtype, device="cuda:1")
    ia = ops.block_ids(ka, src, unique=False)
    with torch.cuda.device(1):
        ib = ops.block_ids(kb, dst, unique=True)
    print(f"gather on 0:        {gpu_ms(0, lambda: ops.gather(ka, ia, chunk_a)):7.3f} ms")
    print(f"peer copy 0->1:     {gpu_ms(0, lambda: chunk_b.copy_(chunk_a, non_blocking=True)):7.3f} ms")
    with torch.cuda.device(1):
        print(f"scatter on 1:       {gpu_ms(1, lambda: ops.scatter(kb, ib, chunk_b)):7.3f} ms")

        def per_layer():
            for layer in range(kb.num_layers):
                ops.scatter(kb, ib, chunk_b, layers=(layer, 1))

        print(f"scatter per layer:  {gpu_ms(1, per_layer):7.3f} ms")
    h = Handoff(ka, kb, src_device=da, dst_device=db)
    h.send(src, dst, after=None).wait()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        h.send(src, dst, after=None).wait()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
    print(p.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=50))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8192)
