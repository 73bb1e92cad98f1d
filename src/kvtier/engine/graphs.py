"""CUDA graphs of the staged path: the per-job GPU sequence of a staged save / load (gathers +
DMAs, or DMAs + scatters, over the two staging buffers) captured once, replayed for later jobs.

Submitting a staged job eagerly costs ~1-3 ms of CPU (a Triton launch, stream switches and an
event pair per chunk); a replay is one `cudaGraphLaunch` on the engine's copy stream, a runtime
call on raw handles (`graph_nodes.Launcher`; torch's replay where that is unavailable). Each
runtime call that reaches the GPU costs the host 10-40 us while the copy engines stream to host
memory (`benchmarks/results/...-33`), so the block ids travel inside the graph: its first node
copies them from a pinned buffer of the exec into the graph's device ids buffer.

Key: everything the graph bakes in besides the ids and the slot address -- direction, slot size,
number of blocks, valid tokens of the last block, the staging buffers. The ids are data: a replay
writes them into the pinned buffer its exec's ids node reads (`ids.IdsBuffers`), once the launch
that last read it has completed (the job's event); when that launch is still queued, the node is
first pointed at another buffer of the exec (cudaGraphExecMemcpyNodeSetParams, host-side only).
An exec whose nodes could not be found waits for its one buffer instead. The slot address is baked
into the DMA (memcpy) nodes; after capture `graph_nodes.py` finds those nodes, and a replay for
another slot of the same size first moves their host side (cudaGraphExecMemcpyNodeSetParams on
the exec graph), so one graph serves every slot. Where the
nodes are not as expected (or the update API fails), that graph is keyed by its slot address
too (`pinned_key`), as before: a replay never writes bytes anywhere but the job's slot.
With `slot_execs` > 1 an entry keeps up to that many execs of its graph (cudaGraphInstantiate of
the kept graph), each pointed at a recent slot: a job on one of those slots launches its exec
unmoved (a moved exec may cost the driver a re-upload at its next launch); another slot moves
the least recently used exec, or a new one (pointed at ids buffers of its own at creation). They
share the device ids buffer: one stream replays them, in order.
The cache is an LRU of `max_graphs` entries; an evicted entry is kept alive until an event
recorded on its stream at eviction has completed (a queued replay may still read it).
A miss runs the job eagerly (which also warms up every Triton specialization and launch plan)
and then captures its sequence for the next job with the same key.

Capture is on the copy stream itself (`torch.cuda.CUDAGraph`, "relaxed" error mode: no
device sync, other threads unaffected). `ops.save_chunks` / `load_chunks` fork their helper
stream from the copy stream with an event recorded inside the capture and join it back at the
end, and wait only on events recorded inside the capture. On replay the whole graph is one
operation of the copy stream: it starts after everything before it there (the engine's
`after` / tracker waits, earlier jobs using the same staging buffers and device ids buffer) and work
recorded after it (e_save / e_load) follows all of its nodes.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import torch

from kvtier.engine.graph_cache import LRU, GraphStats, graph_key, pinned_key
from kvtier.engine.graph_cache import Entry as _Entry
from kvtier.engine.graph_cache import Exec as _Exec
from kvtier.engine.graph_capture import capture_entry
from kvtier.engine.graph_nodes import Launcher, NodeError
from kvtier.engine.ids import IdsBuffers
from kvtier.engine.jobs import NO_TRACE

__all__ = ["LRU", "GraphStats", "StagedGraphs", "graph_key", "pinned_key"]


class StagedGraphs:
    """The graph cache of one CudaMover (used under the engine's lock).

    slot_execs: execs kept per graph, each at a recent slot (1: one exec, moved to each job's slot).
    direct: replay through runtime calls (`Launcher`); off where they are missing or failed.
    trace: a `jobs.SubmitTrace` (or None) to time the phases of a replay.
    """

    def __init__(self, kv, max_graphs: int = 64, slot_execs: int = 1):
        if isinstance(slot_execs, bool) or not isinstance(slot_execs, int) or slot_execs < 1:
            raise ValueError(f"slot_execs: expected a positive int, got {slot_execs!r}")
        self.kv = kv
        self.cache = LRU(max_graphs)
        self.stats = GraphStats()
        self.enabled = True
        self.retarget = True  # capture retargetable graphs (off after a failed node update)
        self.slot_execs = slot_execs
        self.trace = None
        self._warned = False
        self._device = kv.device
        self._dead: list[tuple[torch.cuda.Event, _Entry]] = []  # evicted, maybe still queued
        try:
            self._launcher: Launcher | None = Launcher()
        except NodeError:
            self._launcher = None
        self.direct = self._launcher is not None
        self._make_event = torch.cuda.Event  # guards an ids buffer when a replay has no job event

    def replay(self, key, ids: torch.Tensor, stream: torch.cuda.Stream, slot_ptr: int, done=None) -> bool:
        """Replay the graph of `key` for the slot at `slot_ptr` with block ids `ids` (int64 CPU,
        checked); False on a miss. `done`: an event the caller records on `stream` after this
        returns (the job's), guarding the ids buffer instead of an event record of its own."""
        tr = self.trace or NO_TRACE
        entry = self.cache.get(key) if self.enabled else None
        if entry is None and self.enabled:
            key = pinned_key(key, slot_ptr)
            entry = self.cache.get(key)
        tr.mark("graph_lookup")
        # The DMA nodes must point at this job's slot before the replay is enqueued (else the
        # bytes go to / come from the last slot); skipped when an exec's nodes already do.
        ex = None if entry is None else self._exec_for(key, entry, slot_ptr)
        tr.mark("retarget")
        if ex is None or not self._enqueue(key, entry, ex, ids, stream, done):
            self.stats.misses += 1
            return False
        self.stats.replays += 1
        return True

    def _enqueue(self, key, entry: _Entry, ex: _Exec, ids, stream, done=None) -> bool:
        """Fill the exec's ids buffer, then launch it on `stream` (the entry's copy stream); False:
        nothing of the graph was launched (the job goes eager)."""
        direct = self.direct and ex.handle
        if not direct and ex is not entry.main:
            return False  # only torch's own exec can be launched through torch
        tr, own = self.trace or NO_TRACE, ex.ids
        k = own.take(movable=ex.nodes is not None)  # a buffer no queued launch reads any more
        if k != own.cur:
            if not self._point_ids(key, entry, ex, own.buffers[k].ptr):
                return False
            own.use(k, None)  # the node reads k from now on (free until a launch is guarded below)
        buf = own.buffers[k]
        np.copyto(buf.array, ids.numpy() if isinstance(ids, torch.Tensor) else ids, casting="unsafe")
        tr.mark("ids_fill")
        if direct:
            if torch.cuda.current_device() == stream.device_index:
                ok = self._direct(ex, stream)
            else:
                with torch.cuda.device(stream.device_index):
                    ok = self._direct(ex, stream)
            if not ok:
                return False
        else:
            self._torch_launch(entry, stream)
        if done is None:  # no job event to guard the buffer with: an event of our own
            done = self._make_event()
            done.record(stream)  # after the launch: its ids copy has read the buffer by then
        own.use(k, done)  # rewritten only after `done`: the launch has copied the ids by then
        return True

    def _direct(self, ex: _Exec, stream) -> bool:
        try:
            self._launcher.launch(ex.handle, stream.cuda_stream)
        except NodeError as e:  # nothing of the graph was launched: the job goes eager
            self.direct = False
            self.stats.failures += 1
            warnings.warn(f"kvtier: direct graph launch failed, replays go through torch: {e}", stacklevel=5)
            return False
        (self.trace or NO_TRACE).mark("launch")
        return True

    def _torch_launch(self, entry: _Entry, stream) -> None:
        prev = torch.cuda.current_stream()  # of the current device
        if prev.device_index != stream.device_index:  # another device is current: the general context
            with torch.cuda.stream(stream):
                entry.graph.replay()
        else:
            torch.cuda.set_stream(stream)  # cheaper than a StreamContext on the usual path
            try:
                entry.graph.replay()
            finally:
                torch.cuda.set_stream(prev)
        (self.trace or NO_TRACE).mark("launch")

    def _point_ids(self, key, entry: _Entry, ex: _Exec, ptr: int) -> bool:
        """Point the exec's ids node at the buffer at `ptr` before its launch is enqueued. On failure
        drop the entry (as `_move`): the job goes eager."""
        try:
            ex.nodes.point_ids(ptr)
        except Exception as e:  # noqa: BLE001 - NodeError or anything else: never launch it again
            self._drop(key, entry, f"kvtier: moving a staged graph's ids buffer failed: {e}")
            return False
        return True

    def _drop(self, key, entry: _Entry, msg: str) -> None:
        self.cache.pop(key)
        self._retire(entry)  # a replay of it may still be queued: keep it alive until it ran
        self.retarget = False  # later captures are pinned
        self.stats.failures += 1
        warnings.warn(msg, stacklevel=6)

    def _exec_for(self, key, entry: _Entry, slot_ptr: int) -> _Exec | None:
        """The exec to launch for the slot at `slot_ptr`: one whose nodes point there already, else
        one moved there (a new one while fewer than slot_execs, or the least recently used); None
        when moving failed (the entry is dropped)."""
        if entry.nodes is None:
            return entry.main  # pinned: its key holds this slot's address
        execs = entry.execs if self.direct else [entry.main]
        ex = next((x for x in execs if x.nodes.base == slot_ptr), None)
        if ex is None and self.direct and len(entry.execs) < self.slot_execs:
            ex = self._new_exec(entry)
        if ex is None:
            ex = execs[-1]
        if self.direct:  # most recently used first
            if ex in entry.execs:
                entry.execs.remove(ex)
            entry.execs.insert(0, ex)
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
        nodes = entry.main.nodes.for_exec(h)
        ids = IdsBuffers(entry.main.ids._make_buffer, max_depth=entry.main.ids.max_depth)
        try:
            nodes.point_ids(ids.buffers[0].ptr)  # its own buffer: the captured one is the main exec's
        except Exception as e:  # noqa: BLE001 - as a failed instantiate
            with contextlib.suppress(Exception):
                self._launcher.destroy(h)  # never launched
            self.slot_execs, self.stats.failures = 1, self.stats.failures + 1
            warnings.warn(f"kvtier: another exec of a staged graph failed, one per graph: {e}", stacklevel=5)
            return None
        self.stats.execs += 1
        return _Exec(h, nodes, owned=True, ids=ids)

    def _move(self, key, entry: _Entry, ex: _Exec, slot_ptr: int) -> bool:
        """Point the exec's DMA nodes at the slot at `slot_ptr`, before its replay is enqueued
        (earlier launches keep their slot: graph_nodes.py). On failure drop the entry: it is
        never launched half-updated; the job goes eager and later captures are pinned."""
        try:
            ex.nodes.retarget(slot_ptr)
        except Exception as e:  # noqa: BLE001 - NodeError or anything else: never launch it again
            msg = f"kvtier: moving a staged graph to another slot failed, graphs keyed by slot: {e}"
            self._drop(key, entry, msg)
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
        ev = self._make_event()
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
