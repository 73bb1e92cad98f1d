"""CudaMover: the bytes of a job on a CUDA device, through `kvtier.ops` (Triton).

Every path enqueues on the engine's copy stream, or on a helper stream that the copy stream
is made to wait for before the engine records the job's event:

- staged save: gathers on `gather_stream`, DMAs on the save stream (ops.save_staged makes the
  gather stream wait for the save stream's tail, so it follows the engine's waits);
- staged load: DMAs on the load stream, scatters on `scatter_stream`, then the load stream
  waits for the last scatter (so e_load, recorded on the load stream, covers them);
- kernel: one UVA launch on the copy stream itself (per layer on loads with per_layer),
  on a persistent grid of `uva_ctas` CTAs;
- batch: `batch.py` (cudaMemcpyBatchAsync), on the copy stream itself.

Block ids reach the GPU as one tensor per job (ops.checks.checked_block_ids: the engine's IdCheck
has checked them): no per-block Python loop, no second check.

With `graphs` (engine option, default on), a staged job whose key (`graphs.py`: slot size, block
count, valid tokens of the last block) was seen before is a CUDA-graph replay on the copy stream
itself: the helper streams are inside the graph, forked from and joined into that stream. The
graph's DMA nodes are moved to the job's slot first when it is another one of the same size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvtier import ops
from kvtier.device.base import Event, Stream
from kvtier.engine import batch
from kvtier.engine.graphs import StagedGraphs
from kvtier.engine.paths import Path
from kvtier.ops.checks import checked_block_ids
from kvtier.ops.slots import scatter_slots, slot_sources
from kvtier.pool import Slot

if TYPE_CHECKING:
    from kvtier.engine.engine import TransferEngine


class CudaMover:
    def __init__(self, engine: TransferEngine):
        self.kv = engine.kv
        if self.kv.device.type != "cuda":
            raise ValueError(f"kv: CudaDevice needs a CUDA cache, got {self.kv.device}")
        self.uva_ctas = engine.uva_ctas
        # Two staging buffers per direction, each half of staging_bytes, whole blocks.
        self.chunk_blocks = max(1, engine.staging_bytes // 2 // self.kv.block_nbytes)
        self._save_staging = None  # made on first use: a pure-kernel user never pays for them
        self._load_staging = None
        self.gather_stream = torch.cuda.Stream(device=self.kv.device)  # staged saves' short gathers
        self.scatter_stream = torch.cuda.Stream(device=self.kv.device)  # staged loads' scatters
        self.batch_available = batch.available()
        self.graphs = StagedGraphs(self.kv, engine.max_graphs, engine.graph_execs) if engine.graphs else None
        self.trace = None  # a jobs.SubmitTrace, set through engine.trace
        self._staging_key: dict[str, tuple[int, ...]] = {}  # direction -> staging addresses (graph key)
        self._block_size = self.kv.block_size  # a property of the layers' shapes: read once

    def check_path(self, path: Path) -> None:
        if path is Path.BATCH and not self.batch_available:
            raise ValueError(f"path 'batch' unavailable: {batch.why_unavailable()}")

    def save(self, path: Path, ids, num_tokens: int | None, slot: Slot, stream: Stream, done=None) -> None:
        """Enqueue the save on `stream`; `done`: the job's event, to be recorded there after every
        copy of the job -- by the caller, unless a graph replay recorded it already (done.stream)."""
        kv, raw = self.kv, stream.raw
        if path is Path.STAGED:
            if self._save_staging is None:
                self._save_staging = ops.make_staging(kv, self.chunk_blocks)
                self._staging_key["save"] = tuple(t.data_ptr() for t in self._save_staging)
            g = self.graphs
            if g is not None and g.enabled:  # the graph key (`graph_key`'s tuple) inline: a call fewer
                n, bs = ids.shape[0], self._block_size
                last_valid = bs if num_tokens is None else num_tokens - (n - 1) * bs  # checked by the engine
                key = ("save", slot.nbytes, n, last_valid, self._staging_key["save"])
                if g.replay(key, ids, raw, slot.ptr, done, stream):
                    return  # `done` recorded too where the C helper could (done.stream set)
            else:
                key = None
            self._mark("graph_miss")
            ids = torch.as_tensor(ids)  # numpy from the engine: a tensor view for the ops
            # Eager (also the warm-up of a capture). The last DMA is on `raw`: e_save follows it.
            ops.save_staged(
                kv,
                ids,
                slot.tensor,
                staging=self._save_staging,
                gather_stream=self.gather_stream,
                copy_stream=raw,
                num_tokens=num_tokens,
            )
            self._mark("eager")
            if key is not None:
                self.graphs.capture(key, slot.tensor, self._save_staging, self.gather_stream, raw)
                self._mark("capture")
        else:
            ids = torch.as_tensor(ids)  # numpy from the engine: a tensor view for the ops
            with torch.cuda.stream(raw):
                bid = checked_block_ids(kv, ids, False, num_tokens)  # one H2D; the engine checked them
                if path is Path.KERNEL:
                    ops.gather(kv, bid, slot.tensor, max_ctas=self.uva_ctas)
                else:
                    batch.copy(kv, bid, slot, raw, save=True)

    def load(
        self, path: Path, ids, num_tokens, slot: Slot, stream: Stream, per_layer: bool, label: str, done=None
    ) -> list[Event]:
        """Enqueue the load; return the events of layers 0..L-2 (the last, `done`, is recorded
        on `stream` by the engine after this returns, or by a graph replay: as in `save`)."""
        kv, raw = self.kv, stream.raw
        if path is Path.STAGED:
            if self._load_staging is None:
                self._load_staging = ops.make_staging(kv, self.chunk_blocks)
                self._staging_key["load"] = tuple(t.data_ptr() for t in self._load_staging)
            g = self.graphs
            if g is not None and g.enabled:  # the graph key, inline as in `save`
                n, bs = ids.shape[0], self._block_size
                last_valid = bs if num_tokens is None else num_tokens - (n - 1) * bs  # checked by the engine
                key = ("load", slot.nbytes, n, last_valid, self._staging_key["load"])
                if g.replay(key, ids, raw, slot.ptr, done, stream):
                    return []  # the graph joined its scatters into `raw`: e_load follows them
            else:
                key = None
            self._mark("graph_miss")
            ids = torch.as_tensor(ids)  # numpy from the engine: a tensor view for the ops
            last = ops.load_staged(
                kv,
                ids,
                slot.tensor,
                staging=self._load_staging,
                copy_stream=raw,
                scatter_stream=self.scatter_stream,
                num_tokens=num_tokens,
            )
            # The last scatter runs on the scatter stream: e_load (on `raw`) must follow it.
            raw.wait_event(last)
            self._mark("eager")
            if key is not None:
                self.graphs.capture(key, slot.tensor, self._load_staging, self.scatter_stream, raw)
                self._mark("capture")
            return []
        with torch.cuda.stream(raw):
            bid = checked_block_ids(kv, torch.as_tensor(ids), True, num_tokens)  # one H2D; checked already
            if path is Path.BATCH:
                batch.copy(kv, bid, slot, raw, save=False)
                return []
            if not per_layer:
                ops.scatter(kv, bid, slot.tensor, max_ctas=self.uva_ctas)
                return []
            events = []
            for layer in range(kv.num_layers):
                ops.scatter(kv, bid, slot.tensor, max_ctas=self.uva_ctas, layers=(layer, 1))
                if layer < kv.num_layers - 1:
                    events.append(stream.record(f"{label}:layer{layer}"))  # layer `layer` has landed
            return events

    def load_slots(self, ids, counts, num_tokens, slots, stream: Stream, label: str) -> list[Event]:
        """Layer-major load of several slots (`engine/load_slots.py`): one UVA launch per layer
        for all of them (ops/slots.py); return the events of layers 0..L-2."""
        kv, raw = self.kv, stream.raw
        with torch.cuda.stream(raw):
            bid = checked_block_ids(kv, ids, True, num_tokens)  # one H2D; the engine checked them
            src = slot_sources(kv, bid, [s.tensor for s in slots], pool_slots=True)  # + one H2D of the table
            events = []
            for layer in range(kv.num_layers):
                scatter_slots(kv, src, max_ctas=self.uva_ctas, layers=(layer, 1))
                if layer < kv.num_layers - 1:  # the event: layer `layer` of every slot has landed
                    events.append(stream.record(f"{label}:layer{layer}"))
        return events

    def _mark(self, phase: str) -> None:
        if self.trace is not None:
            self.trace.mark(phase)

    def synchronize(self) -> None:
        self.gather_stream.synchronize()  # helper streams: their work must land before close
        self.scatter_stream.synchronize()

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()  # the engine synchronized the streams: no replay is queued
        self._save_staging = self._load_staging = None
        self._staging_key.clear()
