"""Block ids of one op call on their way from the host to the GPU, through pinned memory.

A copy from pageable memory may make the host wait, and a fresh device tensor per call is an
allocation per call. So each cache keeps a few slots (`SLOTS`), each a pinned int32 buffer and a
device buffer of the same size, used in turn: a call writes its ids into a slot's pinned buffer,
copies them to the slot's device buffer on the stream that reads them (non_blocking: the host
does not wait), launches, and records the slot's event on that stream. The slot is written
again only once that event completed, so neither buffer is touched while a copy or a kernel may
still read it; the host waits there only when every slot is still in flight. A slot grows (new
buffers, after its event) when a call has more ids than it holds.

CUDA only: under the interpreter the ids are a CPU tensor already.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

SLOTS = 16
MIN_IDS = 1024  # a slot's first size; it grows to the largest call's, rounded up to a power of 2
RING_KEY = "id_ring"  # this module's entry in PagedKV.plans
MAX_STREAMS = 256  # torch objects of raw stream handles kept per ring


class Slot:
    __slots__ = ("dev", "event", "host", "host_np", "busy", "used", "ring", "n", "views")

    def __init__(self, ring: IdRing):
        self.ring = ring
        self.dev = self.host = self.host_np = None
        self.event = torch.cuda.Event()
        self.busy = False  # taken by a call that has not recorded its event yet
        self.used = False  # the event was recorded at least once
        self.n, self.views = -1, None  # the last call's length, and its (device, pinned) views

    def fit(self, n: int, device: torch.device) -> None:
        """Room for n ids; the caller waited for the slot's event."""
        if self.host_np is None or self.host_np.shape[0] < n:
            size = max(MIN_IDS, 1 << (n - 1).bit_length())
            self.host = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self.host_np = self.host.numpy()
            self.dev = torch.empty(size, dtype=torch.int32, device=device)
            self.n = -1

    def send(self, n: int) -> torch.Tensor:
        """Copy the first n ids to the device on the current stream; -> the device ids."""
        if n != self.n:  # calls of one length (the usual) reuse their views
            self.n, self.views = n, (self.dev[:n], self.host[:n])
        dev, host = self.views
        dev.copy_(host, non_blocking=True)  # pinned: the host does not wait
        return dev

    def done(self) -> None:
        """After the launches that read the ids, on the current stream: the slot may be reused
        once this stream has got past them."""
        # The slot is written again only after this: no copy or kernel may still read it then.
        self.event.record(self.ring.current())
        self.used = True
        self.busy = False

    def release(self) -> None:
        """The call that took the slot enqueued nothing (its ids were refused): free it as it was,
        its event still the last that guarded it (completed: `take` waited for it)."""
        self.busy = False


class IdRing:
    def __init__(self, device: torch.device):
        self.device = device
        self.index = device.index
        self.slots = [Slot(self) for _ in range(SLOTS)]
        self.next = 0
        self.lock = threading.Lock()
        self.streams: dict[int, torch.cuda.Stream] = {}  # raw handle -> its torch object

    def take(self, n: int) -> Slot:
        """A free slot with room for n ids (waits only if every slot is still in flight)."""
        with self.lock:
            for _ in range(SLOTS):
                s = self.slots[self.next]
                self.next = (self.next + 1) % SLOTS
                if not s.busy:
                    s.busy = True
                    break
            else:
                raise RuntimeError("block ids: every staging slot is taken by a call in progress")
        if s.used and not s.event.query():
            s.event.synchronize()  # the last copy or kernel that read this slot must be done
        s.fit(n, self.device)
        return s

    def current(self) -> torch.cuda.Stream:
        """The current stream of the ring's device, as a torch object: made once per stream (a
        new one per call costs more than the event it records)."""
        raw = torch._C._cuda_getCurrentRawStream(self.index)
        s = self.streams.get(raw)
        if s is None:
            if len(self.streams) >= MAX_STREAMS:
                self.streams.clear()  # callers of ever-new streams: keep the table small
            s = self.streams[raw] = torch.cuda.current_stream(self.device)
        return s


def ring_for(kv) -> IdRing:
    r = kv.plans.get(RING_KEY)
    if r is None:
        r = kv.plans[RING_KEY] = IdRing(kv.device)
    return r


def write(s: Slot, ids: np.ndarray) -> None:
    """ids (int32, or int64 checked to fit) into the slot's pinned buffer."""
    np.copyto(s.host_np[: ids.shape[0]], ids, casting="unsafe")
