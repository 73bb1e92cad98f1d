"""Movers: the bytes of a job, per device. The engine owns the protocol (waits, events,
trackers); a mover only enqueues the copy work on the stream it is given (plus helper streams
that it orders before that stream's next record), so an event recorded on that stream after
`save`/`load` returns marks the whole job done.

    SimMover   SimDevice: `kvtier.reference` gather/scatter launched as "kernels", and
               `dev.copy` as the DMA, so the bytes really land late on the CPU.
    CudaMover  CudaDevice: `kvtier.ops` (Triton) — staged, kernel (UVA), batch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from kvtier.device.base import Event, Stream
from kvtier.engine.paths import Path
from kvtier.layout import PagedKV
from kvtier.pool import Slot

if TYPE_CHECKING:
    from kvtier.engine.engine import TransferEngine


def make_mover(engine: TransferEngine):
    from kvtier.device.sim import SimDevice

    if isinstance(engine.device, SimDevice):
        return SimMover(engine)
    from kvtier.engine.cuda_mover import CudaMover

    return CudaMover(engine)


def layer_kv(kv: PagedKV, layer: int) -> PagedKV:
    """The one-layer cache of layer `layer` (for the reference scatter of one layer)."""
    return dataclasses.replace(kv, layers=(kv.layers[layer],), layer_offsets=(0,), base=0, plans={})


class SimMover:
    """Staged: gather "kernel" into a staging tensor, then a late copy into the slot (and the
    inverse). Kernel: the "kernel" reads/writes the slot itself, one launch per layer on loads."""

    batch_available = False

    def __init__(self, engine: TransferEngine):
        self.dev, self.kv = engine.device, engine.kv
        if self.kv.device.type != "cpu":
            raise ValueError(f"kv: SimDevice needs a CPU cache, got {self.kv.device}")

    def check_path(self, path: Path) -> None:
        if path is Path.BATCH:
            raise ValueError(
                "path 'batch' needs CUDA >= 12.8 (cudaMemcpyBatchAsync); SimDevice has no copy engine"
            )

    def save(self, path: Path, ids, num_tokens: int | None, slot: Slot, stream: Stream, done=None) -> None:
        from kvtier.reference import gather_ref

        kv, ids = self.kv, torch.as_tensor(ids)  # the engine's numpy ids as a tensor view
        dst = slot.tensor if path is Path.KERNEL else torch.empty(slot.nbytes, dtype=torch.uint8)

        def gather() -> None:  # runs when the stream reaches it: reads the blocks then
            dst.copy_(gather_ref(kv, ids, num_tokens).view(-1).view(torch.uint8))

        self.dev.launch(gather, stream)
        if path is Path.STAGED:
            self.dev.copy(slot.tensor, dst, stream)  # the DMA, landing late

    def load(
        self, path: Path, ids, num_tokens, slot: Slot, stream: Stream, per_layer: bool, label: str, done=None
    ) -> list[Event]:
        """Enqueue the load; return the events of layers 0..L-2 (the engine records the last)."""
        from kvtier.reference import scatter_ref

        kv, n, ids = self.kv, len(ids), torch.as_tensor(ids)  # the engine's numpy ids as a tensor view
        src = slot.tensor
        if path is Path.STAGED:
            src = torch.empty(slot.nbytes, dtype=torch.uint8)
            self.dev.copy(src, slot.tensor, stream)  # the DMA into staging, landing late
        chunk = src.view(kv.dtype).view(kv.chunk_shape(n))
        if path is Path.STAGED or not per_layer:
            self.dev.launch(lambda: scatter_ref(kv, ids, chunk, num_tokens), stream)
            return []
        events = []
        for layer in range(kv.num_layers):
            one = layer_kv(kv, layer)
            part = chunk[:, layer : layer + 1]
            self.dev.launch(lambda one=one, part=part: scatter_ref(one, ids, part, num_tokens), stream)
            if layer < kv.num_layers - 1:
                events.append(stream.record(f"{label}:layer{layer}"))  # layer `layer` has landed
        return events

    def load_slots(self, ids, counts, num_tokens, slots, stream: Stream, label: str) -> list[Event]:
        """Layer-major load of several slots (`engine/load_slots.py`): per layer one "kernel"
        scattering that layer of every slot; return the events of layers 0..L-2."""
        from kvtier.reference import scatter_ref

        kv, parts, at = self.kv, [], 0
        for s, c in zip(slots, counts, strict=True):
            last = at + c == len(ids)
            tokens = num_tokens - at * kv.block_size if num_tokens is not None and last else None
            parts.append((ids[at : at + c], s.tensor.view(kv.dtype).view(kv.chunk_shape(c)), tokens))
            at += c
        events = []
        for layer in range(kv.num_layers):
            one = layer_kv(kv, layer)

            def copy(one=one, layer=layer) -> None:  # runs when the stream reaches it
                for i, chunk, tokens in parts:
                    scatter_ref(one, i, chunk[:, layer : layer + 1], tokens)

            self.dev.launch(copy, stream)
            if layer < kv.num_layers - 1:
                events.append(stream.record(f"{label}:layer{layer}"))  # layer `layer` of every slot landed
        return events

    def synchronize(self) -> None:
        pass  # all work is on the engine's streams

    def close(self) -> None:
        pass
