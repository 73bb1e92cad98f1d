"""What `KVStore.stats()` returns and how it reads, and the periodic log line of a serving
integration (as LMCache logs its hit rate).

    StoreStats                 the dict of dicts of `stats()` (``s["host"]["hits"]`` as before),
                               with the derived figures added, printing as a table (`str`)
    StoreStats.line()          the same in one log line
    StatsLog(logger, snapshot) `tick()` on each request: one INFO line every `interval_s`
                               seconds (``KVTIER_STATS_LOG_S``, default 10; 0: off) when there
                               was traffic since the last (`store_snapshot(store)`
                               for a KVStore's)

Derived figures: ``store.hit_rate_pct``, tokens hit of tokens asked (``load_tokens`` of
``load_tokens_asked``, or of the lookups where nothing was loaded); per tier ``hit_rate_pct``
(hits of gets), ``get_ms_mean`` and ``put_ms_mean`` (time per chunk read / written).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable


def _pct(part: float, whole: float) -> float | None:
    return 100.0 * part / whole if whole else None


def _mean_ms(seconds: float, n: int) -> float | None:
    return 1e3 * seconds / n if n else None


def _mb(n: float) -> str:
    """Bytes in the unit that reads best (1e3 steps, as GB/s counts them)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


class StoreStats(dict):
    """`KVStore.stats()`: per tier (``host``, then each lower tier by name) its counters, ``pool``
    and ``store``; a plain dict for every existing reader, with the derived figures added."""

    @classmethod
    def of(cls, raw: dict) -> StoreStats:
        s = cls(raw)
        st = s.get("store", {})
        asked, hit = st.get("load_tokens_asked", 0), st.get("load_tokens", 0)
        if not asked:  # nothing was loaded: what the lookups found
            asked, hit = st.get("lookup_tokens_asked", 0), st.get("lookup_tokens", 0)
        if "store" in s:
            s["store"] = dict(st, tokens_asked=asked, tokens_hit=hit, hit_rate_pct=_pct(hit, asked))
        for name, t in s.items():
            if name in ("store", "pool") or not isinstance(t, dict) or "hits" not in t:
                continue
            s[name] = dict(
                t,
                hit_rate_pct=_pct(t["hits"], t["hits"] + t.get("misses", 0)),
                get_ms_mean=_mean_ms(t.get("get_seconds", 0.0), t["hits"]),
                put_ms_mean=_mean_ms(t.get("put_seconds", 0.0), t.get("puts", 0)),
            )
        return s

    @property
    def tiers(self) -> list[str]:
        return [k for k, v in self.items() if k not in ("store", "pool") and isinstance(v, dict)]

    def line(self) -> str:
        """One line: the hit rate, then per tier its hits, bytes and time per chunk."""
        st = self.get("store", {})
        rate = st.get("hit_rate_pct")
        head = (
            f"{rate:.1f}% of {st.get('tokens_asked', 0):,} tokens hit"
            if rate is not None
            else "no tokens asked"
        )
        return f"{st.get('loads', 0)} loads, {head}; {st.get('saves', 0)} saves; " + self.tier_line()

    def tier_line(self) -> str:
        """Per tier, in one line: its hits, bytes read and time per chunk, bytes written, errors."""
        parts = []
        for name in self.tiers:
            t = self[name]
            get = t.get("get_ms_mean")
            parts.append(
                f"{name}: {t.get('hits', 0)} hits {_mb(t.get('bytes_read', 0))} read"
                + (f" {get:.2f} ms/chunk" if get is not None else "")
                + f", {_mb(t.get('bytes_written', 0))} written"
                + (f", {errors} errors" if (errors := _errors(t)) else "")
            )
        return "; ".join(parts)

    def __str__(self) -> str:
        st, pool = self.get("store", {}), self.get("pool", {})
        rate = st.get("hit_rate_pct")
        lines = [
            f"kvtier store: {st.get('loads', 0)} loads, {st.get('saves', 0)} saves, "
            + (
                f"{st.get('tokens_hit', 0):,} of {st.get('tokens_asked', 0):,} tokens hit ({rate:.1f}%)"
                if rate is not None
                else "no tokens asked yet"
            ),
        ]
        head = (
            "tier",
            "hits",
            "misses",
            "hit rate",
            "read",
            "ms/chunk",
            "written",
            "ms/chunk",
            "errors",
            "held",
        )
        rows = [head]
        for name in self.tiers:
            t = self[name]
            held = _mb(t.get("used_bytes", 0)) + (
                f" of {_mb(t['capacity_bytes'])}" if t.get("capacity_bytes") else ""
            )
            rows.append(
                (
                    name,
                    f"{t.get('hits', 0):,}",
                    f"{t.get('misses', 0):,}",
                    "-" if t.get("hit_rate_pct") is None else f"{t['hit_rate_pct']:.1f}%",
                    _mb(t.get("bytes_read", 0)),
                    "-" if t.get("get_ms_mean") is None else f"{t['get_ms_mean']:.3f}",
                    _mb(t.get("bytes_written", 0)),
                    "-" if t.get("put_ms_mean") is None else f"{t['put_ms_mean']:.3f}",
                    str(_errors(t)),
                    held,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        for r in rows:
            cells = [
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            lines.append("  " + "  ".join(cells))
        if pool:
            lines.append(
                f"  pool: {_mb(pool.get('used', 0))} of {_mb(pool.get('capacity', 0))} used, "
                f"{_mb(pool.get('in_flight', 0))} in flight"
            )
        return "\n".join(lines)


def store_snapshot(store) -> tuple[int, str]:
    """(loads + saves so far, the stats line) of a `KVStore`: what `StatsLog` needs of one."""
    s = store.stats()
    return s["store"].get("loads", 0) + s["store"].get("saves", 0), "kvtier: " + s.line()


def _errors(t: dict) -> int:
    return sum(v for k, v in t.items() if k.startswith("errors_") and isinstance(v, int | float))


def log_interval_s() -> float:
    """``KVTIER_STATS_LOG_S`` (seconds between stats lines; 0 turns them off), default 10."""
    raw = os.environ.get("KVTIER_STATS_LOG_S", "10")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"KVTIER_STATS_LOG_S: expected seconds (0: off), got {raw!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"KVTIER_STATS_LOG_S: expected seconds >= 0 (0: off), got {raw!r}")
    return value


class StatsLog:
    """One INFO line on `logger` every `interval_s` when there was traffic since the last.

    `tick()` is what a request calls: a clock read and a compare (the stats are read only when a
    line is due). `snapshot()` returns (a count that grows with traffic, the line to log)."""

    def __init__(
        self,
        logger: logging.Logger,
        snapshot: Callable[[], tuple[int, str]],
        interval_s: float | None = None,
    ) -> None:
        self.logger, self.snapshot = logger, snapshot
        self.interval_s = log_interval_s() if interval_s is None else interval_s
        self._next = time.monotonic() + self.interval_s
        self._seen = 0

    def tick(self) -> None:
        if not self.interval_s or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.interval_s
        try:
            count, line = self.snapshot()
        except Exception as exc:  # a report; its failure must not reach the request that ticked
            self.logger.debug("kvtier stats: %s", exc)
            return
        if count != self._seen:
            self._seen = count
            self.logger.info("%s", line)
