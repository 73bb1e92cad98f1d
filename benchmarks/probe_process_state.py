"""Is a slow P6 pass the process or the box? Hot submits before and after other suites ran.

In the verdict runs the submit_overhead suite runs in the process that ran bidir and
save_beside_matmul first; its repeat runs in a fresh process on the same box a minute later. On
some boxes the first pass was slower in every row, down to its fastest samples (2026-11-30-14:
1 GiB of 16-token blocks, save 105 us hot, fastest 80; the repeat 62, fastest 43), while the
host's yardstick (a 512-id check) was not. This probe times the suite's hot pair (probe_hot_submit's
`pair`, traced, so the phase that swells is named) on the 8B shape:

  fresh         an engine in this process before anything else ran
  after suites  the same engine, and a new one, after bidir and save_beside_matmul ran in-process
                (interleaved rounds: the box's drift falls on both alike)
  after gc      the new engine after gc.collect() (engines of the suites kept alive by cycles?)
  after caches  then torch's cached device and pinned host blocks handed back (empty_cache)
  after freeze  then gc.freeze(): the objects alive now leave the collector's generations
  new process   a fresh process started now (later on the box, nothing run before)

Each stage also says what the process's threads did while it was timed (`ThreadCensus`, from
/proc/self/task: the threads alive, those that ran, their CPU ms, and the main thread's time
waiting for a CPU and its involuntary switches): a busy thread of torch, Triton or the suites
contending for the GIL or the core would slow every Python phase alike, leaving the yardstick
(one C call) as it was. The process's resident memory and its number of mappings are printed too.

    PYTHONPATH=src python benchmarks/probe_process_state.py [--reps 60] [--rounds 2]

Without a GPU the suites are skipped and it runs on SimDevice: a check of the script, not figures.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_hot_submit import make_engine, run  # noqa: E402 - the same pair, phases and engine

from kvtier.bench.hostref import host_reference  # noqa: E402

SKIP = ("job", "wall_us", "total")  # a trace record's keys that are not phases
TASKS = Path("/proc/self/task")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # a thread that ended meanwhile, or no procfs
        return ""


def _field(status: str, key: str, default):
    """One value of a /proc status file ("key:  value ...")."""
    return next((int(x.split()[1]) for x in status.splitlines() if x.startswith(key + ":")), default)


def thread_times() -> dict[int, tuple[str, float, float, int]]:
    """tid -> (name, CPU ms, ms waiting for a CPU, involuntary switches) of each live thread. CPU
    ms from schedstat (ns) where the kernel fills it, else from stat's utime + stime (ticks)."""
    out = {}
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    for d in TASKS.glob("*") if TASKS.is_dir() else ():
        stat = _read(d / "stat")
        if not stat:
            continue
        name = _read(d / "comm").strip()
        fields = stat.rsplit(")", 1)[-1].split()  # after the name (which may hold spaces)
        cpu = (int(fields[11]) + int(fields[12])) * tick_ms  # utime + stime
        sched = _read(d / "schedstat").split()
        wait = 0.0
        if len(sched) >= 2 and int(sched[0]) > 0:
            cpu, wait = int(sched[0]) / 1e6, int(sched[1]) / 1e6
        nv = _field(_read(d / "status"), "nonvoluntary_ctxt_switches", 0)
        out[int(d.name)] = (name, cpu, wait, nv)
    return out


class ThreadCensus:
    """What the threads did between `start()` and `report()`: a window's snapshot diff."""

    def start(self) -> None:
        self.t0 = thread_times()

    def report(self) -> str:
        t1, main = thread_times(), threading.get_native_id()
        busy, mine = [], "main: ?"  # no procfs: nothing known of the main thread
        for tid, (name, cpu, wait, nv) in t1.items():
            c0 = self.t0.get(tid, (name, 0.0, 0.0, 0))
            d_cpu, d_wait, d_nv = cpu - c0[1], wait - c0[2], nv - c0[3]
            if tid == main:
                mine = f"main: cpu {d_cpu:.0f} ms, waited for a CPU {d_wait:.1f} ms, {d_nv} involuntary"
            elif d_cpu > 0:
                busy.append((d_cpu, f"{name}({tid}) {d_cpu:.0f} ms"))
        others = ", ".join(b for _, b in sorted(busy, reverse=True)[:6]) or "none"
        rss = _field(_read(Path("/proc/self/status")), "VmRSS", "?")
        maps = len(_read(Path("/proc/self/maps")).splitlines())
        return f"threads {len(t1)}; {mine}; others that ran: {others}; rss {rss} kB, {maps} mappings"


class Rig:
    """One engine with a saved slot to load from; `sample` times hot pairs in both directions."""

    def __init__(self, gpu: bool, bs: int = 16):
        self.dev, self.kv, self.pool, self.eng, self.ids = make_engine(bs, gpu)
        self.first = self.eng.save(self.ids[0], after=None)
        self.small = self.eng.save(self.ids[0][:1], after=None)
        self.eng.wait(self.first)  # the loads read these slots only after their saves completed
        self.eng.wait(self.small)

    def sample(self, reps: int) -> tuple[dict[str, list[dict]], str]:
        """Traced hot pairs per direction, and what the threads did meanwhile."""
        out, census = {}, ThreadCensus()
        census.start()
        for direction in ("save", "load"):
            slots = self.first.slot, self.small.slot
            run(self.eng, self.ids, direction, "pair", 5, *slots)  # warm-up: graphs captured
            out[direction] = run(self.eng, self.ids, direction, "pair", reps, *slots)
        return out, census.report()

    def check_and_close(self) -> bool:
        lj = self.eng.load(self.first.slot, self.ids[1])
        self.eng.wait(lj)  # the blocks are compared only after e_load
        ok = all(torch.equal(x[:, self.ids[1]], x[:, self.ids[0]]) for x in self.kv.layers)
        self.eng.release(self.first.slot)
        self.eng.release(self.small.slot)
        self.eng.close()
        self.pool.close()
        return ok


def show(label: str, sampled: tuple[dict[str, list[dict]], str]) -> None:
    got, census = sampled
    ref = host_reference(512, reps=10, gpu=torch.cuda.is_available())
    for direction, recs in got.items():
        wall = sorted(r["wall_us"] for r in recs)
        phases = [k for k in dict.fromkeys(k for r in recs for k in r) if k not in SKIP]
        cols = " ".join(f"{k}={statistics.median(r.get(k, 0) for r in recs) / 1e3:.1f}" for k in phases)
        print(
            f"{label:24s} {direction} median {statistics.median(wall):6.1f} min {wall[0]:6.1f} us"
            f" | yardstick {ref['hot_us']:.1f} us | phase medians: {cols}",
            flush=True,
        )
    print(f"{'':24s} {census}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fresh-only", action="store_true", help="the new-process phase alone")
    args = ap.parse_args()
    if args.reps < 1 or args.rounds < 1:
        raise SystemExit("--reps and --rounds: at least 1")
    gpu = torch.cuda.is_available()
    if not gpu:
        print("no CUDA GPU: a check of this script on SimDevice (tiny cache), not figures")
    old = Rig(gpu)
    show("new process" if args.fresh_only else "fresh", old.sample(args.reps))
    if args.fresh_only:
        return 0 if old.check_and_close() else 1

    from kvtier.bench.runner import run_bench

    res = run_bench(["bidir", "save_beside_matmul"], out_dir=None, plot=False, progress=False)
    ran = {k: v["status"] for k, v in res.doc["suites"].items()}
    print(f"suites in-process: {ran}", flush=True)
    new = Rig(gpu)
    for r in range(args.rounds):
        show(f"after suites, old #{r}", old.sample(args.reps))
        show(f"after suites, new #{r}", new.sample(args.reps))
    gc.collect()
    show("after gc, new", new.sample(args.reps))
    torch.cuda.empty_cache() if gpu else None  # cached device blocks of the suites back to the driver
    host_empty = getattr(torch._C, "_host_emptyCache", None)
    if gpu and host_empty is not None:
        host_empty()  # and their cached pinned host blocks (the suites' 1 GiB buffers)
    show("after caches, new", new.sample(args.reps))
    gc.freeze()
    show("after freeze, new", new.sample(args.reps))
    ok = old.check_and_close() and new.check_and_close()
    print(f"checked: loads of the saved slots equal the source blocks: {ok}", flush=True)
    cmd = [sys.executable, __file__, "--fresh-only", "--reps", str(args.reps)]
    ok = subprocess.run(cmd, check=False).returncode == 0 and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
