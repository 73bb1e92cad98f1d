"""SimMover: the bytes of a job on a `SimDevice` (CPU), landing late as a GPU's would.

Staged: a gather "kernel" into a staging tensor, then a late copy into the slot (and the
inverse). Kernel: the "kernel" reads/writes the slot itself, one launch per layer on loads.
Batch (a `SimDevice(batch_copy=True)` only): the copies `fastpath/batch.py` computes on the host
for cudaMemcpyBatchAsync, handed to `SimDevice.copy_batch` as one late copy -- the CUDA mover's
descriptors themselves, run by memmove.

A job over several slots (`save_slots`, `load_slots_whole`) is one batched copy on the batch
path; elsewhere its slots are submitted one after the other within the one call.
"""

from __future__ import annotations

import torch

from kvtier.device.base import Event, Stream
from kvtier.engine.fastpath import batch
from kvtier.engine.ids import CheckedIds
from kvtier.engine.movers import MoverContext, layer_kv
from kvtier.engine.paths import Path
from kvtier.pool import Slot


def _tokens(n: int, block_size: int, last_valid: int) -> int | None:
    """The reference ops' num_tokens for n blocks whose last holds `last_valid` tokens."""
    return None if last_valid == block_size else (n - 1) * block_size + last_valid


class SimMover:
    def __init__(self, ctx: MoverContext):
        self.dev, self.kv = ctx.device, ctx.kv
        if self.kv.device.type != "cpu":
            raise ValueError(f"kv: SimDevice needs a CPU cache, got {self.kv.device}")
        self.batch_available = bool(getattr(self.dev, "batch_copy", False))
        # The run the batch path's rule weighs (`choose_path`), as on CUDA; none without the path.
        self.batch_run_nbytes = batch.run_nbytes(self.kv) if self.batch_available else 0

    def set_trace(self, trace) -> None:
        pass  # no phases of its own: every copy is one launch

    def check_path(self, path: Path) -> None:
        if path is Path.BATCH and not self.batch_available:
            why = "needs CUDA >= 12.8 (cudaMemcpyBatchAsync); this SimDevice emulates none (batch_copy=False)"
            raise ValueError(f"path 'batch' {why}")

    def save(self, path: Path, ids: CheckedIds, slot: Slot, stream: Stream, done=None) -> None:
        """Enqueue the save of blocks `ids` into `slot` on `stream` (the engine records `done`)."""
        from kvtier.reference import gather_ref

        if path is Path.BATCH:  # addresses from the host's ids, as on CUDA
            self._batch(ids, [slot], [len(ids)], stream, save=True)
            return
        kv, t = self.kv, torch.as_tensor(ids.ids)  # the job's numpy ids as a tensor view
        tokens = _tokens(len(t), kv.block_size, ids.last_valid)
        dst = slot.tensor if path is Path.KERNEL else torch.empty(slot.nbytes, dtype=torch.uint8)

        def gather() -> None:  # runs when the stream reaches it: reads the blocks then
            dst.copy_(gather_ref(kv, t, tokens).view(-1).view(torch.uint8))

        self.dev.launch(gather, stream)
        if path is Path.STAGED:
            self.dev.copy(slot.tensor, dst, stream)  # the DMA, landing late

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
        """Enqueue the load; return the events of layers 0..L-2 (the engine records the last).
        mark: called with l right after layer l's copies, on the per-layer kernel path (as CudaMover)."""
        from kvtier.reference import scatter_ref

        if path is Path.BATCH:  # one batched copy: every layer's event is the job's
            self._batch(ids, [slot], [len(ids)], stream, save=False)
            return []
        kv, t = self.kv, torch.as_tensor(ids.ids)  # the job's numpy ids as a tensor view
        n, tokens = len(t), _tokens(len(t), kv.block_size, ids.last_valid)
        src = slot.tensor
        if path is Path.STAGED:
            src = torch.empty(slot.nbytes, dtype=torch.uint8)
            self.dev.copy(src, slot.tensor, stream)  # the DMA into staging, landing late
        chunk = src.view(kv.dtype).view(kv.chunk_shape(n))
        if path is Path.STAGED or not per_layer:
            self.dev.launch(lambda: scatter_ref(kv, t, chunk, tokens), stream)
            return []
        events = []
        for layer in range(kv.num_layers):
            one = layer_kv(kv, layer)
            part = chunk[:, layer : layer + 1]
            self.dev.launch(lambda one=one, part=part: scatter_ref(one, t, part, tokens), stream)
            if mark is not None:
                mark(layer)  # after the layer's copies on this stream: it has landed then
            if layer < kv.num_layers - 1:
                events.append(stream.record(f"{label}:layer{layer}"))  # layer `layer` has landed
        return events

    def load_slots(
        self, ids: CheckedIds, counts, slots, stream: Stream, label: str, mark=None
    ) -> list[Event]:
        """Layer-major load of several slots (`TransferEngine.load_slots`): per layer one "kernel"
        scattering that layer of every slot; return the events of layers 0..L-2. mark: as in `load`."""
        from kvtier.reference import scatter_ref

        kv, all_ids, parts, at = self.kv, torch.as_tensor(ids.ids), [], 0
        for s, c in zip(slots, counts, strict=True):
            last = at + c == len(all_ids)
            tokens = _tokens(c, kv.block_size, ids.last_valid) if last else None
            parts.append((all_ids[at : at + c], s.tensor.view(kv.dtype).view(kv.chunk_shape(c)), tokens))
            at += c
        events = []
        for layer in range(kv.num_layers):
            one = layer_kv(kv, layer)

            def copy(one=one, layer=layer) -> None:  # runs when the stream reaches it
                for i, chunk, tokens in parts:
                    scatter_ref(one, i, chunk[:, layer : layer + 1], tokens)

            self.dev.launch(copy, stream)
            if mark is not None:
                mark(layer)  # after the layer's copies of every slot: it has landed then
            if layer < kv.num_layers - 1:
                events.append(stream.record(f"{label}:layer{layer}"))  # layer `layer` of every slot landed
        return events

    def save_slots(self, path: Path, ids: CheckedIds, counts, slots, stream: Stream) -> None:
        """Enqueue the save of `ids` into `slots` (slot j: the next counts[j] blocks) on `stream`;
        the engine records the one event after. Batch: one batched copy for every slot."""
        if path is Path.BATCH:
            self._batch(ids, slots, counts, stream, save=True)
            return
        for part, slot in zip(ids.split(counts, self.kv.block_size), slots, strict=True):
            self.save(path, part, slot, stream)

    def load_slots_whole(
        self, path: Path, ids: CheckedIds, counts, slots, stream: Stream, label: str
    ) -> None:
        """Enqueue the load of `slots` into `ids` (slot j: the next counts[j] blocks) on `stream`,
        one event for the whole job (the engine's, recorded after). Batch: one batched copy."""
        if path is Path.BATCH:
            self._batch(ids, slots, counts, stream, save=False)
            return
        for part, slot in zip(ids.split(counts, self.kv.block_size), slots, strict=True):
            self.load(path, part, slot, stream, False, label)

    def _batch(self, ids: CheckedIds, slots, counts, stream: Stream, *, save: bool) -> None:
        """The batch path: the copies cudaMemcpyBatchAsync would be handed, as one late copy."""
        copies = batch.prepare_slots(self.kv, ids.ids, ids.last_valid, slots, counts, save=save)
        self.dev.copy_batch(*copies, stream)

    def synchronize(self) -> None:
        pass  # all work is on the engine's streams

    def close(self) -> None:
        pass
