"""The on-disk form of one chunk, and the IO that writes it atomically and reads it back.

Layout: the packed ``ChunkHeader`` at offset 0, zero padding, the payload at offset 4096, so
O_DIRECT can move the payload between page-aligned memory and the file. O_DIRECT files are
padded to a page multiple; buffered ones are not. Readers accept both.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

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
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / f".odirect.{uuid.uuid4().hex}.tmp"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def write_chunk_file(path: Path, head: bytes, view: memoryview, o_direct: bool, fsync: bool) -> None:
    """Write atomically: temp file, fsync, rename over ``path``, fsync the directory.

    A crash leaves the old state or the new one, never a half file under the chunk's name.
    Raises OSError (ENOSPC, EIO, EINVAL from O_DIRECT …); the temp file is removed first.
    """
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        if o_direct:
            _write_direct(tmp, head, view, fsync)
        else:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, head + bytes(PAGE - len(head)))
                _write_all(fd, view)
                if fsync:  # durable before the rename publishes it under the key's name
                    os.fsync(fd)
            finally:
                os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:  # the rename itself is durable only once the directory is synced
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _write_direct(tmp: Path, head: bytes, view: memoryview, fsync: bool) -> None:
    buf = aligned_buffer(PAGE + view.nbytes)  # O_DIRECT needs page-aligned memory and length
    try:
        buf[: len(head)] = head
        buf[PAGE : PAGE + view.nbytes] = view
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            with memoryview(buf) as mv:  # released before buf.close(), which refuses live exports
                _write_all(fd, mv)
            if fsync:  # O_DIRECT skips the page cache, not the drive's volatile write cache
                os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        buf.close()  # unmapped now: leaving a chunk-sized staging map per put to the GC bloats RSS


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
    path: Path, key: bytes, dest: memoryview | None, o_direct: bool
) -> tuple[ChunkHeader, memoryview]:
    """Read and verify a chunk; the payload lands in ``dest`` if given, else in a new buffer.

    Raises CorruptChunk for anything but ``key``'s intact chunk, OSError for IO failures,
    DestTooSmall if ``dest`` cannot hold it.
    """
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if o_direct else 0))
    try:
        size = os.fstat(fd).st_size
        if o_direct:
            buf = memoryview(aligned_buffer(round_up(max(size, PAGE), PAGE)))
            got = _pread_into(fd, buf, 0)
            header = read_header(key, buf[: min(got, PAGE)], size)
            payload = buf[PAGE : PAGE + header.payload_len]
            if got < PAGE + header.payload_len:
                raise CorruptChunk("file shorter than its header says")
            if dest is not None:  # the bounce copy: dest (a pool slot) need not be page-aligned
                _check_dest(dest, header)
                dest[: header.payload_len] = payload
                payload = dest[: header.payload_len]
        else:
            header = read_header(key, os.pread(fd, PAGE, 0), size)
            if dest is not None:
                _check_dest(dest, header)
                payload = dest[: header.payload_len]
            else:
                payload = memoryview(bytearray(header.payload_len))
            if _pread_into(fd, payload, PAGE) != header.payload_len:
                raise CorruptChunk("file shorter than its header says")
    finally:
        os.close(fd)
    if not header.verify(payload):
        raise CorruptChunk("payload checksum mismatch")
    return header, payload


def scan_chunk_files(root: Path) -> tuple[list[tuple[int, bytes, int]], list[tuple[Path, str]]]:
    """The intact-looking chunk files under ``root`` as ``(mtime_ns, key, size)``, oldest
    first, and the files removed: temp files of puts that died before their rename, foreign
    names, bad headers. Payload checksums are left to each read (a scan reads headers only)."""
    found, removed = [], []
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and len(p.name) == 2):
        for f in sub.iterdir():
            try:
                if f.name.endswith(".tmp"):
                    raise CorruptChunk("temp file of an unfinished put")
                key = bytes.fromhex(f.name.removesuffix(SUFFIX))
                st = f.stat()
                with open(f, "rb") as fh:
                    read_header(key, fh.read(PAGE), st.st_size)
                found.append((st.st_mtime_ns, key, st.st_size))
            except (CorruptChunk, ValueError, OSError) as exc:
                f.unlink(missing_ok=True)
                removed.append((f, str(exc)))
    found.sort()
    return found, removed


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
