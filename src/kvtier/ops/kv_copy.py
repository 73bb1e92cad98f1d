"""Wrappers of the paged-KV copy kernel (kernels/kv_copy.py): validate, plan the launch, launch.

`gather` copies blocks of every layer (K and V) from a paged cache into a contiguous chunk;
`scatter` copies a chunk back into blocks. The chunk (format in `kvtier.layout`) lives in GPU
memory or in pinned host memory, which the kernel reads/writes directly through unified
virtual addressing (UVA). Both run on the current stream and return once *submitted*: the data
is there only when that stream's work has completed (record an event after the call).

Nothing invalid reaches a kernel: a bad argument raises `ValueError` naming it (ops/checks.py).
Block ids are a list, a CPU or GPU tensor (checked on every call), or a `BlockIds` checked once.

The chunk of n blocks, per layout of the cache (`kvtier.layout`; L layers, bs tokens per block,
H KV heads of D elements, a latent of C):

    vllm_flash, flashinfer NHD, cross_layer   (n, L, 2, bs, H, D)
    flashinfer HND (or HND memory)            (n, L, 2, H, bs, D)
    mla                                       (n, L, 1, bs, C)

of the cache's dtype, contiguous; or the same bytes as 1-D uint8 of `kv.chunk_nbytes(n)`.

On a machine without CUDA the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set
before `kvtier.kernels` is imported) on CPU tensors; there a host chunk is a plain CPU tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import triton

from kvtier.kernels.kv_copy import kv_copy_kernel
from kvtier.layout import PagedKV, gcd_bytes
from kvtier.ops.checks import (
    INTERPRETING,
    BlockIds,
    as_block_ids,
    check_cache,
    check_chunk,
    check_layers,
    check_max_ctas,
)

TILE_BYTES = 16 << 10  # bytes per program step: 8 x 16-byte vectors per thread at 4 warps
# Default grids. GPU<->GPU: one program per tile, which beats a persistent grid of a few resident
# CTAs per SM. A UVA copy is bound by PCIe, not by SMs: a quarter of them move it as fast as all
# of them would, and the rest stay free for the model's compute.
UVA_SM_DIVISOR = 4
NUM_WARPS = 4
_UNITS = {4: torch.int32, 2: torch.int16, 1: torch.int8}


class _HostPtr:
    """A pinned host buffer as Triton sees it: an address the GPU reaches through UVA."""

    def __init__(self, t: torch.Tensor):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


@dataclass(frozen=True, slots=True)
class _Plan:
    unit: torch.dtype
    vec: int  # units per aligned vector
    o: int  # segments per piece
    inner: int  # units per token in a segment
    cols: int
    rows: int
    layer_off: torch.Tensor  # int64 [num_layers] on the cache's device, in vec-units
    kv_stride: int  # vec-units
    block_stride: int  # vec-units


def gather(
    kv: PagedKV,
    block_ids: BlockIds | torch.Tensor | Sequence[int],
    dst: torch.Tensor,
    *,
    num_tokens: int | None = None,
    max_ctas: int | None = None,
    layers: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Copy blocks `block_ids` (n of them) of every layer, K and V, into `dst`.

    kv: the paged cache (`kvtier.layout`), on a CUDA GPU (CPU under the interpreter).
    block_ids: n block ids, any order, repeats allowed: a list/tuple of ints, an int32/int64
         tensor [n] on the CPU or the cache's GPU (checked now), or a `BlockIds` (checked once).
    dst: the chunk, (n, num_layers, num_kv, *kv.block_shape) of kv.dtype: (n, L, 2, bs, H, D)
         for vllm_flash / flashinfer NHD / cross_layer, (n, L, 2, H, bs, D) for HND, (n, L, 1,
         bs, C) for mla; or a 1-D uint8 buffer of kv.chunk_nbytes(n). Contiguous; on the
         cache's GPU or in pinned host memory (written through UVA).
    num_tokens: tokens in these blocks, (n - 1) * block_size < num_tokens <= n * block_size;
         default all. Tokens past it in the last block are written as zeros.
    max_ctas: cap on the programs launched (persistent grid), e.g. to leave SMs to compute
         while writing to host memory; default: every tile on the GPU, a quarter of the SMs
         into host memory.
    layers: (first, count): copy only these layers' pieces (the chunk keeps every layer); default all.
    Returns dst. Asynchronous on the current stream.

    >>> import torch
    >>> from kvtier import layout, ops
    >>> caches = [torch.randn(2, 64, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(32)]
    >>> kv = layout.vllm_flash(caches)  # 32 layers of (2, num_blocks, block_size, heads, head_dim)
    >>> dst = torch.empty(kv.chunk_shape(3), dtype=kv.dtype, pin_memory=True)
    >>> ops.gather(kv, [5, 1, 9], dst).shape  # then record an event: the bytes land asynchronously
    torch.Size([3, 32, 2, 16, 8, 128])
    """
    check_cache(kv)
    ids = as_block_ids(kv, block_ids, False, num_tokens)
    check_chunk(kv, dst, len(ids), "dst")
    check_max_ctas(max_ctas)
    layers = check_layers(kv, layers)
    launch(kv, use_ids(ids), dst, ids.last_valid, gather=True, max_ctas=max_ctas, layers=layers)
    return dst


def scatter(
    kv: PagedKV,
    block_ids: BlockIds | torch.Tensor | Sequence[int],
    src: torch.Tensor,
    *,
    num_tokens: int | None = None,
    max_ctas: int | None = None,
    layers: tuple[int, int] | None = None,
) -> None:
    """Copy the chunk `src` into blocks `block_ids` (n distinct ids) of every layer, K and V.

    kv: the paged cache, as in `gather`.
    block_ids: as in `gather`, without duplicates (a `BlockIds` made with unique=True).
    src: the chunk, shaped as `gather`'s dst: (n, num_layers, num_kv, *kv.block_shape) of
         kv.dtype ((n, L, 2, bs, H, D) for vllm_flash / flashinfer NHD / cross_layer,
         (n, L, 2, H, bs, D) for HND, (n, L, 1, bs, C) for mla) or 1-D uint8 of
         kv.chunk_nbytes(n); contiguous; on the cache's GPU or in pinned host memory.
    num_tokens: as in `gather`; cache tokens past it in the last block are left untouched.
    max_ctas: as in `gather`.
    layers: as in `gather` (a per-layer load scatters one layer per call, then records an event).
    Asynchronous on the current stream; `src` must stay alive and unchanged until it completes.

    >>> import torch
    >>> from kvtier import layout, ops
    >>> caches = [torch.zeros(64, 2, 16, 8, 128, dtype=torch.float16, device="cuda") for _ in range(4)]
    >>> kv = layout.flashinfer(caches, "NHD")  # 4 layers of (num_blocks, 2, block_size, heads, dim)
    >>> src = torch.randn(kv.chunk_shape(2), dtype=kv.dtype, pin_memory=True)  # (2, 4, 2, 16, 8, 128)
    >>> ops.scatter(kv, [7, 3], src, num_tokens=20)  # block 7 whole, the first 4 tokens of block 3
    """
    check_cache(kv)
    ids = as_block_ids(kv, block_ids, True, num_tokens)
    check_chunk(kv, src, len(ids), "src")
    check_max_ctas(max_ctas)
    layers = check_layers(kv, layers)
    launch(kv, use_ids(ids), src, ids.last_valid, gather=False, max_ctas=max_ctas, layers=layers)


# ---- launch -----------------------------------------------------------------------------


def use_ids(ids: BlockIds) -> torch.Tensor:
    """ids.dev, made safe to read on the current stream. Inside a CUDA-graph capture nothing is
    recorded (an outside event cannot be waited on there): the ids must have landed already, and
    the graph's owner keeps them alive."""
    if ids.ready is not None and not torch.cuda.is_current_stream_capturing():
        stream = torch.cuda.current_stream(ids.dev.device)
        # The ids may have been copied to the GPU on another stream: read them only once landed.
        stream.wait_event(ids.ready)
        # And their memory must not be handed out again before this stream has read them.
        ids.dev.record_stream(stream)
    return ids.dev


def launch(
    kv: PagedKV,
    ids_dev: torch.Tensor,
    chunk: torch.Tensor,
    last_valid: int,
    *,
    gather: bool,
    max_ctas,
    layers: tuple[int, int] | None = None,
    table: tuple[torch.Tensor, int] | None = None,
):
    """Launch on the current stream; arguments already validated. layers: (first, count) or all.
    table: (chunk_off, align) of a call over several chunks (`ops/slots.py`): block i's pieces
    start chunk_off[i] VEC-units from `chunk`; align divides every chunk address involved."""
    layer0, n_layers = layers if layers is not None else (0, kv.num_layers)
    if ids_dev.numel():
        prepare(
            kv, ids_dev, chunk, last_valid, gather=gather, max_ctas=max_ctas, n_layers=n_layers, table=table
        )(layer0)


def prepare(
    kv: PagedKV,
    ids_dev: torch.Tensor,
    chunk: torch.Tensor,
    last_valid: int,
    *,
    gather: bool,
    max_ctas,
    n_layers: int,
    table: tuple[torch.Tensor, int] | None = None,
):
    """`launch`'s planning done once: returns run(layer0), which launches n_layers layers from
    layer0 on the current stream (a per-layer load launches L times with the same arguments)."""
    n = ids_dev.numel()
    align = math.gcd(chunk.data_ptr(), chunk.untyped_storage().data_ptr())
    plan = plan_for(kv, align if table is None else table[1])
    nct = triton.cdiv(kv.block_size * plan.inner, plan.cols)
    n_rows = n * n_layers * kv.num_kv * plan.o * nct
    if n_rows + plan.rows >= 2**31:
        raise ValueError(f"block_ids: {n} blocks make {n_rows} rows, past the kernel's int32 row index")
    n_tiles = triton.cdiv(n_rows, plan.rows)
    if INTERPRETING:
        cap = 4
    elif chunk.device.type == "cpu":
        cap = max(1, torch.cuda.get_device_properties(kv.device).multi_processor_count // UVA_SM_DIVISOR)
    else:
        cap = n_tiles
    grid = (min(n_tiles, max_ctas or cap),)
    paged = _alias(kv.layers[kv.base], plan.unit)
    chunk_arg = _alias(chunk, plan.unit)
    if not INTERPRETING and chunk.device.type == "cpu":
        chunk_arg = _HostPtr(chunk_arg)  # pinned: the kernel stores/loads through UVA
    head = (
        paged,
        plan.layer_off,
        ids_dev,
        chunk_arg,
        ids_dev if table is None else table[0],
    )  # 5th: unused without TABLE
    consts = dict(KV=kv.num_kv, O=plan.o, BS=kv.block_size, I=plan.inner, COLS=plan.cols, ROWS=plan.rows,
                  VEC=plan.vec, GATHER=gather, TABLE=table is not None, num_warps=NUM_WARPS)  # fmt: skip
    kernel = kv_copy_kernel[grid]
    on = kv.device if kv.device.type == "cuda" else None

    def run(layer0: int) -> None:
        with torch.cuda.device(on) if on is not None else nullcontext():
            kernel(
                *head,
                n,
                last_valid,
                kv.num_layers,
                layer0,
                n_layers,
                plan.kv_stride,
                plan.block_stride,
                **consts,
            )

    return run


def plan_for(kv: PagedKV, chunk_align: int) -> _Plan:
    """The launch plan; chunk_align: a number every chunk address the kernel sees is a multiple of."""
    g = gcd_bytes(kv)
    while chunk_align % g:
        g //= 2
    if g in kv.plans:
        return kv.plans[g]
    ubytes = min(g, 4)
    esize = kv.dtype.itemsize
    hnd = kv.interior == "HND" and kv.block_size > 1
    o = kv.num_heads if hnd else 1
    inner = (kv.head_dim if hnd else kv.num_heads * kv.head_dim) * esize // ubytes
    vec_b = g  # bytes per aligned vector
    cols, rows = tile_shape(kv.block_size * inner, TILE_BYTES // ubytes)
    to_v = lambda elems: elems * esize // vec_b  # noqa: E731 - exact: g divides all of them
    offs = torch.tensor([to_v(x) for x in kv.layer_offsets], dtype=torch.int64).to(kv.device)
    plan = _Plan(
        _UNITS[ubytes], g // ubytes, o, inner, cols, rows, offs, to_v(kv.kv_stride), to_v(kv.block_stride)
    )
    kv.plans[g] = plan
    return plan


def tile_shape(seg: int, tile: int) -> tuple[int, int]:
    """(COLS, ROWS) for segments of `seg` units and `tile` units per step: the widest power-of-2
    row slice that wastes at most 1/8 of each segment (else the least wasteful)."""
    c = min(tile, triton.next_power_of_2(seg))
    floor, best = min(16, c), None
    while c >= floor:
        waste = -seg % c
        if waste * 8 <= seg:
            return c, tile // c
        if best is None or waste < best[0]:
            best = (waste, c)
        c //= 2
    return best[1], tile // best[1]


def _alias(t: torch.Tensor, unit: torch.dtype) -> torch.Tensor:
    """A 1-D `unit` tensor starting at t's first byte (to the end of t's storage)."""
    storage = t.untyped_storage()
    start = t.data_ptr() - storage.data_ptr()
    size = (storage.nbytes() - start) // unit.itemsize
    return torch.empty(0, dtype=unit, device=t.device).set_(storage, start // unit.itemsize, (size,), (1,))
