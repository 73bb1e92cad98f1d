"""Chunks that only a holder of the key wrote: the key ring that seals and opens them.

kvtier's chunk keys are derivable (model, salt scheme, tokens) and a plain checksum is not keyed,
so anyone who can write to a shared Redis or a disk folder could plant a well-formed chunk for a
prefix others will send. A tier given a `KeyRing` seals every chunk it writes and opens every
chunk it reads; what it cannot open is a miss, never loaded:

    KeyRing(keys, encrypt=False)    the first key seals, every key opens (rotation: roll over
                                    without a cold cache); keys are str or bytes of >= 16 bytes
    KeyRing.resolve(keys, encrypt, name) -> KeyRing | None   a setting, else $KVTIER_AUTH_KEYS
                                    (comma-separated), else None (chunks are not authenticated)
    ring.seal(header, payload) -> (stored header, stored payload)   what a tier writes
    check_seal(ring, header)        before a payload is read: a chunk this ring could never open
                                    (plain, sealed without a ring, another key's) is refused
    open_chunk(ring, header, stored, dest) -> (header, payload)     what a tier may hand on;
                                    raises Rejected: "corrupt", "forged" or "unverifiable"
    adopt(tiers, ring)              a store's ring, given to its tiers built without one
    note_unauthenticated(tiers)     the log line, once per process, that chunks are not sealed

The seal (`header.Seal`, header version 2): per write a random 16-byte salt; from it and the key,
an AES-256 key and a mask of this write alone (keyed BLAKE2b). The tag is AES-GCM's over the
header's fields (key, shape, dtype, layout, payload_len, checksum, group, algo, key id, salt)
and the payload: a header moved onto another chunk's payload, or a payload under another header,
fails. Without encryption the payload is GCM's associated data and the header's fields its
plaintext, whose ciphertext is dropped (GMAC: one GHASH pass over the payload, near xxh3's speed
where the CPU has AES and carry-less multiply instructions); with it, the payload is GCM's
plaintext, the stored bytes its ciphertext, and the header's fields the associated data. Each
AES key seals one write, so GCM's fixed nonce is never reused. The header's checksum and group
are stored masked (an encrypted payload's checksum would otherwise tell its plaintext). Tags
are compared in constant time. Keys are never logged, nor in reprs, stats, metrics or error
messages: a ring shows its count and the id of the key that seals (8 bytes derived from the key,
which they do not reveal).

Outcomes, per tier: a tier with a ring counts a chunk it cannot open as ``forged`` (a bad tag, a
key not in its ring, or no tag at all: a plain chunk); a tier without one counts a sealed chunk
as ``unverifiable`` (it cannot tell a forgery from a chunk sealed by a key holder). Both miss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import struct
import threading

from .header import MACS, ChunkHeader, Seal

log = logging.getLogger(__name__)

ENV = "KVTIER_AUTH_KEYS"
MIN_KEY_BYTES = 16
TAG = 16  # bytes of a GCM tag: an encrypted payload is read with this much room after it
MAX_PAYLOAD = 2**31 - 1  # the AEAD's limit on one message (the `cryptography` package's)
_NONCE = bytes(12)  # each AES key seals one write: a fixed nonce is never reused under one key
_DOMAIN = b"kvtier-seal-v2\0"
_MASK = struct.Struct("<QQ")


class Rejected(Exception):
    """A chunk a tier must not hand on. kind: "corrupt" (a plain chunk whose checksum fails),
    "forged" (a ring could not open it) or "unverifiable" (sealed, and the tier has no ring)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class KeyRing:
    """keys: one key or several (str or bytes, each at least 16 bytes; a str may list several,
    comma-separated): the first seals what is written, every one opens what is read. encrypt:
    the payload is stored encrypted too (AES-256-GCM), for stores other parties can read.
    name: how errors name the setting the keys came from (never the keys themselves).

    >>> ring = KeyRing(["a new key of 32 characters......", "the old key, still read"])
    >>> ring
    KeyRing(2 keys, seals with key id ..., encrypt=False)
    """

    __slots__ = ("encrypt", "key_ids", "_masters", "_aead")

    def __init__(self, keys, *, encrypt: bool = False, name: str = "keys") -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # first use: at start

        if not isinstance(encrypt, bool):
            raise ValueError(f"encrypt must be a bool, got {type(encrypt).__name__}")
        masters = [_master(k) for k in _split(keys, name)]
        self.encrypt = encrypt
        self.key_ids = tuple(_key_id(m) for m in masters)
        if len(set(self.key_ids)) != len(self.key_ids):
            raise ValueError(f"{name}: the same key is given twice")
        self._masters = dict(zip(self.key_ids, masters, strict=True))
        self._aead = AESGCM

    @classmethod
    def resolve(cls, keys, encrypt: bool = False, name: str = "auth_keys") -> KeyRing | None:
        """The ring of a setting: ``keys`` as given (a KeyRing passes through), else the keys in
        $KVTIER_AUTH_KEYS, else None. ``encrypt`` needs keys. Errors name ``name`` or the
        environment variable, never a key."""
        if isinstance(keys, KeyRing):
            if encrypt and not keys.encrypt:
                raise ValueError(f"{name}: a KeyRing built with encrypt=False, and encryption asked for")
            return keys
        if keys is None or keys == "" or (isinstance(keys, list | tuple) and not keys):
            keys, name = os.environ.get(ENV) or None, ENV
        if keys is None:
            if encrypt:
                raise ValueError(f"encryption needs keys: give {name} or set {ENV}")
            return None
        return cls(keys, encrypt=bool(encrypt), name=name)

    def __repr__(self) -> str:
        n, first = len(self.key_ids), self.key_ids[0].hex()
        return f"KeyRing({n} key{'s' * (n != 1)}, seals with key id {first}, encrypt={self.encrypt})"

    __str__ = __repr__

    def same_keys(self, other: KeyRing) -> bool:
        """Whether ``other`` seals and opens exactly as this ring does."""
        return isinstance(other, KeyRing) and (other.key_ids, other.encrypt) == (self.key_ids, self.encrypt)

    def seal(self, header: ChunkHeader, payload: memoryview) -> tuple[ChunkHeader, memoryview]:
        """The header and payload a tier stores for ``header`` / ``payload`` (a byte view of
        ``header.payload_len``): sealed by the first key, the payload encrypted into a buffer of
        its own where this ring encrypts. ValueError for a payload over MAX_PAYLOAD."""
        n = payload.nbytes
        if n > MAX_PAYLOAD:
            raise ValueError(f"payload is {n} bytes; a sealed chunk holds at most {MAX_PAYLOAD}")
        plain = header if header.seal is None else dataclasses.replace(header, seal=None)
        key_id, salt = self.key_ids[0], os.urandom(16)
        aead, mask = self._write_key(self._masters[key_id], salt)
        info = _info(plain, key_id, salt, self.encrypt)
        if self.encrypt:
            out = bytearray(n + TAG)
            aead.encrypt_into(_NONCE, payload, info, out)
            stored, tag = memoryview(out)[:n], bytes(out[n:])
        else:
            stored, tag = payload, aead.encrypt(_NONCE, info, payload)[-TAG:]
        seal = Seal(key_id, salt, tag, self.encrypt)
        return _masked(plain, mask, seal), stored

    def open(
        self, header: ChunkHeader, stored: memoryview, dest: memoryview | None
    ) -> tuple[ChunkHeader, memoryview]:
        """Check a sealed chunk read from a tier (see `open_chunk`): the header as its writer gave
        it (unmasked, no seal) and the payload. Raises Rejected("forged")."""
        seal = header.seal
        master = self._masters.get(seal.key_id)
        if master is None:
            raise Rejected("forged", "sealed with a key this ring does not hold")
        aead, mask = self._write_key(master, seal.salt)
        plain = _masked(header, mask, None)
        info = _info(plain, seal.key_id, seal.salt, seal.encrypted)
        n = header.payload_len
        if seal.encrypted:
            if stored.nbytes < n + TAG or stored.readonly:
                raise ValueError(f"stored must be writable with room for the tag ({n + TAG} bytes)")
            out = dest[:n] if dest is not None else memoryview(bytearray(n))
            stored[n : n + TAG] = seal.tag
            try:
                aead.decrypt_into(_NONCE, stored[: n + TAG], info, out)
            except Exception as exc:  # InvalidTag: out holds no trusted byte
                raise Rejected("forged", f"tag mismatch ({type(exc).__name__})") from None
            return plain, out
        if stored.nbytes != n:
            raise Rejected("corrupt", f"payload is {stored.nbytes} bytes, header says {n}")
        tag = aead.encrypt(_NONCE, info, stored)[-TAG:]
        if not hmac.compare_digest(tag, seal.tag):
            raise Rejected("forged", "tag mismatch")
        return plain, stored

    def _write_key(self, master: bytes, salt: bytes):
        """The AEAD and the mask of one write: keyed BLAKE2b of its salt."""
        d = hashlib.blake2b(salt, key=master, digest_size=48, person=b"kvtier-write").digest()
        return self._aead(d[:32]), _MASK.unpack(d[32:])


def open_chunk(
    ring: KeyRing | None, header: ChunkHeader, stored: memoryview, dest: memoryview | None
) -> tuple[ChunkHeader, memoryview]:
    """The header (as its writer gave it: unmasked, no seal) and payload a tier may hand on, of a chunk whose
    ``header`` it read and whose payload bytes it holds in ``stored``. A plain or MAC'd chunk's
    bytes are checked where they are (``stored``: exactly ``payload_len`` bytes, in ``dest``
    where the caller gave one); an encrypted one's are decrypted into ``dest`` (or a new buffer),
    ``stored`` then holding the ciphertext and TAG more writable bytes. Raises Rejected."""
    check_seal(ring, header)
    if header.seal is None:
        if not header.verify(stored):
            raise Rejected("corrupt", "payload checksum mismatch")
        return header, stored
    return ring.open(header, stored, dest)


def check_seal(ring: KeyRing | None, header: ChunkHeader) -> None:
    """Raise Rejected for a chunk ``ring`` could never open, from its header alone: a tier reads
    no payload byte of a plain chunk where keys are required, nor of another key's seal."""
    if header.seal is None:
        if ring is not None:
            raise Rejected("forged", "a plain chunk (no tag) where a key is required")
    elif ring is None:
        raise Rejected("unverifiable", "a sealed chunk, and this tier holds no key")
    elif header.seal.key_id not in ring.key_ids:
        raise Rejected("forged", "sealed with a key this ring does not hold")


def stored_len(header: ChunkHeader) -> int:
    """Bytes a reader holds a payload in before `open_chunk`: an encrypted one's tag follows it."""
    return header.payload_len + (TAG if header.encrypted else 0)


def adopt(tiers, ring: KeyRing | None) -> None:
    """Give ``ring`` to each tier of ``tiers`` that seals (it has an ``auth`` attribute: disk,
    Redis) and was built without one. A tier built with another ring is refused (ValueError);
    an in-process tier (no ``auth``) needs none: no other process writes to it."""
    if ring is None:
        return
    sealing = [t for t in tiers if hasattr(t, "auth")]
    for tier in sealing:  # every one checked before any is changed
        if tier.auth is not None and not ring.same_keys(tier.auth):
            raise ValueError(f"tiers: {tier.name} was built with other keys than the store's auth_keys")
    for tier in sealing:
        if tier.auth is None:
            tier.auth = ring


_noted = threading.Event()


def note_unauthenticated(tiers) -> None:
    """Log once per process that the chunks of ``tiers`` that seal but hold no ring are not
    authenticated: any process that can write to them can plant KV."""
    names = [t.name for t in tiers if hasattr(t, "auth") and t.auth is None]
    if names and not _noted.is_set():
        _noted.set()
        log.warning(
            "kvtier: chunks in tier(s) %s are not authenticated (no key): any process that can write "
            "to them can plant KV that is loaded as a hit; give auth_keys or set %s",
            ", ".join(names),
            ENV,
        )


def _split(keys, name: str) -> list[bytes]:
    """The keys as bytes: one str or bytes, or a list of them; a str may hold several, comma
    separated. Messages name the setting and a key's place, never its bytes."""
    given = [keys] if isinstance(keys, str | bytes) else keys
    if not isinstance(given, list | tuple) or not given:
        raise ValueError(f"{name}: a key or a list of keys, got {type(keys).__name__}")
    out: list[bytes] = []
    for k in given:
        if isinstance(k, str):
            out += [p.strip().encode() for p in k.split(",")]
        elif isinstance(k, bytes):
            out.append(k)
        else:
            raise ValueError(f"{name}: each key a str or bytes, got {type(k).__name__}")
    for i, k in enumerate(out):
        if len(k) < MIN_KEY_BYTES:
            raise ValueError(
                f"{name}: key {i + 1} of {len(out)} is shorter than {MIN_KEY_BYTES} bytes "
                "(make one with `openssl rand -hex 32`)"
            )
    return out


def _master(key: bytes) -> bytes:
    """The 32-byte secret kvtier keys with: any key's bytes, hashed to one length."""
    return hashlib.blake2b(key, digest_size=32, person=b"kvtier-key").digest()


def _key_id(master: bytes) -> bytes:
    """What a header names its key by: keyed BLAKE2b of nothing, which does not reveal the key."""
    return hashlib.blake2b(b"", key=master, digest_size=8, person=b"kvtier-key-id").digest()


def _info(plain: ChunkHeader, key_id: bytes, salt: bytes, encrypted: bool) -> bytes:
    """Every header field the tag covers, in one unambiguous string (the plain header packed)."""
    return _DOMAIN + bytes([MACS["aes256-gcm"], int(encrypted)]) + key_id + salt + plain.sealed_fields()


def _masked(header: ChunkHeader, mask: tuple[int, int], seal: Seal | None) -> ChunkHeader:
    """``header`` with its checksum and group XORed with ``mask`` (masking and unmasking alike)."""
    return dataclasses.replace(
        header, checksum=header.checksum ^ mask[0], group=header.group ^ mask[1], seal=seal
    )
