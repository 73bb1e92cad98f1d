"""CUDA graphs of the staged path: the per-job GPU sequence of a staged save / load (gathers +
DMAs, or DMAs + scatters, over the two staging buffers) captured once, replayed for later jobs.

Submitting a staged job eagerly costs a lot of CPU (Triton launches, stream switches and an
event pair per chunk); a replay is one small H2D copy of the block ids into the graph's own
device buffer and one `cudaGraphLaunch`, both on the engine's copy stream. `StagedGraphs._launch`
is the one way a graph is replayed: with the C helper (`fast.py`) the fill of the pinned ids
buffer, those two calls and the record of the job's event are one C call (`graph_fused.py`; the
event is then recorded right after the launch, as the engine would have); without it the same
runtime calls go through ctypes on raw handles (`graph_nodes.Launcher`). Where neither can run
(no CUDA runtime calls), graphs stay off and staged jobs run eagerly.

Key: everything the graph bakes in besides the ids and the slot address -- direction, slot size,
number of blocks, valid tokens of the last block, the staging buffers. The ids are data: each
replay first copies them from one of the entry's pinned buffers (`ring.HostRing`, made at capture,
refilled only once the event after its last copy has completed). The slot address is baked
into the DMA (memcpy) nodes; after capture `graph_nodes.py` finds those nodes, and a replay for
another slot of the same size first moves their host side (cudaGraphExecMemcpyNodeSetParams on
the exec graph), so one graph serves every slot. Where the
nodes are not as expected (or the update API fails), that graph is keyed by its slot address
too (`pinned_key`): a replay never writes bytes anywhere but the job's slot.
With `slot_execs` > 1 an entry keeps up to that many execs of its graph (cudaGraphInstantiate of
the kept graph), each pointed at a recent slot: a job on one of those slots launches its exec
unmoved (a moved exec may cost the driver a re-upload at its next launch); another slot moves
the least recently used exec, or a new one. They share the ids buffer: one stream replays them.
The cache is an LRU of `max_graphs` entries; an evicted entry is kept alive until an event
recorded on its stream at eviction has completed (a queued replay may still read it).
A miss runs the job eagerly (which also warms up every Triton specialization and launch plan)
and then captures its sequence for the next job with the same key.

Capture is on the copy stream itself (`torch.cuda.CUDAGraph`, "relaxed" error mode: no
device sync, other threads unaffected). `ops.save_chunks` / `load_chunks` fork their helper
stream from the copy stream with an event recorded inside the capture and join it back at the
end, and wait only on events recorded inside the capture. On replay the whole graph is one
operation of the copy stream: it starts after everything before it there (the engine's
`after` / tracker waits, the ids copy, earlier jobs using the same staging buffers) and work
recorded after it (e_save / e_load) follows all of its nodes.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import torch

from kvtier.engine.fastpath.fast import runtime_bound
from kvtier.engine.fastpath.graph_cache import LRU, GraphStats, HostBuf, graph_key, pinned_key
from kvtier.engine.fastpath.graph_cache import Entry as _Entry
from kvtier.engine.fastpath.graph_cache import Exec as _Exec
from kvtier.engine.fastpath.graph_capture import capture_entry
from kvtier.engine.fastpath.graph_fused import STEPS, replay_fused
from kvtier.engine.fastpath.graph_nodes import Launcher, NodeError
from kvtier.engine.fastpath.ring import HostRing
from kvtier.engine.trace import NO_TRACE

__all__ = ["LRU", "GraphStats", "StagedGraphs", "graph_key", "pinned_key"]


class StagedGraphs:
    """The graph cache of one CudaMover (used under the engine's lock).

    slot_execs: execs kept per graph, each at a recent slot (1: one exec, moved to each job's slot).
    fused: replays are one call of the C helper (`graph_fused.py`); off without it, or after it
        failed (replays then go through the ctypes `Launcher`).
    trace: a `SubmitTrace` read by `replay_traced` (the mover calls that one only while tracing).
    launcher: the runtime calls of an unfused replay (None: ctypes' `Launcher`); a test hook for a fake.
    Without the runtime calls a replay needs (`Launcher`), graphs stay off: jobs run eagerly.
    """

    def __init__(self, kv, max_graphs: int = 64, slot_execs: int = 1, launcher: Launcher | None = None):
        if isinstance(slot_execs, bool) or not isinstance(slot_execs, int) or slot_execs < 1:
            raise ValueError(f"slot_execs: expected a positive int, got {slot_execs!r}")
        self.kv = kv
        self.cache = LRU(max_graphs)
        self.stats = GraphStats()
        self.retarget = True  # capture retargetable graphs (off after a failed node update)
        self.slot_execs = slot_execs
        self.trace = None
        self.trace_ns = np.zeros(len(STEPS), dtype=np.int64)  # a traced C replay's stamps (graph_fused)
        self._warned = False
        self._device = kv.device
        self._dead: list[tuple[torch.cuda.Event, _Entry]] = []  # evicted, maybe still queued
        try:
            self._launcher: Launcher | None = Launcher() if launcher is None else launcher
        except NodeError:
            self._launcher = None
        self.enabled = self._launcher is not None  # no runtime calls: every job runs eagerly
        self.fused = self.enabled and runtime_bound()  # replays as one call of the C helper

    def replay(self, key, ids, stream: torch.cuda.Stream, slot_ptr: int, done=None, done_on=None) -> bool:
        """Replay the graph of `key` for the slot at `slot_ptr` with block ids `ids` (int32 [n] CPU,
        checked: the engine's numpy array, or a tensor); False on a miss (the job goes eager).
        `done`: the job's event, recorded on `stream` after the graph (it guards the ids buffer
        instead of an event record of its own). With `done_on` (the device stream wrapping
        `stream`) the C helper may record a raw `done` itself, right after the launch;
        `done.stream` is then set, and the caller records it only while it is None."""
        entry = self._entry(key, slot_ptr)
        ex = None if entry is None else self._exec(key, entry, slot_ptr)
        return self._count(ex is not None and self._launch(entry, ex, ids, stream, done, done_on))

    def replay_traced(self, key, ids, stream, slot_ptr: int, done=None, done_on=None) -> bool:
        """`replay`, marking its phases on `self.trace` (graph_lookup, retarget, then the launch's)."""
        tr = self.trace
        entry = self._entry(key, slot_ptr)
        tr.mark("graph_lookup")
        ex = None if entry is None else self._exec(key, entry, slot_ptr)
        tr.mark("retarget")
        return self._count(ex is not None and self._launch(entry, ex, ids, stream, done, done_on))

    def _entry(self, key, slot_ptr: int) -> _Entry | None:
        """The entry of `key`, or of its slot-pinned key; None on a miss or while graphs are off."""
        if not self.enabled:
            return None
        by_key = self.cache.by_key
        entry = by_key.get(key)  # the LRU's get, inline (a call fewer)
        if entry is not None:
            by_key.move_to_end(key)
            return entry
        return self.cache.get(pinned_key(key, slot_ptr))

    def _exec(self, key, entry: _Entry, slot_ptr: int) -> _Exec | None:
        """The exec to launch: its DMA nodes must point at this job's slot before the replay is
        enqueued (else the bytes go to / come from the last slot)."""
        if entry.nodes is None:
            return entry.main  # pinned: its key holds this slot's address
        x = entry.execs[0]  # the usual case: the most recently used exec points at this slot already
        return x if x.nodes.base == slot_ptr else self._exec_for(key, entry, slot_ptr)

    def _count(self, ok: bool) -> bool:
        if ok:
            self.stats.replays += 1
        else:
            self.stats.misses += 1
        return ok

    def _launch(self, entry: _Entry, ex: _Exec, ids, stream, done, done_on) -> bool:
        """The one way a graph is replayed: the ids copied into a free pinned ring buffer, its H2D
        copy to the graph's device ids buffer, the graph launch (and, fused, the job's event record),
        on `stream`. One call of the C helper where it is built, else the same runtime calls
        through ctypes. False: nothing of the graph was launched (the job goes eager)."""
        if self.fused and done is not None:
            return replay_fused(self, entry, ex, ids, stream, done, done_on)
        tr, ring = self.trace or NO_TRACE, entry.ring
        i = ring.take()  # a buffer no queued copy reads any more
        buf = ring.buffers[i]
        np.copyto(buf.array, ids.numpy() if isinstance(ids, torch.Tensor) else ids, casting="unsafe")
        tr.mark("ids_fill")
        if torch.cuda.current_device() == stream.device_index:
            return self._runtime_calls(entry, ex, buf, i, stream, done)
        with torch.cuda.device(stream.device_index):
            return self._runtime_calls(entry, ex, buf, i, stream, done)

    def _runtime_calls(self, entry: _Entry, ex: _Exec, buf: HostBuf, i: int, stream, done=None) -> bool:
        tr, h = self.trace or NO_TRACE, stream.cuda_stream
        try:
            # The graph reads its ids buffer: the new ids land first, on the stream that replays it
            # (after the previous replay of this graph, which read the old ones, on that same stream).
            self._launcher.h2d(entry.ids_ptr, buf.ptr, buf.array.nbytes, h)
            _arm(entry.ring, i, stream, done)
            tr.mark("ids_h2d")
            self._launcher.launch(ex.handle, h)
        except NodeError as e:  # nothing of the graph was launched: the job goes eager
            self.enabled = False
            self.stats.failures += 1
            warnings.warn(f"kvtier: direct graph launch failed, staged jobs stay eager: {e}", stacklevel=5)
            return False
        tr.mark("launch")
        return True

    def _exec_for(self, key, entry: _Entry, slot_ptr: int) -> _Exec | None:
        """The exec to launch for the slot at `slot_ptr`: one whose nodes point there already, else
        one moved there (a new one while fewer than slot_execs, or the least recently used); None
        when moving failed (the entry is dropped)."""
        if entry.nodes is None:
            return entry.main  # pinned: its key holds this slot's address
        execs = entry.execs
        if execs[0].nodes.base == slot_ptr:
            return execs[0]  # the usual case: the most recently used exec points at this slot already
        ex = None
        for x in execs:  # a plain loop: no generator frame (a hot pair alternates two slots' execs)
            if x.nodes.base == slot_ptr:
                ex = x
                break
        if ex is None and len(execs) < self.slot_execs:
            ex = self._new_exec(entry)
        if ex is None:
            ex = execs[-1]
        if ex in execs:  # most recently used first
            execs.remove(ex)
        execs.insert(0, ex)
        if ex.nodes.base != slot_ptr and not self._move(key, entry, ex, slot_ptr):
            return None
        return ex

    def _new_exec(self, entry: _Entry) -> _Exec | None:
        try:
            h = self._launcher.instantiate(int(entry.graph.raw_cuda_graph()))
        except Exception as e:  # noqa: BLE001 - one exec per graph, moved, as before
            self.slot_execs, self.stats.failures = 1, self.stats.failures + 1
            warnings.warn(f"kvtier: another exec of a staged graph failed, one per graph: {e}", stacklevel=5)
            return None
        self.stats.execs += 1
        return _Exec(h, entry.main.nodes.for_exec(h), owned=True)

    def _move(self, key, entry: _Entry, ex: _Exec, slot_ptr: int) -> bool:
        """Point the exec's DMA nodes at the slot at `slot_ptr`, before its replay is enqueued
        (earlier launches keep their slot: graph_nodes.py). On failure drop the entry: it is
        never launched half-updated; the job goes eager and later captures are pinned."""
        try:
            ex.nodes.retarget(slot_ptr)
        except Exception as e:  # noqa: BLE001 - NodeError or anything else: never launch it again
            self.cache.pop(key)
            self._retire(entry)  # a replay of it may still be queued: keep it alive until it ran
            self.retarget = False
            self.stats.failures += 1
            msg = f"kvtier: moving a staged graph to another slot failed, graphs keyed by slot: {e}"
            warnings.warn(msg, stacklevel=5)
            return False
        self.stats.retargets += 1
        return True

    def capture(self, key, slot_tensor, staging, side, stream) -> None:
        """Capture the sequence of `key` (after the same job ran eagerly: Triton compiled, plans
        cached). A failure disables graphs for this engine with a warning; the eager path stays."""
        if not self.enabled:
            return
        self._reap()
        direction, _nbytes, n, last_valid, _staging = key
        try:
            entry = capture_entry(self, direction, n, last_valid, slot_tensor, staging, side, stream)
        except Exception as e:  # noqa: BLE001 - any capture failure: fall back to the eager path
            self.enabled = False
            self.stats.failures += 1
            from kvtier.device.cudart import clear_last_error

            clear_last_error()  # the failed capture's error must not surface at an unrelated launch
            warnings.warn(f"kvtier: CUDA graph capture failed, staged jobs stay eager: {e}", stacklevel=3)
            return
        base = slot_tensor.data_ptr()
        if entry.nodes is None:
            key = pinned_key(key, base)
        self.stats.captures += 1
        for old in self.cache.put(key, entry):
            self._retire(old)

    def _retire(self, entry: _Entry) -> None:
        self.stats.evictions += 1
        ev = torch.cuda.Event()
        # A replay of the evicted graph may still be queued: keep its buffer and exec until it ran.
        ev.record(entry.stream)
        self._dead.append((ev, entry))

    def _reap(self) -> None:
        keep = []
        for ev, e in self._dead:
            if ev.query():
                self._free(e)  # its last replay has run: its own execs may go
            else:
                keep.append((ev, e))
        self._dead = keep

    def _free(self, entry: _Entry) -> None:
        """Destroy the entry's own execs: only once no launch of them can be queued (its eviction
        event completed, or the streams were synchronized) -- a queued launch would use a freed exec."""
        for x in entry.execs:
            if x.owned:
                with contextlib.suppress(Exception):  # best effort: a leak, never a crash
                    self._launcher.destroy(x.handle)
        entry.execs = [x for x in entry.execs if not x.owned]

    def clear(self) -> None:
        """Drop every graph (the caller synchronized the streams they run on)."""
        for e in self.cache.clear() + [e for _ev, e in self._dead]:
            self._free(e)
        self._dead.clear()


def _arm(ring: HostRing, i: int, stream, done) -> None:
    """Guard ids buffer `i` after its H2D was enqueued on `stream`."""
    if done is not None:
        ring.arm_with(i, done)  # rewritten only after the job's event: its copy read the ids by then
    else:
        ring.arm(i, stream)  # rewritten only after this event: the copy reads the buffer later
