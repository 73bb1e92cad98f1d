"""DiskTier: one file per chunk on a local filesystem, written atomically, verified on read.

The file format and its IO are in ``chunkfile``, the batched write protocol (``put_many``:
one directory fsync per batch) in ``disk_write``; this module is the bookkeeping: the index
(an eviction policy), pins that keep a file alive while it is read or written, capacity,
failure counting. The index is rebuilt on start by scanning headers (payload checksums are
verified on each read, not at scan time). One DiskTier per directory: the index lives in
this process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from .chunkfile import (
    SUFFIX,
    CorruptChunk,
    file_size,
    o_direct_alignment,
    o_direct_supported,
    read_chunk_file,
    scan_chunk_files,
)
from .disk_write import DiskWrites
from .header import ChunkHeader
from .health import CircuitBreaker
from .keys import check_key
from .metrics import StoreMetrics
from .policy import EvictionPolicy, make_policy
from .tier import DestTooSmall, TierReads

log = logging.getLogger(__name__)


class DiskTier(DiskWrites, TierReads):
    """root: directory (created). capacity_bytes: on-disk bytes (headers and padding included).
    policy: "lru", "arc" or an EvictionPolicy. o_direct: bypass the page cache (falls back to
    buffered IO, logged once, where the filesystem refuses it). fsync: make each put durable
    before it returns True (off only for tests or scratch disks).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        capacity_bytes: int,
        policy: str | EvictionPolicy = "lru",
        *,
        o_direct: bool = False,
        fsync: bool = True,
        name: str = "disk",
        metrics: StoreMetrics | None = None,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._policy = make_policy(policy, capacity_bytes)
        self._o_direct = bool(o_direct) and o_direct_supported(self.root)
        self._align = o_direct_alignment(self.root) if self._o_direct else 0  # in-place O_DIRECT writes
        if o_direct and not self._o_direct:
            log.warning("disk tier %s: %s refuses O_DIRECT; using buffered IO", name, self.root)
        self._fsync = fsync
        self._m = (metrics if metrics is not None else StoreMetrics()).tier(name)
        self._read_health = CircuitBreaker(failure_threshold, cooldown_s)
        self._write_health = CircuitBreaker(failure_threshold, cooldown_s)
        self._lock = threading.Lock()
        self._last_stamp = 0
        self._pending: set[bytes] = set()  # keys whose file is still being written
        # Keys to drop at their last unpin (deleted, found corrupt, or failed to write while
        # pinned), with the reason: a deleted chunk may be revived by a put, a corrupt one not.
        self._doomed: dict[bytes, str] = {}
        self.scan_removed = self._scan()

    # -- public API ---------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        check_key(key)
        with self._lock:
            return key in self._policy and key not in self._pending and key not in self._doomed

    def delete(self, key: bytes) -> bool:
        check_key(key)
        with self._lock:
            if key not in self._policy or key in self._doomed:
                return False
            self._doomed[key] = "deleted"
            if not self._policy.is_pinned(key):  # else the last reader's unpin removes it
                self._policy.pin(key)
                self._release(key)
            self._publish()
            return True

    def pin(self, key: bytes) -> bool:
        """Hold a resident chunk against eviction and deletion until ``unpin`` — e.g. from a
        lookup that found it until its load has completed. False if it is not resident."""
        check_key(key)
        with self._lock:
            if key not in self._policy or key in self._pending or key in self._doomed:
                return False
            self._policy.pin(key)
            self._publish()
            return True

    def unpin(self, key: bytes) -> None:
        check_key(key)
        with self._lock:
            self._release(key)  # raises ValueError if the key is not pinned
            self._publish()

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            self._publish()
        out = self._m.snapshot()
        out.update(o_direct=int(self._o_direct), read_skipping=int(self._read_health.is_open))
        out.update(write_skipping=int(self._write_health.is_open))
        return out

    def resident_keys(self) -> list[bytes]:
        """Resident keys in the policy's order (for LRU: next eviction victim first)."""
        with self._lock:
            return [k for k in self._policy.order() if k not in self._pending and k not in self._doomed]

    def close(self) -> None:
        pass  # no open handles between calls

    # -- internals ----------------------------------------------------------------------

    def _get(self, key: bytes, dest: memoryview | None) -> tuple[ChunkHeader, memoryview] | None:
        check_key(key)
        t0 = time.perf_counter()
        with self._lock:
            if key not in self._policy or key in self._pending or key in self._doomed:
                self._m.miss()
                return None
            if not self._read_health.allow():
                self._m.miss("skipped")
                return None
            self._policy.touch(key)
            # Pinned for the read: a concurrent put's eviction would otherwise unlink it mid-read.
            self._policy.pin(key)
        kind, caller_bug = None, None
        try:
            header, payload = read_chunk_file(self._path(key), key, dest, self._o_direct)
        except (CorruptChunk, FileNotFoundError) as exc:  # a vanished file is as bad as a torn one
            kind = "corrupt"
            log.warning("disk tier %s: chunk %s is corrupt (%s); dropped", self.name, key.hex(), exc)
        except DestTooSmall as exc:
            kind, caller_bug = "dest", exc
        except Exception as exc:  # never into the serving loop: any failure is a miss
            kind = "error"
            log.warning(
                "disk tier %s: get %s: %s", self.name, key.hex(), exc, exc_info=not isinstance(exc, OSError)
            )
        with self._lock:
            if kind == "corrupt":
                self._doomed[key] = "corrupt"
            self._release(key)  # after the bytes were copied and verified, never before
            self._publish()
        if caller_bug is not None:
            self._read_health.record_success()
            raise caller_bug
        if kind == "error":
            self._read_health.record_failure()
            self._m.miss(kind, time.perf_counter() - t0)
            return None
        self._read_health.record_success()  # the disk answered, even if with bad bytes
        if kind is not None:
            self._m.miss(kind, time.perf_counter() - t0)
            return None
        self._stamp(key)
        self._m.hit(header.payload_len, time.perf_counter() - t0)
        return header, payload

    def _release(self, key: bytes) -> None:
        """Unpin (lock held); a key deleted or found corrupt while pinned goes at the last unpin."""
        self._policy.unpin(key)
        if key in self._doomed and not self._policy.is_pinned(key):
            del self._doomed[key]
            self._policy.remove(key)
            self._unlink(key)

    def _unlink(self, key: bytes) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:  # an orphan file costs space until the next scan, not correctness
            log.warning("disk tier %s: cannot remove %s: %s", self.name, key.hex(), exc)

    def _publish(self) -> None:
        p = self._policy
        self._m.occupancy(p.used_bytes, p.capacity_bytes, len(p) - len(self._pending), p.pinned_bytes)

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + SUFFIX)

    def _file_size(self, payload_len: int) -> int:
        return file_size(payload_len, padded=self._o_direct)

    def _scan(self) -> int:
        """Rebuild the index from the files (oldest first, so LRU order survives); returns
        how many temp, foreign or corrupt files were removed."""
        found, removed = scan_chunk_files(self.root)
        for path, reason in removed:
            log.warning("disk tier %s: removed %s at start: %s", self.name, path, reason)
        self._last_stamp = found[-1][0] if found else 0
        for _, key, size in found:
            victims = self._policy.admit(key, size)  # capacity may have shrunk since last run
            for victim in [key] if victims is None else victims:
                self._unlink(victim)
        self._publish()
        return len(removed)
