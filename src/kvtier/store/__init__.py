"""Tiered KV-chunk storage: prefix-hash keys, eviction policies, and the disk / Redis tiers.

`KVStore` (lookup / save / load / prefetch over these tiers and the transfer engine) lives
here later; the modules below are engine-independent building blocks.
"""
