"""Per-tier counters, kept as plain numbers for ``stats()`` and exported to Prometheus.

Everything goes to a private ``CollectorRegistry`` (never prometheus_client's global one):
several stores or tests in one process would otherwise collide on metric names.
"""

from __future__ import annotations

import threading
from collections import Counter as _Tally
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Why a chunk became a miss or a put failed; the label values of ``kvtier_tier_errors_total``.
# "foreign": a disk tier found a file that is not kvtier's where a chunk would go (left alone).
# "forged": a tier with a key ring read a chunk no key of it opens (a bad tag, another key's
# seal, or a plain chunk); "unverifiable": a tier without keys read a sealed chunk (`auth`).
ERROR_KINDS = ("error", "timeout", "full", "corrupt", "skipped", "foreign", "forged", "unverifiable")

_LATENCY_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)


class StoreMetrics:
    """The metric families of all tiers of one store, on one private registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.lookups = Counter("kvtier_tier_lookups", "Chunk gets by result", ["tier", "result"], registry=r)
        self.puts = Counter("kvtier_tier_puts", "Chunk puts by result", ["tier", "result"], registry=r)
        self.errors = Counter(
            "kvtier_tier_errors", "Failures turned into misses", ["tier", "kind"], registry=r
        )
        self.bytes = Counter("kvtier_tier_bytes", "Payload bytes moved", ["tier", "direction"], registry=r)
        self.evictions = Counter("kvtier_tier_evictions", "Chunks evicted for capacity", ["tier"], registry=r)
        self.latency = Histogram(
            "kvtier_tier_latency_seconds",
            "Tier op latency",
            ["tier", "op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.used = Gauge("kvtier_tier_used_bytes", "Bytes held by the tier", ["tier"], registry=r)
        self.capacity = Gauge(
            "kvtier_tier_capacity_bytes", "Tier capacity (0 = unknown)", ["tier"], registry=r
        )
        self.entries = Gauge("kvtier_tier_entries", "Chunks held by the tier", ["tier"], registry=r)
        self.pinned = Gauge(
            "kvtier_tier_pinned_bytes", "Bytes pinned by running transfers", ["tier"], registry=r
        )
        self.events = Counter(
            "kvtier_store_events", "KVStore calls, chunks and tokens by event", ["event"], registry=r
        )
        self.pool_bytes = Gauge("kvtier_pool_bytes", "Pinned pool bytes by state", ["state"], registry=r)
        self.calls = Histogram(
            "kvtier_store_call_seconds",
            "KVStore call time in the caller's thread (lower-tier reads included; GPU copies not)",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._names: set[str] = set()
        self._lock = threading.Lock()

    def tier(self, name: str) -> TierMetrics:
        """The recorder of one tier; each name once, since two tiers may not share labels."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        with self._lock:
            if name in self._names:
                raise ValueError(f"name {name!r} is already used by another tier of these metrics")
            self._names.add(name)
        return TierMetrics(name=name, families=self)

    def text(self) -> bytes:
        """The Prometheus exposition text of this registry."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Serve ``/metrics`` over HTTP from a daemon thread (prometheus_client's server)."""
        from prometheus_client import start_http_server

        start_http_server(port, addr=addr, registry=self.registry)


OCCUPANCY = ("used", "capacity", "entries", "pinned")  # the gauge families, in `occupancy`'s order


@dataclass(slots=True)
class TierMetrics:
    """Records one tier's events into plain counters (``snapshot``) and the Prometheus families."""

    name: str
    families: StoreMetrics
    _counts: _Tally = field(default_factory=_Tally, init=False)
    _gauges: dict = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _children: dict = field(default_factory=dict, init=False, repr=False)
    _read: object = field(default=None, init=False, repr=False)  # live occupancy: () -> 4 numbers

    def _c(self, family: str, *labels: str):
        """The labelled child of a family, looked up once (``labels()`` validates on every call:
        a 32K-token hit made ~1,200 such calls)."""
        key = (family, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = getattr(self.families, family).labels(*labels)
        return child

    def _add(self, key: str, n: int | float = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def hit(self, nbytes: int, seconds: float, n: int = 1) -> None:
        """``n`` hits of ``nbytes`` in all, each taking ``seconds`` (a load's host hits are
        counted together: one call per request, not per chunk)."""
        with self._lock:
            c = self._counts
            c["hits"] += n
            c["bytes_read"] += nbytes
            c["get_seconds"] += seconds * n
        self._c("lookups", self.name, "hit").inc(n)
        self._c("bytes", self.name, "read").inc(nbytes)
        latency = self._c("latency", self.name, "get")
        for _ in range(n):
            latency.observe(seconds)

    def miss(self, kind: str | None = None, seconds: float = 0.0) -> None:
        """A miss; ``kind`` names the failure behind it (None: the chunk simply is not there)."""
        self._add("misses")
        self._c("lookups", self.name, "miss").inc()
        if kind is not None:
            self.error(kind)
        if seconds:
            self._c("latency", self.name, "get").observe(seconds)

    def stored(self, nbytes: int, seconds: float) -> None:
        self._add("puts")
        self._add("bytes_written", nbytes)
        self._add("put_seconds", seconds)
        self._c("puts", self.name, "stored").inc()
        self._c("bytes", self.name, "written").inc(nbytes)
        self._c("latency", self.name, "put").observe(seconds)

    def present(self) -> None:
        """A put of a key the tier already holds (same key ⇒ same KV, so nothing is written)."""
        self._add("puts_present")
        self._c("puts", self.name, "present").inc()

    def put_failed(self, kind: str) -> None:
        self._add("put_failures")
        self._c("puts", self.name, "failed").inc()
        self.error(kind)

    def error(self, kind: str) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"kind must be one of {ERROR_KINDS}, got {kind!r}")
        self._add(f"errors_{kind}")
        self._c("errors", self.name, kind).inc()

    def evicted(self, count: int) -> None:
        if count:
            self._add("evictions", count)
            self._c("evictions", self.name).inc(count)

    def occupancy(self, used: int, capacity: int, entries: int, pinned: int) -> None:
        with self._lock:
            self._gauges = {
                "used_bytes": used,
                "capacity_bytes": capacity,
                "entries": entries,
                "pinned_bytes": pinned,
            }
        self._c("used", self.name).set(used)
        self._c("capacity", self.name).set(capacity)
        self._c("entries", self.name).set(entries)
        self._c("pinned", self.name).set(pinned)

    def live_occupancy(self, read) -> None:
        """The occupancy gauges read ``read()`` -> (used, capacity, entries, pinned) when scraped
        or snapshotted, instead of being set on every change (a tier on the hot path changed them
        several times per chunk)."""
        self._read = read
        for i, gauge in enumerate(OCCUPANCY):
            self._c(gauge, self.name).set_function(lambda i=i: read()[i])

    def snapshot(self) -> dict[str, int | float]:
        """All counters (zeros included, so callers can rely on the keys) and the last gauges."""
        base: dict[str, int | float] = dict.fromkeys(
            (
                "hits",
                "misses",
                "puts",
                "puts_present",
                "put_failures",
                "bytes_read",
                "bytes_written",
                "evictions",
            ),
            0,
        )
        base.update({f"errors_{k}": 0 for k in ERROR_KINDS})
        base.update(get_seconds=0.0, put_seconds=0.0)
        with self._lock:
            base.update(self._counts)
            base.update(self._gauges)
        if self._read is not None:
            names = ("used_bytes", "capacity_bytes", "entries", "pinned_bytes")
            base.update(zip(names, self._read(), strict=True))
        return base
