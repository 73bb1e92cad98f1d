"""A slower tier on demand: `ThrottledTier` rate-limits the reads of any tier to a link of
``gbps``; `MemoryTier` holds chunks in this process's memory (the emulated remote's storage).

    remote = ThrottledTier(MemoryTier(name="remote"), gbps=2.0)   # a 2 GB/s remote store
    store = KVStore(engine, model, tiers=[remote])

The link is one pipe shared by every reader (the store's load thread and its read-ahead
workers): each read reserves ``payload_len / gbps`` seconds of it after the reads before it,
reads the inner tier meanwhile, and returns no earlier than the end of its reservation. So a
read is never faster than the link, and a slower inner tier is not hidden: the time is
max(inner read, link time). Writes pass through unthrottled (the `ttft` suite times loads only).
Plain Python; torch-free like every tier.
"""

from __future__ import annotations

import threading
import time

from .header import ChunkHeader
from .keys import check_key
from .tier import DestTooSmall, TierReads, check_put_args, contains_many, put_many


class MemoryTier(TierReads):
    """Chunks in a dict of this process (key -> (header, bytes)), up to ``capacity_bytes`` of
    payload; a put beyond it fails (False: the store recomputes). No eviction, no persistence."""

    def __init__(self, capacity_bytes: int = 1 << 40, *, name: str = "memory") -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: expected an int > 0, got {capacity_bytes!r}")
        self.name, self.capacity_bytes = name, capacity_bytes
        self._lock = threading.Lock()
        self._chunks: dict[bytes, tuple[ChunkHeader, bytes]] = {}
        self._used = 0
        self._counts = {"hits": 0, "misses": 0, "puts": 0, "put_failures": 0}

    def put(self, key: bytes, header: ChunkHeader, payload) -> bool:
        view = check_put_args(key, header, payload)
        with self._lock:
            if key in self._chunks:
                return True
            if self._used + view.nbytes > self.capacity_bytes:
                self._counts["put_failures"] += 1
                return False
            self._chunks[key] = (header, bytes(view))  # a copy: the caller's slot is reused after
            self._used += view.nbytes
            self._counts["puts"] += 1
            return True

    def _get(self, key: bytes, dest: memoryview | None):
        check_key(key)
        with self._lock:
            got = self._chunks.get(key)
            self._counts["hits" if got is not None else "misses"] += 1
        if got is None:
            return None
        header, data = got
        if dest is None:
            return header, memoryview(data)
        if dest.nbytes < len(data):
            raise DestTooSmall(f"dest holds {dest.nbytes} bytes, the chunk has {len(data)}")
        dest[: len(data)] = data
        return header, dest[: len(data)]

    def contains(self, key: bytes) -> bool:
        check_key(key)
        with self._lock:
            return key in self._chunks

    def delete(self, key: bytes) -> bool:
        check_key(key)
        with self._lock:
            got = self._chunks.pop(key, None)
            if got is not None:
                self._used -= len(got[1])
            return got is not None

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            return dict(self._counts, entries=len(self._chunks), used_bytes=self._used)

    def close(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._used = 0


class ThrottledTier:
    """``inner``'s chunks read through a link of ``gbps`` (1e9 bytes/s) with ``latency_us`` per
    read; name: the tier's name in the store (default: the inner tier's)."""

    def __init__(self, inner, gbps: float, *, latency_us: float = 0.0, name: str | None = None) -> None:
        if isinstance(gbps, bool) or not isinstance(gbps, int | float) or not gbps > 0:
            raise ValueError(f"gbps: expected a rate > 0 (GB/s), got {gbps!r}")
        if isinstance(latency_us, bool) or not isinstance(latency_us, int | float) or latency_us < 0:
            raise ValueError(f"latency_us: expected microseconds >= 0, got {latency_us!r}")
        for method in ("put", "get_into", "contains", "delete"):
            if not callable(getattr(inner, method, None)):
                raise ValueError(f"inner: expected a Tier, {type(inner).__name__} has no {method}()")
        self.inner, self.gbps, self.latency_us = inner, float(gbps), float(latency_us)
        self.name = name or inner.name
        self._lock = threading.Lock()
        self._free_at = 0.0  # time.monotonic() at which the link is next idle
        self._bytes = 0
        self._waited_s = 0.0

    def _pace(self, nbytes: int, t_start: float) -> None:
        """Hold the caller until its bytes could have crossed the link (submitted in order)."""
        with self._lock:
            begin = max(t_start, self._free_at)
            end = begin + self.latency_us / 1e6 + nbytes / (self.gbps * 1e9)
            self._free_at = end
            self._bytes += nbytes
        left = end - time.monotonic()
        if left > 0:
            with self._lock:
                self._waited_s += left
            time.sleep(left)

    def get(self, key: bytes):
        t0 = time.monotonic()
        got = self.inner.get(key)
        if got is not None:
            self._pace(got.header.payload_len, t0)
        return got

    def get_into(self, key: bytes, dest) -> ChunkHeader | None:
        t0 = time.monotonic()
        header = self.inner.get_into(key, dest)  # DestTooSmall propagates: a caller bug
        if header is not None:
            self._pace(header.payload_len, t0)
        return header

    def put(self, key: bytes, header: ChunkHeader, payload) -> bool:
        return self.inner.put(key, header, payload)

    def put_many(self, items) -> list[bool]:
        return put_many(self.inner, items)

    def contains(self, key: bytes) -> bool:
        return self.inner.contains(key)

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        return contains_many(self.inner, keys)

    def delete(self, key: bytes) -> bool:
        return self.inner.delete(key)

    def stats(self) -> dict[str, int | float]:
        out = dict(self.inner.stats()) if hasattr(self.inner, "stats") else {}
        with self._lock:
            out.update(throttle_gbps=self.gbps, throttled_bytes=self._bytes, throttle_wait_s=self._waited_s)
        return out

    def close(self) -> None:
        if hasattr(self.inner, "close"):
            self.inner.close()


__all__ = ["DestTooSmall", "MemoryTier", "ThrottledTier"]
