"""VllmSettings: the connector's knobs, read from vLLM's ``kv_connector_extra_config``."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvtier.store.keys import HASHES

WRITE_POLICIES = ("write_through", "write_back")
# vLLM 0.33's KVCacheLayout names, as `kvtier.layout.VLLM_ORDERS` (which imports torch: the
# scheduler side does not); a test keeps the two equal.
VLLM_ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
KV_LAYOUTS = ("auto", "any", *VLLM_ORDERS)


@dataclass(slots=True)
class VllmSettings:
    """Every setting of ``kv_connector_extra_config`` (unknown names are an error).

    chunk_tokens: tokens per stored chunk, a multiple of vLLM's block size (None: 16 blocks);
        the unit of lookup, save, load and eviction. A local prefix hit that ends inside a chunk
        takes no kvtier hit (a chunk is never loaded over blocks vLLM already shares).
    host_bytes: the pinned pool per worker (the host tier and the landing zone of lower tiers).
    disk_path / disk_bytes: a local `DiskTier` per worker (None: no disk tier).
    redis_url / redis_cluster: a `RedisTier` shared by instances (None: no Redis).
    write_policy: "write_through" (each saved chunk pushed down at once) or "write_back".
    model: the identity keys are salted with (None: vLLM's model name and revision).
    salt: a per-tenant secret string mixed into every key. hash_name: kvtier's key hash.
    layerwise: layer-pipelined loads (``wait_for_layer_load`` waits for one layer): they take
        the engine's layer-major "kernel" path (a UVA kernel per layer over every chunk, on a
        quarter of the SMs), so attention of layer l starts once l + 1 layers landed; needs vLLM's
        PIECEWISE CUDA graphs. False: the whole-job DMA paths (staged / batch: no SM but short
        scatters, closer to the link), one wait for the whole load before the forward.
    prefetch_timeout_s: how long a request waits ("ask again") for a lower tier's read
        before it is scheduled with what the host holds.
    index_entries: chunks the scheduler remembers as held (an LRU, ~100 B each).
    engine_path / staging_bytes: `EngineConfig`'s path and staging memory.
    kv_layout: the KV cache layout the connector asks vLLM for (`get_required_kvcache_layout`):
        "auto" asks for BLHNC (a block of every layer one contiguous run) where the attention
        backend accepts it, else nothing; "any" asks for nothing (vLLM's own choice); an order
        name asks for that order. VLLM_KV_CACHE_LAYOUT, where set, wins, and vLLM ignores (with a
        warning) an order its backends do not accept.
    """

    chunk_tokens: int | None = None
    host_bytes: int = 4 << 30
    disk_path: str | None = None
    disk_bytes: int = 64 << 30
    redis_url: str | None = None
    redis_cluster: bool = False
    write_policy: str = "write_through"
    model: str | None = None
    salt: str = ""
    hash_name: str = "sha256"
    layerwise: bool = True
    prefetch_timeout_s: float = 2.0
    index_entries: int = 1 << 20
    engine_path: str = "auto"
    staging_bytes: int = 256 << 20
    kv_layout: str = "auto"

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes", "index_entries", "staging_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_connector_extra_config[{name!r}]: an int >= 1, got {value!r}")
        ct = self.chunk_tokens
        if ct is not None and (isinstance(ct, bool) or not isinstance(ct, int) or ct < 1):
            raise ValueError(f"kv_connector_extra_config['chunk_tokens']: an int >= 1, got {ct!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"kv_connector_extra_config['write_policy']: one of {WRITE_POLICIES}, "
                f"got {self.write_policy!r}"
            )
        if self.hash_name not in HASHES:
            raise ValueError(
                f"kv_connector_extra_config['hash_name']: one of {HASHES}, got {self.hash_name!r}"
            )
        for name in ("redis_cluster", "layerwise"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kv_connector_extra_config[{name!r}]: a bool, got {getattr(self, name)!r}")
        t = self.prefetch_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or t < 0:
            raise ValueError(f"kv_connector_extra_config['prefetch_timeout_s']: seconds >= 0, got {t!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(
                f"kv_connector_extra_config['kv_layout']: one of {KV_LAYOUTS}, got {self.kv_layout!r}"
            )
        if not isinstance(self.salt, str):
            raise ValueError(f"kv_connector_extra_config['salt']: a str, got {self.salt!r}")

    @classmethod
    def from_extra(cls, extra: dict | None) -> VllmSettings:
        """Settings from ``kv_connector_extra_config`` (kvtier's keys may sit under "kvtier")."""
        extra = dict(extra or {})
        extra = dict(extra.get("kvtier", extra))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown settings {unknown}; known: {sorted(known)}")
        return cls(**extra)

    def chunk_tokens_for(self, block_size: int) -> int:
        """chunk_tokens for vLLM's ``block_size``, checked against it."""
        ct = self.chunk_tokens if self.chunk_tokens is not None else 16 * block_size
        if ct % block_size:
            raise ValueError(
                f"kv_connector_extra_config['chunk_tokens']: a multiple of block_size={block_size}, got {ct}"
            )
        return ct
