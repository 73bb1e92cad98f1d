"""What one more Python call costs inside a hot submit (P6) on this host: the slope that says how
much a submit gains from calling fewer Python functions.

The timed window of the submit_overhead suite's hot pair (an untimed save, then the timed one)
is widened by `extra` Python work right before the timed save, in one of three shapes:

  calls    n distinct small functions (each its own code object, a few opcodes: an attribute
           read, an add, a store), called one after the other
  inline   one function whose body is the same n statements written out (no call)
  objects  one function doing the same n statements, each on another object (n objects' data)

The samples of every (shape, n) are interleaved rep by rep (one of each per cycle, in a shuffled
order), so the host's drift over seconds hits them alike. Printed: the median wall time of the
window (extra work + the save) per (shape, n), and per shape the slope over n: what one distinct
Python call, one statement, one more object's data cost in the host state a hot submit runs in
(a tight loop on the same host is printed beside it). On the
8B shape (1 GiB of 16-token blocks, staged path, CUDA graphs) on a GPU; on SimDevice without
one, as a check of the script (not figures).

    PYTHONPATH=src python benchmarks/probe_py_cost.py [--reps 60] [--ns 0 16 32 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
from probe_hot_submit import make_engine


class _Box:
    def __init__(self):
        self.value = 0


def make_extra(n: int, shape: str):
    """A callable doing n small steps, in `shape` (module docstring)."""
    ns: dict = {}
    if shape == "calls":
        for i in range(n):
            exec(f"def f{i}(box):\n    box.value = box.value + {i}\n", ns)  # a new code object each
        fns, box = [ns[f"f{i}"] for i in range(n)], _Box()

        def run():
            for f in fns:
                f(box)

        return run
    if shape == "inline":
        body = "".join(f"    box.value = box.value + {i}\n" for i in range(n)) or "    pass\n"
        exec(f"def g(box):\n{body}", ns)
        g, box = ns["g"], _Box()
        return lambda: g(box)
    boxes = [_Box() for _ in range(n)]  # each its own instance: its own memory
    body = "".join(f"    b[{i}].value = b[{i}].value + {i}\n" for i in range(n)) or "    pass\n"
    exec(f"def h(b):\n{body}", ns)
    h = ns["h"]
    return lambda: h(boxes)


def one_window(eng, src, extra) -> float:
    """us of (extra work + save) right after an untimed save, as the suite's hot pair."""
    first = eng.save(src, after=None)
    t0 = time.perf_counter()
    extra()
    job = eng.save(src, after=None)
    us = (time.perf_counter() - t0) * 1e6
    for j in (first, job):
        eng.wait(j)  # a slot is released only after its copy completed
        eng.release(j.slot)
    return us


def tight_us(op, reps: int = 200, skip: int = 0) -> float:
    """Median us of `op` run back to back (the first `skip` runs left out)."""
    us = []
    for _ in range(reps):
        t0 = time.perf_counter()
        op()
        us.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(us[skip:])


def interleaved(keys, reps: int, sample, rng: random.Random) -> dict:
    """`sample(key)` (a time in us) `reps` times per key, one of each per cycle in a shuffled
    order: the host's drift over seconds hits every key alike."""
    got: dict = {k: [] for k in keys}
    for _ in range(reps):
        order = list(keys)
        rng.shuffle(order)
        for k in order:
            got[k].append(sample(k))
    return got


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
    shapes = ("calls", "inline", "objects")
    extras = {(s, n): make_extra(n, s) for s in shapes for n in args.ns}
    for (s, n), ex in extras.items():
        print(f"tight loop, {s:7s} n={n:3d}: {tight_us(ex):7.2f} us")
    for ex in extras.values():
        one_window(eng, src, ex)  # warm-up: graphs captured, execs made, every shape run once
    rng = random.Random(0)
    for r in range(1, args.rounds + 1):
        got = interleaved(extras, args.reps, lambda k: one_window(eng, src, extras[k]), rng)
        for s in shapes:
            meds = [statistics.median(got[(s, n)]) for n in args.ns]
            cols = " ".join(f"n={n}: {m:6.1f}" for n, m in zip(args.ns, meds, strict=True))
            print(f"round {r} {s:7s} window medians us  {cols}")
            print(f"round {r} slope {s:7s}: {slope(args.ns, meds):6.3f} us per step")
    eng.close()
    pool.close()
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
