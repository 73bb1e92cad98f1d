"""Statistics of repeated timings: percentiles, summary, GB/s; pure Python."""

import math

import numpy as np
import pytest

from kvtier.bench.stats import Timing, percentile, summarize


@pytest.mark.parametrize("xs", [[5.0], [1.0, 2.0], [3.0, 1.0, 2.0], [0.5, 9.0, 2.5, 2.5, 7.0, 1.0, 4.0]])
@pytest.mark.parametrize("q", [0, 10, 25, 50, 90, 100])
def test_percentile_matches_numpy_linear(xs, q):
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_summarize_fields():
    t = summarize([4.0, 1.0, 3.0, 2.0, 10.0], clock="cuda_events")
    assert (t.median_ms, t.min_ms, t.max_ms, t.count) == (3.0, 1.0, 10.0, 5)
    assert t.mean_ms == 4.0
    assert t.p10_ms == pytest.approx(1.4) and t.p90_ms == pytest.approx(7.6)
    assert t.samples_ms == (4.0, 1.0, 3.0, 2.0, 10.0) and t.clock == "cuda_events"
    assert t.spread == pytest.approx((7.6 - 1.4) / 3.0)


def test_median_not_mean_resists_one_outlier():
    t = summarize([1.0] * 9 + [1000.0])
    assert t.median_ms == 1.0 and t.mean_ms > 100


def test_gbps_uses_median_and_1e9():
    t = summarize([2.0, 1.0, 100.0])  # median 2 ms
    assert t.gbps(2_000_000) == pytest.approx(1.0)  # 2e6 B / 2e-3 s = 1e9 B/s
    assert t.median_s == pytest.approx(2e-3)


def test_to_json_has_distribution():
    d = summarize([1.0, 2.0, 3.0]).to_json()
    assert set(d) >= {"median_ms", "min_ms", "max_ms", "p10_ms", "p90_ms", "count"}


@pytest.mark.parametrize("bad", [[], [float("nan")], [-1.0], [math.inf]])
def test_summarize_rejects_bad_samples(bad):
    with pytest.raises(ValueError, match="samples"):
        summarize(bad)


def test_percentile_rejects_bad_q():
    with pytest.raises(ValueError, match="q"):
        percentile([1.0], 101)


def test_zero_median_spread_is_infinite():
    assert Timing(0, 0, 0, 0, 0, 0, 1).spread == math.inf
