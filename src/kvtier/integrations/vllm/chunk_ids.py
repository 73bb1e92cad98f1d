"""Chunk names from vLLM's block hashes: what the scheduler and the workers agree on.

vLLM hashes each full block of ``hash_block_size`` tokens, chaining the parent block's hash
with the block's tokens and its extra keys (multimodal inputs, LoRA, cache salt). The hash of
a chunk's last block therefore names the whole prefix up to the chunk's end: that is the
chunk's *id* here, the same on every TP rank. A tier's *key* binds the id to what else decides
the chunk's bytes (kvtier's `KeyExtra`: model, KV dtype, layout, TP rank/size, salt):

    key = H(domain, H(extra), chunk id)[:KEY_BYTES]

so another model, layout, dtype or rank never matches, and the key keeps kvtier's size limit
(16 bytes; a vLLM block hash is 32). Torch-free: the scheduler computes the keys of every rank
to ask a shared tier what it holds.

vLLM's hashes repeat across processes and restarts with its default sha256 (a fixed seed);
with a non-cryptographic ``prefix_caching_hash_algo`` only when PYTHONHASHSEED is set, else
every process has its own hashes and nothing is shared (a miss, never wrong KV).
"""

from __future__ import annotations

import hashlib

from kvtier.store.keys import KEY_BYTES, KeyExtra

_DOMAIN = b"kvtier.vllm.v1"


def chunk_ids(block_hashes, hashes_per_chunk: int, limit_tokens: int, hash_block_size: int) -> list[bytes]:
    """Ids of the full chunks among ``block_hashes`` (vLLM's ``request.block_hashes``), at most
    ``limit_tokens // (hashes_per_chunk * hash_block_size)`` of them."""
    n = min(len(block_hashes) // hashes_per_chunk, limit_tokens // (hashes_per_chunk * hash_block_size))
    return [bytes(block_hashes[(i + 1) * hashes_per_chunk - 1]) for i in range(max(n, 0))]


def chunk_keys(ids, extra: KeyExtra, hash_name: str = "sha256") -> list[bytes]:
    """The tier keys of chunk ``ids`` for one rank's ``extra``."""
    if hash_name == "xxh3_128":
        import xxhash

        h = xxhash.xxh3_128_digest
    else:
        h = lambda data: hashlib.sha256(data).digest()  # noqa: E731
    prefix = _DOMAIN + h(extra.encode())
    return [h(prefix + cid)[:KEY_BYTES] for cid in ids]
