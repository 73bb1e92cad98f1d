"""How a request maps onto chunks: the chunk format of a cache, and checked block ids."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .header import ChunkHeader


def chunk_layout(kv) -> str:
    """The name of the host chunk format of ``kv`` (`kvtier.layout`): caches whose chunks have
    the same bytes (e.g. vLLM flash and FlashInfer NHD of one shape) share it, nothing else."""
    kind = "mla" if kv.is_mla else kv.interior.lower()
    return f"chunk-{kind}-L{kv.num_layers}-kv{kv.num_kv}-" + "x".join(map(str, kv.block_shape))


def request_block_ids(
    block_ids, *, num_blocks: int, need: int, bpc: int, unique: bool = False
) -> torch.Tensor:
    """A request's ``block_ids`` (a sequence of ints, or a 1-D integer tensor [n] on any device)
    as CPU int64 [n]: at least ``need`` of them, each in [0, num_blocks), distinct when
    ``unique`` (a load writes each block once). ``bpc``: blocks per chunk, for the message. A
    caller bug raises ValueError naming ``block_ids``. Numpy, not torch, for the checks: a list
    of a 32K-token request's ids converts and checks in a few microseconds there, tens in torch
    (this runs in every save and load a serving step starts)."""
    if isinstance(block_ids, torch.Tensor):
        t = block_ids
        bad = t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool
        if t.dim() != 1 or (len(t) and bad):
            raise ValueError(f"block_ids must be a 1-D sequence of ints, got {t.dtype} {tuple(t.shape)}")
        a = t.detach().to("cpu", torch.int64).numpy()
    else:
        try:
            a = np.asarray(block_ids if isinstance(block_ids, list | tuple | np.ndarray) else list(block_ids))
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"block_ids must be a sequence of ints ({exc})") from None
        if a.size == 0 and a.ndim == 1:
            a = a.astype(np.int64)  # [] reads as float64: no id at all is a valid (empty) request
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise ValueError(f"block_ids must be a 1-D sequence of ints, got {a.dtype} {a.shape}")
        if a.dtype.kind == "u" and len(a) and int(a.max()) >= num_blocks:
            raise ValueError(f"block_ids: out of range; the cache has {num_blocks} blocks")
        a = a.astype(np.int64, copy=False)
    if len(a) < need:
        raise ValueError(f"block_ids: {len(a)} ids cannot hold {need // bpc} chunks of {bpc} blocks")
    if len(a) and (int(a.min()) < 0 or int(a.max()) >= num_blocks):
        raise ValueError(f"block_ids: out of range; the cache has {num_blocks} blocks")
    if unique and len(a) > 1:
        s = np.sort(a)
        if bool((s[1:] == s[:-1]).any()):
            raise ValueError("block_ids: duplicate ids; a load cannot write one block twice")
    return torch.from_numpy(a)


@dataclass(frozen=True, slots=True)
class ChunkFormat:
    """One chunk of a cache: ``tokens`` tokens in ``blocks`` whole blocks, ``nbytes`` bytes in
    the host chunk format (a pool slot of ``span`` bytes), and the header fields that say so."""

    tokens: int
    blocks: int
    nbytes: int
    span: int
    shape: tuple[int, ...]
    dtype: str
    layout: str

    @classmethod
    def of(cls, kv, chunk_tokens: int, alignment: int) -> ChunkFormat:
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1 or chunk_tokens % kv.block_size:
            raise ValueError(
                f"chunk_tokens must be a positive multiple of block_size={kv.block_size}, "
                f"got {chunk_tokens!r}"
            )
        blocks = chunk_tokens // kv.block_size
        nbytes = kv.chunk_nbytes(blocks)
        span = -(-nbytes // alignment) * alignment
        dtype = str(kv.dtype).removeprefix("torch.")
        return cls(chunk_tokens, blocks, nbytes, span, tuple(kv.chunk_shape(blocks)), dtype, chunk_layout(kv))

    def header(self, key: bytes, payload, algo: str = "xxh3_64") -> ChunkHeader:
        """The header of a chunk's bytes (checksum computed here; "none" for a chunk only tiers
        that seal it store)."""
        return ChunkHeader.for_payload(key, payload, self.shape, self.dtype, self.layout, algo=algo)

    def matches(self, h: ChunkHeader) -> bool:
        """True if a stored chunk's header describes exactly this format."""
        return (h.shape, h.dtype, h.layout, h.payload_len) == (
            self.shape,
            self.dtype,
            self.layout,
            self.nbytes,
        )
