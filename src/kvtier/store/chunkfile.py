"""The on-disk form of one chunk, and the IO that writes it atomically and reads it back.

Layout: the packed ``ChunkHeader`` at offset 0, zero padding, the payload at offset 4096, so
O_DIRECT can move the payload between page-aligned memory and the file. O_DIRECT files are
padded to a page multiple; buffered ones are not. Readers accept both.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import struct
import threading
import uuid
from pathlib import Path

from .auth import TAG, KeyRing, check_seal, open_chunk, stored_len
from .header import ChunkHeader, HeaderError
from .payload import PAGE, aligned_buffer, round_up
from .tier import DestTooSmall

SUFFIX = ".kvc"


class CorruptChunk(Exception):
    """The file under a key is not that key's intact chunk (torn, flipped, foreign)."""


def file_size(payload_len: int, padded: bool) -> int:
    return PAGE + (round_up(payload_len, PAGE) if padded else payload_len)


def o_direct_supported(directory: Path) -> bool:
    """Whether the filesystem of ``directory`` accepts O_DIRECT (tmpfs, for one, refuses it)."""
    return o_direct_alignment(directory) > 0


def o_direct_alignment(directory: Path) -> int:
    """The memory alignment O_DIRECT needs on ``directory``'s filesystem — statx's
    ``dio_mem_align`` of a probe file (Linux >= 6.1), else a page — or 0 where it is refused."""
    if not hasattr(os, "O_DIRECT"):
        return 0
    probe = directory / f".odirect.{uuid.uuid4().hex}.tmp"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644))
        return _dio_align(probe) or PAGE
    except OSError:
        return 0
    finally:
        probe.unlink(missing_ok=True)


_STATX_DIOALIGN = 0x2000


def _dio_align(path: Path) -> int:
    """max(stx_dio_mem_align, stx_dio_offset_align) of a regular file; 0 where unknown."""
    try:
        buf = ctypes.create_string_buffer(256)  # struct statx
        if ctypes.CDLL(None).statx(-100, os.fsencode(path), 0, _STATX_DIOALIGN, buf) != 0:  # AT_FDCWD
            return 0
    except (OSError, AttributeError):  # no libc statx (old glibc, not Linux)
        return 0
    mask, mem, off = struct.unpack_from("<I", buf, 0)[0], *struct.unpack_from("<II", buf, 152)
    return max(mem, off) if mask & _STATX_DIOALIGN and mem and off <= PAGE else 0


def write_temp(
    path: Path, head: bytes, view: memoryview, o_direct: bool, fsync: bool, align: int = PAGE
) -> Path:
    """The first half of an atomic write: the chunk in a temp file beside ``path`` (its folder
    exists), fsynced when ``fsync``; its name is returned for ``publish``. ``align``: O_DIRECT's
    memory alignment (a payload at such an address is written in place, else through a copy).
    Raises OSError; the temp file is removed first."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        if o_direct:
            _write_direct(tmp, head, view, fsync, align)
        else:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, head + bytes(PAGE - len(head)))
                _write_all(fd, view)
                if fsync:  # durable before the rename publishes it under the key's name
                    os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def publish(tmp: Path, path: Path) -> None:
    """Give a ``write_temp`` file its chunk's name, never replacing a file already there
    (FileExistsError then: it may not be kvtier's). The temp file is gone either way. Durable
    only once ``sync_dir(path.parent)`` returned."""
    try:
        try:
            os.link(tmp, path)  # a new name, atomically, or EEXIST: unlike rename, never a replace
        except OSError as exc:
            if exc.errno not in _NO_LINK:
                raise
            # A filesystem without hard links: a rename after a check; only kvtier writes here.
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, "a file holds the chunk's name", str(path)) from None
            os.rename(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


_NO_LINK = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK)


def sync_dir(directory: Path) -> None:
    """fsync a directory: the renames into it survive a crash only from here on."""
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the journal commit that makes every rename into it durable
    finally:
        os.close(dfd)


class Staging:
    """Page-aligned buffers for O_DIRECT IO of payloads that are not aligned (a SimDevice slot),
    kept for reuse: a fresh map per chunk costs its page faults, several times the copy."""

    def __init__(self, keep: int = 2) -> None:
        self._keep, self._free, self._lock = keep, [], threading.Lock()

    @contextlib.contextmanager
    def buffer(self, nbytes: int):
        size = round_up(max(nbytes, PAGE), PAGE)
        with self._lock:  # one buffer per caller: concurrent puts and gets never share one
            buf = next((b for b in self._free if len(b) == size), None)
            if buf is not None:
                self._free.remove(buf)
        buf = buf if buf is not None else aligned_buffer(size)
        try:
            yield buf
        finally:
            with self._lock:
                keep = len(self._free) < self._keep
                if keep:
                    self._free.append(buf)
            if not keep:  # unmapped now: a chunk-sized map per put left to the GC bloats RSS
                with contextlib.suppress(BufferError):  # a traceback still holds a view: the GC unmaps it
                    buf.close()


_STAGING = Staging()
_HEADS = Staging(keep=8)  # header pages of in-place IO: apart, so they never evict a payload buffer


def _write_direct(tmp: Path, head: bytes, view: memoryview, fsync: bool, align: int) -> None:
    n = view.nbytes
    in_place = n % PAGE == 0 and _address(view) % align == 0
    # O_DIRECT needs aligned memory and lengths: an aligned payload (a pool slot on a GPU host)
    # goes in place after a page of header; any other through a page-aligned copy.
    with (_HEADS if in_place else _STAGING).buffer(PAGE if in_place else PAGE + n) as buf:
        buf[: len(head)] = head
        buf[len(head) : PAGE] = bytes(PAGE - len(head))  # a reused buffer: no stale bytes in padding
        if not in_place:
            buf[PAGE : PAGE + n] = view
            buf[PAGE + n :] = bytes(len(buf) - PAGE - n)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            with memoryview(buf) as mv:  # released before the buffer is closed or reused
                _write_all(fd, mv)
            if in_place:
                _write_all(fd, view)
            if fsync:  # O_DIRECT skips the page cache, not the drive's volatile write cache
                os.fsync(fd)
        finally:
            os.close(fd)


def _address(view: memoryview) -> int:
    """The address of a writable view's first byte; -1 (never aligned) for a read-only one."""
    if view.readonly or view.nbytes == 0:
        return -1
    return ctypes.addressof(ctypes.c_char.from_buffer(view))  # the temporary export ends here


def read_header(key: bytes, head, size: int) -> ChunkHeader:
    """The header of a chunk file of ``size`` bytes whose first bytes are ``head``; it must
    be intact, name ``key``, and agree with the file's size."""
    try:
        header, _ = ChunkHeader.unpack(head)
    except HeaderError as exc:
        raise CorruptChunk(str(exc)) from None
    if header.key != key:
        raise CorruptChunk(f"file holds key {header.key.hex()}")
    if size not in (file_size(header.payload_len, False), file_size(header.payload_len, True)):
        raise CorruptChunk(f"file is {size} bytes, header says payload of {header.payload_len}")
    return header


def read_chunk_file(
    path: Path,
    key: bytes,
    dest: memoryview | None,
    o_direct: bool,
    align: int = PAGE,
    ring: KeyRing | None = None,
) -> tuple[ChunkHeader, memoryview]:
    """Read and check a chunk; the payload lands in ``dest`` if given, else in a new buffer.

    With O_DIRECT, a ``dest`` at an ``align``-aligned address (a pool slot, an SGLang host page)
    takes the payload straight from the file, its page-multiple head in place and only a partial
    last page through a copy; any other ``dest`` takes it through a page-aligned bounce buffer.
    The payload is checked where it landed (`auth.open_chunk`: a plain chunk's checksum, a sealed
    one's tag under ``ring``); an encrypted one lands in a buffer of its own and is decrypted into
    ``dest``. On any exception ``dest`` may hold garbage (a torn file's bytes, another chunk's):
    the caller must not use them.

    Raises CorruptChunk for anything but ``key``'s intact chunk, Rejected for one that fails its
    checksum or its seal, OSError for IO failures, DestTooSmall if ``dest`` cannot hold it
    (``dest`` untouched then).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECT if o_direct else 0))
    try:
        size = os.fstat(fd).st_size
        if o_direct and dest is not None and _address(dest) % align == 0:
            return _read_direct_into(fd, dest, key, size, ring)
        if o_direct and dest is not None:  # the bounce copy: dest (a SimDevice slot) is not aligned
            with _STAGING.buffer(size + TAG) as staged, memoryview(staged) as buf:
                header, stored = _read_direct(fd, buf, key, size, ring)
                _check_dest(dest, header)
                if header.encrypted:  # decrypted out of the bounce buffer, straight into dest
                    try:
                        return open_chunk(ring, header, stored, dest)
                    finally:
                        stored.release()  # before the buffer is reused
                dest[: header.payload_len] = stored
                stored.release()  # before the buffer is reused
            return open_chunk(ring, header, dest[: header.payload_len], dest)
        if o_direct:
            header, stored = _read_direct(fd, memoryview(aligned_buffer(size + TAG)), key, size, ring)
            return open_chunk(ring, header, stored, None)
        header = read_header(key, os.pread(fd, PAGE, 0), size)
        check_seal(ring, header)  # before any payload byte is read
        n = header.payload_len
        if dest is not None:
            _check_dest(dest, header)
        if dest is not None and not header.encrypted:
            stored = dest[:n]
        else:  # a new buffer; an encrypted payload's, with room for its tag
            stored = memoryview(bytearray(stored_len(header)))
        if _pread_into(fd, stored[:n], PAGE) != n:
            raise CorruptChunk("file shorter than its header says")
        return open_chunk(ring, header, stored, dest)
    finally:
        os.close(fd)


def _read_direct(
    fd: int, buf: memoryview, key: bytes, size: int, ring: KeyRing | None
) -> tuple[ChunkHeader, memoryview]:
    """The whole file into ``buf`` (TAG bytes longer than it, for an encrypted payload's tag):
    the header, and the payload's bytes as `open_chunk` takes them."""
    got = _pread_into(fd, buf, 0)
    header = read_header(key, buf[: min(got, PAGE)], size)
    check_seal(ring, header)
    if got < PAGE + header.payload_len:
        raise CorruptChunk("file shorter than its header says")
    return header, buf[PAGE : PAGE + stored_len(header)]


def _read_direct_into(
    fd: int, dest: memoryview, key: bytes, size: int, ring: KeyRing | None
) -> tuple[ChunkHeader, memoryview]:
    """O_DIRECT into an aligned ``dest``: the header page into a page of its own, the payload's
    whole pages from file offset PAGE straight into ``dest``, and the rest of a payload that is
    not a page multiple through that page (O_DIRECT moves whole pages only). An encrypted
    payload goes through a bounce buffer instead, decrypted from there into ``dest``."""
    with _HEADS.buffer(PAGE) as page, memoryview(page) as buf:
        header = read_header(key, buf[: _pread_into(fd, buf, 0)], size)
        check_seal(ring, header)  # before any payload byte lands in dest
        n = header.payload_len
        _check_dest(dest, header)  # before the first byte lands in dest
        if header.encrypted:
            with _STAGING.buffer(n + TAG) as staged, memoryview(staged) as sbuf:
                if _pread_into(fd, sbuf, PAGE) < n:
                    raise CorruptChunk("file shorter than its header says")
                with sbuf[: n + TAG] as stored:  # released before the buffer is reused
                    return open_chunk(ring, header, stored, dest)
        whole = n // PAGE * PAGE
        with dest[:whole] as pages:
            got = _pread_into(fd, pages, PAGE)
        if got == whole < n:  # the payload's last, partial page
            got += min(_pread_into(fd, buf, PAGE + whole), n - whole)
            dest[whole:n] = buf[: n - whole]  # buf's header bytes were parsed already
    if got < n:
        raise CorruptChunk("file shorter than its header says")
    return open_chunk(ring, header, dest[:n], dest)


def is_einval(exc: OSError) -> bool:
    return exc.errno == errno.EINVAL


def _check_dest(dest: memoryview, header: ChunkHeader) -> None:
    if dest.nbytes < header.payload_len:
        raise DestTooSmall(f"dest holds {dest.nbytes} bytes, chunk needs {header.payload_len}")


def _write_all(fd: int, data) -> None:
    # Views released on the way out, even by an exception (ENOSPC): a traceback that still
    # exported an mmap buffer would make closing it fail and mask the real error.
    with memoryview(data) as view:
        pos = 0
        while pos < view.nbytes:
            with view[pos:] as rest:
                pos += os.write(fd, rest)  # os.write may write less than asked


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    total = 0
    while total < view.nbytes:
        n = os.preadv(fd, [view[total:]], offset + total)
        if n == 0:  # end of file: a short (torn) file, reported by the caller
            break
        total += n
    return total
