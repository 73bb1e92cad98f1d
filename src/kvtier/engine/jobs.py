"""The handles `TransferEngine.save` / `load` return.

A job is *submitted* when its call returns and *complete* when its event has completed; it is
*settled* once the engine applied that completion to the trackers (slot READY after a save,
the slot's read ended after a load). Nothing is released before its event completed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.device.base import Event, Stream
from kvtier.pool import Slot


@dataclass(eq=False)
class _Job:
    engine: Any = field(repr=False)  # the TransferEngine that made it (settles it)
    slot: Slot
    event: Event  # e_save / e_load: after it the whole job has landed
    ids: np.ndarray  # int32 [n] block ids (`IdCheck`); read-only (the block tracker holds this memory)
    nbytes: int
    path: str
    submit_s: float  # CPU seconds spent in save()/load()
    settled: bool = False
    slot_released: bool = False  # the owner let go of the slot before this job settled

    @property
    def blocks(self) -> torch.Tensor:
        """The job's block ids as an int64 CPU tensor (a copy of `ids`)."""
        return torch.from_numpy(self.ids).long()

    def done(self) -> bool:
        """True once the job's event has completed (settles it on the way)."""
        if not self.event.query():
            return False
        self.engine._settle(self)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until complete and settled; False on timeout (and nothing is released)."""
        return self.engine.wait(self, timeout)

    def wait_on(self, stream: Stream) -> None:
        """Make later work on `stream` wait for the whole job (no host blocking)."""
        # e.g. compute overwriting saved blocks, or reading loaded ones, must follow the copy.
        stream.wait_event(self.event)
        self.engine.note_wait(stream, self.event)


@dataclass(eq=False)
class SaveJob(_Job):
    """GPU blocks -> one pool slot. The slot is READY (and the blocks free to overwrite) only
    once `event` has completed; `wait()` / `engine.poll()` make it so in the tracker."""


@dataclass(eq=False)
class LoadJob(_Job):
    """One pool slot -> GPU blocks. `layer_events[l]` completes when layer l of every block has
    landed; the last is `event`. On the staged path every layer's event is `event`."""

    layer_events: list[Event] = field(default_factory=list)

    def wait_layer(self, layer: int, stream: Stream) -> None:
        """Later work on `stream` waits until layer `layer` has arrived (the host does not block)."""
        if not isinstance(layer, int) or not 0 <= layer < len(self.layer_events):
            raise ValueError(f"layer: expected 0..{len(self.layer_events) - 1}, got {layer!r}")
        ev = self.layer_events[layer]
        # Attention of layer `layer` must not read its blocks before their bytes have landed.
        stream.wait_event(ev)
        self.engine.note_wait(stream, ev)
