"""The Redis value layout's names, and its writes: a batch of chunks in one pipelined round trip.

Every chunk goes out as parts and a manifest (``redis_tier`` has the value formats): the payload
in parts of ``part_bytes``, each a view of the caller's memory (redis-py sends a memoryview as
it is, no copy), then the manifest, which holds the header and publishes the chunk.

``put_chunks`` on one server: one pipeline for the batch; per chunk its part SETs, then
``_PUBLISH``, a script that sets the manifest (NX: the first writer's stays) only if every part
is there, and otherwise — a part refused by a full server, or another writer's manifest there
first — deletes the parts. A pipeline's commands run in order and a script runs whole, so a
reader finds no manifest or one whose parts are all written, and a failed chunk leaves nothing.

On a Redis Cluster the parts spread over nodes and a pipeline keeps no order between nodes, so
it takes two round trips: every part, then the manifest (SET NX) of each chunk whose parts were
all acknowledged. Either way a chunk is stored whole or not at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from dataclasses import dataclass

from .header import ChunkHeader
from .redis_client import classify

log = logging.getLogger(__name__)
MANIFEST = struct.Struct("<8sIQ")
STORED, PRESENT = "stored", "present"

# KEYS: the manifest, then the chunk's parts; ARGV: the manifest's value, its ttl ("" for none).
# 1: published; 0: another writer's manifest was there; -1: a part is missing. The parts of a
# chunk not published are deleted here: nobody else knows their (nonce'd) names.
_PUBLISH = """
local function drop() for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end end
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then drop() return -1 end
end
local set = {'SET', KEYS[1], ARGV[1], 'NX'}
if ARGV[2] ~= '' then set[5], set[6] = 'EX', ARGV[2] end
local r = redis.pcall(unpack(set))
if type(r) == 'table' and r.ok then return 1 end
drop()
if r then return r end
return 0
"""


@dataclass(frozen=True, slots=True)
class Target:
    """Where a tier's values go: ``client`` (redis-py ``Redis`` or ``RedisCluster``: ``cluster``),
    names under ``prefix``, payloads split into parts of ``part_bytes``, a read fetching
    ``parts_per_batch`` parts a round trip, every key expiring after ``ttl_s`` (None: never).
    ``name``: the tier's, for logs."""

    client: object
    prefix: str
    part_bytes: int
    ttl_s: int | None
    parts_per_batch: int
    name: str
    cluster: bool = False

    def key(self, key: bytes) -> str:
        """The name of ``key``'s value (a manifest, or a one-value chunk of an older writer)."""
        return self.prefix + key.hex()

    def part_keys(self, key: bytes, nonce: bytes, nparts: int) -> list[str]:
        """The names of the parts of one put (``nonce``) of a chunk."""
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


@dataclass(frozen=True, slots=True)
class _Put:
    """One chunk's writes: its parts' names and the manifest that publishes them."""

    key: bytes
    view: memoryview
    names: list[str]
    manifest: bytes


def put_chunks(t: Target, items: list[tuple[bytes, ChunkHeader, memoryview]]) -> list[str]:
    """Store ``items`` (validated ``(key, header, payload view)``); per item "stored",
    "present" (some writer stored it first), or the failure kind ("error", "timeout", "full").
    Never raises: a failed round trip fails the chunks it had not decided yet."""
    puts = [_plan(t, key, header, view) for key, header, view in items]
    out: list[str | None] = [None] * len(puts)
    try:
        (_two_trips if t.cluster else _one_trip)(t, puts, out)
    except Exception as exc:  # the connection failed: every chunk not decided yet is not stored
        for i, p in enumerate(puts):
            if out[i] is None:
                out[i] = _failed(t, p.key, exc)
    return out


def _plan(t: Target, key: bytes, header: ChunkHeader, view: memoryview) -> _Put:
    nonce, nparts = os.urandom(8), -(-view.nbytes // t.part_bytes)
    manifest = b"M" + MANIFEST.pack(nonce, nparts, t.part_bytes) + header.pack()
    return _Put(key, view, t.part_keys(key, nonce, nparts), manifest)


def _one_trip(t: Target, puts: list[_Put], out: list) -> None:
    """One server: each chunk's parts, then its ``_PUBLISH``, all in one pipeline."""
    ttl = "" if t.ttl_s is None else str(t.ttl_s)
    with _pipeline(t) as (pipe, part):
        for p in puts:
            for j, name in enumerate(p.names):
                pipe.set(name, part(p, j), ex=t.ttl_s)
            pipe.eval(_PUBLISH, 1 + len(p.names), t.key(p.key), *p.names, p.manifest, ttl)
        replies = iter(pipe.execute(raise_on_error=False))
    for i, p in enumerate(puts):
        refused = [r for r in (next(replies) for _ in p.names) if isinstance(r, Exception)]
        published = next(replies)
        if published == -1:  # a part refused says why; else one was evicted before the script ran
            out[i] = _failed(t, p.key, refused[0] if refused else _PartGone("a part was gone"))
        elif isinstance(published, Exception):
            out[i] = _failed(t, p.key, published)
        else:
            out[i] = STORED if published == 1 else PRESENT


def _two_trips(t: Target, puts: list[_Put], out: list) -> None:
    """A cluster: every part, then the manifest of each chunk whose parts were all acknowledged."""
    with _pipeline(t) as (pipe, part):
        owner = []
        for i, p in enumerate(puts):
            for j, name in enumerate(p.names):
                pipe.set(name, part(p, j), ex=t.ttl_s)
                owner.append(i)
        for i, reply in zip(owner, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, Exception) and out[i] is None:  # no manifest for this chunk
                out[i] = _failed(t, puts[i].key, reply)
    ready = [i for i, p in enumerate(puts) if out[i] is None]
    pipe = t.client.pipeline(transaction=False)
    for i in ready:
        # Published last, and only if no other writer got there first: readers see either no
        # manifest or one whose parts are all written.
        pipe.set(t.key(puts[i].key), puts[i].manifest, nx=True, ex=t.ttl_s)
    for i, reply in zip(ready, pipe.execute(raise_on_error=False) if ready else (), strict=True):
        if isinstance(reply, Exception):
            out[i] = _failed(t, puts[i].key, reply)
        else:
            out[i] = STORED if reply else PRESENT
    # Not published (another writer's manifest won, or a full server refused a part): orphans.
    t.delete([name for i, p in enumerate(puts) if out[i] in (PRESENT, "full") for name in p.names])


@contextlib.contextmanager
def _pipeline(t: Target):
    """A pipeline, and ``part(put, j)``: the view of part ``j`` of a put's payload. The views
    and the commands holding them go when the block ends, even on an exception."""
    pipe, views = t.client.pipeline(transaction=False), []

    def part(p: _Put, j: int) -> memoryview:
        views.append(p.view[j * t.part_bytes : (j + 1) * t.part_bytes])
        return views[-1]

    try:
        yield pipe, part
    finally:
        pipe.reset()  # its commands hold the views: dropped so none outlives the call
        for v in views:  # released: a caller may unmap its buffer once put returns
            with contextlib.suppress(BufferError):  # an export still alive: the GC releases it
                v.release()


class _PartGone(Exception):
    """A part of a put was not on the server when its manifest was to be published."""


def _failed(t: Target, key: bytes, exc: Exception) -> str:
    kind = classify(exc)
    log.warning("redis tier %s: put %s failed (%s): %s", t.name, key.hex(), kind, exc)
    return kind
