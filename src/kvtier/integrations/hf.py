"""HF transformers through kvtier: a `Cache` whose shared prefix comes from the store.

    kvt = KVTier.for_model(model, tiers=[DiskTier("/tmp/kv", 1 << 30)], chunk_tokens=64)
    cache = kvt.cache(input_ids)                 # lookup + load of the cached prefix (async)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=32, do_sample=False)
    cache.finish(out)                            # the request's KV into paged blocks + KVStore.save

`KVTier` owns the paged KV cache on the device (vLLM flash layout, per layer
``(2, num_blocks, block_size, num_kv_heads, head_dim)``), a `TransferEngine` and a `KVStore`.
`KVTierCache` (one request, batch 1) keeps per layer contiguous K/V ``(1, num_kv_heads, seq,
head_dim)`` for attention, like `DynamicCache`. On a prefix hit it reports the hit's length
from the start, so ``generate`` prefills only the rest of the prompt, and fills layer i from
the loaded blocks at layer i's first ``update`` — right before attention of layer i — after
``load.wait_layer(i, compute)``: layer i is read only once its bytes have landed, while later
layers are still in flight. Full-attention decoder layers only (Llama, Qwen2, Mistral without
a sliding window, ...). A split hit — recompute [0, s) while [s, n) loads — is `hf_split.py`.
"""

from __future__ import annotations

import inspect
import logging
import time
import warnings

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvtier import layout
from kvtier.device.base import Device
from kvtier.engine import EngineConfig, TransferEngine, warm_up
from kvtier.hfconfig import cache_kv_shape
from kvtier.integrations import setting_checks as check
from kvtier.pool import PinnedPool
from kvtier.store import KVStore, StoreConfig
from kvtier.store.stats import StatsLog, store_snapshot
from kvtier.store.tier import Tier

log = logging.getLogger(__name__)


class KVTier:
    """The paged KV cache of a model on ``device`` and the store underneath.

    kv_caches: per layer ``(2, num_blocks, block_size, num_kv_heads, head_dim)``, the model's
    dtype, on the device's memory (CPU for `SimDevice`). Build it with `for_model`.
    """

    def __init__(
        self,
        device: Device,
        kv_caches: list[torch.Tensor],
        pool_bytes: int,
        model: str,
        *,
        tiers=(),
        engine_options: dict | None = None,
        **store_options,
    ) -> None:
        # the store's hit rate, bytes and time per tier, every KVTIER_STATS_LOG_S while requests
        # come (made first: a bad KVTIER_STATS_LOG_S is refused before anything is allocated)
        self._stats_log = StatsLog(log, lambda: store_snapshot(self.store))
        self.device, self.compute = device, device.current_stream()
        self.kv = layout.vllm_flash(kv_caches)
        made = []  # closed again, last first, when a later part is refused: nothing outlives a failed start
        try:
            self.pool = PinnedPool(device, pool_bytes)
            made.append(self.pool.close)
            # compute_beside=False: loads take the per-layer path, an event per layer to wait on.
            # Staging no larger than the whole cache (the default is far larger than a small model needs).
            staging = min(512 << 20, max(2 * self.kv.block_nbytes, self.kv.chunk_nbytes(self.kv.num_blocks)))
            opts = dict(compute_beside=False, staging_bytes=staging)
            config = EngineConfig(**(opts | (engine_options or {})))
            self.engine = TransferEngine(device, self.kv, self.pool, config)
            made.append(self.engine.close)
            self.store = KVStore(self.engine, model, tiers=list(tiers), **store_options)
            # Every copy path's first use now, not in the first request (a save and loads back
            # into the same blocks: their bytes stay as they were).
            warm_up(self.engine, range(self.kv.num_blocks), self.store.fmt.blocks)
        except BaseException:
            for close in reversed(made):
                close()
            raise
        self.chunk_tokens = self.store.fmt.tokens
        self._free = list(range(self.kv.num_blocks))[::-1]  # plain-Python block allocator
        self.owns_device = False  # for_model made it: close() closes it too
        self._closed = False

    @classmethod
    def for_model(
        cls,
        model,
        *,
        device: Device | None = None,
        num_blocks: int = 256,
        block_size: int = 16,
        pool_bytes: int | None = None,
        tiers=(),
        model_id: str | None = None,
        **options,
    ) -> KVTier:
        """Shape the paged cache from ``model.config`` (layers, KV heads, head_dim, dtype) on the
        model's device: `CudaDevice` on CUDA, `SimDevice` on the CPU. pool_bytes: pinned host pool
        (default: room for every block twice). model_id: the identity of the weights, part of every
        key (default: the config's name_or_path, else the class name: give one for weights made
        locally). options: `StoreConfig` fields (chunk_tokens, salt, auth_keys: the keys that
        seal the chunks of disk and Redis tiers shared with other processes, ...) and engine_options
        (`EngineConfig` fields). Sizes take bytes or a string with a unit ("4GiB", "512MiB").

        Every argument is checked first, each error naming it: nothing is allocated and no thread
        started for a call that is refused."""
        # The shape the model's attention really caches (one head for multi-query); refused up
        # front, with the reason, where the paged layout cannot hold it (MLA, sliding windows).
        kv_heads, head_dim = cache_kv_shape(model.config)
        cfg = (
            model.config.get_text_config(decoder=True)
            if hasattr(model.config, "get_text_config")
            else model.config
        )
        check.whole(num_blocks, "num_blocks")
        check.whole(block_size, "block_size")
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise ValueError(f"model_id: a non-empty str naming the weights, got {model_id!r}")
        if device is not None and not isinstance(device, Device):
            raise ValueError(f"device: a kvtier Device (CudaDevice, SimDevice) or None, got {device!r}")
        _check_tiers(tiers)
        chunk_tokens = _check_options(options, block_size)
        # Bytes of one block of every layer, K and V (`layout.PagedKV.block_nbytes`, before any cache exists).
        block_nbytes = cfg.num_hidden_layers * 2 * block_size * kv_heads * head_dim * model.dtype.itemsize
        chunk_nbytes = chunk_tokens // block_size * block_nbytes
        if pool_bytes is None:  # room for every block twice, and at least the host tier's minimum
            pool_bytes = max(2 * num_blocks * block_nbytes, 3 * (-(-chunk_nbytes // 256) * 256))
        else:
            pool_bytes = check.byte_size(pool_bytes, "pool_bytes")
        check.pool_room(pool_bytes, chunk_nbytes, "pool_bytes")
        dev_t = next(model.parameters()).device
        shape = (2, num_blocks, block_size, kv_heads, head_dim)
        caches = [torch.zeros(shape, dtype=model.dtype, device=dev_t) for _ in range(cfg.num_hidden_layers)]
        name = model_id or getattr(cfg, "_name_or_path", "") or type(model).__name__
        made = device is None
        if made:
            from kvtier.device import CudaDevice, SimDevice

            device = CudaDevice(dev_t.index or 0) if dev_t.type == "cuda" else SimDevice()
        try:
            kvt = cls(device, caches, pool_bytes, name, tiers=tiers, **options)
        except BaseException:
            if made:
                device.close()  # its worker threads (SimDevice) must not outlive a refused start
            raise
        kvt.owns_device = made
        return kvt

    # -- one request -------------------------------------------------------------------------

    def cache(self, input_ids: torch.Tensor) -> KVTierCache:
        """A cache for ``input_ids`` ([1, n] or [n]): the longest stored chunk prefix of its first
        n - 1 tokens is loaded (asynchronously; at least one token is left for the model to run)."""
        self._stats_log.tick()
        tokens = _tokens(input_ids)
        t0 = time.perf_counter()
        start = self.engine.load_stream.record("hf-load-start")  # times the reads + copies
        # Blocks for every whole chunk of the first n - 1 tokens (no separate lookup: the load walks
        # the tiers once and says how much it delivers); the blocks past the hit go back at once.
        bpc = self.chunk_tokens // self.kv.block_size
        most = (len(tokens) - 1) // self.chunk_tokens * bpc
        blocks = self._alloc(min(most, len(self._free) // bpc * bpc))
        load = self.store.load(tokens[:-1], blocks) if blocks else None
        keep = load.tokens // self.kv.block_size if load is not None else 0
        self._release(blocks[keep:])  # never part of a copy: free at once
        blocks = blocks[:keep]
        if load is not None and not load.jobs:
            load = None  # nothing stored: a cold request
        return KVTierCache(self, blocks, load, t0, start)

    def _alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(
                f"need {n} KV blocks, {len(self._free)} free of {self.kv.num_blocks}: raise num_blocks"
            )
        return [self._free.pop() for _ in range(n)]

    def _release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def close(self) -> None:
        """Finish every transfer and push, then close the store, the engine, the pool and (made
        by `for_model`) the device; not the tiers. Idempotent, and safe after a failure: every
        part is closed even when one raises (a sticky device error raises in each), and the
        first error is reported once, as a RuntimeWarning, not raised."""
        if self._closed:
            return
        self._closed = True
        parts = [self.store.close, self.engine.close, self.pool.close]
        if self.owns_device:
            parts.append(self.device.close)  # last: its workers run the copies the others wait for
        first: BaseException | None = None
        for close in parts:
            try:
                close()
            except Exception as e:  # noqa: BLE001 - the rest must still be released
                first = first or e
        if first is not None:
            warnings.warn(f"KVTier.close: {first!r} (every part was closed)", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> KVTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Layer(DynamicLayer):
    """A DynamicLayer whose first `hit` positions arrive from kvtier at the first update."""

    def __init__(self, owner: KVTierCache, index: int) -> None:
        super().__init__()
        self._owner, self._index = owner, index

    def get_seq_length(self, *args, **kwargs) -> int:
        if not self.is_initialized:
            return self._owner.hit_tokens  # the loaded prefix counts before it is read
        return super().get_seq_length(*args, **kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized and self._owner.hit_tokens:
            self.keys, self.values = self._owner._arrive(self._index, key_states)
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        return super().update(key_states, value_states, *args, **kwargs)


def gather_blocks(kv, layer: int, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of blocks ``ids`` (on the device) of ``layer`` of paged ``kv``, each (1, H, len(ids) *
    block_size, D): one copy of the blocks' bytes, queued on the current stream."""
    g = kv.layers[layer].index_select(1, ids)  # (2, nb, bs, H, D): the blocks' bytes are read here, once
    g = g.flatten(1, 2).transpose(1, 2).unsqueeze(1).to(dtype)  # (2, 1, H, nb * bs, D), views
    return g[0], g[1]


class KVTierCache(Cache):
    """The cache of one request (batch 1). hit_tokens: the prefix loaded from the store (whole
    chunks); hit_tiers: per loaded chunk, the tier it came from; t_start: perf_counter() when
    the request asked kvtier (before the lookup)."""

    layer_class: type[DynamicLayer] = _Layer
    front = 0  # tokens before the loaded ones, recomputed by the model (a split: hf_split.py)

    def __init__(self, owner: KVTier, blocks: list[int], load, t_start: float, start_event) -> None:
        self.owner, self.blocks, self.load, self.t_start = owner, blocks, load, t_start
        self._start = start_event
        self.hit_tokens = load.tokens if load is not None else 0
        self.hit_tiers: tuple[str, ...] = load.tiers if load is not None else ()
        self.arrived: list[int] = []  # layers in the order they were read (tests check the order)
        self._ids_dev: torch.Tensor | None = None  # the hit's block ids on the device, made once
        self.finished = False
        super().__init__(layers=[self.layer_class(self, i) for i in range(owner.kv.num_layers)])

    @property
    def hit_bytes(self) -> int:
        return self.hit_tokens // self.owner.kv.block_size * self.owner.kv.block_nbytes

    def load_seconds(self) -> float | None:
        """Seconds from before the lookup to the last loaded byte landing (lower-tier reads
        included), from events on the engine's load stream; blocks until the load is done."""
        if self.load is None or not self.load.jobs:
            return None
        self.load.wait()  # an event's time is known only once it has completed
        return self._start.elapsed_ms(self.load.jobs[-1].event) / 1e3  # one stream: the last job ends last

    def _arrive(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V of the hit prefix, each ``(1, kv_heads, hit, head_dim)``."""
        if like.shape[0] != 1:
            raise ValueError(f"key_states: KVTierCache holds one request (batch 1), not {like.shape[0]}")
        got: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._read(layer, lambda: got.append(self._gather(layer, like.dtype)), host=like.device.type == "cpu")
        return got[0]

    def _gather(self, layer: int, dtype: torch.dtype):
        """(K, V) of the hit's blocks of ``layer`` (`gather_blocks`), queued on the current stream."""
        if self._ids_dev is None:
            # Once per request, queued on this stream: torch.tensor(list, device=cuda) would
            # wait for everything queued on it (a host sync per layer, no running ahead).
            ids = torch.as_tensor(self.blocks, dtype=torch.long)
            self._ids_dev = ids.to(self.owner.kv.device, non_blocking=True)
        return gather_blocks(self.owner.kv, layer, self._ids_dev, dtype)

    def _read(self, layer: int, fn, host: bool = False) -> None:
        """Run ``fn`` (a read of layer ``layer``'s blocks) on the compute stream once that layer
        has landed. host: the caller uses fn's output on the host (block until it ran)."""
        o = self.owner
        # The read of layer `layer` must not see its blocks before their bytes have landed:
        # the compute stream waits for that layer's event (later layers may still be in flight).
        self.load.wait_layer(layer, o.compute)
        o.device.launch(fn, o.compute)
        self.arrived.append(layer)
        last = len(self.arrived) == o.kv.num_layers
        if last or host:
            ev = o.compute.record(f"hf-read-layer{layer}")  # marks this layer's read (and all before it)
            if host:
                ev.synchronize()  # the host runs attention: submitted is not done, block until read
            if last:  # the stream has waited every layer, e_load included
                o.engine.compute_read(self.blocks, ev)  # a later load into these blocks waits for the reads

    def finish(self, sequences: torch.Tensor | None = None):
        """End the request: the KV of ``sequences`` (the prompt + generated ids; only the first
        ``get_seq_length()`` have KV) goes into paged blocks and `KVStore.save`, whole chunks
        only; blocks return to the free list once the save has read them. Returns the
        `SaveHandle` (``wait_durable()``: pushed to the lower tiers), or None: nothing new."""
        if self.finished:
            raise RuntimeError("finish() was called already")
        self.finished = True
        o, bs = self.owner, self.owner.kv.block_size
        if self.load is not None:
            self.load.wait()  # the loads must land before anything reuses these blocks
        n = self.get_seq_length() if sequences is not None and self.layers[0].is_initialized else 0
        n_full, h0 = n // o.chunk_tokens * o.chunk_tokens, self.front + self.hit_tokens
        if n_full <= h0:
            o._release(self.blocks)
            return None
        # Blocks for the recomputed front too: a chunk evicted since the lookup is saved from them.
        head, new = o._alloc(self.front // bs), o._alloc((n_full - h0) // bs)
        runs = [(head, 0, self.front), (new, h0, n_full)]
        states = [(lay.keys, lay.values) for lay in self.layers]

        def scatter() -> None:  # (1, H, n, D)[a:b] -> blocks `got` as (len, bs, H, D), K and V
            for got, a, b in (r for r in runs if r[0]):
                ids = torch.tensor(got, device=o.kv.device)
                for pages, kv in zip(o.kv.layers, states, strict=True):
                    for i, x in enumerate(kv):
                        part = x[0, :, a:b].transpose(0, 1).reshape(len(got), bs, *x.shape[1:2], x.shape[3])
                        pages[i].index_copy_(0, ids, part.to(pages.dtype))

        o.device.launch(scatter, o.compute)
        after = o.compute.record("hf-write")  # the save reads the blocks only after this write
        blocks = head + self.blocks + new
        handle = o.store.save(_tokens(sequences)[:n_full], blocks, after=after)
        handle.wait()  # submitted is not done: the blocks are free only once every save read them
        o._release(blocks)
        return handle


def _check_tiers(tiers) -> None:
    names = [getattr(t, "name", None) for t in tiers]
    if not all(isinstance(t, Tier) for t in tiers) or len({*names, "host"}) <= len(names):
        raise ValueError(f"tiers: Tier objects with distinct names other than 'host', got {list(tiers)!r}")


def _check_options(options: dict, block_size: int) -> int:
    """``for_model``'s options checked as `StoreConfig` and `EngineConfig` check them, each error
    naming the option; the chunk's tokens."""
    known = {f for f in StoreConfig.__dataclass_fields__} | {"engine_options"}
    check.refuse_unknown(options, known, "KVTier.for_model options")
    store = StoreConfig(**{k: v for k, v in options.items() if k != "engine_options"})
    ct = check.whole(store.chunk_tokens, "chunk_tokens")
    if ct % block_size:
        raise ValueError(f"chunk_tokens={ct}: a multiple of block_size={block_size}")
    engine_options = options.get("engine_options")
    if engine_options is not None:
        if not isinstance(engine_options, dict):
            raise ValueError(f"engine_options: a dict of EngineConfig fields, got {engine_options!r}")
        check.refuse_unknown(engine_options, set(EngineConfig.__dataclass_fields__), "engine_options")
        try:
            EngineConfig(**engine_options)
        except ValueError as exc:
            raise ValueError(f"engine_options: {exc}") from None
    return ct


def _tokens(ids) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"input_ids: one request (batch 1) expected, got shape {tuple(ids.shape)}")
            ids = ids[0]
        return ids.tolist()
    return list(ids)


def cache_kwarg(model) -> str:
    """The name ``generate``/``forward`` take the cache under: ``cache`` (transformers >= 5.2x)
    or ``past_key_values`` (earlier; still accepted, with a deprecation warning, later)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
