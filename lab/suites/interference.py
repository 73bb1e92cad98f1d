"""Suite save_beside_matmul (target P5): does a save running on the engine's copy stream slow the
model's compute? bf16 8192^3 matmuls on their own stream, alone vs beside a save looping back to
back, for each engine path (staged; kernel on its capped grid; batch where present) and, as the
bad reference, one full-grid UVA kernel writing pinned memory (`ops.gather(..., max_ctas=1 << 30)`).

Method: compute on its own stream (the legacy default stream would serialize with the
copies); a sustained warm-up first (clocks drop under load); each beside window sits between two
alone windows and the slowdown is the median over repeats of beside / mean(the two alone) — a
paired ratio, since alone windows alone spread by ~20% on the H200 (power and clocks); the save
must still be running when each timed window ends (`still_busy`); the spread of the alone
windows and the min / max of the paired slowdowns are reported next to it.

Rows: a Row needs a payload rate and a ceiling, so each row is the *save's* GB/s while beside the
matmul (intervals between consecutive completion events of back-to-back jobs inside the windows)
vs d2h_pinned; the P5 figure is params.slowdown_pct, with alone_tflops, beside_tflops,
alone_spread_pct, still_busy and meets_target (slowdown <= 3% and still_busy).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque

import torch

from kvtier import ops
from kvtier.bench import Context, MiB, register, summarize
from kvtier.bench.suites.kv import Work
from lab.suites.engine_rig import gpu, make_engine, release_when_saved, unavailable
from lab.targets import P5_PCT


class SaveLoop:
    """Keeps saves running back to back from a host thread: `depth` jobs queued on the copy
    stream, the oldest waited (and its slot released) before the next is submitted. `events`
    gets each job's completion event, in order."""

    def __init__(self, submit, finish, depth: int = 3):
        self.submit, self.finish, self.depth = submit, finish, depth
        self.events: list = []
        self._stop, self.queued = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self.queued.wait(60):
            raise RuntimeError("the save loop did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        q: deque = deque()
        try:
            while not self._stop.is_set():
                while len(q) < self.depth:
                    q.append(self.submit())
                self.queued.set()  # the copy stream has work queued: the timed window may open
                self.events.append(self.finish(q.popleft()))
            while q:
                self.events.append(self.finish(q.popleft()))
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            self.error = e
            self.queued.set()


def _uva_full(dev, kv, src, nbytes: int):
    """The bad reference: one full-grid UVA kernel (a program per tile) writing pinned memory."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    side = dev.new_stream("uva-full")

    def submit():
        dev.launch(lambda: ops.gather(kv, src, host, max_ctas=1 << 30), side)
        return side.record("uva-full:done")  # gathers on one stream run in order: no race on `host`

    def finish(ev):
        ev.synchronize()  # the kernel has stored every byte only once this completed
        return ev

    return submit, finish


@register("save_beside_matmul", description="bf16 matmul alone vs beside a looping save, per path (P5)")
def save_beside_matmul(ctx: Context):
    dev = gpu(ctx)
    m, n_mm = (4096, 10) if ctx.quick else (8192, 60)
    reps, warm_s = (2, 0.3) if ctx.quick else (9, 3.0)
    w = Work(ctx, 32 * MiB if ctx.quick else 512 * MiB, layers=2 if ctx.quick else 32)
    kv, src, _ = w.request(16)
    nbytes = w.payload
    comp = dev.new_stream("matmul")  # compute on its own stream: the legacy default one serializes
    a, b = (torch.randn(m, m, dtype=torch.bfloat16, device=ctx.device) for _ in range(2))
    c = torch.empty_like(a)
    savers, engines = {}, []
    for path in ("staged", "kernel", "batch"):
        if why := unavailable(path):
            ctx.skip(f"{path} save beside matmul", why)
            continue
        eng, pool = make_engine(dev, kv, nbytes, 4, path=path)  # 3 jobs queued + one being submitted
        try:
            release_when_saved(
                eng, eng.save(src.cpu, after=None)
            )  # warms up (Triton compiles) and checks the path
        except ValueError as e:
            ctx.skip(f"{path} save beside matmul", str(e))
            eng.close(), pool.close()
            continue
        engines.append((eng, pool))
        savers[path] = (
            lambda eng=eng: eng.save(src.cpu, after=None),
            lambda j, eng=eng: release_when_saved(eng, j),
        )
    savers["uva_full_grid"] = _uva_full(dev, kv, src, nbytes)
    savers["uva_full_grid"][1](savers["uva_full_grid"][0]())  # compile outside any timed window

    def window():
        start = comp.record("mm:start")  # on the matmul stream: times the matmuls only
        dev.launch(lambda: [torch.mm(a, b, out=c) for _ in range(n_mm)], comp)
        end = comp.record("mm:end")  # after the last matmul of the window
        end.synchronize()  # the window's length is known only once the matmuls completed
        return start, end

    t_end = time.perf_counter() + warm_s
    while time.perf_counter() < t_end:  # sustained load first: clocks settle at their loaded level
        window()
    alone: list[float] = []
    ratio = {p: [] for p in savers}
    beside = {p: [] for p in savers}
    busy = {p: [] for p in savers}
    save_ms = {p: [] for p in savers}
    for _ in range(reps):
        for path, (submit, finish) in savers.items():
            # paired: each beside window between two alone windows, so a clock or power drift
            # (alone windows spread by ~20% on the H200) cancels out of the ratio
            s0, e0 = window()
            with SaveLoop(submit, finish) as loop:
                s, e = window()
            s1, e1 = window()
            before, after = s0.elapsed_ms(e0), s1.elapsed_ms(e1)
            alone += [before, after]
            beside[path].append(s.elapsed_ms(e))
            ratio[path].append(s.elapsed_ms(e) / ((before + after) / 2))
            done = [ev.time_s() for ev in loop.events]
            busy[path].append(any(t > e.time_s() for t in done))  # the save outlived the timed window
            gaps = [(x, y) for x, y in zip(done, done[1:], strict=False)]  # one job each, back to back
            inside = [(x, y) for x, y in gaps if y > s.time_s() and x < e.time_s()] or gaps
            save_ms[path] += [(y - x) * 1e3 for x, y in inside]
    flops = 2 * m**3 * n_mm
    t_alone = statistics.median(alone)
    for path in savers:
        t_b = statistics.median(beside[path])
        r = sorted(ratio[path])
        slowdown = (statistics.median(r) - 1) * 100
        p = w.params(16, path, target="P5 matmul loses <= 3%", matmul=f"bf16 {m}^3 x{n_mm}, own stream")
        p |= dict(
            slowdown_pct=slowdown, alone_tflops=flops / t_alone / 1e9, beside_tflops=flops / t_b / 1e9,
            alone_spread_pct=(max(alone) / min(alone) - 1) * 100, still_busy=all(busy[path]), reps=reps,
            beside_spread_pct=(max(beside[path]) / min(beside[path]) - 1) * 100,
            slowdown_min_pct=(r[0] - 1) * 100, slowdown_max_pct=(r[-1] - 1) * 100, method="paired",
            meets_target=slowdown <= P5_PCT and all(busy[path]), reference=path == "uva_full_grid",
        )  # fmt: skip
        timing = summarize(save_ms[path], "cuda_events")  # the save's own pace while beside the matmul
        yield ctx.row(f"{path} save beside matmul", nbytes, timing, "d2h_pinned", **p)
    for eng, pool in engines:
        eng.close(), pool.close()
