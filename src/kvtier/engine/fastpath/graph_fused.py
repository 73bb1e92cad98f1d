"""A staged-graph replay as one call of the C helper (`fast.py`, `_fast.c`), for
`graphs.StagedGraphs`: the query of the event guarding the next pinned ids buffer, the ids
copied into it, their copy to the graph's device buffer, the graph launch and the record of
the job's raw event. The module docstring of `graphs.py` has the whole design."""

from __future__ import annotations

import contextlib
import warnings

import torch

from kvtier.device.cuda_events import NOT_READY
from kvtier.device.cudart import clear_last_error
from kvtier.engine.fastpath.fast import fast as _fast

GUARD, COPY, LAUNCH, RECORD, DEVICE = 5, 1, 2, 3, 4  # the failed step in a nonzero result (_fast.c)
WHAT = {GUARD: "cudaEventQuery", DEVICE: "cudaSetDevice", COPY: "cudaMemcpyAsync", LAUNCH: "cudaGraphLaunch"}


def replay_fused(graphs, entry, ex, ids, stream, done, done_on) -> bool:
    """Replay exec `ex` of `entry` with `ids` (int32, checked: `IdCheck`'s) on `stream`, `done` the
    job's event (recorded here when it is raw and `done_on` its device stream, else by the caller). False:
    nothing of the graph was launched (the job goes eager; later replays go through ctypes)."""
    tr, ring = graphs.trace, entry.ring  # tr: marks only when tracing
    ev = getattr(done, "handle", 0) if done_on is not None else 0  # torch's events: the caller records
    n, ptr = ids.shape[0], (ids.numpy() if isinstance(ids, torch.Tensor) else ids)  # C: int32 only
    try:  # the device stream's plain ints, not torch's properties (calls into torch: a cold host pays each)
        h, dev = done_on.handle, done_on.index
    except AttributeError:  # no device stream (None, or another object): ask torch
        h, dev = stream.cuda_stream, stream.device_index
    i = ring.next  # the buffer to try first and its guard (queried below, in C where it can be)
    g = ring.guards[i]
    gh = None if g is None else getattr(g, "handle", None)
    if gh is None and g is not None:  # not a raw event: asked in Python (it may grow the ring)
        i, gh = ring.take(), 0
    elif gh is not None and g.known_complete:
        gh = 0  # never recorded, or seen complete (a wait, a poll): no cudaEventQuery
    if tr is None:
        rc = _fast.replay(ptr, n, ring.buffers[i].ptr, entry.ids_ptr, ex.handle, h, ev, dev, gh or 0)
        if rc >> 32 == GUARD and rc & 0xFFFFFFFF == NOT_READY:
            clear_last_error()  # "not ready" is no failure: torch's next check must not see it
            # Its last copy may not have read the buffer yet: another buffer (or wait for that copy).
            i = ring.take()
            rc = _fast.replay(ptr, n, ring.buffers[i].ptr, entry.ids_ptr, ex.handle, h, ev, dev, 0)
    else:  # the same call, timing each runtime call (the trace's split)
        args = (ptr, n, entry.ids_ptr, ex.handle, h, ev, dev)
        rc, i = _traced(graphs.trace_ns, tr, ring, i, gh or 0, *args)
    if rc == 0:
        # The buffer is rewritten only after the job's event: its copy has read the ids by then.
        ring.guards[i], ring.next = done, (i + 1) % len(ring.buffers)  # `ring.arm_with(i, done)` inline
        if ev:
            done.mark_recorded(done_on)
        return True
    step, err = rc >> 32, rc & 0xFFFFFFFF
    clear_last_error()  # handled here: torch's next check must not report it at an unrelated launch
    if step == RECORD:  # copy and graph enqueued, the event not: as a failed record of the engine's
        with contextlib.suppress(Exception):
            # The queued copy reads the ids buffer: it must have run before the buffer is reused.
            stream.synchronize()
        raise RuntimeError(f"cudaEventRecord after a graph replay failed: cudaError {err}")
    if step == LAUNCH:
        ring.arm_with(i, done)  # the copy was enqueued: the buffer waits for the job's event
    graphs.fused = False
    graphs.stats.failures += 1
    msg = f"kvtier: fused graph replay failed ({WHAT.get(step)}: cudaError {err}), replays go through ctypes"
    warnings.warn(msg, stacklevel=6)
    return False


# replay_steps' stamps: the phase that ends at each
STEPS = ("replay_prep", "replay_args", "guard", "ids_fill", "device", "ids_h2d", "launch", "event")


def _traced(ns, tr, ring, i, guard, ptr, n, ids_ptr, exec_handle, h, ev, dev):
    """`_fast.replay_steps` (the call `replay_fused` makes, stamping each step) -> (rc, the ring
    buffer used). Marks replay_prep (Python up to the C call), replay_args (the call's
    arguments read), guard (the buffer's cudaEventQuery, where asked), ids_fill (the ids into the
    pinned buffer), device (cudaGetDevice, and cudaSetDevice where another device is current),
    ids_h2d, launch (the graph's launch alone), event (the record) and replay_return (back in
    Python, these marks included)."""
    rc = _fast.replay_steps(ptr, n, ring.buffers[i].ptr, ids_ptr, exec_handle, h, ev, dev, guard, ns)
    if rc >> 32 == GUARD and rc & 0xFFFFFFFF == NOT_READY:
        clear_last_error()  # "not ready" is no failure: torch's next check must not see it
        i = ring.take()  # its last copy may not have read the buffer yet: another one
        rc = _fast.replay_steps(ptr, n, ring.buffers[i].ptr, ids_ptr, exec_handle, h, ev, dev, 0, ns)
    tr.mark_steps(STEPS, ns.tolist())  # a stamp of 0: the step was not reached (a failed call)
    tr.mark("replay_return")
    return rc, i
