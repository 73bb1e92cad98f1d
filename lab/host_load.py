"""A noisy neighbour on purpose: processes that stream through memory (or spin) on this host's
other cores, so the submit figures (P6) can be read on a host made slow by design instead of
waiting for one. On the H200 boxes the same submit runs 1.5-2x slower on some passes than on
others (the bench's yardstick, `host_ref_hot_us`, 2.3-9.8 us across runs): this puts a box in
such a state at will, to see whether the submit stays under P6's line there.

Each process copies one array of --mib MiB into another (`copy`: the memory bus and the last
level cache taken, as a neighbour's data-heavy job does) or runs a Python loop (`spin`: cores
busy, clocks shared), until --seconds have passed or this process is stopped (SIGTERM / SIGINT
stop the workers too).

    python lab/host_load.py --procs 8 [--kind copy] [--mib 64] [--seconds 300]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import signal
import sys
import time

import numpy as np


def work(kind: str, mib: int, seconds: float) -> None:
    end = time.monotonic() + seconds
    if kind == "copy":
        a = np.ones(mib << 17, dtype=np.float64)  # mib MiB of 8-byte items
        b = np.empty_like(a)
        while time.monotonic() < end:
            np.copyto(b, a)
    else:
        x = 0
        while time.monotonic() < end:
            for i in range(10000):
                x += i


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, required=True, help="worker processes (>= 1)")
    ap.add_argument("--kind", choices=("copy", "spin"), default="copy")
    ap.add_argument("--mib", type=int, default=64, help="MiB per array of a copy worker")
    ap.add_argument("--seconds", type=float, default=300.0)
    args = ap.parse_args(argv)
    if args.procs < 1:
        ap.error("--procs must be >= 1")
    if args.mib < 1:
        ap.error("--mib must be >= 1")
    if not args.seconds > 0:
        ap.error("--seconds must be > 0")
    job = (args.kind, args.mib, args.seconds)
    workers = [mp.Process(target=work, args=job, daemon=True) for _ in range(args.procs)]

    def stop(_sig, _frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        for w in workers:
            w.start()
        what = f"{args.procs} {args.kind} workers ({args.mib} MiB arrays) for {args.seconds:g} s"
        print(f"host_load: {what}", flush=True)
        for w in workers:
            w.join()
    finally:
        for w in workers:  # stopped early: no worker outlives this process
            if w.is_alive():
                w.terminate()
        for w in workers:
            w.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
