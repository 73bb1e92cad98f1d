"""The Redis value layout's names, and its writes: several chunks in a few pipelined round trips.

Round trips, for a batch of chunks (``put_chunks``, which ``RedisTier.put_many`` calls):

1. one pipeline: SET NX of every small chunk (``b"S" + header + payload``), EXISTS of every
   large one (an upload of a chunk some host already shared is skipped);
2. the parts of the large chunks not there yet, ``parts_per_batch`` SETs a pipeline;
3. one pipeline: SET NX of the manifest of each large chunk whose every part was written.

Per chunk the order is the single put's: its manifest goes out only after all its parts were
acknowledged, so a reader finds no manifest or a complete one; SET NX keeps the first writer's
value. A pipeline is not a transaction (none is needed: each chunk is published by one SET), so
a Redis Cluster runs it too — redis-py groups its commands by node, one round trip per node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
from dataclasses import dataclass

from .header import ChunkHeader
from .redis_client import classify

log = logging.getLogger(__name__)
MANIFEST = struct.Struct("<8sIQ")
STORED, PRESENT = "stored", "present"
PIPELINE_BYTES = 8 << 20  # small-chunk values per round trip: a bound on the staging memory


@dataclass(frozen=True, slots=True)
class Target:
    """Where a tier's values go: ``client`` (redis-py ``Redis`` or ``RedisCluster``), names under
    ``prefix``, payloads split into parts of ``part_bytes``, ``parts_per_batch`` parts a round
    trip, every key expiring after ``ttl_s`` (None: never). ``name``: the tier's, for logs."""

    client: object
    prefix: str
    part_bytes: int
    ttl_s: int | None
    parts_per_batch: int
    name: str

    def key(self, key: bytes) -> str:
        """The name of ``key``'s value (a small chunk, or a manifest)."""
        return self.prefix + key.hex()

    def part_keys(self, key: bytes, nonce: bytes, nparts: int) -> list[str]:
        """The names of the parts of one put (``nonce``) of a large chunk."""
        base = f"{self.prefix}{key.hex()}:{nonce.hex()}:"
        return [base + str(i) for i in range(nparts)]

    def delete(self, names: list[str], raise_errors: bool = False) -> None:
        """Delete ``names`` in one pipeline; failures logged unless ``raise_errors``."""
        if not names:
            return
        try:
            pipe = self.client.pipeline(transaction=False)  # a cluster spreads names over nodes
            for name in names:
                pipe.delete(name)
            pipe.execute()
        except Exception as exc:  # an orphan costs memory until the server evicts it, not correctness
            if raise_errors:
                raise
            log.debug("redis tier %s: cleanup failed (the server evicts orphans): %s", self.name, exc)


def put_chunks(t: Target, items: list[tuple[bytes, ChunkHeader, memoryview]]) -> list[str]:
    """Store ``items`` (validated ``(key, header, payload view)``); per item "stored",
    "present" (some writer stored it first), or the failure kind ("error", "timeout", "full").
    Never raises: a failed pipeline fails the chunks it had not decided yet."""
    out: list[str | None] = [None] * len(items)
    heads = [header.pack() for _, header, _ in items]
    sizes = [1 + len(h) + view.nbytes for h, (_, _, view) in zip(heads, items, strict=True)]
    small = [n <= t.part_bytes for n in sizes]
    parts: dict[int, tuple[bytes, list[str]]] = {}  # large chunk -> (nonce, part names)
    try:
        for group in _groups([n if one else 0 for n, one in zip(sizes, small, strict=True)]):
            records = [sizes[i] if small[i] else 0 for i in group]
            replies = _first_trip(t, [items[i] for i in group], [heads[i] for i in group], records)
            for i, reply in zip(group, replies, strict=True):
                if isinstance(reply, Exception):
                    out[i] = _failed(t, items[i][0], reply)
                elif small[i] or reply:
                    out[i] = STORED if small[i] and reply else PRESENT
                else:
                    nonce, n = os.urandom(8), -(-items[i][2].nbytes // t.part_bytes)
                    parts[i] = nonce, t.part_keys(items[i][0], nonce, n)
        _put_parts(t, items, parts, out)
        _put_manifests(t, items, heads, parts, out)
    except Exception as exc:  # the connection failed: every chunk not decided yet is not stored
        for i in range(len(items)):
            if out[i] is None:
                out[i] = _failed(t, items[i][0], exc)
    full = [name for i, (_, names) in parts.items() if out[i] == "full" for name in names]
    t.delete(full)  # the server is up, just out of memory: remove what these puts wrote
    return out


def _first_trip(t: Target, items, heads: list[bytes], sizes: list[int]) -> list:
    """One pipeline: SET NX of each small chunk (``sizes[i]``: its record's bytes), EXISTS of
    each large one (size 0): the upload of a chunk some host already shared is skipped."""
    with _STAGING.values(sizes) as records:
        pipe = t.client.pipeline(transaction=False)
        for (key, _, view), head, rec in zip(items, heads, records, strict=True):
            if rec.nbytes:
                rec[:1], rec[1 : 1 + len(head)], rec[1 + len(head) :] = b"S", head, view
                pipe.set(t.key(key), rec, nx=True, ex=t.ttl_s)
            else:
                pipe.exists(t.key(key))
        try:
            return pipe.execute(raise_on_error=False)
        finally:
            pipe.reset()  # the commands' views of the staging buffer go before it is reused


def _groups(sizes: list[int]) -> list[list[int]]:
    """Indices of ``sizes`` in runs of at most PIPELINE_BYTES (a bigger item runs alone)."""
    groups: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(sizes):
        if groups[-1] and total + n > PIPELINE_BYTES:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


class _Staging:
    """One reusable buffer for the small-chunk values of a pipeline (``b"S" + header +
    payload`` each): fresh chunk-sized bytes per value cost their page faults, more than the
    round trips pipelining saves. A second concurrent put gets a buffer of its own."""

    def __init__(self) -> None:
        self._buf, self._lock = bytearray(), threading.Lock()

    @contextlib.contextmanager
    def values(self, sizes: list[int]):
        mine = self._lock.acquire(blocking=False)
        try:
            if mine and len(self._buf) < sum(sizes):
                self._buf = bytearray(sum(sizes))  # a new one: the old may still be exported
            buf = self._buf if mine else bytearray(sum(sizes))
            with memoryview(buf) as whole:
                offsets = [sum(sizes[:k]) for k in range(len(sizes))]
                views = [whole[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
                try:
                    yield views
                finally:
                    for v in views:
                        with contextlib.suppress(BufferError):  # a failed pipeline may still hold it
                            v.release()
        finally:
            if mine:
                self._lock.release()  # the buffer is free for the next put_many


_STAGING = _Staging()


def _put_parts(t: Target, items, parts: dict[int, tuple[bytes, list[str]]], out: list) -> None:
    flat = [(i, j, name) for i, (_, names) in parts.items() for j, name in enumerate(names)]
    for start in range(0, len(flat), t.parts_per_batch):
        pipe = t.client.pipeline(transaction=False)
        batch = flat[start : start + t.parts_per_batch]
        for i, j, name in batch:
            pipe.set(name, items[i][2][j * t.part_bytes : (j + 1) * t.part_bytes], ex=t.ttl_s)
        for (i, _, _), reply in zip(batch, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, Exception) and out[i] is None:  # no manifest for this chunk
                out[i] = _failed(t, items[i][0], reply)


def _put_manifests(t: Target, items, heads, parts: dict[int, tuple[bytes, list[str]]], out: list) -> None:
    ready = [i for i in parts if out[i] is None]  # every part acknowledged
    if not ready:
        return
    pipe = t.client.pipeline(transaction=False)
    for i in ready:
        nonce, names = parts[i]
        manifest = b"M" + MANIFEST.pack(nonce, len(names), t.part_bytes) + heads[i]
        # Published last, and only if no other writer got there first: readers see either no
        # manifest or one whose parts are all written.
        pipe.set(t.key(items[i][0]), manifest, nx=True, ex=t.ttl_s)
    lost = []
    for i, reply in zip(ready, pipe.execute(raise_on_error=False), strict=True):
        if isinstance(reply, Exception):
            out[i] = _failed(t, items[i][0], reply)
        else:
            out[i] = STORED if reply else PRESENT
            lost += [] if reply else parts[i][1]  # another writer's manifest won: ours are orphans
    t.delete(lost)


def _failed(t: Target, key: bytes, exc: Exception) -> str:
    kind = classify(exc)
    log.warning("redis tier %s: put %s failed (%s): %s", t.name, key.hex(), kind, exc)
    return kind
