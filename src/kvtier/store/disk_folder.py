"""The folders a disk tier owns, and what inside them is provably kvtier's.

kvtier works only in a folder it created, or found empty, and marked with ``MARKER`` (a small
JSON file naming the format and its version). A non-empty folder without the marker is
refused: kvtier never writes among files it did not write. Inside a marked folder, a file is
kvtier's only when its name *and* its header say so: ``ab/<key hex>.kvc``, or
``ab/.<key hex>.kvc.<32 hex>.tmp`` (a put's temp file), that starts with that key's header.
Anything else found inside is foreign: left alone (never deleted, truncated or overwritten) and
reported. No symlink inside is followed: a symlink is foreign, whatever its name.

    claim(path, label, create=True)     refuse a folder that is not kvtier's (ValueError naming
                                        ``label``); mark a new or empty one; its (st_dev, st_ino)
    WriterLock(folder, label)           one writer per folder (an flock on its marker), across
                                        processes and within one; a second raises ValueError
    OwnedFolder(root, space, label, writer, name)   a tier's folder: claimed, locked, made again
                                        by ``ready`` if removed; the foreign entries seen in it
    make_shard(path)                    a chunk's two-letter folder, made; ForeignFile if not a folder
    real_dir(path) / is_file(path)      what lstat says (a symlink is neither)
    owned_chunk(path, key) -> bool      name and header prove the file is ``key``'s chunk
    remove_owned(path, key) -> bool     unlink a file proven kvtier's (its header names key)
    scan(folder, remove) -> Scan        the chunks found (oldest first), kvtier's leftovers removed
                                        (only with ``remove``), the foreign entries
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import stat
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .chunkfile import CorruptChunk, read_header
from .header import MAX_HEADER_BYTES, ChunkHeader, HeaderError

log = logging.getLogger(__name__)

MARKER = "kvtier-disk.json"
FORMAT, VERSION = "kvtier-disk", 1
SHARD = re.compile(r"[0-9a-f]{2}")
CHUNK = re.compile(r"([0-9a-f]{16,128})\.kvc")  # keys are 8..64 bytes
TEMP = re.compile(r"\.([0-9a-f]{16,128})\.kvc\.[0-9a-f]{32}\.tmp")
SPACE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
# A fresh ext4 or xfs mount point holds lost+found: such a folder still counts as empty.
_EMPTY_OK = {"lost+found"}


def check_space(space: str | None) -> None:
    if space is None:
        return
    if not isinstance(space, str) or not SPACE.fullmatch(space) or SHARD.fullmatch(space):
        raise ValueError(
            f"space must be a folder name of letters, digits, '_', '.', '-' (not two hex digits), "
            f"got {space!r}"
        )


def claim(
    path: Path, label: str, create: bool = True, ours: tuple[int, int] | None = None
) -> tuple[int, int] | None:
    """Make sure ``path`` is a folder kvtier owns: marked already, or created (``create``, its
    parents too) or found empty, and then marked; ``ours``: the (st_dev, st_ino) of a folder
    this process owns, marked again even if not empty (only its marker was removed). Returns
    the folder's (st_dev, st_ino); None when it does not exist and ``create`` is off. Raises
    ValueError naming ``label`` for anything else. Serialised across processes by an flock on
    the folder, so ranks starting together never see each other's half-made marker."""
    shown = f"{label} {str(path)!r}"
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        if create:
            raise ValueError(f"{shown} cannot be created: a parent folder vanished") from None
        return None
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"{shown} is not a folder") from None
    except OSError as exc:
        raise ValueError(f"{shown} cannot be used: {exc.strerror or exc}") from None
    try:
        _lock(fd, fcntl.LOCK_EX)  # held only while the marker is checked or written
        marker, st = path / MARKER, os.fstat(fd)
        if os.path.lexists(marker):
            _check_marker(marker, shown)
        elif ours == (st.st_dev, st.st_ino):
            _write_marker(path, fd, shown)
        else:
            others = sorted(e for e in os.listdir(fd) if e not in _EMPTY_OK or not real_dir(path / e))
            if others:
                raise ValueError(
                    f"{shown} is not empty and has no {MARKER}: kvtier did not create it, and it never "
                    f"writes among files it did not write ({len(others)} entries, e.g. {others[0]!r}); "
                    "give it a new or empty folder"
                )
            _write_marker(path, fd, shown)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)  # also releases the flock


def _lock(fd: int, how: int) -> bool:
    """flock ``fd``; False where the filesystem has no flock (some network mounts)."""
    try:
        fcntl.flock(fd, how)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EINTR):
            raise
        return False


def _check_marker(marker: Path, shown: str) -> None:
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            data = json.loads(os.read(fd, 4096))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{shown} has a {MARKER} that is not kvtier's marker: give kvtier another folder")
    if data.get("version") != VERSION:
        raise ValueError(
            f"{shown} was written by a kvtier whose disk format is version {data.get('version')!r}; "
            f"this kvtier reads version {VERSION}: give it another folder"
        )


def _write_marker(path: Path, dir_fd: int, shown: str) -> None:
    body = json.dumps({"format": FORMAT, "version": VERSION}).encode() + b"\n"
    try:
        fd = os.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.fsync(dir_fd)  # the marker survives a crash before any chunk is written beside it
    except OSError as exc:
        raise ValueError(f"{shown} cannot be marked as kvtier's: {exc.strerror or exc}") from None


class WriterLock:
    """An exclusive flock on ``folder``'s marker for as long as one DiskTier writes there: two
    writers of one folder would evict each other's files from under their indexes. Released by
    ``release`` or when the lock is garbage-collected."""

    def __init__(self, folder: Path, label: str) -> None:
        self._close = None
        self.acquire(folder, label)

    def acquire(self, folder: Path, label: str) -> None:
        self.release()
        try:
            fd = os.open(folder / MARKER, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ValueError(f"{label}: {str(folder)!r} cannot be locked: {exc.strerror or exc}") from None
        try:
            _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ValueError(
                f"{label}: {str(folder)!r} is in use by another kvtier disk tier (another process, or "
                "one not closed): each writer needs a folder of its own"
            ) from None
        self._close = weakref.finalize(self, os.close, fd)  # closing the fd releases the flock

    def release(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


class ForeignFile(OSError):
    """A path kvtier needs (a chunk's name, a chunk folder) is held by something not kvtier's."""


def real_dir(path: Path | str) -> bool:
    """A folder at ``path`` (a symlink to one is not)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def is_file(path: Path | str) -> bool:
    """A regular file at ``path`` (a symlink to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def make_shard(shard: Path) -> None:
    """A chunk's two-letter folder: made if missing; ForeignFile if something else holds its
    name (a symlink is never written through). FileNotFoundError if the namespace is gone."""
    try:
        st = os.lstat(shard)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):  # another thread made it meanwhile
            os.mkdir(shard)
        st = os.lstat(shard)
    if not stat.S_ISDIR(st.st_mode):
        raise ForeignFile(errno.ENOTDIR, "not kvtier's folder", str(shard))


def _head(path: Path | str) -> tuple[bytes, int] | None:
    """The first bytes of a regular file (a symlink is not followed) and its size; None if it
    is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # NONBLOCK: a FIFO never hangs
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        return os.pread(fd, MAX_HEADER_BYTES, 0), st.st_size
    except OSError:
        return None
    finally:
        os.close(fd)


class OwnedFolder:
    """The folder one disk tier keeps its chunks in: ``root``, or its subfolder ``space``, both
    claimed (see ``claim``) at construction, locked for a writer (``WriterLock``), made again by
    ``ready`` if removed while the tier runs, and the foreign entries seen in it (``foreign``).
    ``label``: how errors name root. A reader claims root, and its folder only if it exists."""

    def __init__(
        self, root: str | os.PathLike, space: str | None, label: str, writer: bool, name: str
    ) -> None:
        check_space(space)
        self.root, self.label, self.writer, self.name = Path(root), label, writer, name
        self.path = self.root if space is None else self.root / space
        self._id = claim(self.root, label)
        if space is not None:
            self._id = claim(self.path, label, create=writer)
        self._lock = WriterLock(self.path, label) if writer else None
        self._remaking = threading.Lock()  # one thread remakes a removed folder
        self._refused = False
        self.foreign: set[str] = set()  # paths inside that are not kvtier's: left alone, counted
        self._noting = threading.Lock()

    def ready(self, forget: Callable[[], None]) -> bool:
        """The writer's folder still carries its marker (one lstat), or is made so again where
        that is safe: removed, or replaced by an empty folder (``forget()`` is called: none of the
        files indexed exist any more), or only its marker gone (marked again, its chunks kept).
        False, logged once, where the path now holds files that are not kvtier's."""
        marker = f"{self.path}/{MARKER}"
        if os.path.lexists(marker):
            return True
        with self._remaking:
            if os.path.lexists(marker):
                return True  # another thread remade it
            try:
                try:
                    st = os.lstat(self.path)
                    same = (st.st_dev, st.st_ino) == self._id
                except FileNotFoundError:
                    same = False
                if not same:
                    claim(self.root, self.label)
                self._id = claim(self.path, self.label, ours=self._id)
                self._lock.acquire(self.path, self.label)
            except ValueError as exc:  # the path holds someone else's files now: never written among
                if not self._refused:
                    log.warning("disk tier %s: its folder went and is not made again: %s", self.name, exc)
                self._refused = True
                return False
            self._refused = False
            if not same:
                forget()
            again = "its marker written again" if same else "made again, empty"
            log.warning("disk tier %s: %s was removed: %s", self.name, self.path, again)
            return True

    def note_foreign(self, path: Path | str, why: str) -> None:
        """Count a path inside that is not kvtier's (left alone); the first one is logged."""
        path = str(path)
        with self._noting:  # puts, reads and evictions on several threads find them
            if path in self.foreign:
                return
            first = not self.foreign
            self.foreign.add(path)
        if first:
            log.warning(
                "disk tier %s: %s is not kvtier's (%s): left alone; others are counted in "
                "stats()['foreign_files'], not logged",
                self.name,
                path,
                why,
            )

    def close(self) -> None:
        """Give the folder up: another writer may take it."""
        if self._lock is not None:
            self._lock.release()


def _names(head: bytes, key: bytes) -> bool:
    """``head`` starts with an intact chunk header (magic, version, CRC) naming ``key``."""
    try:
        header, _ = ChunkHeader.unpack(head)
    except HeaderError:
        return False
    return header.key == key


def owned_chunk(path: Path | str, key: bytes) -> bool:
    """True if ``path`` is a regular file, in a real folder (neither is a symlink), whose
    header names ``key``. Its size and payload may be wrong: a torn or rotted chunk is still
    kvtier's."""
    if not real_dir(os.path.dirname(path)):  # a linked chunk folder leads out of kvtier's
        return False
    got = _head(path)
    return got is not None and _names(got[0], key)


def remove_owned(path: Path | str, key: bytes) -> bool:
    """Unlink ``path`` if it is a regular file whose header names ``key``; False, and nothing
    removed, otherwise. Only a folder's writer calls this, and nothing else writes there: the
    file checked is the file unlinked."""
    if not owned_chunk(path, key):
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return True


@dataclass
class Scan:
    """found: (mtime_ns, key, size) of intact-looking chunks, oldest first. removed: kvtier's
    leftovers unlinked, with the reason. foreign: entries left alone, with the reason."""

    found: list[tuple[int, bytes, int]] = field(default_factory=list)
    removed: list[tuple[Path, str]] = field(default_factory=list)
    foreign: list[tuple[Path, str]] = field(default_factory=list)


def scan(folder: Path, remove: bool) -> Scan:
    """The chunk files of ``folder`` (headers read, payload checksums left to each read). With
    ``remove``, kvtier's own leftovers go: temp files of puts that died before their link,
    chunks whose header is intact but whose size is not. A marked subfolder (a
    namespace of its own) is skipped; everything else not kvtier's is listed as foreign."""
    out = Scan()
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except FileNotFoundError:
        return out
    for e in entries:
        path = Path(e.path)
        if e.name == MARKER:
            continue
        if SHARD.fullmatch(e.name) and e.is_dir(follow_symlinks=False):
            _scan_shard(path, remove, out)
        elif e.is_dir(follow_symlinks=False) and os.path.lexists(path / MARKER):
            continue  # another namespace (e.g. another rank's): its writer's business
        else:
            out.foreign.append((path, "not a chunk folder"))
    out.found.sort()
    return out


def _scan_shard(shard: Path, remove: bool, out: Scan) -> None:
    for e in sorted(os.scandir(shard), key=lambda e: e.name):
        path = Path(e.path)
        regular = e.is_file(follow_symlinks=False)
        chunk, temp = CHUNK.fullmatch(e.name), TEMP.fullmatch(e.name)
        name = chunk or temp
        if not regular or name is None or name.group(1)[:2] != shard.name:
            out.foreign.append((path, "a symlink or not a regular file" if not regular else "foreign name"))
            continue
        key = bytes.fromhex(name.group(1))
        got = _head(path)
        if got is None:
            out.foreign.append((path, "unreadable"))
            continue
        if temp:
            if not _names(got[0], key):
                out.foreign.append((path, "temp-file name, not kvtier's bytes"))
            elif remove and remove_owned(path, key):
                out.removed.append((path, "temp file of an unfinished put"))
            continue
        try:
            read_header(key, got[0], got[1])
        except CorruptChunk as exc:
            if not _names(got[0], key):
                out.foreign.append((path, f"chunk name, foreign bytes ({exc})"))
            elif remove and remove_owned(path, key):
                out.removed.append((path, str(exc)))
            continue
        try:
            out.found.append((e.stat(follow_symlinks=False).st_mtime_ns, key, got[1]))
        except FileNotFoundError:
            continue
