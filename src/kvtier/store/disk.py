"""DiskTier: one file per chunk in a folder kvtier owns, written atomically, verified on read.

What kvtier owns, and may delete, is in ``disk_folder``; the file format and its IO are in
``chunkfile``; this module is the bookkeeping: the index (an eviction policy), pins that keep a
file alive while it is read or written, capacity, failure counting, and the batched write.

A writer (the default) owns its folder alone: a second writer of it is refused, and only the
writer puts, evicts and deletes there. Its index is rebuilt at start by scanning headers
(payload checksums are verified on each read). A put claims its key in the index (pinned and
pending: invisible, and no eviction picks it), writes a temp file and fsyncs it, and links it to
the key's name, never over a file already there; once every link of the batch is done, each
directory they went into is fsynced once — only then are the chunks visible and reported
durable. A failure anywhere drops that chunk, never the batch's others: a chunk is stored whole
or not at all. A folder removed under a running writer is made again (empty, marked) by the
next put, where that is safe.

A reader (``writer=False``) reads a folder another process writes (MLA's latent, written by
TP rank 0 only). It writes, evicts and deletes nothing, and sees the writer's files as they
appear: on an index miss it looks at the file (a stat and a header check).

Either way ``contains`` / ``contains_many`` ask the filesystem (one ``lstat`` per key): a chunk
whose file is gone (deleted by an operator, evicted by another process) is not reported held.

With a key ring (``auth``, `auth.KeyRing`) every chunk is sealed as it is written and opened as
it is read: a file its ring cannot open (planted, sealed under another key, or plain) is a miss
counted ``forged``, and the writer drops it like a torn one, so the next put stores it sealed.
Without one, a sealed file is a miss counted ``unverifiable``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from pathlib import Path

from .auth import KeyRing, Rejected
from .chunkfile import (
    SUFFIX,
    CorruptChunk,
    file_size,
    is_einval,
    o_direct_alignment,
    o_direct_supported,
    publish,
    read_chunk_file,
    sync_dir,
    write_temp,
)
from .disk_folder import (
    ForeignFile,
    OwnedFolder,
    is_file,
    make_shard,
    owned_chunk,
    real_dir,
    remove_owned,
    scan,
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
    """root: the folder (created and marked; a non-empty folder kvtier did not mark is refused,
    ValueError naming ``label``). capacity_bytes: on-disk bytes of this tier's chunks (headers
    and padding included). policy: "lru", "arc" or an EvictionPolicy. space: the subfolder of
    root that holds this tier's chunks, one per writer where several share a root (e.g. ranks);
    None: root itself. writer: False for a reader of a folder another tier writes. label: how
    errors name root (an integration passes the setting as the operator typed it). o_direct:
    bypass the page cache (falls back to buffered IO, logged once, where the filesystem refuses
    it). fsync: make each put durable before it returns True (off only for tests or scratch disks).
    auth: the `KeyRing` that seals what is written and opens what is read (None: plain chunks; a
    `KVStore` with ``auth_keys`` gives its ring to a tier built without one).

    >>> tier = DiskTier("/nvme/kv", 200 << 30, space="tp0")   # chunks in /nvme/kv/tp0/
    >>> peer = DiskTier("/nvme/kv", 200 << 30, space="tp0", writer=False)  # reads what tier writes
    """

    def __init__(
        self,
        root: str | os.PathLike,
        capacity_bytes: int,
        policy: str | EvictionPolicy = "lru",
        *,
        space: str | None = None,
        writer: bool = True,
        label: str = "root",
        o_direct: bool = False,
        fsync: bool = True,
        name: str = "disk",
        metrics: StoreMetrics | None = None,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        auth: KeyRing | None = None,
    ) -> None:
        if auth is not None and not isinstance(auth, KeyRing):
            raise ValueError(f"auth must be a KeyRing or None, got {type(auth).__name__}")
        self.auth = auth
        self._policy = make_policy(policy, capacity_bytes)
        self._folder = OwnedFolder(root, space, label, bool(writer), name)
        self.name, self.writer = name, bool(writer)
        self.root, self.folder = self._folder.root, self._folder.path
        self._dir = str(self.folder)
        try:
            self._start(o_direct, fsync, metrics, failure_threshold, cooldown_s)
        except BaseException:
            self.close()  # a refused construction leaves the folder free for the next writer
            raise

    def _start(self, o_direct, fsync, metrics, failure_threshold, cooldown_s) -> None:
        """The rest of construction, once the folder is claimed (a failure gives it back)."""
        name = self.name
        probe = self.folder if self.writer else self.root  # a reader creates nothing in its folder
        self._o_direct = bool(o_direct) and o_direct_supported(probe)
        # O_DIRECT's memory alignment: payloads at such addresses are written and read in place
        self._align = o_direct_alignment(probe) if self._o_direct else 0
        if o_direct and not self._o_direct:
            log.warning("disk tier %s: %s refuses O_DIRECT; using buffered IO", name, self.root)
        self._fsync = fsync
        self._m = (metrics if metrics is not None else StoreMetrics()).tier(name)
        self._read_health = CircuitBreaker(failure_threshold, cooldown_s)
        self._write_health = CircuitBreaker(failure_threshold, cooldown_s)
        self._lock = threading.Lock()
        self._last_stamp = 0
        self._pending: set[bytes] = set()  # keys whose file is still being written
        # Keys to drop at their last unpin (deleted, found corrupt or gone, or failed to write
        # while pinned), with the reason: a deleted chunk may be revived by a put, the others not.
        self._doomed: dict[bytes, str] = {}
        self.scan_removed = self._scan()

    # -- public API ---------------------------------------------------------------------

    def put(self, key: bytes, header: ChunkHeader, payload) -> bool:
        return self.put_many([(key, header, payload)])[0]

    def put_many(self, items) -> list[bool]:
        """``put`` of each ``(key, header, payload)``, one directory fsync per directory for all:
        each chunk goes to a temp file, fsynced, linked to its name; then each directory is synced
        once, and only then is any of them visible and reported durable (True). One result per
        item. A reader stores nothing (False)."""
        items = list(items)
        batch = {}  # key -> (header, view): a key twice in one batch is written once
        for key, header, payload in items:
            batch.setdefault(key, (header, check_put_args(key, header, payload, self.auth is not None)))
        if not self.writer or not self._folder.ready(self._forget_all):
            for _ in batch:
                self._m.put_failed("skipped" if not self.writer else "error")
            return [False] * len(items)
        t0 = time.perf_counter()
        done = {key: self._claim(key, header.payload_len) for key, (header, _) in batch.items()}
        kinds = {key: None for key, got in done.items() if got is None}  # claimed: None while all goes well
        linked: dict[Path, list[bytes]] = {}
        ring = self.auth
        for key in kinds:
            (header, view), path = batch[key], self.chunk_path(key)
            try:
                if ring is not None:  # sealed one at a time: an encrypted payload's copy lives for its write
                    header, view = ring.seal(header, view)
                self._write(key, path, header.pack(), view)
                linked.setdefault(path.parent, []).append(key)
            except Exception as exc:  # never into the serving loop (a background writer included)
                kinds[key] = self._failed("put", key, exc)
        for directory, keys in linked.items() if self._fsync else ():
            try:
                sync_dir(directory)  # shared by the batch: no link into it is durable before this
            except Exception as exc:  # the links may not survive a crash: not durable, dropped
                for key in keys:
                    kinds[key] = self._failed("sync of the directory of", key, exc)
        dt = (time.perf_counter() - t0) / max(1, len(kinds))
        for key, kind in kinds.items():
            self._settle(key, kind, batch[key][0].payload_len, dt)
            done[key] = kind is None
        return [done[key] for key, _, _ in items]

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Whether each key's chunk is held, asked of the filesystem: an indexed key whose file
        is gone is dropped and not reported; a reader also finds files written since its scan
        (their header checked once). One ``lstat`` per key, none under the index's lock."""
        keys = list(keys)
        for key in keys:
            check_key(key)
        with self._lock:
            known = [self._held(key) for key in keys]
        out, gone, found = [], [], []
        dirs: dict[str, bool] = {}  # shard -> a real folder: a reader checks each once per call
        for key, held in zip(keys, known, strict=True):
            if not held and self.writer:  # the writer's index knows its folder: no file to look at
                out.append(False)
                continue
            path = self._path(key)
            ok = is_file(path)
            if ok and not held:  # a reader's first sight of a file the writer made
                ok = self._real_shard(key, dirs) and owned_chunk(path, key)
                if ok:
                    found.append((key, path))
            elif held and not ok:
                gone.append(key)
            out.append(ok)
        if gone or found:
            self._reconcile(gone, found)
        return out

    def delete(self, key: bytes) -> bool:
        check_key(key)
        with self._lock:
            if not self.writer or key not in self._policy or key in self._doomed:
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
            if not self._held(key):
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
        """Counters and occupancy; ``foreign_files``: entries in the folder that are not
        kvtier's (left alone); ``writer``: 1 for the folder's writer, 0 for a reader."""
        with self._lock:
            self._publish()
            foreign = len(self._folder.foreign)
        out = self._m.snapshot()
        out.update(o_direct=int(self._o_direct), read_skipping=int(self._read_health.is_open))
        out.update(write_skipping=int(self._write_health.is_open), foreign_files=foreign)
        out.update(writer=int(self.writer), authenticated=int(self.auth is not None))
        out.update(encrypted=int(self.auth is not None and self.auth.encrypt))
        return out

    def resident_keys(self) -> list[bytes]:
        """Indexed keys in the policy's order (for LRU: next eviction victim first)."""
        with self._lock:
            return [k for k in self._policy.order() if k not in self._pending and k not in self._doomed]

    def chunk_path(self, key: bytes) -> Path:
        """The file that holds (or would hold) ``key``'s chunk."""
        check_key(key)
        return Path(self._path(key))

    def close(self) -> None:
        """Give up the folder (no open handles between calls): another writer may take it."""
        self._folder.close()

    # -- internals ----------------------------------------------------------------------

    def _path(self, key: bytes) -> str:
        h = key.hex()
        return f"{self._dir}/{h[:2]}/{h}{SUFFIX}"

    def _held(self, key: bytes) -> bool:
        """Indexed, written and not dropped (lock held)."""
        return key in self._policy and key not in self._pending and key not in self._doomed

    def _get(self, key: bytes, dest: memoryview | None) -> tuple[ChunkHeader, memoryview] | None:
        check_key(key)
        t0 = time.perf_counter()
        with self._lock:
            known = self._held(key)
            if not known and self.writer:  # the writer's index is the truth about its folder
                self._m.miss()
                return None
            if not self._read_health.allow():
                self._m.miss("skipped")
                return None
            if known:
                self._policy.touch(key)
                # Pinned for the read: a concurrent put's eviction would otherwise unlink it mid-read.
                self._policy.pin(key)
        kind, caller_bug, path = None, None, self._path(key)
        try:
            if not known and not self._real_shard(key, {}):
                raise FileNotFoundError(path)
            header, payload = read_chunk_file(path, key, dest, self._o_direct, self._align, self.auth)
        except FileNotFoundError:  # the writer's: as bad as a torn file; a reader's: evicted
            kind = "corrupt" if self.writer else "gone"
        except (CorruptChunk, Rejected) as exc:
            kind = getattr(exc, "kind", "corrupt")
            # The message, not the exception: a kept log record would hold its traceback's
            # frames, and their views of dest, and the caller could not unmap its buffer.
            log.warning("disk tier %s: chunk %s is %s (%s); dropped", self.name, key.hex(), kind, str(exc))
        except DestTooSmall as exc:
            kind, caller_bug = "dest", exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink under the chunk's name: not kvtier's
                kind = "corrupt"
                self._folder.note_foreign(path, "a symlink under a chunk's name")
            else:
                kind = "error"
                log.warning("disk tier %s: get %s: %s", self.name, key.hex(), exc)
        except Exception as exc:  # never into the serving loop: any failure is a miss
            kind = "error"
            log.warning("disk tier %s: get %s: %s", self.name, key.hex(), exc, exc_info=True)
        with self._lock:
            if known:
                if kind in ("corrupt", "gone", "forged", "unverifiable"):
                    # A file its ring cannot open is as useless to this tier as a torn one.
                    self._doomed[key] = "gone" if kind == "gone" else "corrupt"
                self._release(key)  # after the bytes were copied and verified, never before
            elif kind is None:
                self._index(key, file_size(header.payload_len, False))
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
            self._m.miss(None if kind == "gone" else kind, time.perf_counter() - t0)
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
            self._drop_file(key)

    def _drop_file(self, key: bytes) -> None:
        """Remove a chunk file the index dropped, only if it is provably kvtier's chunk of
        ``key``; a reader removes nothing."""
        if not self.writer:
            return
        path = self._path(key)
        try:
            if not remove_owned(path, key) and os.path.lexists(path):
                self._folder.note_foreign(path, "a chunk's name, not kvtier's bytes")
        except OSError as exc:  # an orphan file costs space until the next scan, not correctness
            log.warning("disk tier %s: cannot remove %s: %s", self.name, key.hex(), exc)

    def _real_shard(self, key: bytes, seen: dict[str, bool]) -> bool:
        """The key's two-letter folder is a real folder: a reader never follows a symlink there."""
        h2 = key.hex()[:2]
        if h2 not in seen:
            seen[h2] = real_dir(f"{self._dir}/{h2}")
        return seen[h2]

    def _index(self, key: bytes, size: int) -> None:
        """A reader learns of a file the writer made (lock held); what the index drops to make
        room is only forgotten (the files are the writer's)."""
        if key not in self._policy:
            self._policy.admit(key, size)

    def _reconcile(self, gone: list[bytes], found: list[tuple[bytes, str]]) -> None:
        """Drop indexed keys whose file is gone; index the files a reader found."""
        with self._lock:
            for key in gone:
                if not self._held(key) or is_file(self._path(key)):
                    continue  # re-put meanwhile
                if self._policy.is_pinned(key):
                    self._doomed[key] = "gone"
                else:
                    self._policy.remove(key)
            for key, path in found:
                with contextlib.suppress(OSError):
                    self._index(key, os.lstat(path).st_size)
            self._publish()

    def _publish(self) -> None:
        p = self._policy
        self._m.occupancy(p.used_bytes, p.capacity_bytes, len(p) - len(self._pending), p.pinned_bytes)

    def _file_size(self, payload_len: int) -> int:
        return file_size(payload_len, padded=self._o_direct)

    def _scan(self) -> int:
        """Rebuild the index from the files (oldest first, so LRU order survives); returns
        how many of kvtier's leftovers (temp files, torn chunks) the writer removed."""
        found = scan(self.folder, remove=self.writer)
        for path, reason in found.removed:
            log.warning("disk tier %s: removed %s at start: %s", self.name, path, reason)
        for path, why in found.foreign:
            self._folder.note_foreign(path, why)
        self._last_stamp = found.found[-1][0] if found.found else 0
        for _, key, size in found.found:
            victims = self._policy.admit(key, size)  # capacity may have shrunk since last run
            for victim in [key] if victims is None else victims:
                self._drop_file(victim)
        self._publish()
        return len(found.removed)

    def _forget_all(self) -> None:
        """The folder was made anew: none of the indexed files exist any more."""
        with self._lock:
            for key in self._policy.order():
                if key in self._pending:
                    continue
                if self._policy.is_pinned(key):
                    self._doomed[key] = "gone"
                else:
                    self._doomed.pop(key, None)
                    self._policy.remove(key)
            self._publish()

    def _claim(self, key: bytes, payload_len: int) -> bool | None:
        """Admit ``key`` for a write: None if claimed (pinned and pending until settled), else
        the put's answer now (True: already held; False: refused, counted)."""
        with self._lock:
            if key in self._pending:  # another thread writes the same key, so the same KV
                self._m.present()
                return True
            if key in self._policy and self._doomed.get(key, "deleted") == "deleted":
                if is_file(self._path(key)):
                    # Same key, same KV: a chunk deleted while a reader holds it is simply kept.
                    self._doomed.pop(key, None)
                    self._m.present()
                    return True
                if self._policy.is_pinned(key):  # its file went while a read holds it: next time
                    self._doomed[key] = "gone"
                    self._m.put_failed("error")
                    return False
                self._doomed.pop(key, None)
                self._policy.remove(key)  # its file went behind the index's back: written again
            if key in self._policy:  # corrupt, gone or a failed write, dropped once its readers are done
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
            # Removed under the lock so a re-put of a victim key cannot race this removal.
            for victim in victims:
                self._drop_file(victim)
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
            if kind != "foreign":  # a name held by a user's file is not a failing disk
                self._write_health.record_failure()
            self._m.put_failed(kind)

    def _failed(self, what: str, key: bytes, exc: Exception) -> str:
        if isinstance(exc, ForeignFile):  # counted, and logged once, by note_foreign
            return "foreign"
        log.warning(
            "disk tier %s: %s %s: %s", self.name, what, key.hex(), exc, exc_info=not isinstance(exc, OSError)
        )
        return "full" if getattr(exc, "errno", None) in _FULL_ERRNOS else "error"

    def _write(self, key: bytes, path: Path, head: bytes, view: memoryview, again: bool = False) -> None:
        """Temp file, fsync (unless off), link; the caller syncs the directory. A file already
        under the chunk's name is replaced only if it is kvtier's (its header names the key);
        anything else fails the put (ForeignFile) and is left alone."""
        try:
            make_shard(path.parent)
        except ForeignFile:
            self._folder.note_foreign(path.parent, "a chunk folder's name, not a folder")
            raise
        try:
            if self._o_direct:
                try:
                    return publish(write_temp(path, head, view, True, self._fsync, self._align), path)
                except OSError as exc:
                    if not is_einval(exc):
                        raise
                    log.warning("disk tier %s: O_DIRECT write refused (%s); buffered IO", self.name, exc)
                    self._o_direct = False
            publish(write_temp(path, head, view, False, self._fsync), path)
        except FileExistsError:
            if not again and remove_owned(path, key):  # kvtier's own, left by a failed removal
                return self._write(key, path, head, view, again=True)
            self._folder.note_foreign(path, "a chunk's name, not kvtier's bytes")
            raise ForeignFile(errno.EEXIST, "a foreign file holds the chunk's name", str(path)) from None

    def _stamp(self, key: bytes) -> None:
        """Set the file's mtime to a strictly increasing clock: the scan at the next start
        orders the index by it, so recency survives a restart (file systems with coarse
        timestamps would otherwise tie many files). A reader never touches the writer's files."""
        if not self.writer:
            return
        with self._lock:
            self._last_stamp = max(self._last_stamp + 1, time.time_ns())
            stamp = self._last_stamp
        with contextlib.suppress(OSError):  # evicted or deleted meanwhile: its order no longer matters
            os.utime(self._path(key), ns=(stamp, stamp), follow_symlinks=False)
