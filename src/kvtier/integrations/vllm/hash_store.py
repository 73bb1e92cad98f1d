"""HashKeyedStore: a `KVStore` whose chunks are named by vLLM's block hashes, not token ids."""

from __future__ import annotations

from dataclasses import replace

from kvtier.store import KVStore

from .chunk_ids import chunk_keys


class HashKeyedStore(KVStore):
    """`KVStore` with ``keys(ids)``: ``tokens`` everywhere is a sequence of chunk ids
    (`chunk_ids.chunk_ids`), one per chunk, each already naming its whole prefix. Chunk i of
    a call covers ``block_ids[i*bpc:(i+1)*bpc]`` as in `KVStore`; a sub-range of a request's
    chunks is passed as the sub-range of its ids (the keys do not chain). group: one KV cache
    group's label (`groups.Group.label`), carried in the keys' layout field so that a chunk of
    one group never loads into another (None: a model of one group, keys as they always were)."""

    def __init__(self, *args, group: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if group is not None:
            self.extra = replace(self.extra, layout=f"{self.extra.layout}|{group}")

    def keys(self, tokens) -> list[bytes]:
        if isinstance(tokens, bytes | str) or not all(isinstance(i, bytes) for i in tokens):
            raise ValueError("tokens: a sequence of chunk ids (bytes) for a HashKeyedStore")
        return chunk_keys(tokens, self.extra, self.config.hash_name)
