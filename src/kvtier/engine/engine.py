"""TransferEngine: save and load jobs in the lifecycle protocol's order (`kvtier.lifecycle`).

Save (GPU blocks -> a new pool slot), on `save_stream`:
  wait `after` and pending writers/loaders of the blocks -> gather + copy -> record e_save;
  slot FILLING(e_save); READY only once e_save has completed (settled by poll/wait).
Load (slot -> GPU blocks), on `load_stream`:
  wait pending readers/writers/savers/loaders of the blocks -> copy + scatter, an event per
  layer -> record e_load; slot READING(e_load); the read ends only once e_load completed.
Several slots at once (`save_slots`, `load_slots`): the same steps once for all of them -- one
lock, one set of waits, one event -- and a job per slot, each settled when that event completed.

One code path holds the protocol (waits, events, tracker moves); the bytes move through a
per-device mover (`movers.py`), which gets a narrow `MoverContext`, never the engine. Block ids
are checked once here, at the entry (`ids.IdCheck`), and trusted below. Submission takes one
lock, so the order of work on the streams is the order the trackers see. Nothing is ever
released on a timeout or because a call returned: only `poll`/`wait` settle jobs, and they look
at events.

Tracing: with `engine.trace` set, `save` / `load` are the traced twins (`_traced_save`,
`_traced_load`), chosen once by the setter; they run the same steps with a mark between each.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
import warnings

from kvtier.device.base import Device, Event, Stream
from kvtier.engine.config import EngineConfig
from kvtier.engine.flags import FlagStep, LayerFlags
from kvtier.engine.ids import CheckedIds, IdCheck
from kvtier.engine.jobs import LoadJob, SaveJob, _Job
from kvtier.engine.movers import MoverContext
from kvtier.engine.paths import Path, choose_path, parse_path
from kvtier.engine.trace import SubmitTrace
from kvtier.layout import PagedKV
from kvtier.lifecycle import Access, BlockTracker, LifecycleError, SlotState, SlotTracker, sanitize_enabled
from kvtier.pool import PinnedPool, PoolExhausted, Slot

_NOTES_MIN = 64  # a stream's wait notes kept before the completed ones are first dropped


class TransferEngine:
    """Moves paged KV blocks between `kv` (GPU) and slots of `pool` (pinned host).

    Args:
        device: the `CudaDevice` or `SimDevice` of `kv` and `pool`.
        kv: the serving engine's paged cache (`kvtier.layout.PagedKV`); a chunk of n blocks is
            `kv.chunk_nbytes(n)` bytes, shaped `kv.chunk_shape(n)` = (n, layers, K/V, *block_shape).
        pool: the `PinnedPool` of the same device that slots come from.
        config: an `EngineConfig` (None: the defaults).

    Public state: `device`, `kv`, `pool`, `config`, `save_stream`, `load_stream`, `slots` (the
    slot tracker), `blocks` (the block tracker), `sanitize` (resolved), `mover`, and `trace` (a
    `SubmitTrace` timing each submit's phases, or None; KVTIER_SUBMIT_TRACE=1 sets one).

    >>> eng = TransferEngine(dev, kv, PinnedPool(dev, 8 * kv.chunk_nbytes(4)))
    >>> save = eng.save([3, 9, 4, 1], after=compute.record())
    >>> save.wait() and eng.load(save.slot, [5, 6, 7, 8]).wait()
    True
    """

    def __init__(self, device: Device, kv: PagedKV, pool: PinnedPool, config: EngineConfig | None = None):
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config: expected an EngineConfig or None, got {type(config).__name__}")
        if not isinstance(kv, PagedKV):
            raise ValueError(f"kv: expected a PagedKV, got {type(kv).__name__}")
        if getattr(pool, "device", None) is not device:
            raise ValueError("pool: must be a PinnedPool of the same device")
        if config.staging_bytes < 2 * kv.block_nbytes:
            raise ValueError(f"staging_bytes: need at least two blocks ({2 * kv.block_nbytes} B)")
        self.device, self.kv, self.pool, self.config = device, kv, pool, config
        self.sanitize = sanitize_enabled(config.sanitize)
        self.save_stream: Stream = device.new_stream("kvtier-save")
        self._save_streams: set[Stream] = {self.save_stream}  # every stream a save was put on
        self.load_stream: Stream = device.new_stream("kvtier-load")
        self.slots = SlotTracker(pool, sanitize=self.sanitize)
        self.blocks = BlockTracker(sanitize=self.sanitize)
        self.mover = _make_mover(MoverContext(device, kv, config))
        self._lock = threading.RLock()
        self._jobs: list[_Job] = []  # submitted, not settled
        # Sanitizer only: per stream, the events it was made to wait for (each once, by identity),
        # and the size at which the completed ones are next dropped (amortized: no scan per note).
        self._stream_waits: dict[Stream, dict[int, Event]] = {}
        self._notes_cap: dict[Stream, int] = {}
        self._seq = itertools.count(1)
        self._closed = False
        self._ids = IdCheck(kv.num_blocks, kv.block_size)
        self._block_nbytes = kv.block_nbytes  # kv.chunk_nbytes(n) = n * this, without its property chain
        self._num_layers = kv.num_layers  # a property of the layers' shapes: read once
        # Back-pressure: settled jobs and retired slots give their room back while we wait.
        self._on_pressure = lambda _n: self.poll() > 0
        self._auto: dict[tuple[str, bool], Path] = {}  # (direction, per_layer) -> path of a job naming none
        self._trace: SubmitTrace | None = None
        self._flags: LayerFlags | None = None  # `layer_flags()`, made on its first call
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

        block_ids: n ids, a 1-D int32/int64 CPU tensor [n], numpy array, range or sequence of ints.
        after: recorded on the compute stream after these blocks' KV was written (None: no
            compute write is pending beyond those told through `compute_write`).
        num_tokens: valid tokens of the n blocks ((n - 1) * block_size < num_tokens <= n * block_size;
            None: all); the slot holds zeros past them.
        path: this job's copy path ("staged", "kernel", "batch"; None: the engine's).
        timeout: seconds to wait for pool room (completed jobs are harvested meanwhile); None
            waits no longer than one harvest. Then PoolExhausted.
        """
        t0 = time.perf_counter()
        if self._closed:
            self._check_open()
        ids = self._ids.checked(block_ids, False, num_tokens)
        p = self._auto.get(("save", False)) if path is None else None  # decided once: see `_path`
        if p is None:
            p = self._path("save", path, False)
        slot = self.slots.alloc(len(ids) * self._block_nbytes, timeout or 0.0, self._on_pressure)
        try:
            with self._lock:
                k, waited = self._save_waits(ids, after)
                e_save = self.device.new_event(f"e_save#{k}")
                self.mover.save(p, ids, slot, self.save_stream, e_save)
                if e_save.stream is None:  # not recorded by a graph replay right after its copies
                    e_save.record(self.save_stream)  # after every copy: then the slot is READY
                return self._begin_save(ids, slot, e_save, waited, p, t0)
        except BaseException:
            self._undo_save(slot)
            raise

    def load(
        self,
        slot: Slot,
        block_ids,
        *,
        num_tokens: int | None = None,
        per_layer: bool = True,
        path: str | None = None,
        flags: FlagStep | None = None,
        skip_blocks: int = 0,
    ) -> LoadJob:
        """Copy the READY slot `slot` (a save job's `.slot`) into blocks `block_ids`.

        block_ids: n distinct ids, as in `save`; slot.nbytes must be kv.chunk_nbytes(n + skip_blocks).
        per_layer: the job's `layer_events[l]` completes once layer l landed (on the kernel path a
            true event per layer; on the staged path every layer's event is the job's).
        num_tokens, path: as in `save`; tokens past num_tokens are left untouched in the cache.
        flags: a step of this engine's `layer_flags()` (`LayerFlags.arm`): the job joins it, so its
            layer l counts before the step's flag l is set (per layer where the path has per-layer
            events, at the job's end otherwise). None: no flags.
        skip_blocks: the slot's first blocks are not loaded (the cache holds them already); its
            blocks skip_blocks.. go to `block_ids` (a slot is block-major: they are its byte suffix).
        """
        t0 = time.perf_counter()
        ids = self._load_ids(slot, block_ids, num_tokens, per_layer, skip_blocks)
        p = self._auto.get(("load", per_layer)) if path is None else None  # decided once: see `_path`
        if p is None:
            p = self._path("load", path, per_layer)
        if self.slots.state(slot) is SlotState.FILLING:
            self.poll()  # a save into this slot that has completed becomes READY now
        with self._lock:
            k, waits = self._load_waits(slot, ids)
            e_load = self.device.new_event(f"e_load#{k}")
            src = _tail(slot, skip_blocks * self._block_nbytes) if skip_blocks else slot
            w = None if flags is None else self._join(flags)
            try:
                layers = self.mover.load(
                    p,
                    ids,
                    src,
                    self.load_stream,
                    per_layer,
                    f"e_load#{k}",
                    e_load,
                    None if w is None else w.layer,
                )
            except BaseException:
                self._failed_load(w)
                raise
            job = None
            try:
                if e_load.stream is None:  # not recorded by a graph replay right after its copies
                    e_load.record(self.load_stream)  # after every copy: the blocks landed, the slot free
                job = self._begin_load(ids, slot, e_load, waits, layers, p)
            finally:
                if w is not None:  # after e_load: a whole job's progress follows its last copy
                    w.finish(None if job is None else job.layer_events)
        job.submit_s = time.perf_counter() - t0
        return job

    def save_slots(
        self,
        block_ids,
        counts,
        *,
        after: Event | None,
        num_tokens: int | None = None,
        path: str | None = None,
        timeout: float | None = None,
        stream: Stream | None = None,
    ) -> list[SaveJob]:
        """Copy blocks `block_ids` into len(counts) new slots in one submission: slot j gets the
        next counts[j] ids (kv.chunk_nbytes(counts[j]) bytes). One SaveJob per slot, in order,
        all sharing e_save (each slot READY once it completed): the store's chunks of a request
        cost one lock, one wait of the save stream and one event, and on the batch path one
        batched copy for every slot (staged, kernel: the slots one after the other in the call).

        block_ids: sum(counts) ids, as in `save`. counts: positive ints.
        after, path: as in `save`. num_tokens: valid tokens of all the ids together, as in `save`
            (only the last slot's last block may be partial; None: all).
        timeout: seconds to wait for pool room for each slot, as in `save`. Slots are taken in
            order; where the pool has no room for slot j, slots j.. are not saved and fewer jobs
            than counts come back (PoolExhausted, nothing submitted, when slot 0 has none).
        stream: the copy stream of this job, one of this device's (None: `save_stream`). A
            stream runs in order: e_save completes only after every job queued before it there.
            Jobs on other streams do not wait for each other (staged jobs excepted on CUDA: they
            share the staging buffers), so a caller that must wait for one request's saves alone
            (before its blocks are reused) puts requests' saves on streams of their own.
        """
        t0 = time.perf_counter()
        if self._closed:
            self._check_open()
        if stream is None:
            stream = self.save_stream
        elif not isinstance(stream, Stream):
            raise ValueError(f"stream: expected a Stream of this engine's device, got {stream!r}")
        counts = _check_counts(counts)
        ids = self._ids.checked(block_ids, False, num_tokens)
        if sum(counts) != len(ids):
            raise ValueError(f"block_ids: {len(ids)} ids for counts adding up to {sum(counts)}")
        p = self._auto.get(("save", False)) if path is None else None  # decided once: see `_path`
        if p is None:
            p = self._path("save", path, False)
        per_block, slots = self._block_nbytes, []
        try:
            for c in counts:
                try:
                    slots.append(self.slots.alloc(c * per_block, timeout or 0.0, self._on_pressure))
                except PoolExhausted:
                    if not slots:
                        raise
                    break  # the slots taken so far are saved: a full pool ends the job there
            if len(slots) < len(counts):  # cut: the last slot saved holds whole blocks
                counts = counts[: len(slots)]
                ids = CheckedIds(ids.ids[: sum(counts)], ids.bound, False, self.kv.block_size)
            with self._lock:
                k, waited = self._save_waits(ids, after, stream)
                e_save = self.device.new_event(f"e_save#{k}")
                self._save_streams.add(stream)
                self.mover.save_slots(p, ids, counts, slots, stream)
                e_save.record(stream)  # after every slot's copies: then each slot is READY
                self.blocks.register(Access.SAVE, ids, e_save, waited)
                jobs, at = [], 0
                for s, c in zip(slots, counts, strict=True):
                    self.slots.begin_fill(s, e_save)  # READY only once e_save has completed
                    jobs.append(SaveJob(self, s, e_save, ids.ids[at : at + c], c * per_block, p._value_, 0.0))
                    at += c
                self._jobs.extend(jobs)
        except BaseException:
            self._undo_save(*slots, stream=stream)
            raise
        spent = time.perf_counter() - t0
        for j in jobs:
            j.submit_s = spent / len(jobs)
        return jobs

    def load_slots(
        self,
        slots,
        block_ids,
        *,
        num_tokens: int | None = None,
        path: str | None = None,
        flags: FlagStep | None = None,
    ) -> list[LoadJob]:
        """Copy READY slots `slots` (each a chunk of whole blocks) into `block_ids` (slot by slot,
        in order) in one submission. One LoadJob per slot, sharing their layer events and e_load;
        the store tracks chunks one by one, hence a job per slot; each settles when e_load completes.

        path "kernel" (None): layer-major -- layer l of every slot lands before layer l + 1 of
            any, one launch per layer. Chunk-major loads (one job per slot) land layer 0 of a
            request only when almost every byte has landed; here layer 0 of every chunk lands
            first, so attention of layer 0 may start after 1/L of the bytes and the copy hides
            under the forward.
        path "batch": every slot's copies in one batched copy; "staged": the slots one after the
            other within the call. On both every layer's event is e_load (as a load with
            per_layer=False). "auto": the engine's rule for a per-layer load (`load_path`).

        block_ids: as many distinct ids as the slots hold blocks, together.
        flags: a step of this engine's `layer_flags()`, as in `load` (per layer on the kernel path).
        """
        t0 = time.perf_counter()
        self._check_open()
        p = Path.KERNEL if path is None else self._path("load", path, True)
        slots = list(slots) if not isinstance(slots, Slot) else None
        if not slots or not all(isinstance(s, Slot) for s in slots):
            raise ValueError("slots: expected a non-empty sequence of pool Slots")
        if len({id(s) for s in slots}) != len(slots):
            raise ValueError("slots: a slot appears twice; each chunk of a request has its own slot")
        for j, s in enumerate(slots):
            self.pool.check(s, f"slots[{j}]")  # a stale handle: its bytes may be another request's KV
        ids = self._ids.checked(block_ids, True, num_tokens)
        per_block, counts = self._block_nbytes, []
        for j, s in enumerate(slots):
            if s.nbytes % per_block:
                why = f"holds {s.nbytes} B, not a whole number of {per_block} B blocks"
                raise ValueError(f"slots[{j}]: {why}")
            counts.append(s.nbytes // per_block)
        if sum(counts) != len(ids):
            raise ValueError(f"block_ids: {len(ids)} ids for slots holding {sum(counts)} blocks")
        self.poll()  # a save into one of these slots that has completed becomes READY now
        with self._lock:
            if self.sanitize:
                for s in slots:
                    self._check_readable(s)
            k = next(self._seq)
            stream = self.load_stream
            waits = self._wait_all(stream, self.blocks.waits_for(Access.LOAD, ids, stream))
            w = None if flags is None else self._join(flags)
            try:
                if p is Path.KERNEL:
                    mark = None if w is None else w.layer
                    layers = self.mover.load_slots(ids, counts, slots, stream, f"e_load#{k}", mark)
                else:
                    self.mover.load_slots_whole(p, ids, counts, slots, stream, f"e_load#{k}")
                    layers = []
            except BaseException:
                self._failed_load(w)  # its enqueued layers must not outlive the error (they read the slots)
                raise
            events = None
            try:
                e_load = stream.record(f"e_load#{k}")
                for s in slots:
                    self.slots.begin_read(s, e_load)  # each slot may be freed only after e_load
                self.blocks.begin_load(ids, e_load, waited=waits)
                events = [*layers, e_load] if layers else [e_load] * self._num_layers
                jobs, at = [], 0
                for s, c in zip(slots, counts, strict=True):
                    part = ids.ids[at : at + c]
                    job = LoadJob(self, s, e_load, part, s.nbytes, p._value_, 0.0, layer_events=events)
                    jobs.append(job)
                    at += c
                self._jobs.extend(jobs)
            finally:
                if w is not None:  # after e_load: a whole job's progress follows its last copy
                    w.finish(events)
        spent = time.perf_counter() - t0
        for j in jobs:
            j.submit_s = spent / len(jobs)
        return jobs

    def layer_flags(self) -> LayerFlags:
        """This engine's per-layer "landed" flags (`kvtier.engine.flags`), made on the first call:
        call it at start. A CUDA graph of the forward holds `flags.wait(layer)` per layer; a step
        with loads arms them (`flags.arm(compute)`), passes the step to its loads (`flags=`), and
        seals it."""
        with self._lock:
            if self._flags is None:
                self._check_open()
                self._flags = LayerFlags(
                    self.device,
                    self.load_stream,
                    self._num_layers,
                    sanitize=self.sanitize,
                    name="kvtier-flags",
                )
            return self._flags

    def load_path(self, per_layer: bool = False) -> Path:
        """The path a load job with no `path=` of its own takes (`paths.py`)."""
        return self._path("load", None, per_layer)

    # ---- what compute tells the engine -----------------------------------------------------
    def compute_read(self, blocks, event: Event, waited=()) -> None:
        """Compute reads `blocks` (ids, as in `save`) until `event`; a later load into them waits
        for it. waited: events the compute stream had waited for before `event`."""
        self._check_event(event)
        self.blocks.compute_read(self._ids.checked(blocks, False), event, waited=self._waited(event, waited))

    def compute_write(self, blocks, event: Event, waited=()) -> None:
        """Compute writes `blocks` until `event`; a later save or load of them waits for it."""
        self._check_event(event)
        self.blocks.compute_write(self._ids.checked(blocks, False), event, waited=self._waited(event, waited))

    # ---- completion: jobs settle here, and only here ----------------------------------------
    def poll(self) -> int:
        """Settle every job whose event has completed; return how many were settled."""
        with self._lock:
            # A stream runs in order: past its first incomplete job, none of its later ones can have
            # completed, so each poll queries the completed jobs and one more per stream, not all.
            done, blocked = [], set()
            for j in self._jobs:
                stream = j.event.stream
                if stream is not None and stream in blocked:
                    continue
                if j.event.query():
                    done.append(j)
                elif stream is not None:
                    blocked.add(stream)
            for j in done:
                self._settle(j)
            self.slots.poll()  # retired slots whose events completed go back to the pool
        return len(done)

    def wait(self, job: _Job, timeout: float | None = None) -> bool:
        """Block until `job` completed and settle it; False on timeout: nothing is released."""
        if not isinstance(job, _Job) or job.engine is not self:
            raise ValueError(f"job: expected a SaveJob or LoadJob of this engine, got {job!r}")
        if not job.event.synchronize(timeout):  # every event checks its timeout
            return False  # in flight: the slot stays FILLING/READING, the blocks stay pending
        self._settle(job)
        return True

    def release(self, slot: Slot) -> None:
        """The owner drops `slot`; it returns to the pool once no copy into/out of it is pending."""
        _check_slot(slot)
        self.pool.check(slot)  # a stale handle must not retire the slot of its bytes' new owner
        with self._lock:
            self.poll()
            for j in self._jobs:
                if j.slot is slot and isinstance(j, SaveJob):
                    j.slot_released = True  # the retired slot turns READY by itself on completion
            # retire, not release: a copy may still be in flight (never free on a timeout).
            self.slots.retire(slot)

    # ---- lifetime and introspection --------------------------------------------------------
    def close(self) -> None:
        """Wait for every job, settle them, drop the staging buffers. The pool stays open."""
        if self._closed:
            return
        try:
            if self._flags is not None:
                self._flags.close()  # a step left armed is sealed: no wait on its flags blocks forever
            for s in self._save_streams:
                s.synchronize()  # submitted is not done: the copies must land first
            self.load_stream.synchronize()
            self.mover.synchronize()
            self.poll()
        finally:  # after a device error too: closed, and the staging buffers dropped, then re-raise
            self._closed = True
            self.mover.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def trace(self) -> SubmitTrace | None:
        return self._trace

    @trace.setter
    def trace(self, value: SubmitTrace | None) -> None:
        if value is not None and not isinstance(value, SubmitTrace):
            raise ValueError(f"trace: expected a SubmitTrace or None, got {value!r}")
        self._trace = value
        self.mover.set_trace(value)  # the mover's phases: its traced replay, or none
        if value is None:  # the plain submits again (the class's methods)
            self.__dict__.pop("save", None)
            self.__dict__.pop("load", None)
        else:  # chosen once here: the plain submits carry no trace checks
            self.save, self.load = self._traced_save, self._traced_load

    def spare_arrays(self) -> dict[int, int]:
        """How many spare id arrays the id check keeps, by length (they are reused across jobs)."""
        return self._ids.spare_arrays()

    def graph_stats(self):
        """Captures / replays / misses / evictions / failures of the staged CUDA graphs (None: off
        or not on CUDA)."""
        g = getattr(self.mover, "graphs", None)
        return None if g is None else g.stats

    # ---- the steps of a submit (shared by the plain and the traced ones) -------------------
    def _path(self, direction: str, path: str | None, per_layer: bool) -> Path:
        """The path of a job: `path=` if given (checked against the mover), else the engine's own
        (`auto`: `choose_path` for its cache and config), decided and checked once per direction
        and per_layer and kept in `_auto` (kv and config are fixed)."""
        if path is None and (p := self._auto.get((direction, per_layer))) is not None:
            return p
        p = parse_path(path) if path is not None else self.config.path
        if p is Path.AUTO:
            p = choose_path(
                direction,
                run_nbytes=self.mover.batch_run_nbytes,
                per_layer=per_layer,
                compute_beside=self.config.compute_beside,
                batch_ok=self.mover.batch_available,
            )
        self.mover.check_path(p)
        if path is None:  # the engine's own path: fixed, so decided and checked once
            self._auto[(direction, per_layer)] = p
        return p

    def _wait_all(self, stream: Stream, waits: list[Event]) -> list[Event]:
        for e in waits:
            # A copy must not touch blocks a pending access still needs: a load must not overwrite
            # blocks still read, written or saved (vLLM #47282), nor a save read blocks still written.
            stream.wait_event(e)
        return waits

    def _save_waits(self, ids: CheckedIds, after: Event | None, stream: Stream | None = None):
        """Under the lock: the job's number, and the events its save stream now waits for."""
        stream = self.save_stream if stream is None else stream
        k = next(self._seq)
        waits = self.blocks.waits_for(Access.SAVE, ids, stream)
        if after is None:
            return k, self._wait_all(stream, waits)
        # The copy must not read KV the compute has not finished writing (vLLM #31341).
        stream.wait_event(after)
        return k, [*self._wait_all(stream, waits), after]

    def _begin_save(self, ids: CheckedIds, slot: Slot, e_save: Event, waited, p: Path, t0: float) -> SaveJob:
        """Under the lock, after the copies and e_save were enqueued: the trackers' moves, the job."""
        self.blocks.register(Access.SAVE, ids, e_save, waited)
        self.slots.begin_fill(slot, e_save)  # READY only once e_save has completed
        nbytes = len(ids) * self._block_nbytes
        job = SaveJob(self, slot, e_save, ids.ids, nbytes, p._value_, time.perf_counter() - t0)
        self._jobs.append(job)
        return job

    def _undo_save(self, *slots: Slot, stream: Stream | None = None) -> None:
        # A failed mover may have enqueued copies into the slots: they land before one is reused.
        left = [s for s in slots if self.slots.state(s) is SlotState.ALLOCATED]
        if left and self._quiesce(self.save_stream if stream is None else stream):
            for s in left:
                self.slots.release(s)  # nothing of the job is in flight any more

    def _load_ids(
        self, slot: Slot, block_ids, num_tokens: int | None, per_layer: bool, skip_blocks: int = 0
    ) -> CheckedIds:
        """The arguments of a load checked (each error names its argument); its ids."""
        if self._closed:
            self._check_open()
        if type(slot) is not Slot:  # the usual Slot passes with one test; the check names what is wrong
            _check_slot(slot)
        self.pool.check(slot)  # a released or reused slot: its bytes may be another request's KV
        if per_layer is not True and per_layer is not False:
            raise ValueError(f"per_layer: expected True or False, got {per_layer!r}")
        if type(skip_blocks) is not int or skip_blocks < 0:  # a bool is no count
            raise ValueError(f"skip_blocks: expected an int >= 0, got {skip_blocks!r}")
        ids = self._ids.checked(block_ids, True, num_tokens)
        nbytes = (len(ids) + skip_blocks) * self._block_nbytes
        if slot.nbytes != nbytes:
            why = f"{len(ids)} blocks after {skip_blocks} skipped need {nbytes} B"
            raise ValueError(f"slot: holds {slot.nbytes} B, {why}")
        return ids

    def _load_waits(self, slot: Slot, ids: CheckedIds) -> tuple[int, list[Event]]:
        """Under the lock: the slot readable, the job's number, the events the load stream waits for."""
        if self.sanitize:
            self._check_readable(slot)
        k = next(self._seq)
        return k, self._wait_all(self.load_stream, self.blocks.waits_for(Access.LOAD, ids, self.load_stream))

    def _begin_load(self, ids: CheckedIds, slot: Slot, e_load: Event, waits, layers, p: Path) -> LoadJob:
        """Under the lock, after the copies and e_load were enqueued: the trackers' moves, the job."""
        self.slots.begin_read(slot, e_load)  # the slot may be freed only after e_load
        self.blocks.register(Access.LOAD, ids, e_load, waits)
        layer_events = [*layers, e_load] if layers else [e_load] * self._num_layers
        job = LoadJob(self, slot, e_load, ids.ids, slot.nbytes, p._value_, 0.0, layer_events=layer_events)
        self._jobs.append(job)
        return job

    def _check_readable(self, slot: Slot) -> None:
        state = self.slots.state(slot)
        if state not in (SlotState.READY, SlotState.READING):
            # Checked before submitting anything: a half-submitted job could not be undone.
            why = "the slot holds no complete data yet: wait for its save job first"
            raise LifecycleError("load", slot.name, state.value, None, why)

    # ---- the traced submits: the same steps, a mark between each ----------------------------
    def _traced_save(self, block_ids, *, after, num_tokens=None, path=None, timeout=None) -> SaveJob:
        tr, t0 = self._trace, time.perf_counter()
        tr.begin("save")
        self._check_open()
        ids = self._ids.checked(block_ids, False, num_tokens)
        tr.mark("ids")
        p = self._path("save", path, False)
        slot = self.slots.alloc(len(ids) * self._block_nbytes, timeout or 0.0, self._on_pressure)
        tr.mark("slot")
        try:
            with self._lock:
                k, waited = self._save_waits(ids, after)
                tr.mark("tracker_wait")
                e_save = self.device.new_event(f"e_save#{k}")
                self.mover.save(p, ids, slot, self.save_stream, e_save)
                tr.mark("mover")
                if e_save.stream is None:  # as in `save`
                    e_save.record(self.save_stream)  # after every copy: then the slot is READY
                tr.mark("event")
                job = self._begin_save(ids, slot, e_save, waited, p, t0)
                tr.mark("tracker_begin")
        except BaseException:
            self._undo_save(slot)
            raise
        tr.end()
        return job

    def _traced_load(
        self, slot, block_ids, *, num_tokens=None, per_layer=True, path=None, flags=None, skip_blocks=0
    ) -> LoadJob:
        tr, t0 = self._trace, time.perf_counter()
        tr.begin("load")
        ids = self._load_ids(slot, block_ids, num_tokens, per_layer, skip_blocks)
        tr.mark("ids")
        p = self._path("load", path, per_layer)
        if self.slots.state(slot) is SlotState.FILLING:
            self.poll()  # a save into this slot that has completed becomes READY now
        tr.mark("poll")
        with self._lock:
            k, waits = self._load_waits(slot, ids)
            tr.mark("tracker_wait")
            e_load = self.device.new_event(f"e_load#{k}")
            src = _tail(slot, skip_blocks * self._block_nbytes) if skip_blocks else slot
            w = None if flags is None else self._join(flags)
            try:
                layers = self.mover.load(
                    p,
                    ids,
                    src,
                    self.load_stream,
                    per_layer,
                    f"e_load#{k}",
                    e_load,
                    None if w is None else w.layer,
                )
            except BaseException:
                self._failed_load(w)
                raise
            tr.mark("mover")
            job = None
            try:
                if e_load.stream is None:  # as in `load`
                    e_load.record(self.load_stream)  # after every copy: the blocks landed, the slot free
                tr.mark("event")
                job = self._begin_load(ids, slot, e_load, waits, layers, p)
            finally:
                if w is not None:  # as in `load`
                    w.finish(None if job is None else job.layer_events)
        job.submit_s = time.perf_counter() - t0
        tr.mark("tracker_begin")
        tr.end()
        return job

    # ---- helpers ---------------------------------------------------------------------------
    def _settle(self, job: _Job) -> None:
        with self._lock:
            if job.settled:
                return
            if not job.event.query():
                raise RuntimeError(f"internal: settling {job.event.label} before it completed")
            if isinstance(job, SaveJob):
                if not job.slot_released:
                    self.slots.fill_done(job.slot)  # e_save completed: the slot holds the data
            else:
                self.slots.end_read(job.slot, job.event)  # e_load completed: the copy read it all
            job.settled = True
            self._jobs.remove(job)

    def _join(self, step: FlagStep):
        """A load joins `step` (the lock held): its flag writer. Checked before anything is enqueued."""
        if self._flags is None or getattr(step, "flags", None) is not self._flags:
            raise ValueError(f"flags: expected a step of this engine's layer_flags(), got {step!r}")
        return self._flags.join(step, self.load_stream)

    def _failed_load(self, w) -> None:
        """A load submit failed: its enqueued copies finish before the error reaches the caller, and
        a load that joined a step sets its progress all the same (the step's waits never block forever)."""
        quiesced = self._quiesce(self.load_stream)  # its enqueued copies must not outlive the error
        if w is not None:
            w.fail(quiesced)

    def _quiesce(self, stream) -> bool:
        """After a failed submit: wait until nothing it may have enqueued is in flight (`stream`,
        the job's, and the mover's helper streams). False, with a warning, when the wait itself
        failed (the device is lost): the caller then keeps the job's buffers out of reuse."""
        try:
            stream.synchronize()  # copies enqueued before the failure still read / write the buffers
            self.mover.synchronize()  # and its helper streams' gathers / scatters
        except Exception as e:  # the submit's own error is the one to raise
            why = f"kvtier: a failed job's copies could not be waited for ({e}); its slot is kept"
            warnings.warn(why, stacklevel=3)
            return False
        return True

    def note_wait(self, stream: Stream, event: Event) -> None:
        """`stream` was made to wait for `event` (`job.wait_on`, `wait_layer`): a compute access
        registered on that stream later counts it as waited (the order the stream guarantees)."""
        if self.sanitize:
            self.note_waits(stream, (event,))

    def note_waits(self, stream: Stream, events) -> None:
        """`note_wait` for each of `events`. Only the sanitizer reads the notes: without it this
        does nothing. With it each event is kept once and the completed ones are dropped only when
        the notes doubled, so a note costs O(1), never a query of every pending event."""
        if not self.sanitize:
            return
        with self._lock:
            notes = self._stream_waits.setdefault(stream, {})
            for e in events:
                notes[id(e)] = e  # the value keeps the event alive: its id is not reused meanwhile
            if len(notes) > self._notes_cap.get(stream, _NOTES_MIN):
                for k in [k for k, e in notes.items() if e.query()]:
                    del notes[k]  # completed: it orders nothing any more
                self._notes_cap[stream] = max(_NOTES_MIN, 2 * len(notes))

    def _waited(self, event: Event, waited) -> list[Event]:
        if not self.sanitize:
            return list(waited)  # only the sanitizer's check reads them
        with self._lock:
            return [*waited, *self._stream_waits.get(event.stream, {}).values()]

    def _check_event(self, event) -> None:
        """`event` is an event of this engine's device: a later job's stream will wait for it."""
        if not isinstance(event, Event) or getattr(event, "_dev", self.device) is not self.device:
            raise ValueError(f"event: expected an event of this engine's device, got {event!r}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TransferEngine is closed")


def _make_mover(ctx: MoverContext):
    """The mover of `ctx.device`: SimMover on a SimDevice, else CudaMover (imported only then)."""
    from kvtier.device.sim import SimDevice

    if isinstance(ctx.device, SimDevice):
        from kvtier.engine.sim_mover import SimMover

        return SimMover(ctx)
    from kvtier.engine.cuda_mover import CudaMover

    return CudaMover(ctx)


def _check_counts(counts) -> list[int]:
    """`counts` (blocks per slot of a `save_slots`) as a list of positive ints."""
    got = list(counts) if isinstance(counts, list | tuple | range) else None
    if not got or not all(type(c) is int and c > 0 for c in got):
        raise ValueError(f"counts: expected a non-empty list of positive ints, got {counts!r}")
    return got


def _tail(slot: Slot, offset: int) -> Slot:
    """The bytes of `slot` from `offset` on, as a Slot for the movers to read (the trackers and the
    pool keep `slot` itself: its state and events are the whole slot's)."""
    return dataclasses.replace(
        slot,
        offset=slot.offset + offset,
        nbytes=slot.nbytes - offset,
        span=slot.span - offset,
        ptr=slot.ptr + offset,
        _tensor=None,
    )


def _check_slot(slot) -> None:
    if not isinstance(slot, Slot):
        raise ValueError(f"slot: expected a Slot of this engine's pool (a save job's .slot), got {slot!r}")
