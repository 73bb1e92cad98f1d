"""Validation of every argument of the copy ops, in one place: a bad argument raises ValueError
naming it, before anything is launched; nothing out of range ever reaches a kernel."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from triton.runtime.interpreter import InterpretedFunction

from kvtier.kernels.kv_copy import kv_copy_kernel
from kvtier.layout import PagedKV
from kvtier.ops.device_ids import flagged
from kvtier.ops.host_ids import host_ids

# Kernels defined under TRITON_INTERPRET=1 run in Triton's interpreter, on CPU tensors.
INTERPRETING = isinstance(kv_copy_kernel, InterpretedFunction)


CHECKS = ("auto", "eager", "lazy")


class BlockIds:
    """Block ids for one cache (in range and distinct when `unique`, or `lazy`: checked by the
    kernel on each use), with the number of valid tokens in the last block. Build once with
    `block_ids`, reuse for many copies.

    cpu: int64 [n] (None for ids that stayed on the GPU); dev: int32 or int64 [n] on the cache's
    device; ready: event after `dev` landed (CUDA), on the stream `stream` (a raw handle) that made
    it, where a copy needs no wait; lazy: not checked by the host.
    """

    __slots__ = ("kv", "cpu", "dev", "unique", "last_valid", "ready", "lazy", "stream")

    def __init__(self, kv, cpu, dev, unique, last_valid, ready, lazy=False, stream=None):
        self.kv, self.cpu, self.dev, self.unique = kv, cpu, dev, unique
        self.last_valid, self.ready, self.lazy, self.stream = last_valid, ready, lazy, stream

    def __len__(self) -> int:
        return self.dev.shape[0]


def block_ids(
    kv: PagedKV,
    ids: torch.Tensor | Sequence[int],
    *,
    unique: bool = True,
    num_tokens: int | None = None,
    check: str = "auto",
) -> BlockIds:
    """Check `ids` (a 1-D int tensor on the CPU or the cache's device, or a sequence of ints)
    against `kv`. `unique` is required for writes (scatter, load).

    check: "auto" (default): ids on the host are checked now, ids on the GPU lazily; "eager":
    checked now, also GPU ids, which are read back (the host waits for the current stream);
    "lazy": checked by the kernel on every copy that uses them (`ops.device_ids`).
    """
    check_cache(kv)
    check = check_mode(check)
    name = "block_ids"
    if isinstance(ids, BlockIds):
        raise ValueError(f"{name}: already a BlockIds; pass it to the op directly")
    if isinstance(ids, torch.Tensor) and ids.device.type != "cpu":
        dev = device_ids(kv, ids)
        if check != "eager":
            last_valid = check_num_tokens(kv, len(dev), num_tokens)
            return BlockIds(kv, None, dev, unique, last_valid, None, True)
        cpu = torch.from_numpy(host_ids(kv, dev.cpu(), unique, True))  # waits for the current stream
        flagged(kv)  # the host waited anyway: report what lazily checked calls found
        return _landed(kv, cpu, dev.to(torch.int32), unique, check_num_tokens(kv, len(cpu), num_tokens))
    cpu = torch.from_numpy(host_ids(kv, ids, unique, check != "lazy")).to(torch.int64)
    last_valid = check_num_tokens(kv, len(cpu), num_tokens)
    return _landed(kv, cpu, None, unique, last_valid, lazy=check == "lazy")


def check_mode(check) -> str:
    if check not in CHECKS:
        raise ValueError(f"check: expected one of {CHECKS}, got {check!r}")
    return check


def device_ids(kv: PagedKV, ids: torch.Tensor) -> torch.Tensor:
    """GPU ids as the kernel takes them (int32 or int64, 1-D, on the cache's device)."""
    dt = ids.dtype
    if ids.dim() != 1 or not (dt is torch.int32 or dt is torch.int64):
        raise ValueError(f"block_ids: expected a 1-D int32/int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    if ids.device != known_cache(kv).device:
        raise ValueError(f"block_ids: on {ids.device}, expected the CPU or the cache's {kv.device}")
    return ids if ids.is_contiguous() else ids.contiguous()


def trusted_block_ids(kv: PagedKV, ids, unique: bool, last_valid: int) -> BlockIds:
    """BlockIds of ids checked once already, at the entry of their caller (the engine's
    `IdCheck`: in range, distinct when `unique`, `last_valid` the valid tokens of the last block):
    only the copy to the device, no second check. `ids`: int32 or int64 [n], a CPU tensor or numpy
    array; int32 ids go to the device as they are, `BlockIds.cpu` gets an int64 copy."""
    cpu = torch.from_numpy(ids) if isinstance(ids, np.ndarray) else ids
    dev = cpu.to(kv.device, non_blocking=True) if cpu.dtype == torch.int32 else None  # pageable: staged now
    return _landed(kv, cpu.to(torch.int64), dev, unique, last_valid)


def _landed(
    kv: PagedKV, cpu: torch.Tensor, dev, unique: bool, last_valid: int, lazy: bool = False
) -> BlockIds:
    """The BlockIds, with `dev` (int32 ids on the cache's device) copied from `cpu` if not given."""
    if dev is None:
        if lazy:  # unchecked: an id int32 cannot hold must still read as out of range
            cpu = torch.where((cpu < 0) | (cpu >= 2**31), -1, cpu)
        dev = cpu.to(torch.int32).to(kv.device, non_blocking=True)  # pageable source: staged at once
    ready = stream = None
    if dev.is_cuda:
        ready = torch.cuda.Event()
        current = torch.cuda.current_stream(kv.device)
        # Marks the ids landed on the GPU: an op on another stream waits for it before reading them.
        ready.record(current)
        stream = current.cuda_stream
    return BlockIds(kv, cpu, dev, unique, last_valid, ready, lazy, stream)


def as_block_ids(kv: PagedKV, ids, unique: bool, num_tokens: int | None) -> BlockIds:
    """`ids` as BlockIds for this op: checked now, or checked before (then for this cache)."""
    if not isinstance(ids, BlockIds):
        return block_ids(kv, ids, unique=unique, num_tokens=num_tokens)
    return matched(kv, ids, unique, num_tokens)


def matched(kv: PagedKV, ids: BlockIds, unique: bool, num_tokens: int | None) -> BlockIds:
    """A BlockIds given to an op: made for this cache, for writes when the op writes."""
    if ids.kv is not kv:
        raise ValueError("block_ids: a BlockIds made for another cache")
    if unique and not ids.unique:
        raise ValueError("block_ids: this op writes blocks; make the BlockIds with unique=True")
    if num_tokens is not None:
        raise ValueError("num_tokens: already given to the BlockIds; leave it None here")
    return ids


def check_num_tokens(kv: PagedKV, n: int, num_tokens: int | None) -> int:
    """-> valid tokens in the last block (block_size when all are)."""
    bs = kv.block_size
    if num_tokens is None:
        return bs
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise ValueError(f"num_tokens: expected an int, got {num_tokens!r}")
    if n == 0 and num_tokens == 0:
        return bs
    if not (n - 1) * bs < num_tokens <= n * bs:
        raise ValueError(f"num_tokens: {num_tokens} does not fit {n} blocks of {bs} tokens")
    return num_tokens - (n - 1) * bs


def check_max_ctas(max_ctas: int | None) -> None:
    if max_ctas is not None and (isinstance(max_ctas, bool) or not isinstance(max_ctas, int) or max_ctas < 1):
        raise ValueError(f"max_ctas: expected a positive int or None, got {max_ctas!r}")


def check_layers(kv: PagedKV, layers) -> tuple[int, int] | None:
    """(first, count) of a layer range inside the cache, or None for all layers."""
    if layers is None:
        return None
    ok = isinstance(layers, tuple) and len(layers) == 2
    ok = ok and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
    if not ok or not (layers[0] >= 0 and layers[1] >= 1 and layers[0] + layers[1] <= kv.num_layers):
        raise ValueError(f"layers: expected (first, count) inside {kv.num_layers} layers, got {layers!r}")
    return layers


def check_chunk(kv: PagedKV, t: torch.Tensor, n: int, name: str, host_only: bool = False) -> None:
    """A chunk of n blocks: right dtype/shape, contiguous, in memory the kernel can reach."""
    f = known_cache(kv)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    dt, shape = t.dtype, t.shape
    if dt is torch.uint8:
        if len(shape) != 1 or shape[0] != n * f.block_nbytes:
            raise ValueError(
                f"{name}: a uint8 buffer must be 1-D of {kv.chunk_nbytes(n)} bytes, got {tuple(t.shape)}"
            )
    elif dt is not f.dtype:
        raise ValueError(f"{name}: dtype {t.dtype} differs from the cache's {kv.dtype}")
    elif shape[1:] != f.chunk_tail or shape[0] != n:
        want = f"{kv.chunk_shape(n)} (n_blocks, layers, kv, *block_shape)"
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {want}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if INTERPRETING:
        if not t.is_cpu:
            raise ValueError(f"{name}: the Triton interpreter runs on CPU tensors, got {t.device}")
    elif t.is_cuda:
        if host_only:
            raise ValueError(f"{name}: expected pinned host memory, got {t.device}")
        if t.get_device() != f.index:
            raise ValueError(f"{name}: on {t.device}, expected the cache's {kv.device} or pinned host memory")
    elif not t.is_cpu:
        raise ValueError(f"{name}: on {t.device}, expected the cache's {kv.device} or pinned host memory")
    elif not t.is_pinned():
        raise ValueError(
            f"{name}: host buffer is pageable; the GPU can only reach pinned host memory "
            "(allocate with pin_memory=True or take it from a PinnedPool)"
        )


class CacheFacts:
    """What the checks of every call read from one cache, read once (a `PagedKV` is frozen)."""

    __slots__ = ("num_blocks", "block_size", "chunk_tail", "block_nbytes", "dtype", "device", "index")

    def __init__(self, kv: PagedKV):
        self.num_blocks, self.block_size = kv.num_blocks, kv.block_size
        self.chunk_tail = kv.chunk_shape(1)[1:]  # a chunk's shape past its block count
        self.block_nbytes, self.dtype, self.device = kv.block_nbytes, kv.dtype, kv.device
        self.index = kv.device.index if kv.device.type == "cuda" else None


FACTS_KEY = "checked"  # this module's entry in PagedKV.plans: the cache's CacheFacts, once checked


def known_cache(kv: PagedKV) -> CacheFacts:
    """`check_cache` once per cache (what it checks does not change); -> the cache's facts."""
    f = kv.plans.get(FACTS_KEY) if isinstance(kv, PagedKV) else None
    if f is None:
        check_cache(kv)
        f = kv.plans[FACTS_KEY] = CacheFacts(kv)
    return f


def check_cache(kv: PagedKV) -> None:
    if not isinstance(kv, PagedKV):
        raise ValueError(f"kv: expected a PagedKV (see kvtier.layout), got {type(kv).__name__}")
    if INTERPRETING and kv.device.type != "cpu":
        raise ValueError(
            f"kv: the Triton interpreter (TRITON_INTERPRET=1) runs on CPU tensors, got {kv.device}"
        )
    if not INTERPRETING and kv.device.type != "cuda":
        raise ValueError(
            f"kv: on {kv.device}; a CPU cache needs TRITON_INTERPRET=1 set before kvtier is imported"
        )
