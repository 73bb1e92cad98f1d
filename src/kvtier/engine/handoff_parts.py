"""The parts of a GPU-to-GPU handoff (`kvtier.engine.handoff`): each end (`Side`), the submitted
job (`HandoffJob`) and a wait on an event that may belong to another device (`cross_wait`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.device.base import Device, Event, Stream
from kvtier.layout import PagedKV
from kvtier.lifecycle import BlockTracker


@dataclass(slots=True)
class Side:
    """One end of a handoff: a device, its paged cache and the tracker of that cache's blocks.

    Pass the `blocks` tracker of the TransferEngine that serves the same cache (`side(engine)`)
    so handoffs and save/load jobs see each other's pending accesses.
    """

    device: Device
    kv: PagedKV
    blocks: BlockTracker

    def __post_init__(self) -> None:
        if not isinstance(self.kv, PagedKV):
            raise ValueError(f"kv: expected a PagedKV, got {type(self.kv).__name__}")
        if not isinstance(self.blocks, BlockTracker):
            raise ValueError(f"blocks: expected a BlockTracker, got {type(self.blocks).__name__}")


def side(obj, device: Device | None = None, sanitize: bool | None = None) -> Side:
    """A `Side` from a TransferEngine (its device, cache and tracker), a Side, or a PagedKV + device."""
    if isinstance(obj, Side):
        return obj
    if isinstance(obj, PagedKV):
        if device is None:
            raise ValueError("device: needed with a bare PagedKV")
        return Side(device, obj, BlockTracker(sanitize=sanitize, name=f"{device.name} block"))
    for attr in ("device", "kv", "blocks"):
        if not hasattr(obj, attr):
            raise ValueError(f"expected a TransferEngine, Side or PagedKV, got {type(obj).__name__}")
    return Side(obj.device, obj.kv, obj.blocks)


@dataclass(eq=False)
class HandoffJob:
    """A submitted handoff. `layer_events[l]` completes once layer l landed on b; `event` (e_done)
    once everything did; `sent` (e_sent, on a) once the source blocks were read."""

    sent: Event
    event: Event
    layer_events: list[Event]
    src_blocks: torch.Tensor  # int64 [n], CPU
    dst_blocks: torch.Tensor  # int64 [n], CPU
    nbytes: int
    route: str  # "p2p", "host" (CUDA without peer access), "same-device" or "sim"
    _buffers: list = field(default_factory=list, repr=False)  # staging chunks and device ids

    def wait(self, timeout: float | None = None) -> bool:
        """Block until b has every block; False on timeout (the staging chunks are kept)."""
        if not self.event.synchronize(timeout):
            return False  # in flight: the copy may still read/write the staging chunks
        # e_done completed, and b waited e_sent before it: no stream touches the chunks any more.
        self._buffers.clear()
        return True

    def done(self) -> bool:
        if not self.event.query():
            return False
        self._buffers.clear()  # safe only now: the event says the copies landed
        return True


def cross_wait(stream: Stream, device: Device, event: Event) -> None:
    """Later work on `stream` (of `device`) waits for `event`, which may belong to another device."""
    if getattr(event, "_dev", None) is device:
        stream.wait_event(event)
        return
    from kvtier.device.sim import SimDevice

    if isinstance(device, SimDevice):
        # Two simulated devices share no event state: holding b's worker until a's event is
        # reached gives the same order as a device-side wait (the host does not block).
        device.launch(lambda: event.synchronize(), stream)
        return
    if event.stream is not None:
        event.wait_on(stream)  # CUDA events order work across devices of one process
