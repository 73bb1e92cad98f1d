"""The copy engine's batched copy: `cudaMemcpyBatchAsync` (CUDA runtime >= 12.8), one call per job
(a job of several slots, `TransferEngine.load_slots` / `save_slots`, included: `copy_slots`).

Called through ctypes on the CUDA runtime torch has loaded, not through cuda-bindings: the C
signature is stable per runtime major (12.8/12.9 take a `failIdx` pointer, 13.x do not) and the
pointer arrays go in as tensors, so no Python object is built per piece.

A piece is one K or V block of one layer, contiguous in the cache (`kvtier.layout`). A copy
(one descriptor) is a run of pieces adjacent in the cache and in the chunk alike: where a block's
pieces lie in the chunk's order (vLLM's BLHNC / BLNHC, MLA in any B-first order, `cross_layer`)
a full block is one copy, and consecutive ids whose block stride is that run join into one;
elsewhere a layer's adjacent pieces (LBHNC's heads) or single pieces. BHLNC's block is one run
too, but as [H, L, N, C] against the chunk's [L, H, N, C]: its copies stay per piece. A block's
runs are worked out once per cache, and each job's addresses with tensor arithmetic: no Python
object per piece or block. The last block of a partial request is split into its valid token
rows (one per head for HND pieces): a load leaves the cache's tokens past `num_tokens`
untouched, and a save zeroes them in the slot on the CPU before submitting (the slot is ours
and no copy touches it yet), matching the chunk format.

Its CPU cost is per copy and small copies stay well under the link's ceiling, so `auto` uses it
only where a full block's copies are long runs (`run_nbytes`, weighed by `engine/paths.py`). It
refuses the legacy default stream; the engine's copy streams are never that one.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np
import torch

from kvtier.device.cudart import runtime
from kvtier.layout import PagedKV
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


def pieces(kv: PagedKV, ids, last_valid: int, host_ptr):
    """(paged addresses, host addresses, sizes): int64 numpy arrays, one entry per copy; `ids`:
    the job's block ids (a numpy array, CPU tensor or list); `host_ptr`: the chunk's address, or
    an int64 array [n] of each block's address in its chunk (a job of several slots,
    `block_addresses`). Numpy, not torch: a job's few dozen small array steps cost a few
    microseconds each there, several times that in torch.

    A copy is a run of the job's pieces adjacent in the cache and in the chunk alike: a full
    block as its runs (`_block_runs`), the last block of a partial request as its valid rows,
    and then runs that continue each other across blocks (consecutive ids whose block stride
    is the run) joined too (`merge`)."""
    es, bs = kv.dtype.itemsize, kv.block_size
    r = _block_runs(kv)
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    full = n if last_valid == bs else n - 1
    blk = kv.layers[kv.base].data_ptr() + ids * (kv.block_stride * es)  # each block's (layer base, kv 0)
    if isinstance(host_ptr, np.ndarray):
        hblk = host_ptr  # each block's address in its own slot
    else:
        hblk = host_ptr + np.arange(n, dtype=np.int64) * kv.block_nbytes  # its place in the chunk
    paged = (blk[:full, None] + r.paged).reshape(-1)
    host = (hblk[:full, None] + r.host).reshape(-1)
    sizes = np.tile(r.sizes, full)
    if full < n:  # the last block: only the valid token rows of each segment (one per head in HND)
        lp = (blk[-1] + r.piece_paged[:, None] + r.seg).reshape(-1)
        lh = (hblk[-1] + r.piece_host[:, None] + r.seg).reshape(-1)
        ls = np.full_like(lp, last_valid * r.seg_nbytes // bs)
        paged, host, sizes = (
            np.concatenate([paged, lp]),
            np.concatenate([host, lh]),
            np.concatenate([sizes, ls]),
        )
    return merge(paged, host, sizes)


def run_nbytes(kv: PagedKV) -> int:
    """Bytes of the smallest copy of a full block on this path: the block's whole run where its
    pieces lie in the chunk's order (`kvtier.layout.contiguous_block_run`), else one layer's
    adjacent pieces (LBHNC: a layer's heads), else one piece. What `choose_path` weighs."""
    return int(_block_runs(kv).sizes.min())


def merge(paged, host, sizes):
    """(paged, host, sizes) of the copies (int64 arrays or CPU tensors; numpy arrays back) with
    each one that starts where the one before it ends, in the cache and in the chunk alike,
    joined to it: the same bytes, fewer descriptors. Copies adjacent on one side only (blocks
    next to each other in the cache but not in the chunk) stay apart."""
    paged, host, sizes = (np.asarray(a, dtype=np.int64) for a in (paged, host, sizes))
    if len(sizes) < 2:
        return paged, host, sizes
    start = np.ones(len(sizes), dtype=bool)
    start[1:] = (paged[1:] != paged[:-1] + sizes[:-1]) | (host[1:] != host[:-1] + sizes[:-1])
    first = np.flatnonzero(start)
    if len(first) == len(sizes):
        return paged, host, sizes
    last = np.append(first[1:], len(sizes)) - 1
    return paged[first], host[first], paged[last] + sizes[last] - paged[first]


def prepare(kv: PagedKV, ids, last_valid: int, host: torch.Tensor, *, save: bool):
    """(dsts, srcs, sizes) of the job's copies, int64 numpy arrays; `host` is the slot's bytes.

    A save first zeroes the tokens past `last_valid` in the slot's last block: a chunk holds
    zeros there and no copy writes them (the slot is ALLOCATED: nothing is in flight into it)."""
    if save:
        _zero_tail(kv, len(ids), last_valid, host)
    paged, hostp, sizes = pieces(kv, ids, last_valid, host.data_ptr())
    return (hostp, paged, sizes) if save else (paged, hostp, sizes)


def _zero_tail(kv: PagedKV, n: int, last_valid: int, host: torch.Tensor) -> None:
    """Zero the tokens past `last_valid` in the last of the `n` blocks of chunk `host`."""
    if last_valid < kv.block_size:
        chunk = host.view(kv.dtype).view(kv.chunk_shape(n))
        tail = chunk[-1].narrow(2 + kv.token_dim, last_valid, kv.block_size - last_valid)
        tail.view(torch.uint8).zero_()


def block_addresses(kv: PagedKV, ptrs, counts) -> np.ndarray:
    """int64 [sum(counts)]: the host address of each block of a job over several chunks, chunk j
    at address ptrs[j] holding counts[j] blocks (block ids go chunk by chunk, in order)."""
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.repeat(np.asarray(ptrs, dtype=np.int64), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)  # each block's chunk's first index
    return starts + (np.arange(len(starts), dtype=np.int64) - first) * kv.block_nbytes


def prepare_slots(kv: PagedKV, ids, last_valid: int, slots, counts, *, save: bool):
    """`prepare` for a job over several pool slots: `slots[j]` (a `Slot`; its address `.ptr`, no
    tensor made) holds the next `counts[j]` blocks of `ids`; only the last block of the last
    slot may be partial. One list of copies for them all (copies adjacent on both sides join
    across slots too)."""
    if save and last_valid < kv.block_size:
        _zero_tail(kv, counts[-1], last_valid, slots[-1].tensor)  # only the last slot may be partial
    hblk = block_addresses(kv, [s.ptr for s in slots], counts)
    paged, hostp, sizes = pieces(kv, ids, last_valid, hblk)
    return (hostp, paged, sizes) if save else (paged, hostp, sizes)


def copy_slots(
    kv: PagedKV, ids, last_valid: int, slots, counts, stream: torch.cuda.Stream, *, save: bool
) -> None:
    """`copy` for a job over several slots (chunk j: slots[j], counts[j] blocks): every copy of
    every slot in one batched call on `stream`."""
    lib, _ver, why = _runtime()
    if lib is None:  # refused before `prepare_slots` touches a slot
        raise ValueError(f"path 'batch' unavailable: {why}")
    if stream.cuda_stream == 0:
        raise ValueError("path 'batch': cudaMemcpyBatchAsync refuses the legacy default stream")
    dsts, srcs, sizes = prepare_slots(kv, ids, last_valid, slots, counts, save=save)
    launch(dsts, srcs, sizes, stream, kv.device)


def copy(kv: PagedKV, ids, last_valid: int, slot: Slot, stream: torch.cuda.Stream, *, save: bool) -> None:
    """Enqueue the whole job as one batched copy on `stream` (not the legacy default stream).
    ids: the job's checked block ids on the host (an int numpy array or CPU tensor): the
    addresses are computed here, so no id goes to the device (an H2D of pageable ids on
    `stream` could make the host wait for the copies already queued there)."""
    lib, _ver, why = _runtime()
    if lib is None:  # refused before `prepare` touches the slot
        raise ValueError(f"path 'batch' unavailable: {why}")
    if stream.cuda_stream == 0:
        raise ValueError("path 'batch': cudaMemcpyBatchAsync refuses the legacy default stream")
    dsts, srcs, sizes = prepare(kv, ids, last_valid, slot.tensor, save=save)
    launch(dsts, srcs, sizes, stream, kv.device)


def launch(dsts, srcs, sizes, stream: torch.cuda.Stream, device) -> None:
    """One cudaMemcpyBatchAsync of the copies (int64 address / size arrays or CPU tensors) on
    `stream`."""
    lib, ver, why = _runtime()
    if lib is None:
        raise ValueError(f"path 'batch' unavailable: {why}")
    attr = _MemcpyAttributes(
        _SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0), _FLAG_PREFER_OVERLAP
    )
    idx = ctypes.c_size_t(0)
    dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.int64) for a in (dsts, srcs, sizes))
    ptr = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731 - void*/size_t arrays, 8 bytes each
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


_RUNS_KEY = "batch_runs"  # this module's entry in PagedKV.plans


class _Runs(NamedTuple):
    """One block's copies, in bytes from the block's address in the cache (`paged`) and from
    its slot in the chunk (`host`): the merged runs of a full block, and the pieces and their
    segments that a partial block is cut into."""

    paged: np.ndarray
    host: np.ndarray
    sizes: np.ndarray
    piece_paged: np.ndarray
    piece_host: np.ndarray
    seg: np.ndarray  # offsets of a piece's segments: one per head in HND, else the piece
    seg_nbytes: int


def _block_runs(kv: PagedKV) -> _Runs:
    """The copies of one block, worked out once per cache (they hold for every block: only its
    address moves) and kept in `kv.plans`."""
    r = kv.plans.get(_RUNS_KEY)
    if r is not None:
        return r
    es = kv.dtype.itemsize
    pb = kv.piece_numel * es
    loff = np.asarray(kv.layer_offsets, dtype=np.int64) * es
    kvo = np.arange(kv.num_kv, dtype=np.int64) * (kv.kv_stride * es)
    piece_paged = (loff[:, None] + kvo[None, :]).reshape(-1)  # in the chunk's order: layer, then K/V
    piece_host = np.arange(len(piece_paged), dtype=np.int64) * pb
    paged, host, sizes = merge(piece_paged, piece_host, np.full_like(piece_paged, pb))
    hnd = kv.interior == "HND" and kv.block_size > 1 and not kv.is_mla
    segs = kv.num_heads if hnd else 1
    seg = np.arange(segs, dtype=np.int64) * (pb // segs)
    r = kv.plans[_RUNS_KEY] = _Runs(paged, host, sizes, piece_paged, piece_host, seg, pb // segs)
    return r
