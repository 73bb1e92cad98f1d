"""vLLM's `swap_blocks`, rebuilt at run time: one cudaMemcpyAsync per block, issued from native code.

It is the baseline the fast paths must beat: each small copy costs the CPU ~1-3 us to submit and
the copy engine a fixed overhead, so 32 KiB blocks run far below the link's ceiling.

Built with torch's cpp_extension `load_inline` (needs ninja, a C++ compiler and the CUDA headers);
if that fails, the same loop in plain C is compiled with nvcc and loaded with ctypes. If both fail,
`NativeBuildError` says why and the suite skips its rows.
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

_CPP = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

// vLLM csrc/cache_kernels.cu swap_blocks: one cudaMemcpyAsync per (src block, dst block) pair.
// The stream comes from Python (torch.cuda.current_stream().cuda_stream), which keeps this file free
// of torch's CUDA headers (they need the cuBLAS/cuSPARSE headers of a full toolkit).
void swap_blocks(torch::Tensor src, torch::Tensor dst, torch::Tensor mapping, int64_t stream) {
  TORCH_CHECK(mapping.device().is_cpu() && mapping.scalar_type() == torch::kInt64 && mapping.dim() == 2 &&
              mapping.size(1) == 2 && mapping.is_contiguous(),
              "mapping: expected a contiguous int64 CPU tensor [n, 2]");
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "src, dst: expected contiguous tensors");
  TORCH_CHECK(src.is_cuda() || dst.is_cuda(), "src, dst: at least one must be on the GPU");
  const int64_t block_bytes = src.stride(0) * src.element_size();
  cudaMemcpyKind kind = src.is_cuda() ? (dst.is_cuda() ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                                      : cudaMemcpyHostToDevice;
  char* s = static_cast<char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  const int64_t* m = mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < mapping.size(0); i++) {
    cudaError_t e = cudaMemcpyAsync(d + m[2 * i + 1] * block_bytes, s + m[2 * i] * block_bytes, block_bytes,
                                    kind, reinterpret_cast<cudaStream_t>(stream));
    TORCH_CHECK(e == cudaSuccess, "cudaMemcpyAsync: ", cudaGetErrorString(e));
  }
}
"""

_C = r"""
#include <cuda_runtime.h>
#include <stdint.h>
extern "C" int kvtier_swap_blocks(const char* src, char* dst, const int64_t* mapping, int64_t n,
                                  int64_t block_bytes, int kind, void* stream) {
  for (int64_t i = 0; i < n; i++) {
    const int64_t from = mapping[2 * i] * block_bytes, to = mapping[2 * i + 1] * block_bytes;
    cudaError_t e =
        cudaMemcpyAsync(dst + to, src + from, block_bytes, (cudaMemcpyKind)kind, (cudaStream_t)stream);
    if (e != cudaSuccess) return (int)e;
  }
  return 0;
}
"""

SwapBlocks = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
_cache: dict[str, tuple[SwapBlocks, str]] = {}


class NativeBuildError(RuntimeError):
    """Neither builder produced the native swap_blocks."""


def _check(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor) -> None:
    if (
        mapping.device.type != "cpu"
        or mapping.dtype != torch.int64
        or mapping.dim() != 2
        or mapping.shape[1] != 2
    ):
        raise ValueError("mapping: expected an int64 CPU tensor [n, 2] of (src block, dst block)")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("src, dst: expected contiguous tensors [blocks, ...]")
    for name, t in (("src", src), ("dst", dst)):
        if not t.is_cuda and not t.is_pinned():
            raise ValueError(
                f"{name}: a host tensor must be pinned, or each copy silently becomes synchronous"
            )
    if not (src.is_cuda or dst.is_cuda):
        raise ValueError("src, dst: at least one must be on the GPU")
    if src.stride(0) * src.element_size() != dst.stride(0) * dst.element_size():
        raise ValueError("dst: block size in bytes differs from src's")
    if len(mapping) and (
        int(mapping.min()) < 0
        or int(mapping[:, 0].max()) >= src.shape[0]
        or int(mapping[:, 1].max()) >= dst.shape[0]
    ):
        raise ValueError("mapping: a block id is out of range")  # a bad index must never reach the copy loop


def _via_load_inline() -> SwapBlocks:
    from torch.utils.cpp_extension import load_inline

    ext = load_inline(
        name="kvtier_swap_blocks_v2",
        cpp_sources=[_CPP],
        functions=["swap_blocks"],
        with_cuda=True,
        extra_ldflags=["-lcudart"],
        verbose=False,
    )

    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor) -> None:
        dev = src.device if src.is_cuda else dst.device
        ext.swap_blocks(src, dst, mapping, torch.cuda.current_stream(dev).cuda_stream)

    return swap_blocks


def _via_nvcc() -> SwapBlocks:
    tag = hashlib.sha1(_C.encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"kvtier_native_{tag}"
    out.mkdir(exist_ok=True)
    lib, src = out / "swap_blocks.so", out / "swap_blocks.cu"
    if not lib.exists():
        src.write_text(_C)
        # -cudart shared: use the process's libcudart (torch's), not a second static copy
        cmd = ["nvcc", "-O2", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared", "-o", str(lib), str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed: {(r.stderr or r.stdout).strip()[:300]}")
    so = ctypes.CDLL(str(lib))
    fn = so.kvtier_swap_blocks
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    fn.argtypes += [ctypes.c_int, ctypes.c_void_p]

    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor) -> None:
        kind = 3 if src.is_cuda and dst.is_cuda else 2 if src.is_cuda else 1  # D2D / D2H / H2D
        dev = src.device if src.is_cuda else dst.device
        stream = torch.cuda.current_stream(dev).cuda_stream
        bb = src.stride(0) * src.element_size()
        rc = fn(src.data_ptr(), dst.data_ptr(), mapping.data_ptr(), len(mapping), bb, kind, stream)
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyAsync failed with cudaError {rc}")

    return swap_blocks


def load_swap_blocks() -> tuple[SwapBlocks, str]:
    """(swap_blocks(src [blocks, ...], dst [blocks, ...], mapping int64 CPU [n, 2]), how it was built).

    Copies block mapping[i, 0] of src to block mapping[i, 1] of dst, one cudaMemcpyAsync each, on
    the current stream; returns once submitted (the copies may still be running). Unchecked: build
    a `SwapPlan`, which validates once, instead of calling it directly."""
    if "fn" not in _cache:
        errors = []
        for how, build in (("load_inline", _via_load_inline), ("nvcc+ctypes", _via_nvcc)):
            try:
                _cache["fn"] = (build(), how)
                break
            except Exception as e:
                lines = str(e).strip().splitlines() or [""]
                why = next((ln for ln in lines if "error" in ln.lower()), lines[-1])  # the compiler's line
                errors.append(f"{how}: {type(e).__name__}: {why.strip()[:300]}")
        else:
            raise NativeBuildError("could not build the native swap_blocks; " + " | ".join(errors))
    return _cache["fn"]


class SwapPlan:
    """vLLM-style swap of many (src, dst) block tensors with one mapping, validated once.

    pairs:   [(src [blocks, ...], dst [blocks, ...])], e.g. the K and V caches of every layer
    mapping: int64 CPU [n, 2] of (src block, dst block)
    Calling the plan submits len(pairs) * n cudaMemcpyAsync on the current stream."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], mapping: torch.Tensor):
        self.fn, self.built_with = load_swap_blocks()
        mapping = mapping.contiguous()
        for src, dst in pairs:
            _check(src, dst, mapping)
        self.pairs, self.mapping = pairs, mapping

    @property
    def copies(self) -> int:
        return len(self.pairs) * len(self.mapping)

    def __call__(self) -> None:
        for src, dst in self.pairs:
            self.fn(src, dst, self.mapping)
