"""VllmSettings: the connector's knobs, read from vLLM's ``kv_connector_extra_config``, each
checked when the connector is made (``setting_checks``: sizes, paths, URLs, numbers) with an
error naming it as the operator typed it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvtier.integrations import setting_checks as check
from kvtier.store.auth import KeyRing
from kvtier.store.keys import HASHES

WRITE_POLICIES = ("write_through", "write_back")
# vLLM 0.33's KVCacheLayout names, as `kvtier.layout.VLLM_ORDERS` (which imports torch: the
# scheduler side does not); a test keeps the two equal.
VLLM_ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
KV_LAYOUTS = ("auto", "any", *VLLM_ORDERS)
# `kvtier.engine.Path`'s values (that module imports torch: the scheduler side does not); a test
# keeps the two equal.
ENGINE_PATHS = ("auto", "staged", "kernel", "batch")
LOAD_ASYNC = ("auto", "always", "never")
CHOICES = ("auto", "load")
EXTRA = "kv_connector_extra_config"


@dataclass(slots=True)
class VllmSettings:
    """Every setting of ``kv_connector_extra_config`` (unknown names are an error). Sizes
    (``host_bytes``, ``disk_bytes``, ``staging_bytes``) take bytes or a string with a unit
    ("32GiB", "512MiB", "64GB"; `setting_checks.byte_size`) and hold bytes once checked.

    chunk_tokens: tokens per stored chunk, a multiple of vLLM's block size (None: 16 blocks; one
        block for a model with Mamba or linear-attention state, whose state vLLM keeps only where
        a step ends on a block boundary); the unit of lookup, save, load and eviction. Where vLLM's
        own prefix hit ends inside a chunk, only that chunk's blocks past it are loaded (never over
        blocks vLLM computed or shares).
    host_bytes: the pinned pool per worker (the host tier and the landing zone of lower tiers);
        at least three chunks (checked once the worker knows a chunk's size).
    disk_path / disk_bytes: a local `DiskTier` per worker (None: no disk tier); the directory
        exists and is writable, or can be created.
    redis_url / redis_cluster: a `RedisTier` shared by instances (None: no Redis): redis://,
        rediss:// (TLS) or unix://, as redis-py takes it.
    write_policy: "write_through" (each saved chunk pushed down at once) or "write_back".
    model: the identity keys are salted with (None: vLLM's model name and revision).
    salt: a per-tenant secret string mixed into every key. hash_name: kvtier's key hash.
    auth_keys: the key, or list of keys (the first seals, all open: rotation), that seals every
        chunk of the disk and Redis tiers, each a str of at least 16 bytes; none: the keys in
        $KVTIER_AUTH_KEYS where set, else chunks are not authenticated (`kvtier.store.auth`).
        Checked into a `KeyRing`, whose repr shows no key. encrypt_chunks: those tiers store the
        payloads AES-256-GCM-encrypted too (needs keys).
    layerwise: layer-pipelined loads (``wait_for_layer_load`` waits for one layer): they take
        the engine's layer-major "kernel" path (a UVA kernel per layer over every chunk, on a
        quarter of the SMs), so attention of layer l starts once l + 1 layers landed; needs vLLM's
        PIECEWISE CUDA graphs unless ``full_graphs``. False: the whole-job DMA paths (staged /
        batch: no SM but short scatters, closer to the link), one wait for the whole load before
        the forward.
    full_graphs: with ``layerwise``, keep vLLM's FULL CUDA graphs: each layer's wait is a device
        wait on a per-layer "landed" flag (`kvtier.engine.flags`), captured into the graph once; a
        step with loads re-arms the flags before the forward. Off by default until a real vLLM
        run confirms it; without ``layerwise`` the graphs are full anyway (nothing changes).
    load_async: when a hit the host holds whole is loaded in the background, the request waiting
        out of the batch until its blocks landed (vLLM's asynchronous load), rather than in the
        step that computes it: "auto" (while other requests run: their steps then never wait for
        the load, and the load takes the whole-job DMA path, holding no SM beside them; with
        nothing else running, in the step, layer by layer, for the lowest first token), "always",
        or "never". A hit that needs a lower tier's read (disk, Redis) always loads in the
        background: a step never waits for a lower tier.
    choice: "auto": per request, kvtier's planner chooses to load the hit, to load its first
        chunks and let vLLM prefill the rest, or to recompute it, whichever gives the earlier first
        token by this engine's own measured rates (its prefill per step, each tier's delivered
        read rate); "load": every held chunk is loaded (the reads still end at
        ``prefetch_timeout_s``).
    prefetch_timeout_s: the longest a lower tier's read may keep a request waiting (the plan's
        deadline is never later), and, with a disk or Redis, the longest a request waits after a
        start for the workers' first report of what their tiers hold.
    gil_switch_interval_s: the Python switch interval the worker lowers the process's to at start
        (`sys.setswitchinterval`; never raised): the longest vLLM's forward thread waits to get the
        interpreter back from kvtier's saver and loader threads (Python's own default: 5 ms). 0
        leaves Python's.
    index_entries: chunks the scheduler remembers as held (an LRU, ~100 B each).
    engine_path / staging_bytes: `EngineConfig`'s path and staging memory.
    kv_layout: the KV cache layout the connector asks vLLM for (`get_required_kvcache_layout`):
        "auto" asks for BLHNC (a block of every layer one contiguous run) where the attention
        backend accepts it, else nothing; "any" asks for nothing (vLLM's own choice); an order
        name asks for that order. VLLM_KV_CACHE_LAYOUT, where set, wins, and vLLM ignores (with a
        warning) an order its backends do not accept.
    where: how errors name these settings: ``kv_connector_extra_config`` or, for settings in a
        nested block, ``kv_connector_extra_config['kvtier']``.
    """

    chunk_tokens: int | None = None
    host_bytes: int | str = 4 << 30
    disk_path: str | None = None
    disk_bytes: int | str = 64 << 30
    redis_url: str | None = None
    redis_cluster: bool = False
    write_policy: str = "write_through"
    model: str | None = None
    salt: str = ""
    hash_name: str = "sha256"
    layerwise: bool = True
    full_graphs: bool = False
    load_async: str = "auto"
    choice: str = "auto"
    prefetch_timeout_s: float = 2.0
    gil_switch_interval_s: float = 0.0005
    index_entries: int = 1 << 20
    engine_path: str = "auto"
    staging_bytes: int | str = 256 << 20
    kv_layout: str = "auto"
    auth_keys: KeyRing | str | list | None = field(default=None, repr=False)
    encrypt_chunks: bool = False
    where: str = field(default=EXTRA, repr=False, compare=False)

    def __post_init__(self) -> None:
        def name(key: str) -> str:
            return f"{self.where}[{key!r}]"

        for key in ("host_bytes", "disk_bytes", "staging_bytes"):
            setattr(self, key, check.byte_size(getattr(self, key), name(key)))
        check.whole(self.index_entries, name("index_entries"))
        if self.chunk_tokens is not None:
            check.whole(self.chunk_tokens, name("chunk_tokens"))
        for key, allowed in (
            ("write_policy", WRITE_POLICIES),
            ("hash_name", HASHES),
            ("kv_layout", KV_LAYOUTS),
            ("engine_path", ENGINE_PATHS),
            ("load_async", LOAD_ASYNC),
            ("choice", CHOICES),
        ):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{name(key)}: one of {allowed}, got {getattr(self, key)!r}")
        for key in ("redis_cluster", "layerwise", "full_graphs", "encrypt_chunks"):
            setattr(self, key, check.flag(getattr(self, key), name(key)))
        self.prefetch_timeout_s = check.seconds(self.prefetch_timeout_s, name("prefetch_timeout_s"), True)
        self.gil_switch_interval_s = check.seconds(
            self.gil_switch_interval_s, name("gil_switch_interval_s"), True
        )
        if not isinstance(self.salt, str):
            raise ValueError(f"{name('salt')}: a str, got {self.salt!r}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"{name('model')}: a non-empty str (or none: vLLM's model), got {self.model!r}")
        if self.disk_path is not None:
            check.disk_dir(self.disk_path, name("disk_path"))
        if self.redis_url is not None:
            check.redis_url(self.redis_url, name("redis_url"))
        self.auth_keys = KeyRing.resolve(self.auth_keys, self.encrypt_chunks, name("auth_keys"))

    @classmethod
    def from_extra(cls, extra: dict | None) -> VllmSettings:
        """Settings from ``kv_connector_extra_config``; kvtier's keys may sit in a "kvtier" block,
        and then nothing may sit beside it (a setting there would be ignored)."""
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"{EXTRA}: a dict of settings, got {type(extra).__name__}")
        extra, where = dict(extra or {}), EXTRA
        if "kvtier" in extra:
            block = extra.pop("kvtier")
            if extra:
                raise ValueError(
                    f"{EXTRA}: {sorted(map(str, extra))} beside the 'kvtier' block would be ignored; "
                    "put every kvtier setting inside 'kvtier'"
                )
            if not isinstance(block, dict):
                raise ValueError(f"{EXTRA}['kvtier']: a dict of settings, got {type(block).__name__}")
            extra, where = dict(block), f"{EXTRA}['kvtier']"
        check.refuse_unknown(extra, {f.name for f in fields(cls)} - {"where"}, where)
        return cls(**extra, where=where)

    @property
    def flag_waits(self) -> bool:
        """Whether the worker's layer waits are waits on per-layer flags (``layerwise`` and
        ``full_graphs``): vLLM may then capture them into FULL CUDA graphs."""
        return self.layerwise and self.full_graphs

    def check_host_bytes(self, chunk_nbytes: int) -> None:
        """ValueError naming ``host_bytes`` when the pinned pool cannot hold the host tier for
        chunks of ``chunk_nbytes`` (asked by the worker, once a chunk's size is known, before
        it allocates anything)."""
        check.pool_room(self.host_bytes, chunk_nbytes, f"{self.where}['host_bytes']")

    def chunk_tokens_for(self, block_size: int) -> int:
        """chunk_tokens for vLLM's ``block_size``, checked against it."""
        ct = self.chunk_tokens if self.chunk_tokens is not None else 16 * block_size
        if ct % block_size:
            raise ValueError(f"{self.where}['chunk_tokens']: a multiple of block_size={block_size}, got {ct}")
        return ct
