"""The settings of kvtier's SGLang HiCache backend, read from SGLang's ``extra_config`` dict.

SGLang passes ``--hicache-storage-backend-extra-config`` (JSON) through as
``HiCacheStorageConfig.extra_config``; the backend reads its own keys from it here, checks
each once, and builds the tiers. An unknown key is an error (a typo would otherwise silently
fall back to a default), except the keys SGLang itself reads from the same dict.

    tiers                ["disk"], ["redis"] or ["disk", "redis"]: read in this order, written to all
    disk_path            directory of the disk tier (required with "disk")
    disk_capacity_gb     bytes the disk tier may hold, in GB (default 64)
    disk_o_direct        bypass the page cache where the filesystem allows (default true)
    disk_fsync           each put durable before it reports success (default true)
    redis_url            redis://host:port/db (required with "redis")
    redis_cluster        the URL names a node of a Redis Cluster (default false)
    redis_ttl_s          expiry of every key in seconds (default none: the server's eviction)
    redis_timeout_s      per-command socket timeout (default 0.5)
    redis_prefix         key prefix (default "kvtier:sglang:")
    redis_part_bytes     values above this are split into parts (default 4 MiB)
    gather_below_bytes   a page whose pieces are smaller is stored as one chunk (default 256 KiB)
    io_threads           pages moved in parallel (default 4)
    key_salt             mixed into every key: tenants with different salts never share KV
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

TIER_NAMES = ("disk", "redis")
# Keys SGLang (or its dynamic factory) puts in the same dict; read there, ignored here.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})


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
    redis_part_bytes: int = 4 << 20
    gather_below_bytes: int = 256 << 10
    io_threads: int = 4
    key_salt: str = ""
    interface_v1: bool = field(default=False)

    def __post_init__(self) -> None:
        tiers = self.tiers
        if isinstance(tiers, str) or not isinstance(tiers, list | tuple) or not tiers:
            raise ValueError(f"extra_config['tiers'] must be a non-empty list of {TIER_NAMES}, got {tiers!r}")
        bad = [t for t in tiers if t not in TIER_NAMES]
        if bad or len(set(tiers)) != len(tiers):
            raise ValueError(
                f"extra_config['tiers'] must hold each of {TIER_NAMES} at most once, got {tiers!r}"
            )
        object.__setattr__(self, "tiers", tuple(tiers))
        if "disk" in tiers and (not isinstance(self.disk_path, str) or not self.disk_path):
            raise ValueError(
                f"extra_config['disk_path'] must name a directory with tier 'disk', got {self.disk_path!r}"
            )
        if "redis" in tiers and (not isinstance(self.redis_url, str) or "://" not in self.redis_url):
            raise ValueError(
                f"extra_config['redis_url'] must be a redis:// URL with tier 'redis', got {self.redis_url!r}"
            )
        _positive(self, "disk_capacity_gb", (int, float))
        _positive(self, "redis_timeout_s", (int, float))
        _positive(self, "io_threads", int)
        _positive(self, "gather_below_bytes", int, zero_ok=True)
        _positive(self, "redis_part_bytes", int)
        if self.redis_ttl_s is not None:
            _positive(self, "redis_ttl_s", int)
        for name in ("disk_o_direct", "disk_fsync", "redis_cluster", "interface_v1"):
            if not isinstance(getattr(self, name), bool | int):
                raise ValueError(f"extra_config[{name!r}] must be a bool, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))
        for name in ("redis_prefix", "key_salt"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"extra_config[{name!r}] must be a str, got {getattr(self, name)!r}")

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> HiCacheSettings:
        """The settings in SGLang's ``extra_config`` (None: all defaults, which need a disk_path)."""
        extra = dict(extra or {})
        if not isinstance(extra, dict):
            raise ValueError(f"extra_config must be a dict, got {type(extra).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in extra if k not in known and k not in SGLANG_KEYS)
        if unknown:
            raise ValueError(f"extra_config has unknown keys {unknown}; kvtier reads {sorted(known)}")
        return cls(**{k: v for k, v in extra.items() if k in known})

    def make_tiers(self, disk_space: str | None = None, disk_writer: bool = True) -> list:
        """The tiers, in read order. disk_space: this rank's folder under ``disk_path``;
        disk_writer: False for a rank that only reads it. A Redis Cluster's slot map is read
        here: an unreachable cluster fails SGLang's start, not its first request."""
        from kvtier.store.disk import DiskTier
        from kvtier.store.redis_tier import RedisTier

        out = []
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
                    )
                )
        return out


def _positive(s: HiCacheSettings, name: str, kinds, zero_ok: bool = False) -> None:
    value = getattr(s, name)
    ok = isinstance(value, kinds) and not isinstance(value, bool) and (value >= 0 if zero_ok else value > 0)
    if not ok:
        want = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"extra_config[{name!r}] must be a number {want}, got {value!r}")
