"""The copy engine's batched copy: `cudaMemcpyBatchAsync` (CUDA runtime >= 12.8), one call per job.

Called through ctypes on the CUDA runtime torch has loaded, not through cuda-bindings: the C
signature is stable per runtime major (12.8/12.9 take a `failIdx` pointer, 13.x do not) and the
pointer arrays go in as tensors, so no Python object is built per piece.

A piece is one K or V block of one layer, contiguous in the cache (`kvtier.layout`); its address
is computed for all pieces at once with tensor arithmetic. The last block of a partial request is
split into its valid token rows (one per head for HND pieces): a load leaves the cache's tokens
past `num_tokens` untouched, and a save zeroes them in the slot on the CPU before submitting (the
slot is ours and no copy touches it yet), matching the chunk format.

Its CPU cost is per piece and small pieces stay well under the link's ceiling, so `auto` uses it
only for large pieces (`engine/paths.py`). It refuses the legacy default stream; the engine's copy
streams are never that one.
"""

from __future__ import annotations

import ctypes

import torch

from kvtier.device.cudart import runtime
from kvtier.layout import PagedKV
from kvtier.ops.checks import BlockIds
from kvtier.pool import Slot

_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: sources read in stream order
_FLAG_PREFER_OVERLAP = 1  # cudaMemcpyFlagPreferOverlapWithCompute


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


def _runtime() -> tuple[ctypes.CDLL | None, int, str]:
    """(libcudart, runtime version, why not usable or '')."""
    lib, ver, why = runtime()
    if lib is None:
        return None, ver, why
    if ver < 12080 or not hasattr(lib, "cudaMemcpyBatchAsync"):
        return None, ver, f"cudaMemcpyBatchAsync needs CUDA runtime >= 12.8, have {ver}"
    return lib, ver, ""


def available() -> bool:
    return _runtime()[0] is not None


def why_unavailable() -> str:
    return _runtime()[2] or "available"


def pieces(kv: PagedKV, ids: torch.Tensor, last_valid: int, host_ptr: int):
    """(paged addresses, host addresses, sizes): int64 CPU tensors, one entry per copy."""
    es, L, KV = kv.dtype.itemsize, kv.num_layers, kv.num_kv
    pb = kv.piece_numel * es
    base = kv.layers[kv.base].data_ptr()
    loff = torch.tensor(kv.layer_offsets, dtype=torch.int64) * es
    kvo = torch.arange(KV, dtype=torch.int64) * (kv.kv_stride * es)
    ids = ids.to(torch.int64)
    paged = base + (ids * (kv.block_stride * es))[:, None, None] + loff[None, :, None] + kvo[None, None, :]
    host = host_ptr + torch.arange(len(ids) * L * KV, dtype=torch.int64).view(len(ids), L, KV) * pb
    paged, host = paged.reshape(-1), host.reshape(-1)
    sizes = torch.full_like(paged, pb)
    if last_valid == kv.block_size:
        return paged, host, sizes
    # The last block's pieces: only the valid token rows of each segment (one per head in HND).
    hnd = kv.interior == "HND" and kv.block_size > 1 and not kv.is_mla
    segs = kv.num_heads if hnd else 1
    seg_b = pb // segs
    k = L * KV
    offs = torch.arange(segs, dtype=torch.int64) * seg_b
    lp = (paged[-k:, None] + offs).reshape(-1)
    lh = (host[-k:, None] + offs).reshape(-1)
    ls = torch.full_like(lp, last_valid * seg_b // kv.block_size)
    return torch.cat([paged[:-k], lp]), torch.cat([host[:-k], lh]), torch.cat([sizes[:-k], ls])


def prepare(kv: PagedKV, ids: torch.Tensor, last_valid: int, host: torch.Tensor, *, save: bool):
    """(dsts, srcs, sizes) of the job's copies, int64 CPU tensors; `host` is the slot's bytes.

    A save first zeroes the tokens past `last_valid` in the slot's last block: a chunk holds
    zeros there and no copy writes them (the slot is ALLOCATED: nothing is in flight into it)."""
    if save and last_valid < kv.block_size:
        chunk = host.view(kv.dtype).view(kv.chunk_shape(len(ids)))
        tail = chunk[-1].narrow(2 + kv.token_dim, last_valid, kv.block_size - last_valid)
        tail.view(torch.uint8).zero_()
    paged, hostp, sizes = pieces(kv, ids, last_valid, host.data_ptr())
    return (hostp, paged, sizes) if save else (paged, hostp, sizes)


def copy(kv: PagedKV, ids: BlockIds, slot: Slot, stream: torch.cuda.Stream, *, save: bool) -> None:
    """Enqueue the whole job as one batched copy on `stream` (not the legacy default stream)."""
    lib, _ver, why = _runtime()
    if lib is None:  # refused before `prepare` touches the slot
        raise ValueError(f"path 'batch' unavailable: {why}")
    if stream.cuda_stream == 0:
        raise ValueError("path 'batch': cudaMemcpyBatchAsync refuses the legacy default stream")
    dsts, srcs, sizes = prepare(kv, ids.cpu, ids.last_valid, slot.tensor, save=save)
    launch(dsts, srcs, sizes, stream, kv.device)


def launch(
    dsts: torch.Tensor, srcs: torch.Tensor, sizes: torch.Tensor, stream: torch.cuda.Stream, device
) -> None:
    """One cudaMemcpyBatchAsync of the copies (int64 CPU address / size tensors) on `stream`."""
    lib, ver, why = _runtime()
    if lib is None:
        raise ValueError(f"path 'batch' unavailable: {why}")
    attr = _MemcpyAttributes(
        _SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0), _FLAG_PREFER_OVERLAP
    )
    idx = ctypes.c_size_t(0)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731 - void*/size_t arrays, 8 bytes each
    args = [
        ptr(dsts),
        ptr(srcs),
        ptr(sizes),
        ctypes.c_size_t(len(sizes)),
        ctypes.byref(attr),
        ctypes.byref(idx),
    ]
    args.append(ctypes.c_size_t(1))  # one attribute entry for every copy
    fail = ctypes.c_size_t(0)
    if ver < 13000:
        args.append(ctypes.byref(fail))  # 12.8 / 12.9: size_t *failIdx before the stream
    args.append(ctypes.c_void_p(stream.cuda_stream))
    with torch.cuda.device(device):
        err = lib.cudaMemcpyBatchAsync(*args)
    if err != 0:
        lib.cudaGetLastError()  # consume the error so later, unrelated calls are not blamed
        name = lib.cudaGetErrorString(err)
        raise RuntimeError(f"cudaMemcpyBatchAsync failed: cudaError {err} {name!r} (copy {fail.value})")
