"""`KVStore.load`: walk the tiers for the longest chunk prefix, then submit its GPU copies.

    walk chunk by chunk from ``first_chunk`` (`fetch.py`): a host hit is pinned; a lower-tier
    hit is read into a pool slot, its header checked, and promoted into the host
    -> the copies: layer-major over every chunk (`engine.load_slots`, one launch per layer)
       where loads take the kernel path, else an engine load job per chunk

The first chunk no tier delivers ends the walk: the rest of the prefix is useless, and
``handle.tokens`` counts what will arrive. Every fetched chunk whose copy is never submitted
(an error on the way) gives its pin or temporary slot back through ``store._completed``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvtier.engine.paths import Path

from .handles import LoadHandle

if TYPE_CHECKING:
    from .kvstore import KVStore


def load(store: KVStore, tokens, block_ids, *, per_layer: bool = True, first_chunk: int = 0) -> LoadHandle:
    t0 = store._check_open()
    keys = store._keys(tokens)
    if type(first_chunk) is not int or not 0 <= first_chunk <= len(keys):  # a bool is no index
        raise ValueError(f"first_chunk: must be an int within [0, {len(keys)}], got {first_chunk!r}")
    keys = keys[first_chunk:]
    ids = store._ids(block_ids, need=0, unique=True)
    store._reap()
    handle = LoadHandle(num_layers=store.kv.num_layers, _on_done=store._reap)
    tiers: list[str] = []

    def submit(i: int, got, layered: bool) -> None:
        try:
            job = store.engine.load(got.entry.slot, store._chunk(ids, i), per_layer=layered)
        except BaseException:
            store._completed(None, got.entry, got.kind)  # nothing was submitted from the slot
            raise
        store._track(job, got.entry, got.kind)
        handle.jobs.append(job)
        tiers.append(got.tier)

    # The walk ends at the first chunk no tier delivers: the rest of the prefix is useless.
    got_all = []
    try:
        for got in store._fetch.walk(keys[: len(ids) // store.fmt.blocks]):
            got_all.append(got)
    except BaseException:
        for got in got_all:
            store._completed(None, got.entry, got.kind)  # fetched, never submitted
        raise
    if per_layer and len(got_all) > 1 and store.engine.load_path(per_layer=True) is Path.KERNEL:
        # Layer-major over every chunk (one launch per layer): layer 0 of the whole prefix lands
        # first, so attention of layer 0 starts after 1/L of the bytes, not after all of them.
        try:
            slots = [got.entry.slot for got in got_all]
            jobs = store.engine.load_slots(slots, ids[: len(got_all) * store.fmt.blocks])
        except BaseException:
            for got in got_all:
                store._completed(None, got.entry, got.kind)  # nothing was submitted from the slots
            raise
        for job, got in zip(jobs, got_all, strict=True):
            store._track(job, got.entry, got.kind)
            handle.jobs.append(job)
            tiers.append(got.tier)
    else:
        # One job per chunk; only the last is copied layer by layer (a launch and an event per
        # layer), the others whole (one launch): layer i of the prefix is ready once the last
        # chunk's layer i landed, and the earlier chunks, queued before it, landed whole.
        for i, got in enumerate(got_all):
            try:
                submit(i, got, per_layer and i == len(got_all) - 1)
            except BaseException:
                for later in got_all[i + 1 :]:
                    store._completed(None, later.entry, later.kind)  # fetched, never submitted
                raise
    handle.tokens, handle.tiers = len(handle.jobs) * store.fmt.tokens, tuple(tiers)
    chunks = Counter(f"load_chunks_{t}" for t in tiers)
    store._count(loads=1, load_tokens=handle.tokens, _call=("load", t0), **chunks)
    return handle
