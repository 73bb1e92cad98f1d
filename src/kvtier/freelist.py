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
        i = bisect.bisect_left(self._by_size, (span, -1))
        if i == len(self._by_size):
            return None
        size, start = self._by_size[i]
        self._remove(start)
        if size > span:
            self.add(start + span, size - span)
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
