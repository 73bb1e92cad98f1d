"""Circuit breaker state machine and the metrics' private Prometheus registry."""

import prometheus_client
import pytest

from kvtier.store.health import CircuitBreaker
from kvtier.store.metrics import StoreMetrics


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_opens_after_n_consecutive_failures_and_probes_after_cooldown():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=3, cooldown_s=10.0, clock=clock)
    b.record_failure()
    b.record_failure()
    b.record_success()  # resets the streak: failures must be consecutive
    b.record_failure()
    b.record_failure()
    assert b.allow()
    b.record_failure()
    assert b.is_open and not b.allow() and b.trips == 1
    clock.t = 9.9
    assert not b.allow()
    clock.t = 10.0
    assert b.allow()  # the one half-open probe
    assert not b.allow()  # everyone else still skips while the probe is out
    b.record_failure()  # probe failed: open for another cooldown
    assert b.trips == 2 and not b.allow()
    clock.t = 20.0
    assert b.allow()
    b.record_success()
    assert not b.is_open and b.allow() and b.allow()


def test_trip_opens_at_once_and_a_probe_closes_it():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=3, cooldown_s=10.0, clock=clock)
    b.trip()  # a tier found down at start
    assert b.is_open and not b.allow() and b.trips == 1
    clock.t = 10.0
    assert b.allow()  # the probe
    b.record_success()
    assert not b.is_open and b.allow()


def test_breaker_arguments():
    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError, match="cooldown_s"):
        CircuitBreaker(cooldown_s=-1)


def test_metrics_live_on_a_private_registry():
    before = {m.name for m in prometheus_client.REGISTRY.collect()}
    m1, m2 = StoreMetrics(), StoreMetrics()  # two stores in one process must not collide
    t = m1.tier("disk")
    m2.tier("disk")
    t.hit(100, 0.001)
    t.miss()
    t.miss("timeout")
    t.stored(50, 0.002)
    t.put_failed("full")
    t.evicted(2)
    t.occupancy(10, 20, 1, 0)
    snap = t.snapshot()
    assert (
        snap["hits"] == 1 and snap["misses"] == 2 and snap["errors_timeout"] == 1 and snap["errors_full"] == 1
    )
    assert snap["bytes_read"] == 100 and snap["bytes_written"] == 50 and snap["evictions"] == 2
    assert snap["used_bytes"] == 10 and snap["capacity_bytes"] == 20
    text = m1.text().decode()
    assert 'kvtier_tier_lookups_total{result="hit",tier="disk"} 1.0' in text
    assert 'kvtier_tier_errors_total{kind="timeout",tier="disk"} 1.0' in text
    assert 'kvtier_tier_used_bytes{tier="disk"} 10.0' in text
    assert "kvtier_tier_latency_seconds_bucket" in text
    assert {m.name for m in prometheus_client.REGISTRY.collect()} == before
    with pytest.raises(ValueError, match="name"):
        m1.tier("disk")
    with pytest.raises(ValueError, match="kind"):
        t.error("oops")


def test_hits_counted_together_count_as_many():
    """A load's host hits are counted in one call: the counters and the latency histogram see
    each of them."""
    t = StoreMetrics().tier("host")
    t.hit(100, 0.0)
    t.hit(300, 0.0, 3)
    snap = t.snapshot()
    assert snap["hits"] == 4 and snap["bytes_read"] == 400
    text = t.families.text().decode()
    assert 'kvtier_tier_lookups_total{result="hit",tier="host"} 4.0' in text
    assert 'kvtier_tier_latency_seconds_count{op="get",tier="host"} 4.0' in text
