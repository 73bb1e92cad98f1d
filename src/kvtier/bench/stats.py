"""The distribution of repeated timings: median, min, max, p10/p90, count. Pure Python, no torch.

A single number hides warm-up, clock changes and noisy neighbours; the median of many runs with
its spread does not. Percentiles use linear interpolation between order statistics (the same as
``numpy.percentile(..., method="linear")``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of `samples`, linear interpolation."""
    if not samples:
        raise ValueError("samples: need at least one value")
    if not 0 <= q <= 100:
        raise ValueError(f"q: expected 0..100, got {q!r}")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Timing:
    """Summary of repeated timings of one callable; all times in milliseconds."""

    median_ms: float
    min_ms: float
    max_ms: float
    p10_ms: float
    p90_ms: float
    mean_ms: float
    count: int
    samples_ms: tuple[float, ...] = ()
    clock: str = "perf_counter"  # what measured it: "cuda_events", "cuda_graph", "perf_counter"

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the relative width of the middle 80% of runs."""
        return (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms > 0 else math.inf

    @property
    def median_s(self) -> float:
        return self.median_ms / 1e3

    def gbps(self, nbytes: int) -> float:
        """GB/s (1e9 bytes) of `nbytes` moved per run, from the median."""
        return nbytes / self.median_s / 1e9 if self.median_ms > 0 else math.inf

    def to_json(self) -> dict:
        return {
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "max_ms": self.max_ms,
            "p10_ms": self.p10_ms,
            "p90_ms": self.p90_ms,
            "mean_ms": self.mean_ms,
            "count": self.count,
            "clock": self.clock,
        }


def summarize(samples_ms: Sequence[float], clock: str = "perf_counter") -> Timing:
    """Summarize timings (milliseconds, each > = 0) into a `Timing`."""
    xs = [float(x) for x in samples_ms]
    if not xs:
        raise ValueError("samples_ms: need at least one timing")
    bad = [x for x in xs if not math.isfinite(x) or x < 0]
    if bad:
        raise ValueError(f"samples_ms: timings must be finite and >= 0, got {bad[:3]}")
    return Timing(
        median_ms=percentile(xs, 50),
        min_ms=min(xs),
        max_ms=max(xs),
        p10_ms=percentile(xs, 10),
        p90_ms=percentile(xs, 90),
        mean_ms=sum(xs) / len(xs),
        count=len(xs),
        samples_ms=tuple(xs),
        clock=clock,
    )
