"""Can the copy engine do the staged save's gather (P5)? The staged path gathers blocks into GPU
staging with a full-grid Triton kernel (HBM speed), then DMAs the staging to pinned memory; the
short gathers are what a matmul beside it loses (+5% on the H200, P5 wants <= 3%). Here the
gather is one `cudaMemcpyBatchAsync` of every 32 KiB piece, GPU -> GPU, on a copy engine: no SM.

    PYTHONPATH=src python benchmarks/probe_ce_gather.py [--gib 1] [--reps 5]

Prints, for Llama-3-8B KV in 16-token blocks (32 KiB pieces, vLLM flash layout, random ids):
  1. the CE gather alone: GB/s of payload; its bytes equal `reference.gather_ref` (poisoned first)
  2. the Triton gather alone, same bytes, for comparison
  3. "ce-staged": CE gather of 256 MiB chunks into two staging buffers, each followed by its D2H
     to pinned memory on another stream (pipelined), GB/s vs a plain pinned D2H of the same size
  4. a bf16 8192^3 matmul loop alone vs beside (2) and (3) looping: the matmul's slowdown, paired
     (alone, beside, alone; median of beside / mean of the two alone)
  5. whether a CE gather can be captured in a CUDA graph, and the CPU time to submit one job
Needs a CUDA GPU and CUDA runtime >= 12.8. Expected: ~1 minute.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvtier import layout, ops
from kvtier.engine import batch
from kvtier.ops.checks import checked_block_ids
from kvtier.reference import gather_ref

CHUNK = 128  # blocks per staging chunk: 256 MiB of 2 MiB blocks


def timed(fn, reps: int, stream) -> list[float]:
    """Seconds per call of `fn` (which enqueues on `stream`), device events around each."""
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()  # the elapsed time exists only once the end event completed
        out.append(a.elapsed_time(b) / 1e3)
    return out


class Looper:
    """Enqueues `fn` on `stream` again whenever fewer than two are queued (from this thread, between
    matmul submits): the copies keep running for the whole matmul window."""

    def __init__(self, fn, stream):
        self.fn, self.stream, self.q = fn, stream, []

    def top_up(self) -> None:
        self.q = [e for e in self.q if not e.query()]
        while len(self.q) < 2:
            self.fn()
            e = torch.cuda.Event()
            e.record(self.stream)  # the loop knows when this copy is done without blocking
            self.q.append(e)

    def drain(self) -> None:
        for e in self.q:
            e.synchronize()  # nothing of the loop may run into the next alone window
        self.q = []


def matmul_window(a, comp, iters: int, looper: Looper | None) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if looper is not None:
        looper.top_up()
    s.record(comp)
    with torch.cuda.stream(comp):
        for _ in range(iters):
            a @ a
            if looper is not None:
                looper.top_up()
    e.record(comp)
    while not e.query():
        if looper is not None:
            looper.top_up()
        time.sleep(2e-4)
    if looper is not None:
        looper.drain()
    return s.elapsed_time(e) / 1e3


def slowdown(a, comp, looper: Looper, reps: int, iters: int = 8) -> tuple[float, float, float]:
    """(median, min, max) % slowdown of the matmul beside the looper, paired windows."""
    pcts = []
    for _ in range(reps):
        t0 = matmul_window(a, comp, iters, None)
        tb = matmul_window(a, comp, iters, looper)
        t1 = matmul_window(a, comp, iters, None)
        pcts.append((tb / ((t0 + t1) / 2) - 1) * 100)
    return statistics.median(pcts), min(pcts), max(pcts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    if not batch.available():
        print("cudaMemcpyBatchAsync unavailable:", batch.why_unavailable())
        return 2
    dev = torch.device("cuda")
    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, "cuda", torch.version.cuda)
    bs, layers, heads, dim = 16, 32, 8, 128
    block = 2 * layers * bs * heads * dim * 2
    n = int(args.gib * 2**30) // block // CHUNK * CHUNK
    g = torch.Generator(device=dev).manual_seed(0)
    kv = layout.vllm_flash(
        [
            torch.randn((2, 2 * n, bs, heads, dim), dtype=torch.bfloat16, device=dev, generator=g)
            for _ in range(layers)
        ]
    )
    ids = torch.randperm(2 * n, generator=torch.Generator().manual_seed(1))[:n]
    nbytes = kv.chunk_nbytes(n)
    ref = gather_ref(kv, ids).view(torch.uint8).reshape(-1)
    cstream, dstream, comp = (torch.cuda.Stream(device=dev) for _ in range(3))

    # 1. CE gather, whole job, GPU -> GPU
    out = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    t0 = time.perf_counter()
    dsts, srcs, sizes = batch.prepare(kv, ids, bs, out, save=True)
    prep_us = (time.perf_counter() - t0) * 1e6
    out.fill_(0xA5)  # poisoned: every byte must come from the copy
    torch.cuda.synchronize()  # the poison (default stream) lands before the copy on cstream writes

    def ce_gather():
        batch.launch(dsts, srcs, sizes, cstream, dev)

    t0 = time.perf_counter()
    ce_gather()
    launch_us = (time.perf_counter() - t0) * 1e6
    cstream.synchronize()  # the check reads `out` only after the copy landed
    ok_ce = torch.equal(out, ref)
    t = timed(ce_gather, args.reps, cstream)
    rate = nbytes / min(t) / 1e9
    print(f"1. CE gather GPU->GPU, {len(sizes)} pieces of {int(sizes[0])} B: {rate:.1f} GB/s "
          f"(median {nbytes / statistics.median(t) / 1e9:.1f}); bytes equal gather_ref: {ok_ce}; "
          f"CPU: prepare {prep_us:.0f} us + launch {launch_us:.0f} us")  # fmt: skip

    # 2. Triton gather, same job
    bid = checked_block_ids(kv, ids, False, None)
    out.fill_(0xA5)
    torch.cuda.synchronize()  # the poison lands before the Triton gather writes

    def sm_gather():
        with torch.cuda.stream(cstream):
            ops.gather(kv, bid, out)

    sm_gather()
    cstream.synchronize()  # the check reads `out` only after the gather landed
    ok_sm = torch.equal(out, ref)
    t = timed(sm_gather, args.reps, cstream)
    print(f"2. Triton gather GPU->GPU: {nbytes / min(t) / 1e9:.1f} GB/s; bytes equal gather_ref: {ok_sm}")

    # 3. ce-staged save: chunked CE gathers into two staging buffers, each chunk's D2H on dstream
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    staging = [torch.empty(CHUNK * block, dtype=torch.uint8, device=dev) for _ in range(2)]
    plans = []
    for c in range(n // CHUNK):
        st = staging[c % 2]
        plans.append((batch.prepare(kv, ids[c * CHUNK : (c + 1) * CHUNK], bs, st, save=True), st, c))
    free = [torch.cuda.Event() for _ in range(2)]  # staging buffer i's last D2H has read it

    def ce_staged():
        for (d, s_, z), st, c in plans:
            cstream.wait_event(free[c % 2])  # the gather must not overwrite staging its D2H still reads
            batch.launch(d, s_, z, cstream, dev)
            gathered = torch.cuda.Event()
            gathered.record(cstream)
            dstream.wait_event(gathered)  # the D2H reads the staging only after its gather landed
            with torch.cuda.stream(dstream):
                host[c * CHUNK * block : (c + 1) * CHUNK * block].copy_(st, non_blocking=True)
            free[c % 2].record(dstream)
        cstream.wait_event(free[(len(plans) - 1) % 2])  # the job ends on cstream after its last D2H

    host.fill_(0xA5)
    ce_staged()
    cstream.synchronize()  # the check reads `host` only after every gather
    dstream.synchronize()  # and every D2H landed
    ok_st = torch.equal(host, ref.cpu())
    t = timed(ce_staged, args.reps, cstream)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    t_d2h = timed(lambda: _d2h(host, src, cstream), args.reps, cstream)
    pct = min(t_d2h) / min(t) * 100
    print(f"3. ce-staged save: {nbytes / min(t) / 1e9:.1f} GB/s = {pct:.1f}% of a plain pinned "
          f"D2H ({nbytes / min(t_d2h) / 1e9:.1f} GB/s); bytes equal gather_ref: {ok_st}")  # fmt: skip

    # 4. the matmul beside each
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    with torch.cuda.stream(comp):
        for _ in range(30):
            a @ a  # sustained warm-up: clocks settle under load
    comp.synchronize()  # the warm-up ends before the first timed window
    for name, fn in [
        ("CE gather loop", ce_gather),
        ("Triton gather loop", sm_gather),
        ("ce-staged save loop", ce_staged),
    ]:
        med, lo, hi = slowdown(a, comp, Looper(fn, cstream), args.reps)
        print(f"4. matmul beside {name}: {med:+.1f}% (paired min {lo:+.1f}, max {hi:+.1f})")

    # 5. capture
    try:
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr, stream=cstream):
            batch.launch(dsts, srcs, sizes, cstream, dev)
        out.fill_(0xA5)
        torch.cuda.synchronize()  # the poison lands before the replay writes
        t0 = time.perf_counter()
        with torch.cuda.stream(cstream):
            gr.replay()
        rep_us = (time.perf_counter() - t0) * 1e6
        cstream.synchronize()  # the check reads `out` only after the replay landed
        same = torch.equal(out, ref)
        print(f"5. CE gather captured in a CUDA graph: replay submit {rep_us:.0f} us, bytes equal: {same}")
    except Exception as e:  # noqa: BLE001 - the answer is the failure
        print(f"5. CE gather capture failed: {type(e).__name__}: {str(e)[:200]}")
    return 0 if ok_ce and ok_sm and ok_st else 1


def _d2h(host, src, stream):
    with torch.cuda.stream(stream):
        host.copy_(src, non_blocking=True)


if __name__ == "__main__":
    sys.exit(main())
