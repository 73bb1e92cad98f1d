"""How a request maps onto chunks: the chunk format of a cache, and checked block ids."""

from __future__ import annotations

from dataclasses import dataclass

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
    caller bug raises ValueError naming ``block_ids``."""
    try:
        ids = torch.as_tensor(block_ids if isinstance(block_ids, torch.Tensor) else list(block_ids))
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise ValueError(f"block_ids must be a sequence of ints ({exc})") from None
    if ids.dim() != 1 or (len(ids) and (ids.dtype.is_floating_point or ids.dtype == torch.bool)):
        raise ValueError(f"block_ids must be a 1-D sequence of ints, got {ids.dtype} {tuple(ids.shape)}")
    ids = ids.to("cpu", torch.int64)
    if len(ids) < need:
        raise ValueError(f"block_ids: {len(ids)} ids cannot hold {need // bpc} chunks of {bpc} blocks")
    if len(ids) and bool(((ids < 0) | (ids >= num_blocks)).any()):
        raise ValueError(f"block_ids: out of range; the cache has {num_blocks} blocks")
    if unique and len(torch.unique(ids)) != len(ids):
        raise ValueError("block_ids: duplicate ids; a load cannot write one block twice")
    return ids


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

    def header(self, key: bytes, payload) -> ChunkHeader:
        """The header of a chunk's bytes (checksum computed here)."""
        return ChunkHeader.for_payload(key, payload, self.shape, self.dtype, self.layout)

    def matches(self, h: ChunkHeader) -> bool:
        """True if a stored chunk's header describes exactly this format."""
        return (h.shape, h.dtype, h.layout, h.payload_len) == (
            self.shape,
            self.dtype,
            self.layout,
            self.nbytes,
        )
