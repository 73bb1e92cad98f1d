"""How fast each lower tier delivers chunks to this store, measured on its own reads: the planner's
read time for a disk or remote hit, where a probe of the raw device would be too optimistic (a
chunk read also opens a file, checks a header and a checksum, and shares the host with the rest).

A load reads a chunk on its own thread and the next ones ahead on others, so reads overlap and
their summed times would make a tier look several times slower than it is. Instead the reads of
one tier are joined into busy periods (a read that starts before the period's last read ended,
or within `GAP_S` of it, extends the period), and the rate is the bytes over the wall time of the
last `PERIODS` periods: what a load of many chunks sees.

    rates = ReadRate()
    t0 = time.perf_counter(); ...read...; rates.record("disk", t0, time.perf_counter(), nbytes)
    rates.gbps("disk")   # None until the tier has read a chunk
"""

from __future__ import annotations

import threading
from collections import deque

GAP_S = 0.002  # reads this close after a period's end continue it: one load's walk between reads
PERIODS = 8  # busy periods per tier the rate is taken over: a few recent loads, not the first alone


class ReadRate:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._periods: dict[str, deque[list[float]]] = {}  # tier -> [[start, end, bytes], ...]

    def record(self, tier: str, start: float, end: float, nbytes: int) -> None:
        """One read of ``nbytes`` from ``tier`` between ``start`` and ``end`` (perf_counter s)."""
        if nbytes <= 0 or end < start:
            return
        with self._lock:
            periods = self._periods.setdefault(tier, deque(maxlen=PERIODS))
            last = periods[-1] if periods else None
            if last is not None and last[0] - GAP_S <= start <= last[1] + GAP_S:
                last[0], last[1] = min(last[0], start), max(last[1], end)
                last[2] += nbytes
            else:
                periods.append([start, end, float(nbytes)])

    def gbps(self, tier: str) -> float | None:
        """GB/s ``tier`` delivered over its recent busy periods; None before its first read."""
        with self._lock:
            periods = self._periods.get(tier)
            if not periods:
                return None
            seconds = sum(p[1] - p[0] for p in periods)
            nbytes = sum(p[2] for p in periods)
        return nbytes / seconds / 1e9 if seconds > 0 else None

    def snapshot(self) -> dict[str, float]:
        """{tier: GB/s} of every tier read so far."""
        with self._lock:
            tiers = list(self._periods)
        return {t: r for t in tiers if (r := self.gbps(t)) is not None}
