"""The distribution of repeated timings: median, min, max, p10/p90 (any percentile), count; and
`Rate`, a rate over such runs with its slowest and fastest. Pure Python, no torch.

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

    def percentile_ms(self, q: float) -> float:
        """The q-th percentile of the runs (with n runs, p99 is close to the slowest of them)."""
        return percentile(self.samples_ms, q) if self.samples_ms else self.median_ms

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


class Rate(float):
    """A rate (GB/s, TFLOP/s) from repeated runs, as nvbandwidth reports one: its value is the
    median run's; ``low`` / ``high`` are the slowest and the fastest run's, ``samples`` how many
    runs there were and ``nbytes`` the size of one. A float everywhere a plain figure is read.

    >>> r = Rate.of(2 * 10**9, summarize([900.0, 1000.0, 1100.0]))
    >>> float(r), r.low, r.high, r.samples
    (2.0, 1.8181818181818181, 2.2222222222222223, 3)
    """

    low: float
    high: float
    samples: int
    nbytes: int

    def __new__(cls, value: float, low: float, high: float, samples: int, nbytes: int = 0) -> Rate:
        r = super().__new__(cls, value)
        r.low, r.high, r.samples, r.nbytes = low, high, samples, nbytes
        return r

    def __reduce__(self):  # copies and pickles keep the spread, not just the float
        return (Rate, (float(self), self.low, self.high, self.samples, self.nbytes))

    @classmethod
    def of(cls, amount: float, timing: Timing, nbytes: int = 0, scale: float = 1e9) -> Rate:
        """`amount` (bytes, FLOPs) per run over `timing`, in units of `scale` per second."""
        per_s = amount / scale
        return cls(
            per_s / timing.median_s,
            per_s / (timing.max_ms / 1e3),
            per_s / (timing.min_ms / 1e3) if timing.min_ms > 0 else math.inf,
            timing.count,
            nbytes,
        )

    @property
    def spread(self) -> float:
        """(high - low) / value: how far apart the fastest and the slowest run are."""
        return (self.high - self.low) / self if self > 0 else math.inf

    def to_json(self) -> dict:
        return {
            "median": float(self),
            "min": self.low,
            "max": self.high,
            "samples": self.samples,
            "bytes": self.nbytes,
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
