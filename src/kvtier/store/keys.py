"""Chunk keys: a hash chain over the token prefix, bound to model identity and KV layout.

Token ids are cut into chunks of ``chunk_tokens`` (a multiple of the serving engine's block
size, so a chunk is whole KV blocks). Chunk i's key is

    key_i = H(domain, extra_digest, key_{i-1}, tokens of chunk i)        key_{-1} = b""

so a key names the *whole prefix* up to the end of its chunk, not just its own tokens: the
KV of a token depends on every token before it. ``extra`` (model, KV dtype, layout, TP rank,
salt) enters every link, so KV of another model, dtype, layout or rank never matches.

The partial trailing chunk (fewer than ``chunk_tokens`` tokens) gets no key: its KV would be
shared only by requests that end at exactly the same token, and it is still being extended
by decode — it is cheaper to recompute than to store.

Hash choice: sha256 (truncated to 16 bytes) is the default. A key collision would hand one
request another's KV, and token ids come from users, so the hash must resist crafted
collisions (the reason vLLM moved its prefix cache to sha256); hashing a chunk's token ids
costs far less than moving that chunk's KV. Keying from a tensor or array avoids the
list-to-bytes step, which dominates for a long Python list. ``hash_name="xxh3_128"`` is there
for trusted single-tenant setups. Never Python's ``hash()``: it is salted per process.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

KEY_BYTES = 16
_DOMAIN = b"kvtier.chunk.v1"
HASHES = ("sha256", "xxh3_128")


@dataclass(frozen=True, slots=True)
class KeyExtra:
    """What besides the tokens decides the bytes of a chunk's KV.

    model: model identity, e.g. "meta-llama/Llama-3.1-8B@<revision>" — any string that changes
        when the weights do. kv_dtype: e.g. "bfloat16", "fp8_e4m3". layout: the KV layout name,
        e.g. "vllm_flash" or "flashinfer_hnd". tp_rank / tp_size: this rank holds only its heads.
    salt: optional per-tenant secret, so tenants can never share (or probe) each other's KV.
    """

    model: str
    kv_dtype: str
    layout: str
    tp_rank: int = 0
    tp_size: int = 1
    salt: bytes = b""

    def __post_init__(self) -> None:
        for name in ("model", "kv_dtype", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {self.tp_size!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be an int in [0, tp_size={self.tp_size}), got {self.tp_rank!r}")
        if not isinstance(self.salt, bytes):
            raise ValueError(f"salt must be bytes, got {type(self.salt).__name__}")

    def encode(self) -> bytes:
        """Canonical bytes: every field length-prefixed, so ("ab","c") ≠ ("a","bc")."""
        out = bytearray()
        for field_bytes in (self.model.encode(), self.kv_dtype.encode(), self.layout.encode(), self.salt):
            out += struct.pack("<I", len(field_bytes)) + field_bytes
        out += struct.pack("<II", self.tp_rank, self.tp_size)
        return bytes(out)


def _hasher(hash_name: str):
    if hash_name == "sha256":
        return lambda data: hashlib.sha256(data).digest()[:KEY_BYTES]
    if hash_name == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128_digest
    raise ValueError(f"hash_name must be one of {HASHES}, got {hash_name!r}")


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 (the same bytes on every host and process)."""
    if hasattr(tokens, "cpu") or hasattr(tokens, "dtype"):  # torch / numpy: vectorised, no list
        return _array_token_bytes(tokens)
    try:
        arr = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"tokens must be ints in [0, 2**32), got an element that is not ({exc})") from None
    if arr.itemsize != 4:  # pragma: no cover - every platform CPython supports has 4-byte "I"
        raise RuntimeError("array('I') is not 4 bytes on this platform")
    if sys.byteorder == "big":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def _array_token_bytes(tokens) -> bytes:
    import numpy as np

    arr = np.asarray(tokens.cpu().numpy() if hasattr(tokens, "cpu") else tokens)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**32):
        raise ValueError("tokens must be ints in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def chunk_keys(
    tokens: Sequence[int],
    chunk_tokens: int = 256,
    block_size: int = 16,
    *,
    extra: KeyExtra,
    hash_name: str = "sha256",
) -> list[bytes]:
    """Keys of the full chunks of ``tokens``: ``len(tokens) // chunk_tokens`` keys of 16 bytes.

    tokens: token ids, a sequence of ints or a 1-D integer tensor/array, shape ``[num_tokens]``.
    Key i covers tokens ``[0, (i + 1) * chunk_tokens)``; the partial trailing chunk is not keyed.
    """
    if not isinstance(extra, KeyExtra):
        raise ValueError(f"extra must be a KeyExtra, got {type(extra).__name__}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1 or chunk_tokens % block_size:
        raise ValueError(
            f"chunk_tokens must be a positive multiple of block_size={block_size}, got {chunk_tokens!r}"
        )
    h = _hasher(hash_name)
    data = _token_bytes(tokens)
    prefix = _DOMAIN + h(extra.encode())
    step = 4 * chunk_tokens
    keys: list[bytes] = []
    parent = b""
    for start in range(0, len(data) - step + 1, step):
        # The parent is fixed-length (0 or 16 bytes) and the chunk fixed-size, so the
        # concatenation is unambiguous without separators.
        parent = h(prefix + parent + data[start : start + step])
        keys.append(parent)
    return keys


def key_hex(key: bytes) -> str:
    """The printable form used in file names and Redis keys."""
    check_key(key)
    return key.hex()


def check_key(key: bytes, name: str = "key") -> None:
    """Tiers take any 8..64-byte key (chunk_keys makes 16); anything else is a caller bug."""
    if not isinstance(key, bytes) or not 8 <= len(key) <= 64:
        raise ValueError(f"{name} must be bytes of length 8..64, got {key!r:.60}")
