"""Where a hybrid hit's background load goes: the `hybrid` rows' rig (a random Gemma 3, one store
per KV cache group, the host tier) at --tokens, its load split into its parts.

    python -m lab.probe_hybrid_load [--tokens 32768] [--reps 5] [--out DIR]

Per rep, from vLLM's start_load_kv to the worker's get_finished reporting the request:
  start    the forward thread's start_load (the hand-over)
  submit   until the loader thread has queued every copy (`WorkerSide.wait_submitted`)
  copies   until the device finished them (a synchronize)
  report   until get_finished names the request (polled as the rig polls)
and the load as the row times it (start_load to get_finished, polled every 0.5 ms). Then one
load under torch's profiler: its CUDA kernels and copies, how many, their summed device time,
and the span from the first to the last (device busy against the wall), the Chrome trace to
--out.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

POLL_S = 0.0005


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lab.probe_hybrid_load", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_hybrid_load: needs a CUDA GPU")
    from kvtier.bench.suite import Context
    from kvtier.bench.suites.vllm_hybrid import HybridRig

    ctx = Context("cuda")
    ctx.suite = "vllm"
    rig = HybridRig(ctx, "gemma3-small", a.tokens)
    ws = rig.ws
    try:
        runs = rig.load_meta().loads
        mb = rig.loaded_mb()
        print(f"{a.tokens} tokens: runs per group {[(r.group, len(r.ids), len(r.block_ids)) for r in runs]}")
        print(f"MB per group {mb}, chunk units: {[st.fmt.nbytes for st in ws.stores]} bytes")
        rig.load()  # first use
        whole = []
        for _ in range(a.reps):
            torch.cuda.synchronize()  # earlier copies are not timed here
            t0 = time.perf_counter()
            assert rig.load()
            whole.append((time.perf_counter() - t0) * 1e3)
        parts = [split_load(rig) for _ in range(a.reps)]
        print(f"load as the row times it: median {statistics.median(whole):.2f} ms ({fmt(whole)})")
        for i, name in enumerate(("start", "submit", "copies", "report")):
            col = [p[i] for p in parts]
            print(f"  {name:7s} median {statistics.median(col):7.2f} ms ({fmt(col)})")
        profile(rig, Path(a.out))
    finally:
        rig.close()


def split_load(rig) -> tuple[float, float, float, float]:
    """One load, its parts in ms: start_load, the loader's submission, the copies, the report."""
    ws, meta = rig.ws, rig.load_meta()
    torch.cuda.synchronize()  # earlier copies are not timed here
    ws.handle_preemptions(meta)
    t0 = time.perf_counter()
    ws.start_load(meta)
    t1 = time.perf_counter()
    ws.wait_submitted()
    t2 = time.perf_counter()
    torch.cuda.synchronize()  # the copies landed
    t3 = time.perf_counter()
    ws.save(meta)
    while not (ws.finished(set())[1] or set()) & {"hit"}:
        time.sleep(POLL_S)
    t4 = time.perf_counter()
    return tuple((b - c) * 1e3 for b, c in ((t1, t0), (t2, t1), (t3, t2), (t4, t3)))


def profile(rig, out: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.synchronize()  # only the load under the profiler
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        rig.load()
        torch.cuda.synchronize()  # its copies inside the window
        wall = (time.perf_counter() - t0) * 1e3
    prof.export_chrome_trace(str(out / "hybrid_load.trace.json"))
    gpu = [e for e in prof.events() if e.device_type.name == "CUDA"]
    kinds: dict[str, list] = {}
    for e in gpu:
        kinds.setdefault(e.name[:60], []).append(e)
    print(f"profiled load: wall {wall:.2f} ms, {len(gpu)} device ops")
    for name, evs in sorted(kinds.items(), key=lambda kv: -sum(e.time_range.elapsed_us() for e in kv[1]))[:8]:
        busy = sum(e.time_range.elapsed_us() for e in evs) / 1e3
        print(f"  {len(evs):5d} x {name:60s} {busy:7.2f} ms device")
    if gpu:
        start = min(e.time_range.start for e in gpu)
        end = max(e.time_range.end for e in gpu)
        busy = sum(e.time_range.elapsed_us() for e in gpu) / 1e3
        print(f"  device ops from first to last: {(end - start) / 1e3:.2f} ms, busy {busy:.2f} ms")
    calls = [e for e in prof.events() if e.name.startswith(("cudaMemcpy", "cudaLaunch", "cuLaunch"))]
    print(f"  host API calls (copies, launches): {len(calls)}")


def fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


if __name__ == "__main__":
    main()
