"""The contract every tier keeps, so KVStore can stack them (host pool → disk → Redis).

Failure never escapes a tier: an error, timeout, full tier, or bytes that fail their header
or checksum (or, for a tier with a key ring, their seal) make ``get`` return None (a miss — the
caller recomputes) and ``put`` return False; each is logged and counted in ``stats()``. Only
caller bugs (a malformed key, a header that does not match its payload) raise, as ValueError
naming the argument.

A tier that other processes can write (disk, Redis) has an ``auth`` attribute: None, or the
`auth.KeyRing` that seals every chunk it puts and opens every chunk it reads; a get then returns
the header as its writer gave it (unsealed), and never a chunk its ring could not open. A tier
without the attribute holds chunks only this process writes.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Protocol, runtime_checkable

from .header import ChunkHeader
from .keys import check_key
from .payload import as_view, as_writable_view

log = logging.getLogger(__name__)


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

    # Optional (not part of the isinstance check, so tiers written before them still qualify);
    # callers go through ``put_many(tier, items)`` / ``contains_many(tier, keys)`` below:
    #   put_many(items: list of (key, header, payload)) -> list[bool]   one result per item
    #   contains_many(keys: list[bytes]) -> list[bool]                 one round trip, not one per key

    def delete(self, key: bytes) -> bool: ...

    def stats(self) -> dict[str, int | float]: ...

    def close(self) -> None: ...


class TierReads:
    """`get` and `get_into` of a tier that implements one private read,
    `_get(key, dest_view_or_None) -> (header, payload) | None`; `put_many` and `contains_many`
    as loops over `put` and `contains`, for a tier that has nothing better."""

    def put_many(self, items) -> list[bool]:
        return [self.put(key, header, payload) for key, header, payload in items]

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        return [self.contains(key) for key in keys]

    def _get(self, key: bytes, dest: memoryview | None) -> tuple[ChunkHeader, memoryview] | None:
        raise NotImplementedError

    def get(self, key: bytes) -> Chunk | None:
        got = self._get(key, None)
        return None if got is None else Chunk(*got)

    def get_into(self, key: bytes, dest) -> ChunkHeader | None:
        got = self._get(key, as_writable_view(dest))
        return None if got is None else got[0]


def check_put_args(key: bytes, header: ChunkHeader, payload, sealed: bool = False) -> memoryview:
    """Validate a put's arguments (caller bugs raise) and return the payload's byte view.
    ``sealed``: the tier seals what it stores (only then may a header have no checksum)."""
    check_key(key)
    if not isinstance(header, ChunkHeader):
        raise ValueError(f"header must be a ChunkHeader, got {type(header).__name__}")
    if header.algo == "none" and not sealed:
        raise ValueError("header.algo 'none' (no checksum): only for a tier with a key ring, which seals it")
    if header.key != key:
        raise ValueError(f"header.key {header.key.hex()} does not match key {key.hex()}")
    view = as_view(payload)
    if view.nbytes != header.payload_len:
        raise ValueError(f"payload is {view.nbytes} bytes but header.payload_len is {header.payload_len}")
    return view


def put_many(tier, items: list) -> list[bool]:
    """``tier.put_many(items)`` (``items``: ``(key, header, payload)`` tuples), or one ``put``
    each for a tier without it; never raises: a tier that raises stored nothing (False)."""
    if hasattr(tier, "put_many"):
        try:
            return list(tier.put_many(items))
        except Exception:
            log.exception("tier %s raised on put_many", getattr(tier, "name", tier))
            return [False] * len(items)
    out = []
    for key, header, payload in items:
        try:
            out.append(bool(tier.put(key, header, payload)))
        except Exception:
            log.exception("tier %s raised on put", getattr(tier, "name", tier))
            out.append(False)
    return out


def contains_many(tier, keys: list[bytes]) -> list[bool]:
    """``tier.contains_many(keys)``, or one ``contains`` each for a tier without it. Raises
    what the tier raises (the caller counts it a miss)."""
    if hasattr(tier, "contains_many"):
        return list(tier.contains_many(keys))
    return [bool(tier.contains(key)) for key in keys]
