"""The settings of kvtier's SGLang HiCache backend, read from SGLang's ``extra_config`` dict.

SGLang passes ``--hicache-storage-backend-extra-config`` (JSON) through as
``HiCacheStorageConfig.extra_config``; the backend reads its own keys from it here, checks
each once (``setting_checks``: errors name ``extra_config['<key>']`` and the value), and builds
the tiers. An unknown key is an error (a typo would otherwise silently fall back to a default),
except the keys SGLang itself reads from the same dict.

    tiers                ["disk"], ["redis"] or ["disk", "redis"]: read in this order, written to all
    disk_path            directory of the disk tier (required with "disk"): exists and writable,
                         or can be created (checked when the tiers are built, not for tiers given)
    disk_capacity_gb     bytes the disk tier may hold, in GB of 10**9 bytes (default 64)
    disk_o_direct        bypass the page cache where the filesystem allows (default true)
    disk_fsync           each put durable before it reports success (default true)
    redis_url            redis://, rediss:// (TLS) or unix:// URL (required with "redis")
    redis_cluster        the URL names a node of a Redis Cluster (default false)
    redis_ttl_s          expiry of every key in seconds (default none: the server's eviction)
    redis_timeout_s      per-command socket timeout in seconds (default 0.5)
    redis_prefix         key prefix (default "kvtier:sglang:")
    redis_part_bytes     values above this are split into parts (default 4 MiB; at least 4 KiB)
    gather_below_bytes   a page whose pieces are smaller is stored as one chunk (default 256 KiB)
    io_threads           pages moved in parallel (default 4)
    key_salt             mixed into every key: tenants with different salts never share KV
    auth_keys            the key (or list of keys: the first seals, all open) that seals every
                         chunk of both tiers, each a str of at least 16 bytes; none: the keys in
                         $KVTIER_AUTH_KEYS where set, else chunks are not authenticated (`auth`)
    encrypt_chunks       the payloads stored AES-256-GCM-encrypted too (default false; needs keys)
    kv_cache_dtype       the server's --kv-cache-dtype, needed only where SGLang's own cannot be
                         read and the pool stores uint8 (fp8): ``sglang_dtype``

Sizes (``*_bytes``) take bytes or a string with a unit ("4MiB", "256KiB", "64GB").
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvtier.integrations import setting_checks as check
from kvtier.store.auth import KeyRing

TIER_NAMES = ("disk", "redis")
# Keys SGLang (or its dynamic factory) puts in the same dict; read there, ignored here.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})
MIN_PART_BYTES = 4096  # RedisTier's smallest part


def _name(key: str) -> str:
    return f"extra_config[{key!r}]"


@dataclass(frozen=True, slots=True)
class HiCacheSettings:
    tiers: tuple[str, ...] = ("disk",)
    disk_path: str | None = None
    disk_capacity_gb: float = 64.0
    disk_o_direct: bool = True
    disk_fsync: bool = True
    redis_url: str | None = None
    redis_cluster: bool = False
    redis_ttl_s: int | None = None
    redis_timeout_s: float = 0.5
    redis_prefix: str = "kvtier:sglang:"
    redis_part_bytes: int | str = 4 << 20
    gather_below_bytes: int | str = 256 << 10
    io_threads: int = 4
    key_salt: str = ""
    kv_cache_dtype: str | None = None
    auth_keys: KeyRing | str | list | None = field(default=None, repr=False)
    encrypt_chunks: bool = False
    interface_v1: bool = field(default=False)

    def __post_init__(self) -> None:
        def put(key: str, value) -> None:
            object.__setattr__(self, key, value)  # frozen: the checked value, once

        tiers = self.tiers
        if isinstance(tiers, str) or not isinstance(tiers, list | tuple) or not tiers:
            raise ValueError(f"{_name('tiers')} must be a non-empty list of {TIER_NAMES}, got {tiers!r}")
        bad = [t for t in tiers if t not in TIER_NAMES]
        if bad or len(set(tiers)) != len(tiers):
            raise ValueError(f"{_name('tiers')} must hold each of {TIER_NAMES} at most once, got {tiers!r}")
        put("tiers", tuple(tiers))
        if "disk" in tiers and (not isinstance(self.disk_path, str) or not self.disk_path):
            raise ValueError(
                f"{_name('disk_path')} must name a directory with tier 'disk', got {self.disk_path!r}"
            )
        if "redis" in tiers and (not isinstance(self.redis_url, str) or not self.redis_url):
            raise ValueError(
                f"{_name('redis_url')} must be a redis:// URL with tier 'redis', got {self.redis_url!r}"
            )
        gb = check.positive(self.disk_capacity_gb, _name("disk_capacity_gb"), "GB")
        check.byte_size(int(gb * 1e9), f"{_name('disk_capacity_gb')}={gb!r} GB")
        check.seconds(self.redis_timeout_s, _name("redis_timeout_s"))
        check.whole(self.io_threads, _name("io_threads"))
        put("gather_below_bytes", check.byte_size(self.gather_below_bytes, _name("gather_below_bytes"), 0))
        put(
            "redis_part_bytes",
            check.byte_size(self.redis_part_bytes, _name("redis_part_bytes"), MIN_PART_BYTES),
        )
        if self.redis_ttl_s is not None:
            check.whole(self.redis_ttl_s, _name("redis_ttl_s"))
        for key in ("disk_o_direct", "disk_fsync", "redis_cluster", "interface_v1", "encrypt_chunks"):
            put(key, check.flag(getattr(self, key), _name(key)))
        for key in ("redis_prefix", "key_salt"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"{_name(key)} must be a str, got {getattr(self, key)!r}")
        if self.kv_cache_dtype is not None and (
            not isinstance(self.kv_cache_dtype, str) or not self.kv_cache_dtype
        ):
            raise ValueError(
                f"{_name('kv_cache_dtype')} must be SGLang's --kv-cache-dtype, got {self.kv_cache_dtype!r}"
            )
        # Checked into a KeyRing (its repr shows no key; errors name the setting, never a key).
        put("auth_keys", KeyRing.resolve(self.auth_keys, self.encrypt_chunks, _name("auth_keys")))

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> HiCacheSettings:
        """The settings in SGLang's ``extra_config`` (None: all defaults, which need a disk_path)."""
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"extra_config must be a dict, got {type(extra).__name__}")
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        check.refuse_unknown({k: v for k, v in extra.items() if k not in SGLANG_KEYS}, known, "extra_config")
        return cls(**{k: v for k, v in extra.items() if k in known})

    def check_locations(self) -> None:
        """``disk_path`` (a writable directory, or one that can be created) and ``redis_url`` (a
        URL redis-py takes) of the tiers named, before any is built."""
        if "disk" in self.tiers:
            check.disk_dir(self.disk_path, _name("disk_path"))
        if "redis" in self.tiers:
            check.redis_url(self.redis_url, _name("redis_url"))

    def make_tiers(self, disk_space: str | None = None, disk_writer: bool = True) -> list:
        """The tiers, in read order, once ``check_locations`` passed (a tier built before a
        failing one is closed again). disk_space: this rank's folder under ``disk_path``;
        disk_writer: False for a rank that only reads it. A Redis server or cluster that does
        not answer is a warning here (``RedisTier``), not an error: the tier runs as a miss
        until it answers."""
        from kvtier.store.disk import DiskTier
        from kvtier.store.redis_tier import RedisTier

        self.check_locations()
        out = []
        try:
            for name in self.tiers:
                if name == "disk":
                    cap = int(self.disk_capacity_gb * 1e9)
                    out.append(
                        DiskTier(
                            self.disk_path,
                            cap,
                            space=disk_space,
                            writer=disk_writer,
                            label="extra_config['disk_path']",
                            o_direct=self.disk_o_direct,
                            fsync=self.disk_fsync,
                            auth=self.auth_keys,
                        )
                    )
                else:
                    out.append(
                        RedisTier(
                            url=self.redis_url,
                            cluster=self.redis_cluster,
                            prefix=self.redis_prefix,
                            part_bytes=self.redis_part_bytes,
                            ttl_s=self.redis_ttl_s,
                            timeout_s=float(self.redis_timeout_s),
                            auth=self.auth_keys,
                        )
                    )
        except BaseException:
            for tier in out:
                tier.close()  # nothing built for a backend that does not start outlives it
            raise
        return out
