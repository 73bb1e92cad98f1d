"""Tiered KV-chunk storage: prefix-hash keys, eviction policies, the host / disk / Redis tiers,
and `KVStore` (lookup / save / load / prefetch over those tiers and the transfer engine).

The tier modules are engine- and torch-independent building blocks; `KVStore` (which needs the
engine, hence torch) is imported on first use: ``from kvtier.store import KVStore``.
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
