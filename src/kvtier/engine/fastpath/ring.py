"""The pinned host buffers a staged graph's block ids are copied from (`HostRing`).

An asynchronous H2D copy reads its pinned source when the stream reaches it, not when it is
enqueued: a buffer is written again only once the event recorded after its last copy has
completed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class HostRing:
    """Host buffers reused round-robin, each guarded by the event recorded after the copy that
    last read it. Not thread-safe (used under the engine's lock).

    make_buffer(): a new buffer (pinned, on CUDA). make_event(): an event with `record(stream)`,
    `query()` and `synchronize()`. depth: buffers made up front; up to max_depth are made when
    every buffer is still being read, past that the host waits for the oldest copy. A buffer is
    guarded by the ring's own event (`arm`) or by one the caller records later (`arm_with`, e.g.
    the job's event: one runtime call fewer, the buffer busy until the whole job is done).
    `guards` (per buffer: its event, None while never used) and `next` (the buffer `take` tries
    first) are read and written inline by the fused replay (`graph_fused.py`): it queries the guard
    itself and calls `take` only when that buffer is busy, then arms it as `arm_with` would.
    """

    def __init__(self, make_buffer: Callable[[], Any], make_event: Callable[[], Any], depth=2, max_depth=16):
        if not 1 <= depth <= max_depth:
            raise ValueError(f"depth: expected 1 <= depth <= max_depth ({max_depth}), got {depth}")
        self._make_buffer, self._make_event, self.max_depth = make_buffer, make_event, max_depth
        self.buffers: list = []
        self.guards: list = []  # per buffer: recorded after its last copy (None: never used)
        self._own: list = []  # per buffer: the ring's own event, made on its first `arm`
        self.next = 0  # the buffer used longest ago
        self.grown = self.waited = 0
        for _ in range(depth):
            self._add(len(self.buffers))

    def _add(self, i: int) -> None:
        self.buffers.insert(i, self._make_buffer())
        self.guards.insert(i, None)
        self._own.insert(i, None)

    def take(self) -> int:
        """The index of a buffer the host may write now; then enqueue its copy and `arm` it."""
        i = self.next
        ev = self.guards[i]
        if ev is not None and not ev.query():  # its last copy may not have read it yet
            if len(self.buffers) < self.max_depth:
                self._add(i)  # a new buffer in its place; the busy one stays next in line
                self.grown += 1
            else:
                # Writing it now would change the ids of a copy still queued: wait for that copy.
                ev.synchronize()
                self.waited += 1
        return i

    def arm(self, i: int, stream) -> None:
        """Record buffer `i`'s event on `stream` right after the copy that reads it was enqueued."""
        own = self._own[i]
        if own is None:
            own = self._own[i] = self._make_event()
        # The buffer is reused only after this event: the copy has then read the ids it held.
        own.record(stream)
        self.guards[i] = own
        self.next = (i + 1) % len(self.buffers)

    def arm_with(self, i: int, event) -> None:
        """Guard buffer `i` with `event`, which the caller records after the copy that reads it
        (on that copy's stream, later in the same submit): no event record of the ring's own.
        Until it is recorded the buffer reads as free; the caller holds the lock meanwhile."""
        # The buffer is reused only after `event`: the copy before it has then read the ids.
        self.guards[i] = event
        self.next = (i + 1) % len(self.buffers)

    def __len__(self) -> int:
        return len(self.buffers)
