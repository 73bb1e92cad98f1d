"""The chunk header: what a stored payload is, and the checksum that proves it is intact.

Serialized with ``struct`` (little-endian), itself protected by a CRC so a torn or flipped
header is caught before any field of it is trusted. Version 1, a plain chunk:

    magic "KVTC" | version u16 (1) | algo u8 | pad u8 | header_len u32 | payload_len u64 |
    checksum u64 | key_len u8 key | ndim u8 shape u64*ndim | dtype_len u8 dtype |
    layout_len u8 layout | [group u64, only where nonzero] |
    header_crc u32 (zlib.crc32 of all bytes before it)

Version 2, a sealed chunk (``Seal``: a tier with a key ring wrote it, `auth.KeyRing`): the same
fields, the flags byte in place of the pad (bit 0: the payload is encrypted), the group always
present, then the seal before the CRC:

    ... layout | group u64 | mac u8 | key_id 8 bytes | salt 16 bytes | tag 16 bytes | header_crc u32

A sealed header's checksum and group are stored masked (`auth` unmasks them once the tag
verified). A reader that knows only version 1 refuses version 2 (a miss), and a reader of both
never takes one for the other.

Payload checksum: xxh3-64 by default, several times faster than zlib.crc32 (and than blake2b)
on a CPU, so verifying a chunk on every read costs little next to reading it.
It guards against torn writes and bit rot, not against an attacker: a sealed chunk's tag does.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from dataclasses import dataclass

import xxhash

from .keys import check_key
from .payload import as_view

MAGIC = b"KVTC"
VERSION, SEALED_VERSION = 1, 2
# "none": no checksum, only for a chunk a key ring seals (its tag covers the payload instead).
ALGOS = {"xxh3_64": 1, "crc32": 2, "none": 0}
_ALGO_NAMES = {v: k for k, v in ALGOS.items()}
MACS = {"aes256-gcm": 1}  # a seal's tag: AES-256-GCM under a key made for the write (`auth`)
_MAC_NAMES = {v: k for k, v in MACS.items()}
_FIXED = struct.Struct("<4sHBBIQQ")
_CRC = struct.Struct("<I")
_GROUP = struct.Struct("<Q")
_SEAL = struct.Struct("<QB8s16s16s")  # group, mac, key_id, salt, tag
_ENCRYPTED = 1  # flags bit of a sealed header
MAX_HEADER_BYTES = 1024  # bounds what a reader reads before it can check anything


class HeaderError(ValueError):
    """Bytes that are not a valid header (torn, corrupted, or another format/version)."""


@dataclass(frozen=True, slots=True)
class Seal:
    """What makes a chunk authentic (`auth.KeyRing` makes and checks it). key_id: names the
    ring's key that sealed it (derived from the key, which it does not reveal). salt: random per
    write; the AES key of this one write is derived from it. tag: AES-GCM's tag over the
    header's fields and the payload. encrypted: the payload is AES-GCM's ciphertext."""

    key_id: bytes
    salt: bytes
    tag: bytes
    encrypted: bool = False
    mac: str = "aes256-gcm"

    def __post_init__(self) -> None:
        for name, n in (("key_id", 8), ("salt", 16), ("tag", 16)):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != n:
                raise ValueError(f"{name} must be {n} bytes, got {value!r}")
        if self.mac not in MACS:
            raise ValueError(f"mac must be one of {tuple(MACS)}, got {self.mac!r}")
        if not isinstance(self.encrypted, bool):
            raise ValueError(f"encrypted must be a bool, got {self.encrypted!r}")


def payload_checksum(payload, algo: str = "xxh3_64") -> int:
    view = as_view(payload)
    if algo == "xxh3_64":
        return xxhash.xxh3_64_intdigest(view)
    if algo == "crc32":
        return zlib.crc32(view)
    if algo == "none":
        return 0
    raise ValueError(f"algo must be one of {tuple(ALGOS)}, got {algo!r}")


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """key: the chunk key. shape / dtype / layout: how the payload bytes are read back as
    KV (e.g. ``(layers, 2, tokens, heads, dim)``, "bfloat16", "vllm_flash") — carried, not
    interpreted, by tiers. payload_len: bytes. checksum: of the payload, by ``algo`` ("none": 0,
    for a chunk only a tier that seals it stores: its tag covers the payload instead).
    group: what ties chunks written as one unit (e.g. the pieces of one SGLang page) to that
    write, so a reader that assembles the unit can tell one write from a mix of two; 0: none.
    Tiers carry it, never interpret it. seal: None for a plain chunk; a sealed one's `Seal`
    (its checksum and group are then as stored, masked, until `auth.KeyRing.open` opens it).
    """

    key: bytes
    shape: tuple[int, ...]
    dtype: str
    layout: str
    payload_len: int
    checksum: int
    algo: str = "xxh3_64"
    group: int = 0
    seal: Seal | None = None

    def __post_init__(self) -> None:
        check_key(self.key)
        if not isinstance(self.shape, tuple) or len(self.shape) > 16:
            raise ValueError(f"shape must be a tuple of at most 16 ints, got {self.shape!r}")
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"shape must hold non-negative ints, got {self.shape!r}")
        for name in ("dtype", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not 0 < len(value.encode()) < 256:
                raise ValueError(f"{name} must be a non-empty str under 256 bytes, got {value!r}")
        if not isinstance(self.payload_len, int) or self.payload_len < 0:
            raise ValueError(f"payload_len must be an int >= 0, got {self.payload_len!r}")
        if not isinstance(self.checksum, int) or not 0 <= self.checksum < 2**64:
            raise ValueError(f"checksum must be an int in [0, 2**64), got {self.checksum!r}")
        if self.algo not in ALGOS:
            raise ValueError(f"algo must be one of {tuple(ALGOS)}, got {self.algo!r}")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or not 0 <= self.group < 2**64:
            raise ValueError(f"group must be an int in [0, 2**64), got {self.group!r}")
        if self.seal is not None and not isinstance(self.seal, Seal):
            raise ValueError(f"seal must be a Seal or None, got {type(self.seal).__name__}")

    @property
    def encrypted(self) -> bool:
        """The stored payload is ciphertext (only a key ring that holds its key can read it)."""
        return self.seal is not None and self.seal.encrypted

    @classmethod
    def for_payload(
        cls,
        key: bytes,
        payload,
        shape: tuple[int, ...],
        dtype: str,
        layout: str,
        algo: str = "xxh3_64",
        group: int = 0,
    ):
        """The header of ``payload`` (its length and checksum computed here)."""
        view = as_view(payload)
        return cls(key, tuple(shape), dtype, layout, view.nbytes, payload_checksum(view, algo), algo, group)

    def verify(self, payload) -> bool:
        """True if ``payload`` has this header's length and checksum (the plain check: a sealed
        chunk read from a tier is checked by its key ring instead; algo "none" checks nothing,
        so never verifies)."""
        view = as_view(payload)
        if self.algo == "none" or view.nbytes != self.payload_len:
            return False
        return payload_checksum(view, self.algo) == self.checksum

    def pack(self) -> bytes:
        """Version 1 for a plain header, version 2 for a sealed one. ValueError for a plain
        header without a checksum (algo "none")."""
        if self.seal is None and self.algo == "none":
            raise ValueError("a plain header needs a checksum: algo 'none' is for a chunk a key ring seals")
        return self._pack()

    def sealed_fields(self) -> bytes:
        """What a seal's tag covers of this header: every field but the seal, packed as version 1
        (one unambiguous string; a checksum of algo "none" too)."""
        return dataclasses.replace(self, seal=None)._pack() if self.seal is not None else self._pack()

    def _pack(self) -> bytes:
        dtype, layout = self.dtype.encode(), self.layout.encode()
        seal = self.seal
        if seal is None:
            tail, version, flags = _GROUP.pack(self.group) if self.group else b"", VERSION, 0
        else:
            tail = _SEAL.pack(self.group, MACS[seal.mac], seal.key_id, seal.salt, seal.tag)
            version, flags = SEALED_VERSION, _ENCRYPTED if seal.encrypted else 0
        body = (
            bytes([len(self.key)])
            + self.key
            + bytes([len(self.shape)])
            + struct.pack(f"<{len(self.shape)}Q", *self.shape)
            + bytes([len(dtype)])
            + dtype
            + bytes([len(layout)])
            + layout
            + tail
        )
        total = _FIXED.size + len(body) + _CRC.size
        fixed = _FIXED.pack(MAGIC, version, ALGOS[self.algo], flags, total, self.payload_len, self.checksum)
        head = fixed + body
        return head + _CRC.pack(zlib.crc32(head))

    @classmethod
    def unpack(cls, buf) -> tuple[ChunkHeader, int]:
        """Parse a header at the start of ``buf``; returns it and its length in bytes.

        Raises HeaderError on anything but a whole, intact header of version 1 or 2.
        """
        view = memoryview(buf).cast("B")
        if view.nbytes < _FIXED.size:
            raise HeaderError(f"header truncated: {view.nbytes} bytes")
        magic, version, algo, flags, total, payload_len, checksum = _FIXED.unpack_from(view)
        if magic != MAGIC:
            raise HeaderError(f"bad magic {magic!r}")
        if version not in (VERSION, SEALED_VERSION):
            raise HeaderError(f"unsupported header version {version}")
        if not _FIXED.size + _CRC.size < total <= min(view.nbytes, MAX_HEADER_BYTES):
            raise HeaderError(f"bad or truncated header length {total} (have {view.nbytes} bytes)")
        (crc,) = _CRC.unpack_from(view, total - _CRC.size)
        if zlib.crc32(view[: total - _CRC.size]) != crc:
            raise HeaderError("header checksum mismatch")
        try:
            pos = _FIXED.size
            key, pos = _take(view, pos)
            ndim = view[pos]
            shape = struct.unpack_from(f"<{ndim}Q", view, pos + 1)
            pos += 1 + 8 * ndim
            dtype, pos = _take(view, pos)
            layout, pos = _take(view, pos)
            group, seal = 0, None
            if version == SEALED_VERSION:
                if flags & ~_ENCRYPTED or pos + _SEAL.size != total - _CRC.size:
                    raise HeaderError("sealed header fields do not fill header_len")
                group, mac, key_id, salt, tag = _SEAL.unpack_from(view, pos)
                seal = Seal(key_id, salt, tag, bool(flags & _ENCRYPTED), _MAC_NAMES[mac])
                pos += _SEAL.size
            elif flags or algo == ALGOS["none"]:
                raise HeaderError(f"a plain header with flags {flags} and algo {algo}")
            elif pos + _GROUP.size == total - _CRC.size:
                (group,) = _GROUP.unpack_from(view, pos)
                pos += _GROUP.size
            if pos != total - _CRC.size:
                raise HeaderError("header fields do not fill header_len")
            header = cls(
                key,
                tuple(shape),
                dtype.decode(),
                layout.decode(),
                payload_len,
                checksum,
                _ALGO_NAMES[algo],
                group,
                seal,
            )
        except HeaderError:
            raise
        except (struct.error, IndexError, KeyError, UnicodeDecodeError, ValueError) as exc:
            raise HeaderError(f"malformed header: {exc}") from None
        return header, total


def _take(view: memoryview, pos: int) -> tuple[bytes, int]:
    n = view[pos]
    if pos + 1 + n > view.nbytes:
        raise HeaderError("header field runs past the buffer")
    return bytes(view[pos + 1 : pos + 1 + n]), pos + 1 + n
