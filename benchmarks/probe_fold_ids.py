"""Would folding a replay's ids copy into its graph save a submit the host time of that call?

Today a staged replay is three runtime calls (`_fast.c`): the ids' H2D copy from a pinned buffer,
the graph launch, the job's event record. Folded, the graph would hold the copy as its first node
(from a pinned buffer fixed per exec) and a replay would be two calls. This probe captures both
forms of a small graph -- a gather reading int32 ids from a device buffer, after the ids' copy in
the folded form -- and times the host side of a replay of each (the copy call and the launch, or
the launch alone; ctypes calls, ~1 us each of their own), the forms interleaved sample by sample,
each sample right after a 1 GiB device-to-host copy was enqueued on the same stream (as a job's
submit right after the one before) or with the stream idle. Every sample's ids are new and the
gather's output is poisoned first and checked bit-exact, so the folded form is shown reading the
ids written before its launch.

    PYTHONPATH=src python benchmarks/probe_fold_ids.py [--reps 60]

Needs a CUDA GPU; without one it says so and exits 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    if args.reps < 1:
        raise SystemExit("--reps: at least 1")
    if not torch.cuda.is_available():
        print("probe_fold_ids needs a CUDA GPU")
        return 2
    from probe_graph_launch import captured  # benchmarks/ is on sys.path when run as a script

    from kvtier.engine.graph_nodes import Launcher

    launcher, stream = Launcher(), torch.cuda.Stream()
    h = stream.cuda_stream
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big_host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    gen, ok = torch.Generator().manual_seed(0), True
    for n in (512, 8192):
        rows = torch.randn(4 * n, 64, device="cuda")
        host32 = torch.zeros(n, dtype=torch.int32).pin_memory()
        ids_dev = torch.zeros(n, dtype=torch.int32, device="cuda")
        out = torch.empty(n, 64, device="cuda")

        def gather(rows=rows, ids_dev=ids_dev, out=out):
            torch.index_select(rows, 0, ids_dev, out=out)

        def folded(host32=host32, ids_dev=ids_dev, gather=gather):
            ids_dev.copy_(host32, non_blocking=True)  # captured as the graph's first node
            gather()

        graphs = {"copy + launch": captured(gather, stream), "folded launch": captured(folded, stream)}
        execs = {k: int(g.raw_cuda_graph_exec()) for k, g in graphs.items()}
        us = {(form, busy): [] for form in execs for busy in (False, True)}
        for i in range(args.reps + 3):
            for busy in (False, True):
                for form, ex in execs.items():
                    ids = torch.randperm(4 * n, generator=gen)[:n].to(torch.int32)
                    host32.copy_(ids)  # the stream is idle: no copy reads host32 now
                    out.fill_(float("nan"))  # poisoned: a gather that did not run shows
                    torch.cuda.synchronize()  # poison and ids in place before the sample
                    if busy:
                        with torch.cuda.stream(stream):
                            big_host.copy_(big, non_blocking=True)  # the job before: a 1 GiB D2H
                    t0 = time.perf_counter_ns()
                    if form == "copy + launch":
                        launcher.h2d(ids_dev.data_ptr(), host32.data_ptr(), n * 4, h)
                    launcher.launch(ex, h)
                    t = (time.perf_counter_ns() - t0) / 1e3
                    stream.synchronize()  # the gather ran before its output is compared
                    ok = ok and torch.equal(out, rows[ids.to(rows.device).long()])
                    if i >= 3:  # warm-up samples dropped
                        us[(form, busy)].append(t)
        for (form, busy), v in us.items():
            where = "after a 1 GiB D2H" if busy else "stream idle"
            print(f"{n:5d} ids  {form:14s} {where:18s} median {statistics.median(v):6.1f} us", flush=True)
    print(f"checked: every gather bit-exact, the folded one with the ids written before it: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
