"""An SM-kernel copy, to compare with the copy engine: a flat Triton copy whose source or
destination may be pinned host memory, reached through unified virtual addressing (UVA).

This is a measuring instrument for `probe`, not a kvtier op (those live in kernels/ and ops),
which is why kernel and wrapper sit together here. Triton refuses CPU tensors, so a pinned tensor
is handed over as `HostPtr`: an object with `data_ptr()` and `dtype`, which Triton turns into a
pointer; pinned memory allocated by CUDA is addressable from the GPU at that same address.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192  # elements per program: 32 KiB of int32, enough bytes in flight per SM


@triton.jit
def copy_kernel(
    src,  # *int32, n elements (device memory, or pinned host memory through UVA)
    dst,  # *int32, n elements (same)
    n,  # number of elements
    BLOCK: tl.constexpr,  # elements per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


class HostPtr:
    """A pinned CPU tensor as Triton sees a GPU pointer (keeps the tensor alive)."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def _as_arg(t: torch.Tensor, name: str):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if t.nbytes % 4 or t.data_ptr() % 16:
        raise ValueError(f"{name}: byte size must be a multiple of 4 and the address 16-byte aligned")
    v = t.reshape(-1).view(torch.uint8).view(torch.int32)
    if t.is_cuda:
        return v
    if not t.is_pinned():
        raise ValueError(f"{name}: a CPU tensor must be pinned (pin_memory=True) to be reached through UVA")
    return HostPtr(v)


def sm_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src with a Triton kernel on the current stream. Either side may be pinned host memory;
    at least one side must be on the GPU. Same byte size, contiguous."""
    if src.nbytes != dst.nbytes:
        raise ValueError(f"dst: byte size {dst.nbytes} differs from src's {src.nbytes}")
    if not (src.is_cuda or dst.is_cuda):
        raise ValueError("src, dst: at least one must be on the GPU")
    s, d = _as_arg(src, "src"), _as_arg(dst, "dst")
    n = src.nbytes // 4
    copy_kernel[(triton.cdiv(n, BLOCK),)](s, d, n, BLOCK=BLOCK, num_warps=8)
