"""`KVStore.stats()` reads at a glance: the hit rate as tokens hit of tokens asked, bytes and time
per chunk for every tier, a table when printed, and the dict access every caller used; and the
periodic log line a serving integration writes when there was traffic."""

from __future__ import annotations

import logging

from kvtier.store.disk import DiskTier
from kvtier.store.stats import StatsLog, StoreStats

from test_kvstore import CT, Rig


def test_stats_give_the_hit_rate_bytes_and_time_per_tier_and_print_as_a_table(tmp_path):
    rig = Rig(tiers=[DiskTier(str(tmp_path / "kv"), 1 << 30)], write_policy="write_through")
    try:
        a = list(range(1, 3 * CT + 5))  # 3 full chunks and 4 tokens more
        rig.store.save(a, range(8), after=rig.write(a, range(8))).wait_durable(5)
        rig.store.evict()  # the next load comes from the disk
        lh = rig.store.load(a, range(40, 48))
        assert lh.wait(5) and lh.tokens == 3 * CT
        assert rig.store.load(list(range(500, 500 + 2 * CT)), range(60, 64)).tokens == 0  # a miss
        s = rig.store.stats()
        assert isinstance(s, StoreStats) and isinstance(s, dict)
        assert s["store"]["loads"] == 2 and s["host"]["hits"] >= 0  # the dict readers had
        asked = len(a) + 2 * CT
        assert s["store"]["tokens_asked"] == asked and s["store"]["tokens_hit"] == 3 * CT
        assert abs(s["store"]["hit_rate_pct"] - 100 * 3 * CT / asked) < 1e-9
        r = s["disk"]
        assert r["hits"] == 3 and r["bytes_read"] == 3 * rig.chunk_nbytes and r["get_ms_mean"] > 0
        assert r["put_ms_mean"] > 0 and r["hit_rate_pct"] == 100 * 3 / (3 + r["misses"])
        text = str(s)
        lines = text.splitlines()
        rate = s["store"]["hit_rate_pct"]
        assert lines[0] == f"kvtier store: 2 loads, 1 saves, {3 * CT} of {asked} tokens hit ({rate:.1f}%)"
        assert lines[1].split() == [
            "tier",
            "hits",
            "misses",
            "hit",
            "rate",
            "read",
            "ms/chunk",
            "written",
            "ms/chunk",
            "errors",
            "held",
        ]
        row = next(x.split() for x in lines if x.split()[0] == "disk")
        assert row[1] == "3" and row[4:6] == [f"{3 * rig.chunk_nbytes / 1e3:,.1f}", "KB"]
        assert all(len(x) < 120 for x in lines) and "pool:" in lines[-1]
        assert "% of" in s.line() and "disk: 3 hits" in s.line() and "\n" not in s.line()
    finally:
        rig.close()


def test_an_empty_store_prints_too():
    rig = Rig()
    try:
        s = rig.store.stats()
        assert s["store"]["hit_rate_pct"] is None and "no tokens asked yet" in str(s)
    finally:
        rig.close()


def test_the_stats_log_writes_a_line_per_interval_only_after_traffic(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("kvtier.store.stats.time.monotonic", lambda: clock[0])
    count = [0]
    log = StatsLog(logging.getLogger("kvtier.test"), lambda: (count[0], f"line {count[0]}"), interval_s=10)
    with caplog.at_level(logging.INFO, logger="kvtier.test"):
        log.tick()  # too soon
        clock[0] += 11
        log.tick()  # due, but no traffic yet
        count[0] = 3
        log.tick()  # traffic, but not due again
        clock[0] += 11
        log.tick()  # due, traffic: a line
        clock[0] += 11
        log.tick()  # due, no new traffic
    assert [r.getMessage() for r in caplog.records] == ["line 3"]
    monkeypatch.setenv("KVTIER_STATS_LOG_S", "0")
    assert StatsLog(logging.getLogger("kvtier.test"), lambda: (1, "x")).interval_s == 0
    monkeypatch.setenv("KVTIER_STATS_LOG_S", "often")
    try:
        StatsLog(logging.getLogger("kvtier.test"), lambda: (1, "x"))
    except ValueError as e:
        assert "KVTIER_STATS_LOG_S" in str(e) and "often" in str(e)
    else:
        raise AssertionError("a bad KVTIER_STATS_LOG_S was taken")
