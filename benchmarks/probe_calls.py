"""Which calls a hot submit makes (P6): every Python function and builtin call of one timed save
and one timed load, counted with `sys.setprofile`, the pair as in the submit_overhead suite (an
untimed submit right before), after 20 such pairs (the steady state: event handles, spares and
rings reused). In the submit window of the H200 hosts a Python call costs ~0.37 us and an object
~0.2-0.4 (`probe_py_cost.py`): this list is what a leaner submit must remove.

    PYTHONPATH=src python benchmarks/probe_calls.py [--block-size 16] [--top 60]

Without a GPU it runs on SimDevice (another mover: the counts of the protocol's part only).
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from probe_hot_submit import make_engine

from kvtier.engine.jobs import SaveJob


def counted(fn):
    """(fn's result, Counter of 'kind name' -> calls) for one call of fn."""
    counts: collections.Counter = collections.Counter()

    def prof(frame, event, arg):
        if event == "call":
            co = frame.f_code
            counts[f"py  {co.co_filename.rsplit('/', 2)[-1]}:{co.co_qualname}"] += 1
        elif event == "c_call":
            counts[f"c   {getattr(arg, '__qualname__', getattr(arg, '__name__', repr(arg)))}"] += 1

    sys.setprofile(prof)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--top", type=int, default=60)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    dev, kv, pool, eng, ids = make_engine(args.block_size, gpu)
    src = eng.save(ids[0], after=None)
    eng.wait(src)
    calls = {
        "save": lambda: eng.save(ids[0], after=None),
        "load": lambda: eng.load(src.slot, ids[1], per_layer=False),
    }

    def settle(job):
        eng.wait(job)  # a slot is released only once its job's event completed
        if isinstance(job, SaveJob):
            eng.release(job.slot)

    for name, call in calls.items():
        for _ in range(3):  # graphs captured, execs made, caches warm
            settle(call())
        for _ in range(20):  # pairs as the suite's: the steady state (event handles, spares, rings)
            pair = [call(), call()]
            for job in pair:
                settle(job)
        first = call()
        job, counts = counted(call)
        settle(first)
        settle(job)
        py = sum(v for k, v in counts.items() if k.startswith("py"))
        c = sum(v for k, v in counts.items() if k.startswith("c "))
        print(f"## {name} bs{args.block_size} ({'cuda' if gpu else 'sim'}, path {job.path}): "
              f"{py} Python calls, {c} builtin calls; graph stats {eng.graph_stats}")  # fmt: skip
        for k, v in counts.most_common(args.top):
            print(f"{v:4d}  {k}")
    eng.close()
    pool.close()


if __name__ == "__main__":
    main()
