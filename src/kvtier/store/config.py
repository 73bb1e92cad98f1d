"""StoreConfig: the knobs of a `KVStore`, checked when made."""

from __future__ import annotations

from dataclasses import dataclass

from .auth import KeyRing
from .keys import HASHES
from .policy import EvictionPolicy

WRITE_POLICIES = ("write_through", "write_back")


@dataclass(slots=True)
class StoreConfig:
    """chunk_tokens: tokens per chunk, a multiple of the cache's block size (the unit of keys,
    tiers and eviction). host_capacity_bytes: pool bytes the host index may hold (None: the pool
    less max(an eighth, two chunks), the headroom for lower-tier reads not promoted and for
    write-back spills in flight). host_policy: "lru", "arc" or an EvictionPolicy.
    write_policy: "write_through" (each saved chunk is pushed down by the writer thread once its
    copy landed) or "write_back" (pushed only when the host evicts it). promote: chunks read from
    a lower tier stay in the host and are copied to the tiers above the one that had them.
    tp_rank / tp_size / salt: key isolation (see `KeyExtra`). hash_name: key hash (`keys.py`).
    fetch_wait_s: how long a load waits for a chunk another request is saving or reading.
    alloc_timeout_s: how long a save or read waits for pool room (0: one harvest, no sleep).
    prefetch_workers: threads that run ``prefetch`` and read-ahead. read_ahead: once a load
    reads a chunk from a lower tier, how many of the following chunks are read in the background
    meanwhile (promote only; 0: none).
    auth_keys: the keys that seal the chunks of the lower tiers that other processes can write
    (disk, Redis: `auth.KeyRing`): one, or a list whose first seals and all open (rotation); each
    a str or bytes of at least 16 bytes; None: $KVTIER_AUTH_KEYS (comma-separated) where set, else
    no key (chunks not authenticated). Checked into a `KeyRing` (its repr shows no key). The
    store gives it to every such tier built without one. encrypt_chunks: those tiers store the
    payloads AES-256-GCM-encrypted too (needs keys).
    """

    chunk_tokens: int = 256
    host_capacity_bytes: int | None = None
    host_policy: str | EvictionPolicy = "lru"
    write_policy: str = "write_through"
    promote: bool = True
    tp_rank: int = 0
    tp_size: int = 1
    salt: bytes = b""
    hash_name: str = "sha256"
    fetch_wait_s: float = 0.5
    alloc_timeout_s: float = 0.0
    prefetch_workers: int = 2
    read_ahead: int = 4
    auth_keys: KeyRing | str | bytes | list | None = None
    encrypt_chunks: bool = False

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.hash_name not in HASHES:
            raise ValueError(f"hash_name must be one of {HASHES}, got {self.hash_name!r}")
        for name in ("fetch_wait_s", "alloc_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name} must be seconds >= 0, got {value!r}")
        if not isinstance(self.prefetch_workers, int) or self.prefetch_workers < 1:
            raise ValueError(f"prefetch_workers must be an int >= 1, got {self.prefetch_workers!r}")
        if isinstance(self.read_ahead, bool) or not isinstance(self.read_ahead, int) or self.read_ahead < 0:
            raise ValueError(f"read_ahead must be an int >= 0, got {self.read_ahead!r}")
        if not isinstance(self.promote, bool):
            raise ValueError(f"promote must be a bool, got {self.promote!r}")
        if not isinstance(self.encrypt_chunks, bool):
            raise ValueError(f"encrypt_chunks must be a bool, got {self.encrypt_chunks!r}")
        self.auth_keys = KeyRing.resolve(self.auth_keys, self.encrypt_chunks, "auth_keys")

    def host_capacity(self, pool_capacity: int, span: int) -> int:
        """The host index's capacity for a pool of ``pool_capacity`` and slots of ``span``."""
        cap = self.host_capacity_bytes
        if cap is None:
            cap = pool_capacity - max(2 * span, pool_capacity // 8)
        if isinstance(cap, bool) or not isinstance(cap, int) or not span <= cap <= pool_capacity:
            raise ValueError(
                f"host_capacity_bytes must be an int in [{span}, pool capacity {pool_capacity}] "
                f"(one chunk takes {span} B), got {cap!r}"
            )
        return cap
