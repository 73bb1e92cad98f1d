"""The write half of `DiskTier`: claim, write, publish and settle chunks, a batch at a time.

A put claims its key in the index (pinned and pending: invisible, and no eviction picks it),
writes a temp file and fsyncs it, renames it to the key's name; once every rename of the batch
is done, each directory they went into is fsynced once — only then are the chunks visible and
reported durable. A failure anywhere drops that chunk (its file removed), never the batch's
others: a chunk is stored whole or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from pathlib import Path

from .chunkfile import is_einval, publish, sync_dir, write_temp
from .header import ChunkHeader
from .tier import check_put_args

log = logging.getLogger(__name__)
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskWrites:
    """Mixed into `DiskTier`, whose index, lock, health and metrics it uses."""

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
            (header, view), path = batch[key], self._path(key)
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
            os.utime(self._path(key), ns=(stamp, stamp))
