"""Where the CPU time of submitting one engine job goes (P6: <= 100 us per 1 GiB job, flat in
block count), phase by phase (`kvtier.engine.jobs.SubmitTrace`), on the CUDA device when there is
one, else a dry run on a SimDevice whose streams run each item at once (the engine's own Python --
ids, slot, tracker, events -- without worker threads; the sim's "mover" is its CPU copy, no graph).

    PYTHONPATH=src python benchmarks/profile_submit.py [--reps 20] [--hot] [--json out.json] [--cprofile]

Cases: 1 GiB of Llama-3-8B KV (32 layers, 8 KV heads, head_dim 128, bf16) in 16-token blocks (512
blocks of 2 MiB) and in 1-token blocks (8192 blocks of 128 KiB). Modes, each on a fresh engine
over one shared pool of four 1 GiB slots, path "staged":
  same       every save into one slot, every load from one slot (--hot: two, the one before's too)
  alternate  saves alternate between two slots, loads too (the engine keeps an exec per recent
             slot, graph_execs = 4: none is moved once both exist)
  alt-moved  alternate with one exec per graph (graph_execs = 1): every replay first moves it
  alt-torch  alternate, replayed through torch (copy_, CUDAGraph.replay) instead of runtime calls
  eager      graphs off
Cold (default): each timed job is submitted after the host waited for the one before, as the
submit_overhead suite times them. --hot: each timed job follows an untimed one of the same kind,
submitted just before it (loads into other blocks), as a serving loop submits back to back.
--spin-ms: the host runs that long of mixed Python / numpy / torch CPU work right before each
timed job, as a serving loop's scheduler step between submits.
Per mode: median submit_us (perf_counter around save()/load(), as the submit_overhead suite), the
median thread CPU time of the same call (cpu_us: time.thread_time; less than submit_us when the
thread was descheduled), and median us per phase; the graph stats; and a check that the last
saves wrote exactly the bytes of the reference slot into freshly poisoned slots, and the last
loads wrote src's KV into poisoned dst blocks. Expected on an H200: 30-80 s in all (the first
jobs compile the Triton kernels).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch

from kvtier import layout
from kvtier.bench.hostref import host_work as spin
from kvtier.device.sim import SimDevice, SimStream
from kvtier.engine import TransferEngine
from kvtier.engine.ids import IdCheck
from kvtier.engine.jobs import SubmitTrace
from kvtier.pool import PinnedPool

CASES = {"bs16": (16, 512), "bs1": (1, 8192)}  # block size, blocks: 1 GiB each on the 8B shape
GPU_MODES = ["same", "alternate", "alt-moved", "alt-torch", "eager"]
SIM_MODES = ["same", "alternate"]
PHASES = ["ids", "slot", "poll", "tracker_wait", "graph_lookup", "retarget", "ids_fill", "ids_h2d",
          "launch", "graph_miss", "eager", "capture", "mover", "event", "tracker_begin", "other"]  # fmt: skip


class _InlineStream(SimStream):
    """A SimStream that runs each item when it is enqueued (no worker thread)."""

    def __init__(self, device, name):
        self._dev, self.name = device, name
        self._seq = iter(range(1, 1 << 62))

    def _put(self, item) -> None:
        try:
            item()
        except BaseException as e:  # noqa: BLE001 - as a worker would: raised at the next sync
            self._dev._set_error(e, self.name)

    def _stop(self) -> None:
        pass


class InlineSim(SimDevice):
    def new_stream(self, name=None):
        s = _InlineStream(self, name or f"stream{next(self._names)}")
        self._streams.append(s)
        return s

    def close(self) -> None:
        self._closed = True


def make_cache(device, bs: int, n: int, gpu: bool):
    layers, heads, dim = (32, 8, 128) if gpu else (2, 1, 8)
    g = torch.Generator(device=device).manual_seed(bs)
    shape = (2, 3 * n, bs, heads, dim)  # src, dst, and the hot mode's other dst
    return layout.vllm_flash(
        [torch.randn(shape, dtype=torch.bfloat16, device=device, generator=g) for _ in range(layers)]
    )


def floor_us(spin_ms: float, reps: int, raw: bool = False) -> dict:
    """The least a GPU submit can be in the same host state: one 2 KiB pinned H2D copy plus one
    event record, timed after `spin_ms` of host work (or hot, right after the same two calls).
    Through torch (copy_, Event.record), or with `raw` as two ctypes calls into libcudart
    (cudaMemcpyAsync, cudaEventRecord on an event made once): what a native submit would pay."""
    import ctypes

    from kvtier.device.cudart import runtime

    src = torch.zeros(512, dtype=torch.int32).pin_memory()
    dst = torch.empty(512, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    if raw:
        lib = runtime()[0]
        vp = ctypes.c_void_p
        memcpy = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, ctypes.c_size_t, ctypes.c_int, vp)(
            ("cudaMemcpyAsync", lib)
        )
        record = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp)(("cudaEventRecord", lib))
        ev = vp(0)
        assert lib.cudaEventCreateWithFlags(ctypes.byref(ev), 2) == 0  # cudaEventDisableTiming
        d, s_, h = dst.data_ptr(), src.data_ptr(), stream.cuda_stream

        def calls():
            memcpy(d, s_, 2048, 1, h)  # cudaMemcpyHostToDevice
            record(ev, h)
    else:

        def calls():
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                torch.cuda.Event().record(stream)

    out = {}
    for name, before in (("hot", calls), ("after_work", lambda: spin(spin_ms))):
        us = []
        for _ in range(reps):
            before()
            t0 = time.perf_counter()
            calls()
            us.append((time.perf_counter() - t0) * 1e6)
            stream.synchronize()  # the source is reused: its copy must have read it
        out[name] = statistics.median(us)
    return out


def run_mode(
    dev,
    kv,
    pool,
    src,
    dst,
    mode: str,
    reps: int,
    prof=None,
    dst2=None,
    spin_ms=0.0,
    staging_mib=512,
    probe=False,
) -> dict:
    """One mode; with `dst2` (hot) each timed job follows an untimed one submitted just before;
    `spin_ms`: the host spins that long right before each timed submit; `probe`: right before
    each timed save, one check of its ids by an IdCheck of our own is timed (the host's speed at
    that moment, kvtier's submit aside)."""  # fmt: skip
    gpu = dev.name != "sim"
    eng = TransferEngine(
        dev, kv, pool, path="staged", graphs=mode != "eager", staging_bytes=staging_mib << 20
    )
    g = getattr(eng.mover, "graphs", None)
    if g is not None and mode in ("alt-moved", "alt-torch"):
        g.slot_execs = 1  # torch's replay launches only its own exec
    if g is not None and mode == "alt-torch":
        g.direct = False
    alternate = mode.startswith("alt")
    compute = dev.current_stream()
    srcs = []
    for _ in range(2 if alternate else 1):  # the loads' sources (the first save is eager + capture)
        job = eng.save(src, after=None)
        assert eng.wait(job)  # a load reads the slot only after its save completed
        srcs.append(job.slot)
    ref = srcs[0].tensor
    warm, held, ok, tr = 3, None, {"saves": 0, "loads": 0}, SubmitTrace()
    total = warm + reps + 4  # four untimed jobs at the end check the bytes
    us = {"save": [], "load": []}
    probe_check, probed = IdCheck(kv.num_blocks, kv.block_size), []
    cpu = {"save": [], "load": []}
    for i in range(total):
        timed, check = warm <= i < warm + reps, i >= total - 2
        if i == warm:
            eng.trace = tr  # the timed jobs only
        if i == warm + reps:
            eng.trace = None
        if check:
            poison_dst(eng, kv, dst, compute, gpu)
        pre = eng.save(src, after=None) if dst2 is not None else None  # hot: the submit just before
        if timed and spin_ms:
            spin(spin_ms)
        if timed and probe:
            t0 = time.perf_counter()
            probe_check.check(src, False)
            probed.append((time.perf_counter() - t0) * 1e6)
        if timed and prof is not None:
            prof.enable()
        c0 = time.thread_time_ns()
        job = eng.save(src, after=None)
        c_save = time.thread_time_ns() - c0
        if timed and prof is not None:
            prof.disable()
        if pre is not None:
            assert eng.wait(pre)  # its slot is released only after its copy completed
            eng.release(pre.slot)
        assert eng.wait(job)
        if check:
            ok["saves"] += bool(torch.equal(job.slot.tensor, ref))
        if i >= total - 4:
            job.slot.tensor.fill_(0xA5)  # no copy touches it (e_save completed): poisoned for reuse
        if alternate:
            if held is not None:
                eng.release(held)  # the slot before: the next save takes it, the one after the other
            held = job.slot
        else:
            eng.release(job.slot)
        pre = eng.load(srcs[(i + 1) % len(srcs)], dst2) if dst2 is not None else None  # hot: just before
        if timed and spin_ms:
            spin(spin_ms)
        if timed and prof is not None:
            prof.enable()
        c0 = time.thread_time_ns()
        lj = eng.load(srcs[i % len(srcs)], dst)
        c_load = time.thread_time_ns() - c0
        if timed and prof is not None:
            prof.disable()
        if pre is not None:
            assert eng.wait(pre)  # its source slot's read ends only after e_load
        assert eng.wait(lj)  # the check below reads the blocks only after e_load
        if check:
            ok["loads"] += all(torch.equal(x[:, dst], x[:, src]) for x in kv.layers)
        eng.poll()
        if timed:
            us["save"].append(job.submit_s * 1e6)
            us["load"].append(lj.submit_s * 1e6)
            cpu["save"].append(c_save / 1e3)
            cpu["load"].append(c_load / 1e3)
    out = {
        "mode": mode,
        "hot": dst2 is not None,
        "checked": ok,
        "graph_stats": vars(g.stats).copy() if g is not None else None,
        "host_probe_us": statistics.median(probed) if probed else None,
    }
    if g is not None:  # nodes per captured graph (save, load): what one cudaGraphLaunch submits
        out["graph_nodes"] = [getattr(e.nodes, "num_nodes", None) for e in g.cache.by_key.values()]
    for job in ("save", "load"):
        out[job] = {
            "submit_us": statistics.median(us[job]), "cpu_us": statistics.median(cpu[job]),
            "phases_us": tr.medians(job), **tr.split(job),
        }  # fmt: skip
    for s in [*srcs, held]:
        if s is not None:
            eng.release(s)
    eng.close()
    assert pool.stats().used == 0
    return out


def poison_dst(eng, kv, dst, compute, gpu: bool) -> None:
    """0xFF bytes in the dst blocks, written on the compute stream; the next load waits for it."""
    if gpu:
        with torch.cuda.stream(compute.raw):
            for x in kv.layers:
                x.view(torch.int16)[:, dst] = -1
    else:
        for x in kv.layers:
            x.view(torch.int16)[:, dst] = -1
    eng.compute_write(dst, compute.record("poison"))


def show(case: str, r: dict) -> None:
    for job in ("save", "load"):
        ph = r[job]["phases_us"]
        cols = " ".join(f"{k}={ph[k]:.1f}" for k in PHASES if ph.get(k))
        head = f"submit_us={r[job]['submit_us']:7.1f} cpu_us={r[job]['cpu_us']:7.1f}"
        if r[job].get("py_us") is not None:
            head += f" py_us={r[job]['py_us']:6.1f} calls_us={r[job]['calls_us']:5.1f}"
        print(f"{case:5s} {r['mode']:10s} {job}: {head} | {cols}")
    gs = r["graph_stats"]
    if gs:
        print(f"{'':17s}graph stats {gs}, nodes per graph {r.get('graph_nodes')}")
    print(f"{'':17s}checked: {r['checked']} of 2 saves / 2 loads bit-exact")
    if r.get("host_probe_us") is not None:
        print(
            f"{'':17s}host probe (a 512-id check right before each timed save): {r['host_probe_us']:.1f} us"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--modes", nargs="*", default=None)
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--hot", action="store_true", help="each timed job right after an untimed one")
    ap.add_argument(
        "--spin-ms",
        type=float,
        default=0.0,
        help="host work (a scheduler step's stand-in) this long before each timed job",
    )
    ap.add_argument(
        "--staging-mib",
        type=int,
        default=512,
        help="GPU staging per direction (two buffers of half; GPU only)",
    )
    ap.add_argument("--probe", action="store_true", help="time a check of the ids right before each save")
    ap.add_argument("--pin-cpu", type=int, default=None, help="run on this CPU only (sched_setaffinity)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--cprofile", action="store_true", help="cProfile the timed submits of bs16 alternate")
    args = ap.parse_args()
    if args.pin_cpu is not None:
        os.sched_setaffinity(0, {args.pin_cpu})  # this thread and those it starts: one CPU
        print(f"pinned to CPU {args.pin_cpu}")
    t_start = time.perf_counter()
    gpu = torch.cuda.is_available()
    if gpu:
        from kvtier.device import CudaDevice

        dev, device = CudaDevice(), "cuda"
        print(
            "device:", torch.cuda.get_device_name(0), "torch", torch.__version__, "cuda", torch.version.cuda
        )
    else:
        dev, device = InlineSim(), "cpu"
        print("no CUDA device: dry run on SimDevice (inline streams); graph modes need a GPU")
    modes = args.modes or (GPU_MODES if gpu else SIM_MODES)
    results, pool = [], None
    for case in args.cases:
        bs, n = CASES[case]
        kv = make_cache(device, bs, n, gpu)
        nbytes = kv.chunk_nbytes(n)
        if pool is None or pool.chunk_bytes != nbytes:
            if pool is not None:
                pool.close()
            pool = PinnedPool(dev, 5 * nbytes, chunk_bytes=nbytes)  # one slot per chunk
        perm = torch.randperm(3 * n, generator=torch.Generator().manual_seed(n))
        src, dst, dst2 = perm[:n].clone(), perm[n : 2 * n].clone(), perm[2 * n :].clone()
        print(f"== {case}: {n} blocks of {bs} tokens, {nbytes / 2**30:.2f} GiB per job")
        for mode in modes:
            prof = cProfile.Profile() if args.cprofile and case == "bs16" and mode == "alternate" else None
            r = run_mode(
                dev,
                kv,
                pool,
                src,
                dst,
                mode,
                args.reps,
                prof,
                dst2 if args.hot else None,
                args.spin_ms,
                args.staging_mib,
                args.probe,
            )
            r.update(case=case, blocks=n, block_size=bs, nbytes=nbytes, device=dev.name)
            results.append(r)
            show(case, r)
            if prof is not None:
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        del kv
        if gpu:
            torch.cuda.empty_cache()
    if pool is not None:
        pool.close()
    how = "hot: each right after another" if args.hot else "cold: each after waiting for the one before"
    how += f", after {args.spin_ms:g} ms of host work" if args.spin_ms else ""
    if gpu:
        for raw in (False, True):
            f = floor_us(args.spin_ms or 3.0, args.reps, raw)
            how_calls = "ctypes into libcudart" if raw else "torch"
            print(f"floor (2 KiB pinned H2D + event record, {how_calls}): {f['hot']:.1f} us hot, "
                  f"{f['after_work']:.1f} us after {args.spin_ms or 3.0:g} ms of host work")  # fmt: skip
    print(f"\nsubmit_us medians (save / load), {how}; P6: <= 100 us, flat in block count")
    for r in results:
        sv, ld = r["save"]["submit_us"], r["load"]["submit_us"]
        line = f"  {r['case']:5s} {r['mode']:10s} {sv:7.1f} / {ld:7.1f}"
        if r["save"].get("py_us") is not None:  # kvtier's Python, then the runtime calls (see split_us)
            line += f"   py {r['save']['py_us']:6.1f} / {r['load']['py_us']:6.1f}"
            line += f"   calls {r['save']['calls_us']:5.1f} / {r['load']['calls_us']:5.1f}"
        print(line)
    print(f"elapsed {time.perf_counter() - t_start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    bad = [r for r in results if r["checked"] != {"saves": 2, "loads": 2}]
    if bad:
        print("BYTES WRONG in", [(r["case"], r["mode"]) for r in bad])
    dev.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
