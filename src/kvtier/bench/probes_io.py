"""Ceilings of the storage hops, for the `store` suite: disk write (+ fsync) and read of a file of
at least 256 MiB, in IO_QUEUE sequential slices at once (O_DIRECT where the file system allows,
else dropped from the page cache before each read), and a Redis SET / GET of the same bytes on
loopback. All timed on the host clock, each a `Rate` over repeated runs."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.bench.stats import Rate
from kvtier.bench.timing import Timer

_IO_PIECE = 8 << 20  # bytes per write / read call: large sequential IO
IO_QUEUE = 4  # slices of a file moved at once: a device reaches its rate only with IOs in flight
# Smaller files measure a device's cache, or its fixed costs, rather than its rate.
DISK_MIN_BYTES = 256 << 20


def _host_timer(timer: Timer) -> Timer:
    """A host-clock timer like `timer` (disk and socket IO are timed on the host clock)."""
    return timer if not timer.on_cuda else Timer("cpu", min_reps=timer.min_reps, budget_s=timer.budget_s)


def disk_io_mode(root) -> str:
    """How the disk probes (and a `DiskTier(o_direct=True)`) move bytes on ``root``'s filesystem."""
    from pathlib import Path

    from kvtier.store.chunkfile import o_direct_supported

    if o_direct_supported(Path(root)):
        return "O_DIRECT"
    return "buffered; file dropped from the page cache (posix_fadvise DONTNEED) before each read"


def _disk_file(root, nbytes: int):
    """(path, page-aligned buffer of random bytes (nbytes rounded up to a page), open flags) for a
    disk probe: a fresh temp file in `root`, opened with O_DIRECT where the filesystem allows."""
    import tempfile

    from kvtier.store.payload import PAGE, aligned_buffer, round_up

    buf = aligned_buffer(round_up(nbytes, PAGE))  # O_DIRECT moves whole pages from aligned memory
    torch.frombuffer(buf, dtype=torch.uint8).random_()  # never write zeros: a disk may compress them
    fd, path = tempfile.mkstemp(prefix=".kvtier-probe-", dir=root)
    os.close(fd)
    return path, buf, os.O_DIRECT if disk_io_mode(root) == "O_DIRECT" else 0


def _slices(nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) of the IO_QUEUE slices a file of `nbytes` is moved in, each a whole number
    of IO pieces (the last takes the rest): one thread moves each, as a queue depth of IO_QUEUE."""
    pieces = -(-nbytes // _IO_PIECE)
    per = -(-pieces // IO_QUEUE) * _IO_PIECE
    return [(at, min(per, nbytes - at)) for at in range(0, nbytes, per)]


def _move(pool: ThreadPoolExecutor, path: str, view: memoryview, flags: int, write: bool) -> None:
    """Write (and fsync) or read `view` to / from `path` in IO_QUEUE slices at once, each in
    8 MiB calls from its own descriptor."""

    def one(at: int, n: int) -> None:
        fd = os.open(path, (os.O_WRONLY if write else os.O_RDONLY) | flags)
        try:
            done = 0
            while done < n:
                piece = view[at + done : at + min(n, done + _IO_PIECE)]
                got = os.pwrite(fd, piece, at + done) if write else os.preadv(fd, [piece], at + done)
                if got == 0:
                    raise RuntimeError(f"disk probe: {path} is shorter than the {view.nbytes} bytes written")
                done += got  # a call may move less than asked
        finally:
            os.close(fd)

    for f in [pool.submit(one, at, n) for at, n in _slices(view.nbytes)]:
        f.result()  # every slice is in (or out) before the file is synced or the clock stops
    if write:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.fsync(fd)  # durable, as a tier put is: the bytes must reach the device
        finally:
            os.close(fd)


def _disk_probe(root, nbytes: int, timer: Timer, name: str, write: bool) -> Rate:
    nbytes = max(nbytes, DISK_MIN_BYTES)
    path, buf, flags = _disk_file(root, nbytes)
    view = memoryview(buf)
    pool = ThreadPoolExecutor(IO_QUEUE, thread_name_prefix="kvtier-disk-probe")

    def drop() -> None:
        if not flags:  # buffered: else every read would come from the page cache, not the disk
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # fsynced pages are clean: dropped
            finally:
                os.close(fd)

    def fresh() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)  # each write run starts from an empty file
        os.close(fd)

    try:
        fresh()
        if write:
            fn, setup = (lambda: _move(pool, path, view, flags, True)), fresh
        else:
            _move(pool, path, view, flags, True)
            fn, setup = (lambda: _move(pool, path, view, flags, False)), drop
        t = _host_timer(timer).time(fn, setup=setup, name=f"probe/{name}")
        return Rate.of(view.nbytes, t, view.nbytes)
    finally:
        pool.shutdown(wait=True)  # no thread still reads or writes the buffer released below
        view.release()
        buf.close()
        os.unlink(path)


def disk_write(timer: Timer, nbytes: int, *, root) -> Rate:
    """Write + fsync of a file of `nbytes` (at least DISK_MIN_BYTES) in `root`: IO_QUEUE slices at
    once, 8 MiB writes, O_DIRECT where the filesystem accepts it (as `DiskTier(o_direct=True)`
    writes); bytes written."""
    return _disk_probe(root, nbytes, timer, "disk_write", write=True)


def disk_read(timer: Timer, nbytes: int, *, root) -> Rate:
    """Read of a file of `nbytes` (at least DISK_MIN_BYTES) in `root`, written and fsynced before:
    IO_QUEUE slices at once, 8 MiB preads, O_DIRECT where the filesystem accepts it, else buffered
    after dropping the file from the page cache (`disk_io_mode` says which); bytes read."""
    return _disk_probe(root, nbytes, timer, "disk_read", write=False)


def _redis_parts(url: str, nbytes: int, part_bytes: int):
    """(client, part keys, bytes to store) for a Redis probe: random bytes in parts of part_bytes."""
    import uuid

    from kvtier.store.redis_client import make_client

    client = make_client(url, timeout_s=30.0)
    data = _pageable(nbytes)
    data.random_()
    base = f"kvtier-probe:{uuid.uuid4().hex}:"
    keys = [base + str(i) for i in range(-(-nbytes // part_bytes))]
    return client, keys, memoryview(data.numpy())


def _redis_set_all(client, keys: list[str], view: memoryview, part_bytes: int, batch: int) -> None:
    for b in range(0, len(keys), batch):
        pipe = client.pipeline(transaction=False)
        for i in range(b, min(b + batch, len(keys))):
            pipe.set(keys[i], view[i * part_bytes : (i + 1) * part_bytes])
        pipe.execute()


def redis_loopback_set(timer: Timer, nbytes: int, *, url: str, part_bytes: int, batch: int = 16) -> Rate:
    """SET of `nbytes` in parts of `part_bytes` through redis-py, `batch` parts per pipeline (as the
    Redis tier writes a chunk of several parts), to the server at `url`; payload bytes stored."""
    client, keys, view = _redis_parts(url, nbytes, part_bytes)
    try:
        t = _host_timer(timer).time(
            lambda: _redis_set_all(client, keys, view, part_bytes, batch), name="probe/redis_set"
        )
    finally:
        client.delete(*keys)
        client.close()
    return Rate.of(nbytes, t, nbytes)


def redis_loopback_get(timer: Timer, nbytes: int, *, url: str, part_bytes: int, batch: int = 16) -> Rate:
    """GET of the same parts back, `batch` per pipeline, each copied into one buffer (as the Redis
    tier reads into a pool slot); payload bytes read. Checks the bytes once."""
    client, keys, view = _redis_parts(url, nbytes, part_bytes)
    out = bytearray(nbytes)

    def get_all() -> None:
        for b in range(0, len(keys), batch):
            pipe = client.pipeline(transaction=False)
            for k in keys[b : b + batch]:
                pipe.get(k)
            for i, part in enumerate(pipe.execute(), start=b):
                out[i * part_bytes : i * part_bytes + len(part)] = part

    try:
        _redis_set_all(client, keys, view, part_bytes, batch)
        t = _host_timer(timer).time(get_all, name="probe/redis_get")
        if out != view:  # a probe that did not read the bytes back would flatter the ceiling
            raise RuntimeError("redis probe: the bytes read back differ from those written")
    finally:
        client.delete(*keys)
        client.close()
    return Rate.of(nbytes, t, nbytes)


def _pageable(n: int) -> torch.Tensor:
    t = torch.empty(n, dtype=torch.uint8)
    t.fill_(7)  # touch every page now, so no page fault lands in a timed run
    return t
