"""How the `hf` suite runs one request: transformers' caches (dynamic, offloaded), a streamer
that notes when each token came out, and the record of one timed `generate`."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch


def offloaded_cache(model):
    """(generate kwargs factory, what it is) for transformers' offloaded cache, or (None, why not)."""
    import transformers
    from transformers import cache_utils

    from kvtier.integrations.hf import cache_kwarg

    key, dyn = cache_kwarg(model), cache_utils.DynamicCache
    params = inspect.signature(dyn.__init__).parameters
    if "offloading" in params:
        cfg = {"config": model.config} if "config" in params else {}
        return (lambda: {key: dyn(offloading=True, **cfg)}), "DynamicCache(offloading=True)"
    if hasattr(cache_utils, "OffloadedCache"):
        return (lambda: {key: cache_utils.OffloadedCache()}), "OffloadedCache"
    from transformers.generation import configuration_utils as gc

    if "offloaded" in getattr(gc, "ALL_CACHE_IMPLEMENTATIONS", ()):
        return (lambda: {"cache_implementation": "offloaded"}), 'cache_implementation="offloaded"'
    why = "has no DynamicCache(offloading=...), OffloadedCache or cache_implementation 'offloaded'"
    return None, f"transformers {transformers.__version__} {why}"


def dynamic_cache(model, prefill: list[tuple[torch.Tensor, torch.Tensor]] = ()):
    """A DynamicCache, optionally holding ``prefill``: per layer (K, V), each (1, kv_heads, n, head_dim)."""
    from transformers import DynamicCache

    has_config = "config" in inspect.signature(DynamicCache).parameters
    cache = DynamicCache(config=model.config) if has_config else DynamicCache()
    for i, (k, v) in enumerate(prefill):
        cache.update(k, v, i)
    return cache


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()  # a host clock read is only true once the queued GPU work has finished


class TokenClock:
    """A generate() streamer: the host time of each new token, read once the device has made it."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.times = cuda, []

    def put(self, value) -> None:
        if value.dim() > 1:
            return  # the prompt (1, n), streamed before the prefill
        _sync(self.cuda)  # submitted is not done: the token exists once every stream has made it
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass(slots=True)
class Run:
    sequences: torch.Tensor  # (1, prompt + new), on the model's device
    ttft_s: float
    step_s: float  # seconds per decode step (mean over the run)
    cache: object = None  # the cache it used; dropped once read (its KV is large)
    hit_tokens: int | None = None  # kvtier runs: the prefix the store gave
    load_ms: float | None = None  # kvtier runs: lookup -> last loaded byte landed (engine events)


def timed_generate(model, ids: torch.Tensor, new_tokens: int, make_kwargs, cuda: bool) -> Run:
    """One greedy run; ``make_kwargs()`` gives the cache, made inside the clock (a lookup counts)."""
    from kvtier.integrations.hf import cache_kwarg

    clock = TokenClock(cuda)
    _sync(cuda)  # the clock must not start while earlier work is still queued
    t0 = time.perf_counter()
    kw = make_kwargs()
    with torch.no_grad():  # min_new_tokens: an early EOS would shorten the decode being timed
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, streamer=clock, **kw)  # fmt: skip
    t = clock.times
    if len(t) != new_tokens:
        raise RuntimeError(f"generate streamed {len(t)} tokens, expected {new_tokens}")
    return Run(out, t[0] - t0, (t[-1] - t[0]) / (len(t) - 1), kw.get(cache_kwarg(model)))


def _kvtier_done(run: Run) -> Run:
    """Read what a kvtier run's cache knows, give its blocks back, drop it."""
    c = run.cache
    run.hit_tokens = c.hit_tokens
    load = c.load_seconds()  # waits for the load's last event: untimed, after the run
    run.load_ms = None if load is None else load * 1e3
    c.finish(None)  # no save: only the blocks go back
    run.cache = None
    return run
