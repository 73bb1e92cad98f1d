"""A prefix hit of n tokens, split: the model recomputes [0, s) while chunks [s, n) load.

    kvt = KVTier.for_model(model, tiers=[DiskTier("/nvme/kv", 200 << 30)], chunk_tokens=256)
    p = planner.plan("llama-3-8b", "h200", "disk", kvt.store.lookup(ids[0, :-1].tolist()).tokens, ...)
    cache = split_cache(kvt, model, ids, p.split_tokens)   # load [s, n) starts, then forward [0, s)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64, do_sample=False)
    cache.finish(out)

Order of work. The load of chunks [s, n) starts first: on the calling thread when every chunk is
in pinned host memory (submitting its copies costs little host time), else on a thread of its
own (a disk or remote read blocks in `KVStore.load`). Its copies take the staged path: DMAs on
the copy engine and short scatters, so they hold no SM while the front computes (a per-layer
kernel load would share the SMs with it); each layer's event is then the whole load's, which the
tail waits for after the front anyway. Meanwhile the model runs one forward over tokens [0, s) on
the compute stream, filling every layer's K/V for those positions: this is exact, because
attention of a token < s reads only keys < s — it never needs the loaded [s, n). ``generate`` then sees
``get_seq_length() == s + loaded`` and prefills only the rest of the prompt; at each layer's
first update, that layer waits for its load event, its loaded K/V is appended after [0, s), and
then the new tokens' K/V. The cache holds exactly what one forward over the prompt would.
"""

from __future__ import annotations

import inspect
import threading
import time

import torch
from transformers.cache_utils import DynamicLayer

from kvtier.integrations.hf import KVTier, KVTierCache, _Layer, _tokens, cache_kwarg


class _SplitLayer(_Layer):
    """Tokens [0, s) come from the model's own forward; the loaded [s, s + loaded) are appended
    at the first update after it (the rest of the prompt's prefill)."""

    def __init__(self, owner: SplitCache, index: int) -> None:
        super().__init__(owner, index)
        self._placed = False

    def get_seq_length(self, *args, **kwargs) -> int:
        o = self._owner
        pending = 0 if self._placed or o.recomputing else o.hit_tokens  # counts before it is read
        return DynamicLayer.get_seq_length(self) + pending

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        o = self._owner
        if not (o.recomputing or self._placed) and o.hit_tokens:
            k, v = o._arrive(self._index, key_states)  # waits for this layer's load event
            if self.is_initialized:  # after [0, s): positions s .. s + loaded
                self.keys = torch.cat([self.keys, k], dim=-2)
                self.values = torch.cat([self.values, v], dim=-2)
            else:
                self.keys, self.values = k, v
                self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            self._placed = True
        return DynamicLayer.update(self, key_states, value_states, *args, **kwargs)


class SplitCache(KVTierCache):
    """`KVTierCache` of a split hit. front: s, the tokens recomputed; hit_tokens: the tokens
    loaded after them ([s, s + hit_tokens)); hit_tiers: per loaded chunk, its tier."""

    layer_class = _SplitLayer

    def __init__(self, owner: KVTier, blocks, load, t_start: float, start_event, front: int) -> None:
        self.front, self.recomputing = front, False
        self.front_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # set by a `front` callable
        super().__init__(owner, blocks, load, t_start, start_event)


def split_cache(kvt: KVTier, model, input_ids: torch.Tensor, split_tokens: int, front=None) -> SplitCache:
    """Look up ``input_ids`` ([1, n] or [n]), start loading the hit's chunks from ``split_tokens``
    on, and run ``model`` over tokens [0, split_tokens) meanwhile; returns the cache to pass to
    ``generate``. split_tokens: a multiple of the store's chunk (a chunk boundary), capped at the
    hit (0: load all of it, like ``kvt.cache``; >= the hit: recompute all of it).
    front: instead of the model's forward, ``front(ids[:, :s])`` computes [0, s) and returns its
    per-layer (K, V), kept as ``cache.front_kv`` (`LeanRunner.split_first_token`)."""
    ct, bs = kvt.chunk_tokens, kvt.kv.block_size
    if (
        isinstance(split_tokens, bool)
        or not isinstance(split_tokens, int)
        or split_tokens < 0
        or split_tokens % ct
    ):
        raise ValueError(f"split_tokens: must be a multiple of chunk_tokens={ct} >= 0, got {split_tokens!r}")
    tokens = _tokens(input_ids)
    ids = torch.as_tensor(tokens, device=next(model.parameters()).device).unsqueeze(0)
    t0 = time.perf_counter()
    start = kvt.engine.load_stream.record("hf-load-start")
    hit = kvt.store.lookup(tokens[:-1])  # the last prompt token always runs: it gives the logits
    n = hit.tokens
    s = min(split_tokens, n)
    blocks = kvt._alloc((n - s) // bs)
    box: dict = {}

    def read() -> None:  # lower tiers are read on the calling thread of KVStore.load
        try:
            # Staged copies beside the front: the copy engine moves the bytes, the SMs stay its.
            box["load"] = kvt.store.load(
                tokens[:-1], blocks, first_chunk=s // ct, path="staged" if s else None
            )
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    reader = None
    if n > s and all(t == "host" for t in hit.tiers[s // ct :]):
        read()  # nothing to read: the copies are queued before the front's launches, here
        if "error" in box:  # refused before any copy: no forward for a request that fails
            kvt._release(blocks)
            raise box["error"]
    elif n > s:
        reader = threading.Thread(target=read, name="kvtier-split-load", daemon=True)
        reader.start()  # disk / remote reads and the copies overlap the forward over [0, s) below
    cache = SplitCache(kvt, blocks, None, t0, start, front=s)
    try:
        if s and front is not None:
            # Nothing here reads the loaded blocks (tokens < s never attend to positions >= s).
            cache.front_kv = front(ids[:, :s])
        elif s:
            # Nothing here reads the loaded blocks (tokens < s never attend to positions >= s).
            extra = (
                {"logits_to_keep": 1}
                if "logits_to_keep" in inspect.signature(model.forward).parameters
                else {}
            )
            cache.recomputing = True
            try:
                with torch.no_grad():
                    model(ids[:, :s], **{cache_kwarg(model): cache}, use_cache=True, **extra)
            finally:
                cache.recomputing = False
    finally:
        if reader is not None:
            reader.join()  # the load handle (its per-layer events) exists only once read() returned
    if "error" in box:
        kvt._release(blocks)
        raise box["error"]
    load = box.get("load")
    if load is not None and load.tokens < n - s:  # a chunk vanished since the lookup: fewer blocks
        keep = load.tokens // bs
        kvt._release(blocks[keep:])
        del blocks[keep:]
    cache.load = load
    cache.hit_tokens = load.tokens if load is not None else 0
    cache.hit_tiers = load.tiers if load is not None else ()
    return cache


# The options `plan_request` takes from the first-use costs when not given (a calibration gives
# the first two)
FIRST_USE = frozenset({"efficiency", "forward_floor_ms", "floor_ms_per_token", "hit_fixed_ms"})


def read_options(store, tier: str) -> dict:
    """`plan`'s read_gbps and read_fixed_ms for a hit in ``tier``: as ``store``'s loads from it saw
    them (`ReadRate.fit`); before its first read, none (the probe's rate, or the datasheet's)."""
    fit = store.read_rate.fit(tier)
    return {} if fit is None else {"read_gbps": fit[0], "read_fixed_ms": fit[1] * 1e3}


def plan_request(
    kvt: KVTier, model, input_ids: torch.Tensor, gpu, ceilings=None, *, first_use: bool = True, **options
):
    """`planner.plan` for this request: the model's shape from ``model.config``, the hit's length
    from a lookup, its tier the slowest one holding part of it (the store lists tiers fastest
    first). gpu: a key or `specs.GPU`; options: `plan`'s (efficiency, link, kv_dtype, ...).
    first_use: what options do not give of the efficiency, the forward floor, its growth with the
    prefix and a hit's fixed cost (`FIRST_USE`), take from this model's costs on this machine
    (`hf_costs.model_costs`: measured on first use, then read from a file), so the first plan
    already knows them; a calibration gives the first two, not the growth or the hit's cost. A
    hit in a lower tier is planned at the read rate the store measured on its earlier loads from
    that tier (`KVStore.read_rate`), once it has one."""
    import tempfile

    from kvtier.hfconfig import from_hf_config
    from kvtier.planner import plan
    from kvtier.specs import get_gpu

    hit = kvt.store.lookup(_tokens(input_ids)[:-1])
    order = ["host", *(t.name for t in kvt.store.tiers)]
    tier = max(hit.tiers, key=order.index) if hit.tiers else "host"
    cfg = (
        model.config.get_text_config(decoder=True)
        if hasattr(model.config, "get_text_config")
        else model.config
    )
    with tempfile.TemporaryDirectory() as d:  # the config as transformers writes it: one parser
        cfg.to_json_file(f"{d}/config.json")
        spec = from_hf_config(d)
    if first_use and not options.keys() >= FIRST_USE:
        from kvtier.integrations.hf_costs import planner_options

        g = get_gpu(gpu, ceilings) if isinstance(gpu, str) else gpu
        dtypes = {k: options[k] for k in ("dtype", "kv_dtype") if k in options}
        options = planner_options(model, spec, g, **dtypes) | options  # given options win
    if tier != "host" and "read_gbps" not in options:
        options |= read_options(kvt.store, tier)
    n_new = len(_tokens(input_ids)) - hit.tokens
    return plan(spec, gpu, tier, hit.tokens, n_new, ceilings, chunk_tokens=kvt.chunk_tokens, **options)
