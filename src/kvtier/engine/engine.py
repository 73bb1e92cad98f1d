"""TransferEngine: save and load jobs in the lifecycle protocol's order (DESIGN.md).

Save (GPU blocks -> a new pool slot), on `save_stream`:
  wait `after` and pending writers/loaders of the blocks -> gather + copy -> record e_save;
  slot FILLING(e_save); READY only once e_save has completed (settled by poll/wait).
Load (slot -> GPU blocks), on `load_stream`:
  wait pending readers/writers/savers/loaders of the blocks -> copy + scatter, an event per
  layer -> record e_load; slot READING(e_load); the read ends only once e_load completed.

One code path holds the protocol (waits, events, tracker moves); the bytes move through a
per-device mover (`movers.py`). Submission takes one lock, so the order of work on the
streams is the order the trackers see. Nothing is ever released on a timeout or because a
call returned: only `poll`/`wait` (`completion.py`) apply completions, and they look at events.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

from kvtier.device.base import Device, Event, Stream
from kvtier.engine.completion import Completion
from kvtier.engine.compute import ComputeAccess
from kvtier.engine.ids import IdCheck
from kvtier.engine.jobs import LoadJob, SaveJob, SubmitTrace, _Job
from kvtier.engine.movers import make_mover
from kvtier.engine.options import check_options, check_per_layer, check_slot
from kvtier.engine.paths import Path, job_path, parse_path
from kvtier.layout import PagedKV
from kvtier.lifecycle import Access, BlockTracker, LifecycleError, SlotState, SlotTracker, sanitize_enabled
from kvtier.pool import PinnedPool, Slot


class TransferEngine(Completion, ComputeAccess):
    """Moves paged KV blocks between `kv` (GPU) and slots of `pool` (pinned host).

    Args:
        path: "auto" (rule in `paths.py`), "staged", "kernel" or "batch"; per job `path=` wins.
        sanitize: raise LifecycleError on illegal moves (default: env KVTIER_SANITIZE).
        staging_bytes: GPU staging per direction for the staged path (two buffers of half). 512 MiB:
            on the H200 the staged save ran 98.7% of pinned D2H with 256 MiB chunks against 96.3%
            with 32-128 MiB ones, and CPU submit time grows with the number of chunks.
        uva_ctas: CTAs of the kernel path's persistent grid (default: a quarter of the SMs).
        compute_beside: the model computes while jobs run (steers "auto" to copy-engine paths;
            "auto" is decided once per direction from it and the cache: set it at construction).
        graphs: on CUDA, replay staged jobs from CUDA graphs captured once per direction / slot
            size / block count / last-block tokens, each pointed at the job's slot (`graphs.py`;
            one call of the C helper per replay, `fast.py`). max_graphs: size of that LRU cache.
        graph_execs: execs kept per graph, each pointed at a recent slot: a job on one of those
            slots replays without first moving the graph's DMA nodes (one runtime call per
            256 MiB chunk, ~20 us per 1 GiB job on the H200). Slots are reused lowest address
            first, so a few execs cover the slots a serving loop cycles through.

    `trace`: a `SubmitTrace` timing the phases of each submit (KVTIER_SUBMIT_TRACE=1), or None.
    Completion (poll / wait / release) comes from `Completion` (`completion.py`), what compute
    tells it (compute_read / compute_write) from `ComputeAccess` (`compute.py`).
    """

    def __init__(
        self,
        device: Device,
        kv: PagedKV,
        pool: PinnedPool,
        *,
        path: str = "auto",
        sanitize: bool | None = None,
        staging_bytes: int = 512 << 20,
        uva_ctas: int | None = None,
        compute_beside: bool = True,
        graphs: bool = True,
        max_graphs: int = 64,
        graph_execs: int = 4,
    ):
        check_options(
            device, kv, pool, staging_bytes=staging_bytes, uva_ctas=uva_ctas, graphs=graphs,
            max_graphs=max_graphs, graph_execs=graph_execs,
        )  # fmt: skip
        self.graphs, self.max_graphs, self.graph_execs = graphs, max_graphs, graph_execs
        self.device, self.kv, self.pool = device, kv, pool
        self.path = parse_path(path)
        self.sanitize = sanitize_enabled(sanitize)
        self.staging_bytes, self.uva_ctas, self.compute_beside = staging_bytes, uva_ctas, compute_beside
        self.save_stream: Stream = device.new_stream("kvtier-save")
        self.load_stream: Stream = device.new_stream("kvtier-load")
        self.slots = SlotTracker(pool, sanitize=self.sanitize)
        self.blocks = BlockTracker(sanitize=self.sanitize)
        self.mover = make_mover(self)
        self._lock = threading.RLock()
        self._jobs: list[_Job] = []  # submitted, not settled
        self._stream_waits: dict[Stream, list[Event]] = {}  # events a stream was made to wait for
        self._seq = itertools.count(1)
        self._closed = False
        self._check_ids = IdCheck(kv.num_blocks, kv.block_size)
        self._block_nbytes = kv.block_nbytes  # kv.chunk_nbytes(n) = n * this, without its property chain
        self._num_layers = kv.num_layers  # a property of the layers' shapes: read once
        # Back-pressure: settled jobs and retired slots give their room back while we wait.
        self._on_pressure = lambda _n: self.poll() > 0
        self._auto: dict[tuple[str, bool], Path] = {}  # (direction, per_layer) -> path of a job naming none
        on = os.environ.get("KVTIER_SUBMIT_TRACE", "").strip().lower() in ("1", "true", "yes", "on")
        self.trace = SubmitTrace() if on else None

    # ---- jobs -----------------------------------------------------------------------------
    def save(
        self,
        block_ids,
        *,
        after: Event | None,
        num_tokens: int | None = None,
        path: str | None = None,
        timeout: float | None = None,
    ) -> SaveJob:
        """Copy blocks `block_ids` (every layer, K and V) into a new slot of kv.chunk_nbytes(n).

        after: recorded on the compute stream after these blocks' KV was written (None: no
            compute write is pending beyond those told through `compute_write`).
        timeout: seconds to wait for pool room (completed jobs are harvested meanwhile); None
            waits no longer than one harvest. Then PoolExhausted.
        """
        t0, tr = time.perf_counter(), self._trace  # tr: None unless tracing (then the phases are marked)
        if tr is not None:
            tr.begin("save")
        if self._closed:
            self._check_open()
        bset = self._check_ids.checked(block_ids, False, num_tokens)
        ids = bset.ids  # int32 numpy, the job's own
        if tr is not None:
            tr.mark("ids")
        p = self._auto.get(("save", False)) if path is None else None  # decided once: see paths.job_path
        if p is None:
            p = job_path(self, "save", path)
        nbytes = len(ids) * self._block_nbytes
        slot = self.slots.alloc(nbytes, timeout or 0.0, self._on_pressure)
        if tr is not None:
            tr.mark("slot")
        try:
            with self._lock:
                k = next(self._seq)
                waits = self.blocks.waits_for(Access.SAVE, bset, self.save_stream)
                if after is not None:
                    # The copy must not read KV the compute has not finished writing (vLLM #31341).
                    self.save_stream.wait_event(after)
                    waited = [*waits, after]
                else:
                    waited = waits
                for e in waits:
                    # Nor blocks a load or a registered compute write still writes.
                    self.save_stream.wait_event(e)
                if tr is not None:
                    tr.mark("tracker_wait")
                e_save = self.device.new_event(f"e_save#{k}")
                self.mover.save(p, ids, num_tokens, slot, self.save_stream, e_save)
                if tr is not None:
                    tr.mark("mover")
                if e_save.stream is None:  # not recorded by a graph replay right after its copies
                    e_save.record(self.save_stream)  # after every copy: then the slot is READY
                if tr is not None:
                    tr.mark("event")
                self.blocks.register(Access.SAVE, bset, e_save, waited)
                self.slots.begin_fill(slot, e_save)  # READY only once e_save has completed
                job = SaveJob(self, slot, e_save, ids, nbytes, p._value_, time.perf_counter() - t0)
                self._jobs.append(job)
                if tr is not None:
                    tr.mark("tracker_begin")
                    tr.end()
                return job
        except BaseException:
            # A failed mover may have enqueued copies into the slot: they land before it is reused.
            if self.slots.state(slot) is SlotState.ALLOCATED and self._quiesce(self.save_stream):
                self.slots.release(slot)  # nothing of the job is in flight any more
            raise

    def load(
        self,
        slot: Slot,
        block_ids,
        *,
        num_tokens: int | None = None,
        per_layer: bool = True,
        path: str | None = None,
    ) -> LoadJob:
        """Copy the READY slot `slot` into blocks `block_ids` (n distinct ids, every layer)."""
        t0, tr = time.perf_counter(), self._trace  # as in save: marks only when tracing
        if tr is not None:
            tr.begin("load")
        if self._closed:
            self._check_open()
        if type(slot) is not Slot:  # the usual Slot passes with one test; the check names what is wrong
            check_slot(slot)
        if per_layer is not True and per_layer is not False:
            check_per_layer(per_layer)
        bset = self._check_ids.checked(block_ids, True, num_tokens)
        ids = bset.ids  # int32 numpy, the job's own
        if tr is not None:
            tr.mark("ids")
        nbytes = len(ids) * self._block_nbytes
        if slot.nbytes != nbytes:
            raise ValueError(f"slot: holds {slot.nbytes} B, {len(ids)} blocks need {nbytes} B")
        p = self._auto.get(("load", per_layer)) if path is None else None  # decided once: see paths.job_path
        if p is None:
            p = job_path(self, "load", path, per_layer)
        if self.slots.state(slot) is SlotState.FILLING:
            self.poll()  # a save into this slot that has completed becomes READY now
        if tr is not None:
            tr.mark("poll")
        with self._lock:
            if self.sanitize and self.slots.state(slot) not in (SlotState.READY, SlotState.READING):
                # Checked before submitting anything: a half-submitted job could not be undone.
                why = "the slot holds no complete data yet: wait for its save job first"
                raise LifecycleError("load", slot.name, self.slots.state(slot).value, None, why)
            k = next(self._seq)
            waits = self.blocks.waits_for(Access.LOAD, bset, self.load_stream)
            for e in waits:
                # The load must not overwrite blocks still read, written or saved (vLLM #47282).
                self.load_stream.wait_event(e)
            if tr is not None:
                tr.mark("tracker_wait")
            e_load = self.device.new_event(f"e_load#{k}")
            try:
                layers = self.mover.load(
                    p, ids, num_tokens, slot, self.load_stream, per_layer, f"e_load#{k}", e_load
                )
            except BaseException:
                self._quiesce(self.load_stream)  # its enqueued copies must not outlive the error
                raise
            if tr is not None:
                tr.mark("mover")
            if e_load.stream is None:  # not recorded by a graph replay right after its copies
                e_load.record(self.load_stream)  # after every copy: the blocks landed, the slot free
            if tr is not None:
                tr.mark("event")
            self.slots.begin_read(slot, e_load)  # the slot may be freed only after e_load
            self.blocks.register(Access.LOAD, bset, e_load, waits)
            layer_events = [*layers, e_load] if layers else [e_load] * self._num_layers
            job = LoadJob(self, slot, e_load, ids, nbytes, p._value_, 0.0, layer_events=layer_events)
            self._jobs.append(job)
        job.submit_s = time.perf_counter() - t0
        if tr is not None:
            tr.mark("tracker_begin")
            tr.end()
        return job

    def load_path(self, per_layer: bool = False) -> Path:
        """The path a load job with no `path=` of its own takes (`paths.py`)."""
        return job_path(self, "load", None, per_layer)

    def load_slots(self, slots, block_ids, *, num_tokens: int | None = None) -> list[LoadJob]:
        """Copy READY slots `slots` (each a chunk of whole blocks) into `block_ids` (slot by slot,
        in order) layer-major: layer l of every slot lands before layer l + 1 of any, one launch
        per layer (kernel path). One LoadJob per slot, sharing layer events and e_load."""
        from kvtier.engine.load_slots import load_slots

        return load_slots(self, slots, block_ids, num_tokens=num_tokens)

    # ---- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for every job, settle them, drop the staging buffers. The pool stays open."""
        if self._closed:
            return
        self.save_stream.synchronize()  # submitted is not done: the copies must land first
        self.load_stream.synchronize()
        self.mover.synchronize()
        self.poll()
        self.mover.close()
        self._closed = True

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def trace(self) -> SubmitTrace | None:
        return self._trace

    @trace.setter
    def trace(self, value: SubmitTrace | None) -> None:
        self._trace = value
        for obj in (self.mover, getattr(self.mover, "graphs", None)):
            if obj is not None:
                obj.trace = value  # the mover and its graphs mark their own phases

    @property
    def graph_stats(self):
        """Captures / replays / misses / evictions / failures of the staged CUDA graphs (None: off)."""
        g = getattr(self.mover, "graphs", None)
        return None if g is None else g.stats

    # ---- helpers ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TransferEngine is closed")
