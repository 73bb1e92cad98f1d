"""PinnedPool: one pinned host slab, allocated once, carved into slots.

The slab is `ceil(capacity / chunk_bytes)` buffers from `Device.alloc_pinned` (each at most
`chunk_bytes`, 1 GiB by default: large registrations are slow and may fail), made once at
start and never per request.

Allocator: best fit over an address-ordered free list, coalescing on free.
- A request is rounded up to `alignment` (256 B by default, for DMA and vector loads) and
  nothing more: no power-of-two classes, so internal waste is < `alignment` per slot.
- The smallest free extent that fits is split; the remainder stays free. Ties go to the
  lowest address, which keeps allocations packed at the front of each chunk.
- A freed slot merges with free neighbours in the same chunk; slots never straddle chunks.
- Fragmentation is measured (`stats()`, `unusable_fraction`). With equal-size requests
  (the usual KV chunk) only each chunk's tail (< one slot) is ever unusable and a request
  fails only when every slot position is taken; mixed sizes are bounded by test.

Exhaustion is back-pressure, never an out-of-memory crash: `alloc` waits up to `timeout`
for a `free` (asking `on_pressure`, e.g. an evictor, to make room), then raises
`PoolExhausted`; `try_alloc` returns None.

Handles are checked, sanitizer or not. A `Slot` carries its generation (`id`, unique per
allocation) and the slab knows the allocation that lives at each start, so `check(slot)` is
O(1): a released handle, one whose bytes a later allocation owns now, or a slot of another pool
raises `StaleSlotError` (a `lifecycle.LifecycleError`) naming the slot, its generation and the
live one. `free` checks the same way: a stale handle never frees a new owner's bytes. The
engine checks every slot it is handed (load, load_slots, release) before it submits anything.
The lifecycle tracker (`kvtier.lifecycle`) adds the states: releases under DMA, reads before
the fill landed.

Closing waits for copies in flight: `close()` with slots still marked in flight (FILLING /
READING) synchronizes the device first, because freeing pinned pages under a DMA is a
use-after-free; then it gives the slab back. It is idempotent, and a device error met while
waiting is raised only after the slab was given back.

The bookkeeping (free extents, live slots, byte counts, the in-flight set) is `slab.py`'s: in C
where it is built (then `try_alloc` and `set_in_flight` are its calls themselves, atomic under
the GIL: a save's submit allocates without a Python frame of the pool), else in Python under the
pool's lock. `native=False` picks the Python one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.device.base import Device, check_nbytes, check_timeout
from kvtier.lifecycle.errors import StaleSlotError
from kvtier.numa import allocate_near
from kvtier.slab import PySlab, make_slab


class PoolExhausted(RuntimeError):
    """No free extent fits the request within the timeout (back-pressure, not a crash)."""


class PoolClosed(RuntimeError):
    """The pool was closed: its slab went back to the device, no slot of it may be used."""


@dataclass(slots=True, eq=False)
class Slot:
    """One allocation: `nbytes` bytes at `offset` in chunk `chunk`; compared by identity.

    `ptr` is the address of its first byte; `tensor` a 1-D uint8 view of exactly `nbytes` bytes
    of the slab, made on first use (a job replayed from a CUDA graph needs only `ptr`).
    """

    id: int  # the generation: unique per allocation, a stale handle never shares it with the new owner
    chunk: int
    offset: int
    nbytes: int
    span: int  # nbytes rounded up to the pool's alignment
    base: torch.Tensor = field(repr=False)  # the chunk the slot lies in
    ptr: int = field(repr=False)
    _tensor: torch.Tensor | None = field(default=None, repr=False)

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = self.base[self.offset : self.offset + self.nbytes]
        return self._tensor

    @property
    def name(self) -> str:
        return f"slot#{self.id}(chunk {self.chunk} +{self.offset}, {self.nbytes} B)"

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The slot's bytes as `dtype` with `shape` (must cover exactly `nbytes`)."""
        return self.tensor.view(dtype).view(shape)


@dataclass(slots=True, frozen=True)
class PoolStats:
    capacity: int
    used: int  # bytes handed out (aligned spans)
    free: int
    in_flight: int  # bytes of slots marked in flight (FILLING / READING)
    slots: int
    largest_free: int  # the biggest request that would succeed now
    external_fragmentation: float  # 1 - largest_free / free; 0 when free is one extent
    internal_waste: int  # alignment padding inside used spans

    def __post_init__(self) -> None:
        if self.used + self.free != self.capacity or min(self.used, self.free, self.in_flight) < 0:
            raise ValueError(f"inconsistent pool accounting: {self}")


class PinnedPool:
    """A fixed slab of pinned host memory carved into slots. Thread-safe.

    Args:
        device: provides `alloc_pinned`.
        capacity_bytes: slab size (rounded up to `alignment`).
        chunk_bytes: largest single pinned buffer; a multiple of `alignment`.
        alignment: start alignment of every slot, a power of two.
        numa_node: best effort: allocate and first-touch the slab with this thread bound to
            the node's CPUs (Linux), so pages land near the GPU's node; ignored with a
            warning where the node is unknown. `numa_bound` says whether it happened.
        native: the C bookkeeping (`slab.py`): None where built, False the Python reference.
    """

    def __init__(
        self,
        device: Device,
        capacity_bytes: int,
        *,
        chunk_bytes: int = 1 << 30,
        alignment: int = 256,
        numa_node: int | None = None,
        native: bool | None = None,
    ):
        if not isinstance(device, Device):
            raise ValueError(f"device must be a kvtier Device (CudaDevice, SimDevice), got {device!r}")
        check_nbytes(capacity_bytes, "capacity_bytes")
        check_nbytes(alignment, "alignment")
        if alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        check_nbytes(chunk_bytes, "chunk_bytes")
        if chunk_bytes % alignment:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a multiple of alignment={alignment}")
        if numa_node is not None and (not isinstance(numa_node, int) or numa_node < 0):
            raise ValueError(f"numa_node must be an int >= 0 or None, got {numa_node!r}")
        self.device = device
        self.alignment = alignment
        self.chunk_bytes = chunk_bytes
        self.capacity = -(-capacity_bytes // alignment) * alignment
        self.numa_node = numa_node
        self.numa_bound = False
        self.closed = False
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self.chunks = self._allocate_slab()
        sizes = [c.numel() for c in self.chunks]
        ptrs = [c.data_ptr() for c in self.chunks]
        self._ptrs = ptrs  # each chunk's first byte: a slot whose address differs is foreign
        self._slab = make_slab(Slot, self.chunks, ptrs, sizes, chunk_bytes, alignment, check_nbytes, native)
        self.native = not isinstance(self._slab, PySlab)
        if self.native:  # one atomic C call each (the GIL): no pool frame, no lock on a submit
            self.try_alloc = self._slab.take
            self.set_in_flight = self._slab.set_in_flight

    def _allocate_slab(self) -> list[torch.Tensor]:
        sizes = [min(self.chunk_bytes, self.capacity - o) for o in range(0, self.capacity, self.chunk_bytes)]
        chunks, self.numa_bound = allocate_near(self.device.alloc_pinned, sizes, self.numa_node)
        return chunks

    # -- public ----------------------------------------------------------------------------
    def try_alloc(self, nbytes: int) -> Slot | None:
        """A slot of exactly `nbytes` usable bytes, or None when no free extent fits."""
        with self._lock:  # the Python bookkeeping's (the C one replaces this method: see __init__)
            return self._slab.take(nbytes)

    def alloc(
        self, nbytes: int, timeout: float | None = 0.0, on_pressure: Callable[[int], bool] | None = None
    ) -> Slot:
        """A slot of `nbytes`, waiting up to `timeout` s (None: forever) for room.

        `on_pressure(nbytes)` is asked to make room (evict, harvest completed releases)
        whenever the pool is short; it returns True when it freed something.
        Raises PoolExhausted when the time is up.
        """
        if self.closed:
            self._refuse()
        check_timeout(timeout)
        with self._lock:  # `take` checks nbytes (ValueError naming it) before anything else
            if (slot := self._slab.take(nbytes)) is not None:
                return slot  # the usual case: room now, no clock read
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if (slot := self._slab.take(nbytes)) is not None:
                    return slot
            if on_pressure is not None and on_pressure(nbytes):
                continue
            with self._lock:
                if (slot := self._slab.take(nbytes)) is not None:
                    return slot
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    sl = self._slab
                    raise PoolExhausted(
                        f"no room for {nbytes} B within {timeout} s: {self.capacity - sl.used} B free "
                        f"(largest extent {sl.largest()} B), {sl.in_flight_bytes} B in flight"
                    )
                wait = left
                if on_pressure is not None:
                    # Completions that on_pressure could harvest do not notify us: poll.
                    wait = 1e-3 if left is None else min(1e-3, left)
                self._freed.wait(wait)  # back-pressure: a free() wakes us

    def check(self, slot: Slot, name: str = "slot") -> None:
        """Raise unless `slot` is a live allocation of this pool, in O(1): `StaleSlotError` for a
        released or reused handle or a slot of another pool, `PoolClosed` once closed,
        ValueError for what is no Slot. `name` is the argument the error names."""
        if self.closed:
            self._refuse()
        if not isinstance(slot, Slot):
            raise ValueError(f"{name} must be a Slot of this pool, got {slot!r}")
        if not self._slab.is_live(slot):  # one dict lookup and an identity test (atomic: the GIL)
            raise self._stale("check", slot, name)

    def free(self, slot: Slot) -> None:
        """Return `slot`'s memory; `StaleSlotError` unless it is a live slot of this pool."""
        with self._lock:  # the check and the free are one step: no other free comes between
            if not self._slab.is_live(slot):  # (what is no Slot: ValueError, from the slab)
                raise self._stale("free", slot, "slot")
            self._slab.free(slot)
            self._freed.notify_all()

    def _stale(self, action: str, slot: Slot, name: str) -> StaleSlotError:
        """The error for `slot`, which is not the live allocation at its address."""
        c = slot.chunk
        if not (type(c) is int and 0 <= c < len(self._ptrs) and self._ptrs[c] + slot.offset == slot.ptr):
            why = "it is a slot of another pool"
            return StaleSlotError(action, name, slot.name, slot.id, None, why)
        live = self._slab.live.get(c * self.chunk_bytes + slot.offset)
        if live is None:
            why = f"generation {slot.id} was released and nothing is allocated there now"
            return StaleSlotError(action, name, slot.name, slot.id, None, why)
        why = (
            f"generation {slot.id} was released; the live generation {live.id} ({live.name}) "
            "owns its bytes now"
        )
        return StaleSlotError(action, name, slot.name, slot.id, live.id, why)

    def set_in_flight(self, slot: Slot, busy: bool) -> None:
        """Count `slot` as in flight (a copy may touch it) or not; idempotent. (What is no Slot:
        ValueError, from the slab.)"""
        with self._lock:  # the Python bookkeeping's (the C one replaces this method: see __init__)
            self._slab.set_in_flight(slot, busy)

    def unusable_fraction(self, nbytes: int) -> float:
        """Fraction of free bytes in extents too small for a request of `nbytes`."""
        span = -(-check_nbytes(nbytes) // self.alignment) * self.alignment
        with self._lock:
            free = self.capacity - self._slab.used
            return self._slab.smaller_than(span) / free if free else 0.0

    def stats(self) -> PoolStats:
        with self._lock:
            sl = self._slab
            free, largest = self.capacity - sl.used, sl.largest()
            return PoolStats(
                capacity=self.capacity,
                used=sl.used,
                free=free,
                in_flight=sl.in_flight_bytes,
                slots=len(sl.live),
                largest_free=largest,
                external_fragmentation=1.0 - largest / free if free else 0.0,
                internal_waste=sl.waste,
            )

    def check_free_list(self) -> None:
        """Verify the free list: sorted, disjoint, coalesced, and adding up (for tests)."""
        with self._lock:
            ext = [(s, n, "free") for s, n in self._slab.extents()]
            ext = sorted(ext + [(s, sl.span, "used") for s, sl in self._slab.live.items()])
            pos, prev = 0, None  # chunks tile [0, capacity) with no gaps
            for start, size, kind in ext:
                if start != pos:
                    raise AssertionError(f"gap or overlap at {start} (expected {pos})")
                if kind == prev == "free" and start % self.chunk_bytes:
                    raise AssertionError(f"uncoalesced free extents at {start}")
                pos, prev = start + size, kind
            if pos != self.capacity:
                raise AssertionError(f"extents end at {pos}, capacity is {self.capacity}")
            assert self._slab.total() + self._slab.used == self.capacity

    def close(self) -> None:
        """Give the slab back to the device, once no copy can touch it; idempotent.

        Slots still marked in flight (a save filling one, a load reading one) make it synchronize
        the device first. Allocations and `check` then raise `PoolClosed` (the slab's bookkeeping
        still holds the chunks: it must not hand out unpinned memory). A device error met while
        waiting is raised after the slab was given back (the pool is closed either way).
        """
        if self.closed:
            return
        self.closed = True
        self.try_alloc = self._refuse  # the C slab's own call too (an instance attribute)
        error: BaseException | None = None
        if self._slab.in_flight_bytes:
            try:
                # Freeing pinned pages while a DMA still reads or writes them is a use-after-free.
                self.device.synchronize()
            except Exception as e:  # noqa: BLE001 - the slab goes back all the same, then raised
                error = e
        chunks, self.chunks = self.chunks, []
        for c in chunks:
            try:
                self.device.free_pinned(c)
            except Exception as e:  # noqa: BLE001 - every chunk is given back; the first error raised
                error = error or e
        if error is not None:
            raise error

    def _refuse(self, nbytes: int = 0) -> None:
        raise PoolClosed("PinnedPool is closed: its slab was given back to the device")
