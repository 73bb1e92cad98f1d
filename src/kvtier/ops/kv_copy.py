"""Wrappers of the paged-KV copy kernel (kernels/kv_copy.py): validate, plan the launch, launch.

`gather` copies blocks of every layer (K and V) from a paged cache into a contiguous chunk;
`scatter` copies a chunk back into blocks. The chunk (format in `kvtier.layout`) lives in GPU
memory or in pinned host memory, which the kernel reads/writes directly through unified
virtual addressing (UVA). Both run on the current stream and return once *submitted*: the data
is there only when that stream's work has completed (record an event after the call).

Nothing invalid reaches a kernel: a bad argument raises `ValueError` naming it (ops/checks.py).
Block ids are a list, tuple, range, CPU tensor or numpy array (checked on the host at every
call, in one pass that also writes them where the copy to the GPU reads them), a GPU tensor
(checked by the kernel, reported by `ops.check`), or a `BlockIds` checked once.

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

from collections.abc import Sequence

import torch

from kvtier.layout import PagedKV
from kvtier.ops.call_ids import call_ids, finish, use_ids
from kvtier.ops.checks import BlockIds, check_chunk, check_layers, check_max_ctas, known_cache
from kvtier.ops.launch import claim, launch, plan_for, prepare, tile_shape

__all__ = ["claim", "gather", "launch", "plan_for", "prepare", "scatter", "tile_shape", "use_ids"]


def gather(
    kv: PagedKV,
    block_ids: BlockIds | torch.Tensor | Sequence[int],
    dst: torch.Tensor,
    *,
    num_tokens: int | None = None,
    max_ctas: int | None = None,
    layers: tuple[int, int] | None = None,
    check: str = "auto",
) -> torch.Tensor:
    """Copy blocks `block_ids` (n of them) of every layer, K and V, into `dst`.

    kv: the paged cache (`kvtier.layout`), on a CUDA GPU (CPU under the interpreter).
    block_ids: n block ids, any order, repeats allowed: a list/tuple/range of ints or an int
         tensor / numpy array [n] on the CPU (checked now), an int32/int64 tensor [n] on the
         cache's GPU (checked by the kernel: the host never waits), or a `BlockIds` (checked once).
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
    check: "auto", "eager" or "lazy": where the ids are checked (the table in `kvtier.ops`). A bad
         id checked lazily is skipped (its block of `dst` is not written) and raises at `ops.check`.
    Returns dst. Asynchronous on the current stream. Host time: the checks and one launch; host
    ids add one pass over them, one small copy to the GPU and one event record.

    >>> import torch
    >>> from kvtier import layout, ops
    >>> caches = [torch.randn(2, 64, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(32)]
    >>> kv = layout.vllm_flash(caches)  # 32 layers of (2, num_blocks, block_size, heads, head_dim)
    >>> dst = torch.empty(kv.chunk_shape(3), dtype=kv.dtype, pin_memory=True)
    >>> ops.gather(kv, [5, 1, 9], dst).shape  # then record an event: the bytes land asynchronously
    torch.Size([3, 32, 2, 16, 8, 128])
    """
    _copy(kv, block_ids, dst, "dst", num_tokens, max_ctas, layers, check, gather=True)
    return dst


def scatter(
    kv: PagedKV,
    block_ids: BlockIds | torch.Tensor | Sequence[int],
    src: torch.Tensor,
    *,
    num_tokens: int | None = None,
    max_ctas: int | None = None,
    layers: tuple[int, int] | None = None,
    check: str = "auto",
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
    check: as in `gather`; lazily, every copy of an id named twice in the call is skipped too.
    Asynchronous on the current stream; `src` must stay alive and unchanged until it completes.
    Host time: as `gather`'s; lazily checked ids add the claim kernel's launch.

    >>> import torch
    >>> from kvtier import layout, ops
    >>> caches = [torch.zeros(64, 2, 16, 8, 128, dtype=torch.float16, device="cuda") for _ in range(4)]
    >>> kv = layout.flashinfer(caches, "NHD")  # 4 layers of (num_blocks, 2, block_size, heads, dim)
    >>> src = torch.randn(kv.chunk_shape(2), dtype=kv.dtype, pin_memory=True)  # (2, 4, 2, 16, 8, 128)
    >>> ops.scatter(kv, [7, 3], src, num_tokens=20)  # block 7 whole, the first 4 tokens of block 3
    """
    _copy(kv, block_ids, src, "src", num_tokens, max_ctas, layers, check, gather=False)


def _copy(kv, block_ids, chunk, name, num_tokens, max_ctas, layers, check, *, gather: bool) -> None:
    known_cache(kv)
    ids = call_ids(kv, block_ids, not gather, num_tokens, check)
    try:
        check_chunk(kv, chunk, ids.n, name)
        check_max_ctas(max_ctas)
        layers = check_layers(kv, layers)
        stamp = claim(kv, ids.dev) if ids.check == 2 else 0
        launch(
            kv,
            ids.dev,
            chunk,
            ids.last_valid,
            gather=gather,
            max_ctas=max_ctas,
            layers=layers,
            check=ids.check,
            stamp=stamp,
        )
    finally:
        finish(ids)  # the ids' pinned slot: free once this stream got past what was enqueued
