"""ReadRate: a tier's delivered GB/s from its reads, overlapping reads counted once."""

import threading
import time

import pytest

from kvtier.store.read_rate import GAP_S, PERIODS, ReadRate


def test_no_rate_before_a_read_and_bad_reads_are_ignored():
    r = ReadRate()
    assert r.gbps("disk") is None and r.snapshot() == {}
    r.record("disk", 1.0, 0.5, 100)  # ends before it starts
    r.record("disk", 1.0, 2.0, 0)  # no bytes
    assert r.gbps("disk") is None


def test_overlapping_reads_count_their_wall_time_once():
    r = ReadRate()
    # three readers, each 1e9 bytes over [0, 1), [0.5, 1.5), [1, 2): 3e9 bytes in 2 s, not in 3
    for start in (0.0, 0.5, 1.0):
        r.record("disk", start, start + 1.0, 10**9)
    assert r.gbps("disk") == pytest.approx(1.5)
    r.record("redis", 0.0, 2.0, 10**9)
    assert r.snapshot() == {"disk": pytest.approx(1.5), "redis": pytest.approx(0.5)}


def test_idle_time_between_loads_is_not_counted():
    r = ReadRate()
    r.record("disk", 0.0, 1.0, 10**9)
    r.record("disk", 1.0 + GAP_S / 2, 2.0, 10**9)  # the next read of the same load: one period
    r.record("disk", 100.0, 101.0, 10**9)  # a later load, after an idle minute
    assert r.gbps("disk") == pytest.approx(1.0)


def test_the_rate_follows_the_recent_loads():
    r = ReadRate()
    r.record("disk", 0.0, 1.0, 10**9)  # an early slow period
    for i in range(PERIODS):
        t = 10.0 * (i + 1)
        r.record("disk", t, t + 1.0, 4 * 10**9)
    assert r.gbps("disk") == pytest.approx(4.0)  # the first period fell out of the window


def test_concurrent_records():
    r, t0 = ReadRate(), time.perf_counter()

    def reader():
        for _ in range(200):
            s = time.perf_counter()
            r.record("disk", s, s + 1e-4, 1000)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert r.gbps("disk") > 0 and time.perf_counter() > t0


def test_fit_splits_a_loads_fixed_part_from_its_rate():
    from kvtier.store.read_rate import SPREAD

    r = ReadRate()
    assert r.fit("disk") is None
    # loads of 2, 8 and 32 chunks of 32 MB: 40 ms to start, then 1.5 GB/s
    t = 0.0
    for chunks in (2, 8, 32, 2, 8, 32):
        nbytes = chunks * 32e6
        r.record("disk", t, t + 0.040 + nbytes / 1.5e9, int(nbytes))
        t += 10.0
    rate, fixed = r.fit("disk")
    assert rate == pytest.approx(1.5, rel=1e-6) and fixed == pytest.approx(0.040, rel=1e-6)
    # one size only: the plain rate, no fixed part
    same = ReadRate()
    for i in range(4):
        same.record("disk", 10.0 * i, 10.0 * i + 0.5, 10**9)
    assert same.fit("disk") == (pytest.approx(2.0), 0.0)
    assert SPREAD > 1
    # a line that would start below zero (noise): the plain rate
    odd = ReadRate()
    odd.record("disk", 0.0, 1.0, 10**8)
    odd.record("disk", 10.0, 10.5, 10**9)
    assert odd.fit("disk") == (pytest.approx(1.1e9 / 1.5 / 1e9), 0.0)
