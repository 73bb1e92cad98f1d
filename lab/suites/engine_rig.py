"""What the engine suites share: the GPU device, an engine on its own pool, jobs timed with device
events (one run at a time, or several kinds of run in turn), and settling jobs (wait, then release).

Jobs are timed from before the submit to after the job's event, one job at a time from an idle
engine; the slot is waited for and released outside the timed region.
"""

from __future__ import annotations

from kvtier.bench import Context, SkipSuite, summarize
from kvtier.engine import SaveJob
from lab.spin import hold


def gpu(ctx: Context):
    if not ctx.on_gpu:
        raise SkipSuite("needs a CUDA GPU")
    from kvtier.device import CudaDevice

    return CudaDevice(ctx.device.index or 0)


def make_engine(dev, kv, nbytes: int, slots: int, **kw):
    from kvtier.engine import EngineConfig, TransferEngine
    from kvtier.pool import PinnedPool

    pool = PinnedPool(dev, slots * nbytes, chunk_bytes=nbytes)  # one slot per chunk: no straddling
    return TransferEngine(dev, kv, pool, EngineConfig(**kw)), pool


def time_jobs(dev, submit, finish, reps: int, warmup: int = 2, hold_ms: float = 0.0, held=None):
    """Device-event time from before `submit(start)` to after the events of the jobs it returns,
    one run at a time; `finish(jobs)` (untimed) waits for them and releases their slots.
    hold_ms: the device is held that long before each start (`hold`), so the jobs the host submits
    meanwhile all start at it; `held` (a list) gets, per timed run, whether the start was still
    pending once every job was submitted (False: the hold ran out first)."""
    return time_alternating(dev, [(submit, finish, held)], reps, warmup, hold_ms)[0]


def time_alternating(dev, runs, reps: int, warmup: int = 2, hold_ms: float = 0.0):
    """`time_jobs` for several (submit, finish, held) at once: their runs alternate (one of each
    per round, the order reversed every other round), so each one's median spans the same moments
    of a drifting device or link. One summary per entry of `runs`."""
    cur, samples = dev.current_stream(), [[] for _ in runs]
    for i in range(warmup + reps):
        order = range(len(runs)) if i % 2 == 0 else range(len(runs) - 1, -1, -1)
        for k in order:
            submit, finish, held = runs[k]
            if hold_ms:
                hold(dev, cur, hold_ms)  # the start event completes only after the hold
            start = cur.record("bench:start")  # the clock starts when the GPU reaches the submit, not the CPU
            jobs = submit(start)
            if held is not None and i >= warmup:
                held.append(not start.query())
            for j in jobs:
                cur.wait_event(j.event)  # the end event must follow each job's last copy, or it under-reports
            end = cur.record("bench:end")  # after the waits above: covers every job
            end.synchronize()  # elapsed time is known only once the end event completed
            finish(jobs)
            if i >= warmup:
                samples[k].append(start.elapsed_ms(end))
    return [summarize(s, "cuda_events") for s in samples]


def timed_load(eng, slot, ids, start, **kw):
    if start is not None:
        eng.load_stream.wait_event(start)  # the timed load must not start before the timer's start event
    return eng.load(slot, ids, **kw)


def unavailable(path: str) -> str | None:
    """Why `path` cannot run here (checked before a pool is pinned for it), or None."""
    from kvtier.engine.fastpath import batch

    return batch.why_unavailable() if path == "batch" and not batch.available() else None


def settle(eng, jobs) -> None:
    for j in jobs:
        eng.wait(j)  # only a completed job gives its slot back: never release under DMA
        if isinstance(j, SaveJob):
            eng.release(j.slot)


def release_when_saved(eng, job):
    eng.wait(job)  # the slot is released only once e_save completed: never under DMA
    eng.release(job.slot)
    return job.event
