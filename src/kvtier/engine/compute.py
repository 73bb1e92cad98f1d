"""What the serving engine tells `TransferEngine` about its own use of the GPU blocks.

Compute reads and writes the blocks on its own streams; kvtier cannot see them unless told. A
later save of a block must wait for a pending compute write to it, a later load for pending
reads and writes. And a compute stream that waited for a job's event (`job.wait_on`,
`wait_layer`) has that event noted here, so a read registered on that stream counts it as
waited (the sanitizer then sees the order the stream already guarantees).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvtier.device.base import Event, Stream
from kvtier.engine.options import check_event

if TYPE_CHECKING:
    from kvtier.device.base import Device
    from kvtier.engine.ids import IdCheck
    from kvtier.lifecycle import BlockTracker


class ComputeAccess:
    """Mixed into `TransferEngine`, which owns the state below (set in its `__init__`)."""

    _lock: threading.RLock
    _stream_waits: dict[Stream, list[Event]]  # events a stream was made to wait for
    _check_ids: IdCheck
    device: Device
    blocks: BlockTracker

    def compute_read(self, blocks, event: Event, waited=()) -> None:
        """Compute reads `blocks` until `event`; a later load into them waits for it."""
        check_event(self.device, event)
        bset = self._check_ids.checked(blocks, False)
        self.blocks.compute_read(bset, event, waited=self._waited(event, waited))

    def compute_write(self, blocks, event: Event, waited=()) -> None:
        """Compute writes `blocks` until `event`; a later save or load of them waits for it."""
        check_event(self.device, event)
        bset = self._check_ids.checked(blocks, False)
        self.blocks.compute_write(bset, event, waited=self._waited(event, waited))

    def _note_wait(self, stream: Stream, event: Event) -> None:
        with self._lock:
            evs = [e for e in self._stream_waits.get(stream, []) if not e.query()]
            evs.append(event)
            self._stream_waits[stream] = evs

    def _waited(self, event: Event, waited) -> list[Event]:
        with self._lock:
            return [*waited, *self._stream_waits.get(event.stream, [])]
