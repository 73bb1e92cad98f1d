"""Tiered KV-chunk storage keyed by token prefix: a repeated prefix is loaded, not recomputed.

`KVStore` is what a serving engine (or `kvtier.integrations`) calls, once per request; tokens
are ``[num_tokens]`` ids, block ids the request's GPU blocks in order:

    lookup(tokens) -> Lookup                   longest stored prefix and its tiers; no side effects
    save(tokens, block_ids, after) -> SaveHandle   copy each full chunk not held yet into the host;
                                               its events complete once the blocks were read
    load(tokens, block_ids) -> LoadHandle      longest available prefix into the blocks; lower-tier
                                               reads happen in the call, copies after it; one event
                                               per layer (``wait_layer``); a miss ends the prefix
    prefetch(tokens) -> Future[int]            lower-tier chunks into the host, in the background
    evict(tokens, lower) -> int                drop chunks no transfer uses (and below, ``lower``)
    keys(tokens) -> list[bytes]                the chunks' names in every tier; no side effects
    stats() / flush() / close()                counters; wait for pushes; every slot given back

Tier failures (errors, timeouts, a full tier, bad bytes) are misses, never raised; bad
arguments raise ValueError naming them.

The tiers, for `KVStore(tiers=...)` or alone (each keeps `Tier`'s contract, `tier.py`):

    DiskTier(root, capacity_bytes)   chunk files on a local disk, crash-safe, evicted by policy,
                                     in a folder it created and marked (it touches nothing else)
    RedisTier(client | url)          one Redis/Valkey server or a cluster, shared between hosts
    MemoryTier / ThrottledTier       in-process, and a rate-limited wrapper, to model a tier

Disk and Redis tiers given a key ring (``auth=KeyRing(keys)``, `auth`; or the store's
``StoreConfig.auth_keys`` / $KVTIER_AUTH_KEYS) seal every chunk they write and load only chunks
a holder of the keys sealed: a chunk another process planted is a miss counted ``forged``.

The tier modules need neither torch nor the engine; `KVStore` (which needs both) is imported
on first use: ``from kvtier.store import KVStore``.
"""

_LAZY = {
    "KVStore": "kvstore",
    "StoreConfig": "config",
    "Lookup": "handles",
    "LoadHandle": "handles",
    "SaveHandle": "handles",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
