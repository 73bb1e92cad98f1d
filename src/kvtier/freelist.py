"""The free extents of `PinnedPool`'s slab: best fit by size, coalescing on release.

Extents are addressed globally (chunk * chunk_bytes + offset); two extents merge only inside
one chunk, so a slot never straddles chunks. Not thread-safe: the pool holds its lock.
"""

from __future__ import annotations

import bisect


class FreeList:
    def __init__(self, chunk_bytes: int):
        self.chunk_bytes = chunk_bytes
        self._at: dict[int, int] = {}  # start -> size
        self._end: dict[int, int] = {}  # end -> start, to find the left neighbour
        self._by_size: list[tuple[int, int]] = []  # sorted (size, start): best fit by bisect

    def add(self, start: int, size: int) -> None:
        self._at[start] = size
        self._end[start + size] = start
        bisect.insort(self._by_size, (size, start))

    def _remove(self, start: int) -> int:
        size = self._at.pop(start)
        del self._end[start + size]
        del self._by_size[bisect.bisect_left(self._by_size, (size, start))]
        return size

    def take(self, span: int) -> int | None:
        """The start of `span` bytes cut from the smallest extent that fits (ties: the lowest
        address); the rest of that extent stays free. None when none fits."""
        by = self._by_size
        i = bisect.bisect_left(by, (span, -1))
        if i == len(by):
            return None
        size, start = by[i]
        del self._at[start], by[i]  # `_remove` and `add` written out: a submit allocates a slot
        end = start + size
        if size == span:
            del self._end[end]
        else:  # the rest stays free; the index entry at its end now names the rest's start
            rest, at = size - span, start + span
            self._at[at] = rest
            self._end[end] = at
            by.insert(bisect.bisect_left(by, (rest, at), 0, i), (rest, at))  # below (size, start): before i
        return start

    def release(self, start: int, size: int) -> None:
        """Give `size` bytes at `start` back, merged with free neighbours in the same chunk."""
        if start % self.chunk_bytes and start in self._end:  # left neighbour, same chunk
            start = self._end[start]
            size += self._remove(start)
        end = start + size
        if end % self.chunk_bytes and end in self._at:  # right neighbour, same chunk
            size += self._remove(end)
        self.add(start, size)

    def largest(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def smaller_than(self, span: int) -> int:
        """Free bytes in extents too small for `span`."""
        return sum(s for s, _ in self._by_size[: bisect.bisect_left(self._by_size, (span, -1))])

    def extents(self) -> list[tuple[int, int]]:
        """(start, size) of every free extent."""
        return list(self._at.items())

    def total(self) -> int:
        """Free bytes; also checks that the three indexes agree (for tests)."""
        assert len(self._by_size) == len(self._at) == len(self._end)
        return sum(n for n, _ in self._by_size)
