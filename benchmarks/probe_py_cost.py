"""What one more Python call costs inside a hot submit (P6) on this host: the slope that says how
much a submit gains from calling fewer Python functions.

The timed window of the submit_overhead suite's hot pair (an untimed save, then the timed one)
is widened by `extra` Python work right before the timed save, in one of two shapes:

  calls    n distinct small functions (each its own code object, a few opcodes: an attribute
           read, an add, a store), called one after the other
  inline   one function whose body is the same n statements written out (no call)

For n in --ns the median wall time of the window (extra work + the save) is printed, and the
slope over n per shape: the cost of one distinct Python call, and of its body alone, in the
host state a hot submit runs in (a tight loop on the same host is printed beside it). On the
8B shape (1 GiB of 16-token blocks, staged path, CUDA graphs) on a GPU; on SimDevice without
one, as a check of the script (not figures).

    PYTHONPATH=src python benchmarks/probe_py_cost.py [--reps 60] [--ns 0 16 32 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from probe_hot_submit import make_engine


class _Box:
    value = 0


def make_extra(n: int, shape: str):
    """A callable doing n small steps: n distinct functions ("calls") or one body ("inline")."""
    box, ns = _Box(), {}
    if shape == "calls":
        for i in range(n):
            exec(f"def f{i}(box):\n    box.value = box.value + {i}\n", ns)  # a new code object each
        fns = [ns[f"f{i}"] for i in range(n)]

        def run():
            for f in fns:
                f(box)

        return run
    body = "".join(f"    box.value = box.value + {i}\n" for i in range(n)) or "    pass\n"
    exec(f"def g(box):\n{body}", ns)
    g = ns["g"]
    return lambda: g(box)


def window(eng, src, extra, reps: int) -> list[float]:
    """us of (extra work + save) right after an untimed save, as the suite's hot pair."""
    out = []
    for _ in range(reps):
        first = eng.save(src, after=None)
        t0 = time.perf_counter()
        extra()
        job = eng.save(src, after=None)
        out.append((time.perf_counter() - t0) * 1e6)
        for j in (first, job):
            eng.wait(j)  # a slot is released only after its copy completed
            eng.release(j.slot)
    return out


def slope(ns: list[int], us: list[float]) -> float:
    """Least-squares slope of us over n."""
    mx, my = statistics.fmean(ns), statistics.fmean(us)
    den = sum((x - mx) ** 2 for x in ns)
    return sum((x - mx) * (y - my) for x, y in zip(ns, us, strict=True)) / den if den else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--ns", type=int, nargs="*", default=[0, 16, 32, 64])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if any(n < 0 for n in args.ns) or len(set(args.ns)) < 2:
        ap.error("--ns: at least two distinct counts >= 0")
    gpu = torch.cuda.is_available()
    if not gpu:
        print("no CUDA GPU: a check of this script on SimDevice (tiny cache), not figures")
    dev, kv, pool, eng, ids = make_engine(16, gpu)
    src = ids[0]
    extras = {(s, n): make_extra(n, s) for s in ("calls", "inline") for n in args.ns}
    for (s, n), ex in extras.items():
        tight = []
        for _ in range(200):
            t0 = time.perf_counter()
            ex()
            tight.append((time.perf_counter() - t0) * 1e6)
        print(f"tight loop, {s:6s} n={n:3d}: {statistics.median(tight):7.2f} us")
    window(eng, src, extras[("calls", 0)], 5)  # warm-up: graphs captured, execs made
    for r in range(1, args.rounds + 1):
        meds: dict[str, list[float]] = {"calls": [], "inline": []}
        for n in args.ns:  # shapes interleaved per n: the host's drift hits both alike
            for s in ("calls", "inline"):
                us = window(eng, src, extras[(s, n)], args.reps)
                meds[s].append(statistics.median(us))
                print(f"round {r} {s:6s} n={n:3d}: window median {meds[s][-1]:7.1f} us (min {min(us):6.1f})")
        for s in ("calls", "inline"):
            print(f"round {r} slope {s:6s}: {slope(args.ns, meds[s]):6.3f} us per step")
    eng.close()
    pool.close()
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
