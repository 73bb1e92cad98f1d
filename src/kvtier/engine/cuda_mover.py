"""CudaMover: the bytes of a job on a CUDA device, through `kvtier.ops` (Triton).

Every path enqueues on the engine's copy stream, or on a helper stream that the copy stream
is made to wait for before the engine records the job's event:

- staged save: gathers on `gather_stream`, DMAs on the save stream (ops.save_staged makes the
  gather stream wait for the save stream's tail, so it follows the engine's waits);
- staged load: DMAs on the load stream, scatters on `scatter_stream`, then the load stream
  waits for the last scatter (so e_load, recorded on the load stream, covers them);
- kernel: one UVA launch on the copy stream itself (per layer on loads with per_layer),
  on a persistent grid of `uva_ctas` CTAs;
- batch: `fastpath/batch.py` (cudaMemcpyBatchAsync), on the copy stream itself.

A job over several slots (`TransferEngine.save_slots`, `load_slots`): on the batch path one
batched call for every slot's copies; on the kernel path a load is layer-major (one launch per
layer for every slot); on the staged path one eager pipelined sequence over every slot
(`ops.staged.save_slot_chunks` / `load_slot_chunks`: a slot's gather overlaps the DMA before
it, which per-slot graph replays, each one operation of the copy stream, cannot); otherwise the
slots are submitted one after the other within the call.

Block ids arrive as `CheckedIds` (checked at the engine's entry) and reach the GPU as one
`ops.BlockIds` per job (`ops.checks.trusted_block_ids`): one H2D copy, no second check.

With `config.graphs` (default on), a staged job whose key (`fastpath/graphs.py`: slot size,
block count, valid tokens of the last block, staging buffers) was seen before is a CUDA-graph
replay on the copy stream itself: the helper streams are inside the graph, forked from and joined
into that stream. A miss runs eagerly, then captures the job's sequence for the next one.
"""

from __future__ import annotations

import torch

from kvtier import ops
from kvtier.device.base import Event, Stream
from kvtier.engine.fastpath import batch
from kvtier.engine.fastpath.graphs import StagedGraphs
from kvtier.engine.ids import CheckedIds
from kvtier.engine.movers import MoverContext
from kvtier.engine.paths import Path
from kvtier.engine.trace import NO_TRACE
from kvtier.ops.call_ids import use_ids
from kvtier.ops.checks import trusted_block_ids
from kvtier.ops.slots import scatter_slots, slot_sources
from kvtier.ops.staged import load_slot_chunks, save_slot_chunks
from kvtier.pool import Slot


class CudaMover:
    def __init__(self, ctx: MoverContext):
        self.kv = kv = ctx.kv
        if kv.device.type != "cuda":
            raise ValueError(f"kv: CudaDevice needs a CUDA cache, got {kv.device}")
        cfg = ctx.config
        self.uva_ctas = cfg.uva_ctas
        # Two staging buffers per direction, each half of staging_bytes, whole blocks.
        self.chunk_blocks = max(1, cfg.staging_bytes // 2 // kv.block_nbytes)
        self._save_staging = None  # made on first use: a pure-kernel user never pays for them
        self._load_staging = None
        self._staged_stream = None  # the save stream of the last staged save (`_staged_on`)
        self.gather_stream = torch.cuda.Stream(device=kv.device)  # staged saves' short gathers
        self.scatter_stream = torch.cuda.Stream(device=kv.device)  # staged loads' scatters
        self.batch_available = batch.available()
        self.batch_run_nbytes = batch.run_nbytes(kv)  # its smallest copy of a full block (`choose_path`)
        self.graphs = StagedGraphs(kv, cfg.max_graphs, cfg.graph_execs) if cfg.graphs else None
        self._staging_key: dict[str, tuple[int, ...]] = {}  # direction -> staging addresses (graph key)
        self.set_trace(None)

    def set_trace(self, trace) -> None:
        """Time the phases of each job on `trace` (a SubmitTrace), or stop (None). A graph replay
        is then the traced one: the plain replay carries no trace checks."""
        self._trace = trace or NO_TRACE  # the eager path's marks: next to its launches, nothing
        g = self.graphs
        if g is not None:
            g.trace = trace
        self._replay = None if g is None else g.replay if trace is None else g.replay_traced

    def check_path(self, path: Path) -> None:
        if path is Path.BATCH and not self.batch_available:
            raise ValueError(f"path 'batch' unavailable: {batch.why_unavailable()}")

    def save(self, path: Path, ids: CheckedIds, slot: Slot, stream: Stream, done=None) -> None:
        """Enqueue the save on `stream`; `done`: the job's event, to be recorded there after every
        copy of the job -- by the caller, unless a graph replay recorded it already (done.stream)."""
        kv, raw = self.kv, stream.raw
        if path is Path.BATCH:  # addresses from the host's ids: no ids on the device at all
            batch.copy(kv, ids.ids, ids.last_valid, slot, raw, save=True)
            return
        if path is not Path.STAGED:
            with torch.cuda.stream(raw):
                bid = trusted_block_ids(kv, ids.ids, False, ids.last_valid)  # one H2D, on `raw`
                ops.gather(kv, bid, slot.tensor, max_ctas=self.uva_ctas)
            return
        staging = self._save_staging
        if staging is None:  # made on first use; the hot path makes no call once it is
            staging = self._staging("save")
        self._staged_on(stream)
        g = self.graphs
        key = None
        if g is not None and g.enabled:  # the graph key (`graph_key`'s tuple) inline: a call fewer
            key = ("save", slot.nbytes, ids.ids.shape[0], ids.last_valid, self._staging_key["save"])
            if self._replay(key, ids.ids, raw, slot.ptr, done, stream):
                return  # `done` recorded too where the C helper could (done.stream set)
        tr = self._trace
        tr.mark("graph_miss")
        with torch.cuda.stream(raw):
            bid = trusted_block_ids(kv, ids.ids, False, ids.last_valid)  # one H2D, on `raw`
        # Eager (also the warm-up of a capture). The last DMA is on `raw`: e_save follows it.
        ops.save_staged(
            kv,
            bid,
            slot.tensor,
            staging=staging,
            gather_stream=self.gather_stream,
            copy_stream=raw,
        )
        tr.mark("eager")
        if key is not None:
            g.capture(key, slot.tensor, staging, self.gather_stream, raw)
            tr.mark("capture")

    def load(
        self,
        path: Path,
        ids: CheckedIds,
        slot: Slot,
        stream: Stream,
        per_layer: bool,
        label: str,
        done=None,
        mark=None,
    ) -> list[Event]:
        """Enqueue the load; return the events of layers 0..L-2 (the last, `done`, is recorded
        on `stream` by the engine after this returns, or by a graph replay: as in `save`).
        mark: called with l right after layer l's copies were enqueued on `stream`, on the per-layer
        kernel path only (the engine's flag writer); other paths land every layer at the end."""
        kv, raw = self.kv, stream.raw
        if path is Path.BATCH:  # addresses from the host's ids: no ids on the device at all
            batch.copy(kv, ids.ids, ids.last_valid, slot, raw, save=False)
            return []
        if path is not Path.STAGED:
            with torch.cuda.stream(raw):
                bid = trusted_block_ids(kv, ids.ids, True, ids.last_valid)  # one H2D, on `raw`
                if not per_layer:
                    ops.scatter(kv, bid, slot.tensor, max_ctas=self.uva_ctas)
                    return []
                events = []
                for layer in range(kv.num_layers):
                    ops.scatter(kv, bid, slot.tensor, max_ctas=self.uva_ctas, layers=(layer, 1))
                    if mark is not None:
                        mark(layer)  # after the layer's copies on this stream: it has landed then
                    if layer < kv.num_layers - 1:
                        events.append(stream.record(f"{label}:layer{layer}"))  # layer `layer` has landed
                return events
        staging = self._load_staging
        if staging is None:  # made on first use; the hot path makes no call once it is
            staging = self._staging("load")
        g = self.graphs
        key = None
        if g is not None and g.enabled:  # the graph key, inline as in `save`
            key = ("load", slot.nbytes, ids.ids.shape[0], ids.last_valid, self._staging_key["load"])
            if self._replay(key, ids.ids, raw, slot.ptr, done, stream):
                return []  # the graph joined its scatters into `raw`: e_load follows them
        tr = self._trace
        tr.mark("graph_miss")
        with torch.cuda.stream(raw):
            bid = trusted_block_ids(kv, ids.ids, True, ids.last_valid)  # one H2D, on `raw`
        last = ops.load_staged(
            kv,
            bid,
            slot.tensor,
            staging=staging,
            copy_stream=raw,
            scatter_stream=self.scatter_stream,
        )
        # The last scatter runs on the scatter stream: e_load (on `raw`) must follow it.
        raw.wait_event(last)
        tr.mark("eager")
        if key is not None:
            g.capture(key, slot.tensor, staging, self.scatter_stream, raw)
            tr.mark("capture")
        return []

    def load_slots(
        self, ids: CheckedIds, counts, slots, stream: Stream, label: str, mark=None
    ) -> list[Event]:
        """Layer-major load of several slots (`TransferEngine.load_slots`): one UVA launch per
        layer for all of them (ops/slots.py); return the events of layers 0..L-2. mark: as in `load`."""
        kv, raw = self.kv, stream.raw
        with torch.cuda.stream(raw):
            bid = trusted_block_ids(kv, ids.ids, True, ids.last_valid)  # one H2D, on `raw`
            src = slot_sources(kv, bid, [s.tensor for s in slots], pool_slots=True)  # + one H2D of the table
            events = []
            for layer in range(kv.num_layers):
                scatter_slots(kv, src, max_ctas=self.uva_ctas, layers=(layer, 1))
                if mark is not None:
                    mark(layer)  # after the layer's copies of every slot: it has landed then
                if layer < kv.num_layers - 1:  # the event: layer `layer` of every slot has landed
                    events.append(stream.record(f"{label}:layer{layer}"))
        return events

    def save_slots(self, path: Path, ids: CheckedIds, counts, slots, stream: Stream) -> None:
        """Enqueue the save of `ids` into `slots` (slot j: the next counts[j] blocks) on `stream`;
        the engine records the one event after. Batch: every copy of every slot in one call;
        staged / kernel: slot by slot, each as its own `save` would (no `done`: a graph replay
        must not record the shared event before the later slots' copies)."""
        if path is Path.BATCH:
            batch.copy_slots(self.kv, ids.ids, ids.last_valid, slots, counts, stream.raw, save=True)
            return
        if path is Path.STAGED and len(slots) > 1:
            # One pipelined sequence: slot j + 1's gather overlaps slot j's DMA (a graph per slot
            # is one operation of the copy stream: it would wait for the DMA before it).
            self._staged_on(stream)
            dev = self._ids_for(ids, False, stream.raw, self.gather_stream)
            chunks = [s.tensor for s in slots]
            save_slot_chunks(
                self.kv,
                dev,
                ids.last_valid,
                chunks,
                counts,
                staging=self._staging("save"),
                gather_stream=self.gather_stream,
                copy_stream=stream.raw,
            )
            return
        for part, slot in zip(ids.split(counts, self.kv.block_size), slots, strict=True):
            self.save(path, part, slot, stream)

    def load_slots_whole(
        self, path: Path, ids: CheckedIds, counts, slots, stream: Stream, label: str
    ) -> None:
        """Enqueue the load of `slots` into `ids` (slot j: the next counts[j] blocks) on `stream`,
        one event for the whole job (the engine's, recorded after). Batch: one call; staged:
        slot by slot, as `save_slots`."""
        if path is Path.BATCH:
            batch.copy_slots(self.kv, ids.ids, ids.last_valid, slots, counts, stream.raw, save=False)
            return
        if path is Path.STAGED and len(slots) > 1:
            # One pipelined sequence (see save_slots); it ends joined into the copy stream:
            # e_load follows every scatter.
            dev = self._ids_for(ids, True, stream.raw, self.scatter_stream)
            load_slot_chunks(
                self.kv,
                dev,
                ids.last_valid,
                [s.tensor for s in slots],
                counts,
                staging=self._staging("load"),
                copy_stream=stream.raw,
                scatter_stream=self.scatter_stream,
            )
            return
        for part, slot in zip(ids.split(counts, self.kv.block_size), slots, strict=True):
            self.load(path, part, slot, stream, False, label)

    def _staged_on(self, stream: Stream) -> None:
        """A staged save is about to run on `stream`: the save staging buffers are shared by every
        save stream, so one on another stream than the last staged save first waits for that
        stream's tail (its DMAs out of the buffers); on one stream, order alone keeps them apart."""
        last = self._staged_stream
        if last is not None and last != stream:
            stream.raw.wait_stream(last.raw)  # the buffers may still be under the other stream's DMAs
        self._staged_stream = stream

    def _staging(self, direction: str):
        """The two staging buffers of "save" or "load", made on first use (a pure-kernel user
        never pays for them); their addresses are part of the staged graphs' key."""
        attr = f"_{direction}_staging"
        bufs = getattr(self, attr)
        if bufs is None:
            bufs = ops.make_staging(self.kv, self.chunk_blocks)
            setattr(self, attr, bufs)
            self._staging_key[direction] = tuple(t.data_ptr() for t in bufs)
        return bufs

    def _ids_for(self, ids: CheckedIds, unique: bool, raw, reader: torch.cuda.Stream) -> torch.Tensor:
        """The job's ids on the device (one H2D on `raw`), made safe to read on `reader`."""
        with torch.cuda.stream(raw):
            bid = trusted_block_ids(self.kv, ids.ids, unique, ids.last_valid)  # one H2D, on `raw`
        with torch.cuda.stream(reader):
            return use_ids(bid)  # `reader` reads them only once landed, and they live until it did

    def synchronize(self) -> None:
        self.gather_stream.synchronize()  # helper streams: their work must land before close
        self.scatter_stream.synchronize()

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()  # the engine synchronized the streams: no replay is queued
        self._save_staging = self._load_staging = None
        self._staging_key.clear()
