"""ops: the paged-KV copy primitives, in one Triton kernel launched by kvtier's own wrappers.

Every op copies whole blocks of every layer (K and V) between a paged cache (`kvtier.layout`,
a `PagedKV`) and a block-major chunk of n blocks, `(n, num_layers, num_kv, *block_shape)` of
the cache's dtype or 1-D uint8 of `kv.chunk_nbytes(n)`, in GPU memory or pinned host memory.
The ops only submit, on the current stream or the streams given: the bytes are there once that
work has completed (record an event after the call).

    primitive                           promise                                      called by
    gather(kv, ids, dst)                blocks -> chunk, one launch                  engine (kernel), Handoff
    scatter(kv, ids, src)               chunk -> blocks, one launch                  engine (kernel), Handoff
    make_staging(kv, chunk_blocks)      two GPU staging buffers                      engine (staged)
    save_staged(kv, ids, dst, ...)      GPU gathers + one pinned DMA per chunk,      engine (staged)
                                        pipelined; -> event after the last DMA
    load_staged(kv, ids, src, ...)      one pinned DMA per chunk + GPU scatters,     engine (staged)
                                        pipelined; -> event after the last scatter
    block_ids(kv, ids)                  ids checked once, reusable (`BlockIds`)      callers reusing ids
    check(kv)                           raise `BlockIdError` for bad ids that calls  callers of GPU ids
                                        checked on the device met (waits for the GPU)
    slots.slot_sources(kv, ids, chunks) several chunks (pool slots) checked once;    engine.load_slots
                                        ids and a block table put on the device
    slots.scatter_slots(kv, src, ...)   every chunk of `src` into its blocks, one    engine.load_slots
                                        launch per call (per layer: layers=(l, 1))
    staged.save_chunks / load_chunks    the staged GPU sequences alone, unchecked    engine's graph capture

All of them are public for callers of their own (`kvtier bench` times them directly).

What every op promises: nothing invalid reaches the kernel. Arguments are checked before the
first launch (cache, dtypes, shapes, contiguity, devices, pinned host memory, streams, staging
buffers, `num_tokens`, `layers`, `max_ctas`) and a bad one raises `ValueError` naming it. Tokens
past `num_tokens` in the last block are zeros in a chunk and left untouched in the cache. A
write (scatter, load) never targets a block twice in one call.

Block ids are checked once per call, eagerly or lazily (`check=` of every op and of `block_ids`):

    ids                                  "auto" (default)                 "eager"            "lazy"
    list, tuple, range, CPU tensor,
    numpy array [n]                      on the host, at the call         the same           on the device
    GPU tensor [n] (int32/int64)         on the device, by the kernel     read back: waits   on the device
    BlockIds                             when it was made (its own `check`)

Eager: the call raises ValueError naming the first bad id (out of range; repeated, for writes;
no int) before anything is launched. Host ids are read, checked and written as int32 into a
pinned slot of the cache's in one pass (`ops/host_ids.py`: one C call where kvtier's helper is
built), then reach the GPU from there without making the host wait (`ops/id_ring.py`). Lazy:
the ids are never read back, so the host never waits for the GPU; the kernel skips every copy
of a bad id (an id out of range, or named twice in one write, is neither read nor written) and
counts it in the cache's error flag, which `check(kv)` -- or the next eager check of GPU ids,
which waits anyway -- turns into a `BlockIdError` (a ValueError) with the counts. A `BlockIds`
from `block_ids` is matched to the cache (and to `unique` for writes) after that: build it once
for ids reused across calls (the engine checks its ids once at its own entry and passes them on
this way). `scatter_slots` checks nothing more: `slot_sources` did (lazily for lazy ids: each
call then checks on the device).

Host cost per call, beyond the argument checks: a launch plan is kept per cache, chunk alignment,
block count and layer count, and after the first call of a kind each kernel's own launcher is
called directly (`ops/launch.py`), the claim kernel's too. On top of the one launch of `gather`
and `scatter`: host ids cost one pass over them, one small copy to the GPU and one event record
(for the pinned slot); GPU ids cost nothing more, but a lazily checked write launches the claim
kernel first; a `BlockIds` costs a stream wait only when used on another stream than it was made
on. The staged ops cost one launch, one DMA, two event records and up to two stream waits per
staging piece, so their host time grows with n / blocks per staging buffer.

Without CUDA the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, which kvtier sets
itself when torch sees no GPU and triton is not imported yet) on CPU tensors: there a host chunk
is a plain CPU tensor and the staged paths take no streams. Chunk format and layouts:
`kvtier.layout`. PyTorch references: `kvtier.reference`.
"""

import kvtier.kernels  # noqa: F401, I001 - first: it may set TRITON_INTERPRET before triton is imported
from kvtier.ops.checks import INTERPRETING, BlockIds, block_ids
from kvtier.ops.device_ids import BlockIdError, check
from kvtier.ops.kv_copy import gather, scatter
from kvtier.ops.staged import load_staged, make_staging, save_staged

__all__ = [
    "INTERPRETING",
    "BlockIdError",
    "BlockIds",
    "block_ids",
    "check",
    "gather",
    "load_staged",
    "make_staging",
    "save_staged",
    "scatter",
]
