"""How fast each lower tier delivers chunks to this store, measured on its own reads: the planner's
read time for a disk or remote hit, where a probe of the raw device would be too optimistic (a
chunk read also opens a file, checks a header and a checksum, and shares the host with the rest).

A load reads a chunk on its own thread and the next ones ahead on others, so reads overlap and
their summed times would make a tier look several times slower than it is. Instead the reads of
one tier are joined into busy periods (a read that starts before the period's last read ended,
or within `GAP_S` of it, extends the period): one per load, about. A period's time is a fixed
part (the first read before read-ahead fills the pipeline, opening the tier's connection or
files) plus its bytes at a rate, so a rate taken from short loads alone would make a long one
look slow, and one from long loads a short one fast: `fit` takes both from the last `WINDOW`
periods, a least-squares line of seconds over bytes, where their sizes differ enough to tell
them apart; else the bytes over the wall time of the last `PERIODS` periods, with no fixed part.

    rates = ReadRate()
    t0 = time.perf_counter(); ...read...; rates.record("disk", t0, time.perf_counter(), nbytes)
    rates.fit("disk")    # (GB/s, fixed seconds per load), or None until the tier has read a chunk
"""

from __future__ import annotations

import threading
from collections import deque

GAP_S = 0.002  # reads this close after a period's end continue it: one load's walk between reads
PERIODS = 8  # busy periods the plain rate is taken over: a few recent loads, not the first alone
WINDOW = 32  # busy periods kept per tier, the line is fitted over
SPREAD = 2.0  # the line needs periods this many times apart in bytes; else the plain rate


class ReadRate:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._periods: dict[str, deque[list[float]]] = {}  # tier -> [[start, end, bytes], ...]

    def record(self, tier: str, start: float, end: float, nbytes: int) -> None:
        """One read of ``nbytes`` from ``tier`` between ``start`` and ``end`` (perf_counter s)."""
        if nbytes <= 0 or end < start:
            return
        with self._lock:
            periods = self._periods.setdefault(tier, deque(maxlen=WINDOW))
            last = periods[-1] if periods else None
            if last is not None and last[0] - GAP_S <= start <= last[1] + GAP_S:
                last[0], last[1] = min(last[0], start), max(last[1], end)
                last[2] += nbytes
            else:
                periods.append([start, end, float(nbytes)])

    def gbps(self, tier: str) -> float | None:
        """GB/s ``tier`` delivered over its last `PERIODS` busy periods; None before its first read."""
        with self._lock:
            periods = list(self._periods.get(tier, ()))[-PERIODS:]
        seconds = sum(p[1] - p[0] for p in periods)
        nbytes = sum(p[2] for p in periods)
        return nbytes / seconds / 1e9 if seconds > 0 else None

    def fit(self, tier: str) -> tuple[float, float] | None:
        """(GB/s, fixed seconds) of a load from ``tier``: seconds = fixed + bytes / rate, fitted
        over its last `WINDOW` busy periods when their sizes differ by `SPREAD` or more (the fixed
        part never negative), else (`gbps`, 0); None before its first read."""
        with self._lock:
            periods = [(p[2], p[1] - p[0]) for p in self._periods.get(tier, ())]
        if not periods:
            return None
        sizes = [b for b, _ in periods]
        if min(sizes) * SPREAD <= max(sizes):
            n = len(periods)
            mb, ms = sum(sizes) / n, sum(t for _, t in periods) / n
            var = sum((b - mb) ** 2 for b in sizes)
            slope = sum((b - mb) * (t - ms) for b, t in periods) / var
            fixed = ms - slope * mb
            if slope > 0 and fixed >= 0:
                return 1 / slope / 1e9, fixed
        rate = self.gbps(tier)
        return None if rate is None else (rate, 0.0)

    def snapshot(self) -> dict[str, float]:
        """{tier: GB/s} (`gbps`) of every tier read so far."""
        with self._lock:
            tiers = list(self._periods)
        return {t: r for t in tiers if (r := self.gbps(t)) is not None}
