"""The bookkeeping of `PinnedPool`'s slab: its free extents (`freelist.FreeList`: best fit,
coalescing), the live slots by start, the used / waste / in-flight byte counts and the set of
slots in flight. One interface, two implementations:

    PySlab            here, in Python: the reference (and what runs without the C one)
    kvtier._slab.Slab the same in C (`_slab.c`), used when built: `take` and `set_in_flight`
                      are what a save's submit calls, and each is then one C call instead of a
                      chain of Python frames, bisects, dict updates and a dataclass __init__
                      (the "slot" phase of a submit's trace, `SubmitTrace`)

`make_slab` picks one: the C one unless KVTIER_NATIVE=0, it is not built, or the interpreter runs
without a GIL (its calls rely on the GIL to be atomic: `native.py`). The tests run both (`native=False`).

Interface: take(nbytes) -> a new slot or None when no free extent fits (nbytes checked:
`check_request` raises for what is no positive int -- a plain function, not a bound method of the
pool, which would make a reference cycle through the C type -- and a request over the largest
chunk is refused); is_live(slot) (True when `slot` itself is the allocation that lives at its
address: O(1), False for a released, reused or foreign handle); free(slot) (ValueError unless
is_live); set_in_flight(slot, busy) (ValueError when busy and not is_live); largest(),
smaller_than(span), extents(), total(); the attributes used, waste, in_flight_bytes, max_request,
live (start -> slot), in_flight (a set). Not thread-safe by itself: the pool calls PySlab under
its lock; each call of the C one is atomic under the GIL.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from kvtier.freelist import FreeList
from kvtier.native import load


class PySlab:
    def __init__(
        self,
        slot_type: type,
        chunks: Sequence,
        ptrs: Sequence[int],
        sizes: Sequence[int],
        chunk_bytes: int,
        alignment: int,
        check_request: Callable[[int], None],
    ):
        self.slot_type, self.chunks, self.ptrs = slot_type, list(chunks), list(ptrs)
        self.chunk_bytes, self.alignment, self.check_request = chunk_bytes, alignment, check_request
        self.max_request = max(sizes)
        self.live: dict[int, object] = {}
        self.in_flight: set = set()
        self.used = self.waste = self.in_flight_bytes = 0
        self._ids = itertools.count(1)  # unique per allocation: a stale handle never shares it
        self._free = FreeList(chunk_bytes)
        for i, size in enumerate(sizes):
            self._free.add(i * chunk_bytes, size)

    def take(self, nbytes: int):
        if type(nbytes) is not int or not 0 < nbytes <= self.max_request:  # the usual int: one test
            self.check_request(nbytes)
            if nbytes > self.max_request:
                raise ValueError(f"nbytes={nbytes} exceeds the largest chunk; a slot never straddles chunks")
        span = -(-nbytes // self.alignment) * self.alignment
        start = self._free.take(span)
        if start is None:
            return None
        chunk, off = divmod(start, self.chunk_bytes)
        base, ptr = self.chunks[chunk], self.ptrs[chunk] + off
        slot = self.slot_type(next(self._ids), chunk, off, nbytes, span, base, ptr)
        self.live[start] = slot
        self.used += span
        self.waste += span - nbytes
        return slot

    def is_live(self, slot) -> bool:
        self._check_slot(slot)
        return self.live.get(slot.chunk * self.chunk_bytes + slot.offset) is slot

    def free(self, slot) -> None:
        self._check_slot(slot)
        start = slot.chunk * self.chunk_bytes + slot.offset
        live = self.live.get(start)
        if live is not slot:  # a stale handle must not free the bytes of their new owner
            now = "nothing lives at its address" if live is None else f"{live.name} lives at its address"
            raise ValueError(f"slot {slot.name} is not allocated: {now}")
        del self.live[start]
        self.used -= live.span
        self.waste -= live.span - live.nbytes
        self.set_in_flight(live, False)
        self._free.release(start, live.span)

    def set_in_flight(self, slot, busy: bool) -> None:
        self._check_slot(slot)
        if busy and slot not in self.in_flight:
            if not self.is_live(slot):  # counted, a stale handle would never be uncounted
                raise ValueError(f"slot {slot.name} is not allocated: it cannot be in flight")
            self.in_flight.add(slot)
            self.in_flight_bytes += slot.span
        elif not busy and slot in self.in_flight:
            self.in_flight.discard(slot)
            self.in_flight_bytes -= slot.span

    def _check_slot(self, slot) -> None:
        if not isinstance(slot, self.slot_type):
            raise ValueError(f"slot must be a Slot of this pool, got {slot!r}")

    def largest(self) -> int:
        return self._free.largest()

    def smaller_than(self, span: int) -> int:
        return self._free.smaller_than(span)

    def extents(self) -> list[tuple[int, int]]:
        return sorted(self._free.extents())

    def total(self) -> int:
        return self._free.total()


_module, why = load("kvtier._slab")
Slab = None if _module is None else _module.Slab  # the C type or None, and why not (`why`)


def make_slab(slot_type, chunks, ptrs, sizes, chunk_bytes, alignment, check_request, native=None):
    """The C slab where it is available (native None or True), else `PySlab`; native=True
    without it raises."""
    if native is None:
        native = Slab is not None
    if native and Slab is None:
        raise RuntimeError(f"kvtier._slab is unavailable: {why}")
    kind = Slab if native else PySlab
    return kind(slot_type, list(chunks), list(ptrs), list(sizes), chunk_bytes, alignment, check_request)


def status() -> str:
    """One line for reports: in use, or why not."""
    return "in use" if Slab is not None else why
