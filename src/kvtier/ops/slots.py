"""Scatter from several chunks at once: the pinned slots of one request's chunks into its blocks,
one launch per call (a per-layer load: one launch per layer for every chunk of the request).

    src = slot_sources(kv, block_ids, [slot_a.tensor, slot_b.tensor], num_tokens=None)
    for layer in range(kv.num_layers):
        scatter_slots(kv, src, layers=(layer, 1), max_ctas=32)   # then record layer's event

`slot_sources` checks everything once and puts the ids and a table of where each block sits in
its chunk on the device (one small copy each); `scatter_slots` only launches. Chunk j holds
`len(chunks[j])` blocks (its size says how many); block ids go chunk by chunk, in order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.layout import PagedKV, gcd_bytes
from kvtier.ops.call_ids import use_ids
from kvtier.ops.checks import (
    BlockIds,
    as_block_ids,
    check_cache,
    check_chunk,
    check_layers,
    check_max_ctas,
    known_cache,
)
from kvtier.ops.launch import claim, plan_for, prepare


@dataclass(frozen=True, slots=True, eq=False)
class SlotSources:
    """Chunks and block ids checked for one cache. base: the lowest-addressed chunk; off: int64
    [n] VEC-units from base to each block, on the cache's device; align: divides every address."""

    ids: BlockIds
    chunks: tuple[torch.Tensor, ...]  # kept alive: the kernel reads them until its stream is past it
    base: torch.Tensor
    off: torch.Tensor
    align: int
    stream: int | None  # the raw CUDA stream the ids and offsets were made ready on (None off CUDA)
    runs: dict = field(default_factory=dict)  # (n_layers, max_ctas) -> prepared launch


def slot_sources(
    kv: PagedKV,
    block_ids: BlockIds | torch.Tensor | Sequence[int],
    chunks: Sequence[torch.Tensor],
    *,
    num_tokens: int | None = None,
    pool_slots: bool = False,
) -> SlotSources:
    """Check `chunks` and `block_ids` once, for any number of `scatter_slots` calls after.

    kv: the paged cache (`kvtier.layout`) on a CUDA GPU (CPU under the interpreter).
    block_ids: N distinct ids, chunk by chunk in order (chunk 0's blocks first): a list/tuple of
         ints, an int32/int64 tensor [N] on the CPU or the cache's GPU, or a `BlockIds` made with
         unique=True. N is the number of blocks the chunks hold together.
    chunks: a non-empty sequence; chunks[j] holds n_j whole blocks, as `scatter` takes a chunk:
         (n_j, num_layers, num_kv, *kv.block_shape) of kv.dtype ((n_j, L, 2, bs, H, D) for
         vllm_flash / flashinfer NHD / cross_layer, (n_j, L, 2, H, bs, D) for HND, (n_j, L, 1,
         bs, C) for mla) or 1-D uint8 of kv.chunk_nbytes(n_j); contiguous, pinned host memory or
         the cache's GPU, each its own allocation if need be (UVA reaches across them).
    num_tokens: valid tokens of the ids as a whole, as in `scatter` (only the last block partial).
    pool_slots: the chunks are slots of a `PinnedPool` (pinned, contiguous uint8, sizes checked
         by the caller): only their sizes are read.
    The ids and a table of where each block sits go to the device asynchronously on the current
    stream, the only stream `scatter_slots` may then run on.

    >>> import torch
    >>> from kvtier import layout
    >>> from kvtier.ops.slots import scatter_slots, slot_sources
    >>> kv = layout.vllm_flash([torch.zeros(2, 64, 16, 8, 128, dtype=torch.bfloat16, device="cuda")])
    >>> a = torch.randn(kv.chunk_shape(2), dtype=kv.dtype, pin_memory=True)  # (2, 1, 2, 16, 8, 128)
    >>> b = torch.randn(kv.chunk_shape(3), dtype=kv.dtype, pin_memory=True)
    >>> src = slot_sources(kv, [4, 5, 10, 11, 12], [a, b])  # a -> blocks 4, 5; b -> 10, 11, 12
    >>> scatter_slots(kv, src)
    """
    check_cache(kv)
    if isinstance(chunks, torch.Tensor) or not isinstance(chunks, Sequence) or not chunks:
        raise ValueError("chunks: expected a non-empty sequence of chunk tensors")
    per_block = kv.chunk_nbytes(1)
    counts = []
    for j, t in enumerate(chunks):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"chunks[{j}]: expected a torch.Tensor, got {type(t).__name__}")
        nb = t.numel() * t.element_size()
        if nb == 0 or nb % per_block:
            raise ValueError(f"chunks[{j}]: {nb} bytes is not a whole number of blocks of {per_block} B")
        counts.append(nb // per_block)
        if not pool_slots:
            check_chunk(kv, t, counts[-1], f"chunks[{j}]")
    ids = as_block_ids(kv, block_ids, True, num_tokens)
    if len(ids) != sum(counts):
        raise ValueError(f"block_ids: {len(ids)} ids for chunks holding {sum(counts)} blocks")
    g = gcd_bytes(kv)
    align = math.gcd(g, *(x for t in chunks for x in (t.data_ptr(), t.untyped_storage().data_ptr())))
    plan = plan_for(kv, align)
    vec_b = plan.vec * plan.unit.itemsize  # bytes per VEC-unit
    base = min(chunks, key=lambda t: t.data_ptr())
    starts = np.array([(t.data_ptr() - base.data_ptr()) // vec_b for t in chunks], dtype=np.int64)
    step = per_block // vec_b  # a block of the chunk format, in VEC-units (vec_b divides it: gcd)
    # In numpy: torch's CPU ops here (repeat_interleave above all) cost milliseconds a call on a
    # many-core host, waking its thread pool for a few dozen numbers.
    n = np.asarray(counts, dtype=np.int64)
    within = (np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)) * step
    off = torch.from_numpy(np.repeat(starts, n) + within)
    off = off.to(kv.device, non_blocking=True)  # pageable source: staged before the call returns
    stream = None
    if kv.device.type == "cuda":
        stream = torch._C._cuda_getCurrentRawStream(kv.device.index)
        use_ids(ids)  # this stream reads the ids only once landed, and they live until it did
    return SlotSources(ids, tuple(chunks), base, off, align, stream)


def scatter_slots(
    kv: PagedKV, src: SlotSources, *, max_ctas: int | None = None, layers: tuple[int, int] | None = None
) -> None:
    """Copy every chunk of `src` into its blocks: one launch on the current stream, which must
    be the stream `slot_sources` ran on (two for lazily checked ids: the claim kernel first).
    Nothing is checked again beyond `src` being this cache's.

    kv: the cache `src` was made for.
    src: the `SlotSources` of `slot_sources`; its chunks must stay alive and unchanged until
         this stream is past the launch.
    max_ctas: as in `scatter`.
    layers: (first, count), default all: a per-layer load calls once per layer with
         (layer, 1) and records that layer's event after each call.

    >>> for layer in range(kv.num_layers):  # kv, src as in `slot_sources`'s example
    ...     scatter_slots(kv, src, layers=(layer, 1), max_ctas=32)
    ...     layer_done = torch.cuda.current_stream().record_event()  # attention of `layer` waits
    """
    if not isinstance(src, SlotSources) or src.ids.kv is not kv:
        raise ValueError("src: expected the SlotSources made by slot_sources for this cache")
    if src.stream is not None and torch._C._cuda_getCurrentRawStream(known_cache(kv).index) != src.stream:
        # The ids and offsets were made ready on src.stream only: another stream could read them early.
        raise ValueError("src: scatter_slots must run on the stream slot_sources ran on")
    check_max_ctas(max_ctas)
    first, count = check_layers(kv, layers) or (0, kv.num_layers)
    check = 2 if src.ids.lazy else 0
    run = src.runs.get((count, max_ctas))
    if run is None:
        table = (src.off, src.align)
        run = prepare(
            kv,
            src.ids.dev,
            src.base,
            src.ids.last_valid,
            gather=False,
            max_ctas=max_ctas,
            n_layers=count,
            table=table,
            check=check,
        )
        src.runs[count, max_ctas] = run
    run(first, claim(kv, src.ids.dev) if check else 0)
