"""The contract every tier keeps, so KVStore can stack them (host pool → disk → Redis).

Failure never escapes a tier: an error, timeout, full tier, or bytes that fail their header
or checksum make ``get`` return None (a miss — the caller recomputes) and ``put`` return
False; each is logged and counted in ``stats()``. Only caller bugs (a malformed key, a header
that does not match its payload) raise, as ValueError naming the argument.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from .header import ChunkHeader
from .keys import check_key
from .payload import as_view, as_writable_view


class DestTooSmall(ValueError):
    """``get_into``'s ``dest`` cannot hold the stored chunk: a caller bug, so it is raised."""


class Chunk(NamedTuple):
    """A verified chunk: its header and payload (``payload.nbytes == header.payload_len``).
    The payload may be read-only (a view of the bytes the Redis client returned)."""

    header: ChunkHeader
    payload: memoryview


@runtime_checkable
class Tier(Protocol):
    name: str

    def put(self, key: bytes, header: ChunkHeader, payload) -> bool:
        """Store a chunk. True once it is durably held (or already was). Safe to call from
        a background writer thread concurrently with gets and puts (write-back)."""
        ...

    def get(self, key: bytes) -> Chunk | None:
        """The verified chunk, or None for a miss or any failure."""
        ...

    def get_into(self, key: bytes, dest) -> ChunkHeader | None:
        """Read the payload straight into ``dest`` (writable, ``nbytes >= payload_len``, e.g.
        a pinned pool slot); the header on success. On None, ``dest``'s bytes are undefined.
        Raises DestTooSmall (a ValueError) if the stored chunk does not fit ``dest``."""
        ...

    def contains(self, key: bytes) -> bool:
        """A cheap hint (no payload read); ``get`` may still miss."""
        ...

    def delete(self, key: bytes) -> bool: ...

    def stats(self) -> dict[str, int | float]: ...

    def close(self) -> None: ...


class TierReads:
    """`get` and `get_into` of a tier that implements one private read,
    `_get(key, dest_view_or_None) -> (header, payload) | None`."""

    def _get(self, key: bytes, dest: memoryview | None) -> tuple[ChunkHeader, memoryview] | None:
        raise NotImplementedError

    def get(self, key: bytes) -> Chunk | None:
        got = self._get(key, None)
        return None if got is None else Chunk(*got)

    def get_into(self, key: bytes, dest) -> ChunkHeader | None:
        got = self._get(key, as_writable_view(dest))
        return None if got is None else got[0]


def check_put_args(key: bytes, header: ChunkHeader, payload) -> memoryview:
    """Validate a put's arguments (caller bugs raise) and return the payload's byte view."""
    check_key(key)
    if not isinstance(header, ChunkHeader):
        raise ValueError(f"header must be a ChunkHeader, got {type(header).__name__}")
    if header.key != key:
        raise ValueError(f"header.key {header.key.hex()} does not match key {key.hex()}")
    view = as_view(payload)
    if view.nbytes != header.payload_len:
        raise ValueError(f"payload is {view.nbytes} bytes but header.payload_len is {header.payload_len}")
    return view
