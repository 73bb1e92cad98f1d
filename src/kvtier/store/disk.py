"""DiskTier: one file per chunk on a local filesystem, written atomically, verified on read.

The file format and its IO are in ``chunkfile``; this module is the bookkeeping: the index
(an eviction policy), pins that keep a file alive while it is read or written, capacity,
failure counting, and the batched write protocol. A put claims its key in the index (pinned
and pending: invisible, and no eviction picks it), writes a temp file and fsyncs it, renames
it to the key's name; once every rename of the batch is done, each directory they went into
is fsynced once — only then are the chunks visible and reported durable. A failure anywhere
drops that chunk (its file removed), never the batch's others: a chunk is stored whole or not
at all. The index is rebuilt on start by scanning headers (payload checksums are
verified on each read, not at scan time). One DiskTier per directory: the index lives in
this process.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from pathlib import Path

from .chunkfile import (
    SUFFIX,
    CorruptChunk,
    file_size,
    is_einval,
    o_direct_alignment,
    o_direct_supported,
    publish,
    read_chunk_file,
    scan_chunk_files,
    sync_dir,
    write_temp,
)
from .header import ChunkHeader
from .health import CircuitBreaker
from .keys import check_key
from .metrics import StoreMetrics
from .policy import EvictionPolicy, make_policy
from .tier import DestTooSmall, TierReads, check_put_args

log = logging.getLogger(__name__)
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskTier(TierReads):
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
        # O_DIRECT's memory alignment: payloads at such addresses are written and read in place
        self._align = o_direct_alignment(self.root) if self._o_direct else 0
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

    def put(self, key: bytes, header: ChunkHeader, payload) -> bool:
        return self.put_many([(key, header, payload)])[0]

    def put_many(self, items) -> list[bool]:
        """``put`` of each ``(key, header, payload)``, one directory fsync per directory for all:
        each chunk goes to a temp file, fsynced, renamed; then each directory is synced once, and
        only then is any of them visible and reported durable (True). One result per item."""
        items = list(items)
        batch = {}  # key -> (header, view): a key twice in one batch is written once
        for key, header, payload in items:
            batch.setdefault(key, (header, check_put_args(key, header, payload)))
        t0 = time.perf_counter()
        done = {key: self._claim(key, header.payload_len) for key, (header, _) in batch.items()}
        kinds = {key: None for key, got in done.items() if got is None}  # claimed: None while all goes well
        renamed: dict[Path, list[bytes]] = {}
        for key in kinds:
            (header, view), path = batch[key], self.chunk_path(key)
            try:
                self._write(path, header.pack(), view)
                renamed.setdefault(path.parent, []).append(key)
            except Exception as exc:  # never into the serving loop (a background writer included)
                kinds[key] = self._failed("put", key, exc)
        for directory, keys in renamed.items() if self._fsync else ():
            try:
                sync_dir(directory)  # shared by the batch: no rename into it is durable before this
            except Exception as exc:  # the renames may not survive a crash: not durable, dropped
                for key in keys:
                    kinds[key] = self._failed("sync of the directory of", key, exc)
        dt = (time.perf_counter() - t0) / max(1, len(kinds))
        for key, kind in kinds.items():
            self._settle(key, kind, batch[key][0].payload_len, dt)
            done[key] = kind is None
        return [done[key] for key, _, _ in items]

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

    def chunk_path(self, key: bytes) -> Path:
        """The file that holds (or would hold) ``key``'s chunk."""
        check_key(key)
        h = key.hex()
        return self.root / h[:2] / (h + SUFFIX)

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
            header, payload = read_chunk_file(self.chunk_path(key), key, dest, self._o_direct, self._align)
        except (CorruptChunk, FileNotFoundError) as exc:  # a vanished file is as bad as a torn one
            kind = "corrupt"
            # The message, not the exception: a kept log record would hold its traceback's
            # frames, and their views of dest, and the caller could not unmap its buffer.
            log.warning("disk tier %s: chunk %s is corrupt (%s); dropped", self.name, key.hex(), str(exc))
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
            try:
                raise caller_bug
            finally:  # breaks the cycle exception -> traceback -> this frame that pins dest's memory
                caller_bug = None
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
            self.chunk_path(key).unlink(missing_ok=True)
        except OSError as exc:  # an orphan file costs space until the next scan, not correctness
            log.warning("disk tier %s: cannot remove %s: %s", self.name, key.hex(), exc)

    def _publish(self) -> None:
        p = self._policy
        self._m.occupancy(p.used_bytes, p.capacity_bytes, len(p) - len(self._pending), p.pinned_bytes)

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

    def _claim(self, key: bytes, payload_len: int) -> bool | None:
        """Admit ``key`` for a write: None if claimed (pinned and pending until settled), else
        the put's answer now (True: already held; False: refused, counted)."""
        with self._lock:
            if key in self._policy and self._doomed.get(key, "deleted") == "deleted":
                # Same key, same KV: a chunk deleted while a reader holds it is simply kept.
                self._doomed.pop(key, None)
                self._m.present()
                return True
            if key in self._policy:  # corrupt or a failed write, dropped once its readers are done
                self._m.put_failed("corrupt" if self._doomed[key] == "corrupt" else "error")
                return False
            if not self._write_health.allow():
                self._m.put_failed("skipped")
                return False
            victims = self._policy.admit(key, self._file_size(payload_len))
            if victims is None:  # bigger than the tier, or the rest is pinned by transfers
                self._write_health.record_success()
                self._m.put_failed("full")
                return False
            # Pinned while written: a concurrent put's eviction must not pick a file not yet there.
            self._policy.pin(key)
            self._pending.add(key)
            # Unlinked under the lock so a re-put of a victim key cannot race this unlink.
            for victim in victims:
                self._unlink(victim)
            self._m.evicted(len(victims))
            return None

    def _settle(self, key: bytes, kind: str | None, payload_len: int, dt: float) -> None:
        """End a claimed write: published (kind None) or dropped."""
        with self._lock:
            self._pending.discard(key)
            if kind is not None:
                self._doomed[key] = "failed"  # dropped from the index by the unpin below
            self._release(key)  # only now: until the directory sync, an eviction could pick a file not there
            self._publish()
        if kind is None:
            self._stamp(key)
            self._write_health.record_success()
            self._m.stored(payload_len, dt)
        else:
            self._write_health.record_failure()
            self._m.put_failed(kind)

    def _failed(self, what: str, key: bytes, exc: Exception) -> str:
        log.warning(
            "disk tier %s: %s %s: %s", self.name, what, key.hex(), exc, exc_info=not isinstance(exc, OSError)
        )
        return "full" if getattr(exc, "errno", None) in _FULL_ERRNOS else "error"

    def _write(self, path: Path, head: bytes, view: memoryview) -> None:
        """Temp file, fsync (unless off), rename; the caller syncs the directory."""
        if self._o_direct:
            try:
                return publish(write_temp(path, head, view, True, self._fsync, self._align), path)
            except OSError as exc:
                if not is_einval(exc):
                    raise
                log.warning("disk tier %s: O_DIRECT write refused (%s); using buffered IO", self.name, exc)
                self._o_direct = False
        publish(write_temp(path, head, view, False, self._fsync), path)

    def _stamp(self, key: bytes) -> None:
        """Set the file's mtime to a strictly increasing clock: the scan at the next start
        orders the index by it, so recency survives a restart (file systems with coarse
        timestamps would otherwise tie many files)."""
        with self._lock:
            self._last_stamp = max(self._last_stamp + 1, time.time_ns())
            stamp = self._last_stamp
        with contextlib.suppress(OSError):  # evicted or deleted meanwhile: its order no longer matters
            os.utime(self.chunk_path(key), ns=(stamp, stamp))
