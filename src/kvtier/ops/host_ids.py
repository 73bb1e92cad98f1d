"""Block ids given on the host (a list, tuple or range of ints, a CPU tensor, a numpy array):
read, checked and written as int32 where the kernel's ids go, in one pass where it can be.

    HostIds(kv).count(ids)          n, without reading the ids (None: `host_ids` must read them)
    HostIds(kv).fill(ids, n, ...)   int32 ids into a buffer (a pinned slot, or a new array),
                                    checked: in range, distinct for writes
    host_ids(kv, ids, ...)          the ids as a numpy array (the general path, and the errors)

With the C helper built (`kvtier._fast.check_ids`, the one the engine's entry
uses) a list or tuple of ints, a contiguous int32/int64 CPU tensor or numpy array is copied,
range-checked and (for writes) checked for repeats in one C call, straight into the buffer the
copy to the GPU reads. Otherwise numpy does the same in a few passes (for repeats: a mark per
block, written and read back at the ids; no sort). Either way a bad id raises ValueError naming the first one
and nothing is launched. The helper lives with the engine's fast path; it is loaded at the
first fill, never at import (the engine package imports the ops).
"""

from __future__ import annotations

import array
import functools
import operator
import threading

import numpy as np
import torch

from kvtier.layout import PagedKV
from kvtier.native import load

HOST_IDS_KEY = "host_ids"  # this module's entry in PagedKV.plans
NOT_INTS = 3  # the C check's answer for an item that is no int: numpy's path decides


@functools.cache
def _helper():
    """The C helper's module, or None (not built, or off: KVTIER_NATIVE=0)."""
    return load("kvtier._fast")[0]


class HostIds:
    """The host-side id check of one cache: its bound and the scratch of the repeat check.
    Thread-safe: the C call is one step under the GIL (`kvtier.native` refuses a build without
    one), and the numpy passes over the shared marks hold `lock`."""

    def __init__(self, kv: PagedKV, native: bool = True):
        """native: use the C helper where it is built (False: numpy alone, e.g. to test it)."""
        self.kv = kv
        self.num_blocks = kv.num_blocks
        self.native = native
        self.lock = threading.Lock()
        self.bits: np.ndarray | None = None  # the C check's: a bit per block, all zero between calls
        self.marks: np.ndarray | None = None  # numpy's: per block, a position of the last check
        self.order = np.arange(0, dtype=np.int32)  # 0, 1, 2...: the positions marked

    def count(self, ids) -> int | None:
        """How many ids, read from the container alone; None where only reading them says."""
        t = type(ids)
        if t is list or t is tuple or t is range:
            return len(ids)
        if t is torch.Tensor or t is np.ndarray:
            return ids.shape[0] if ids.ndim == 1 else None  # another rank: host_ids names it
        return None

    def fill(self, ids, n: int, unique: bool, out: np.ndarray) -> None:
        """out[:n] = the ids as int32, checked (in range; distinct when `unique`); ValueError
        naming the first bad id otherwise (out's contents are then undefined). `n`: `count`'s."""
        fast = _helper() if self.native else None
        if fast is not None:
            rc = self._native(fast, ids, n, unique, out)
            if rc == 0:
                return
            if rc != NOT_INTS:  # an id out of range (1) or repeated (2): numpy's pass names it
                host_ids(self.kv, ids, unique, True, self)
                raise ValueError("block_ids: an id out of range or repeated")  # were numpy to disagree
        a = host_ids(self.kv, ids, unique, True, self)
        np.copyto(out[:n], a, casting="unsafe")  # in range: every id fits int32

    def _native(self, fast, ids, n: int, unique: bool, out: np.ndarray) -> int:
        """The C call: 0, 1 (out of range), 2 (repeat) or NOT_INTS (also: an input it does not take)."""
        t = type(ids)
        if t is list or t is tuple:
            src, wide = ids, 2
        elif t is torch.Tensor:
            dt = ids.dtype
            if not (ids.is_cpu and (dt is torch.int64 or dt is torch.int32) and ids.is_contiguous()):
                return NOT_INTS
            src, wide = ids.data_ptr(), dt is torch.int64
        elif t is np.ndarray:
            dt = ids.dtype
            if dt.kind != "i" or dt.itemsize not in (4, 8) or not dt.isnative or not ids.flags.c_contiguous:
                return NOT_INTS
            src, wide = ids, dt.itemsize == 8
        else:
            return NOT_INTS
        bits = None
        if unique:
            bits = self.bits
            if bits is None:
                bits = self.bits = np.zeros((self.num_blocks + 63) // 64, dtype=np.uint64)
        return fast.check_ids(src, wide, n, self.num_blocks, bits, out)

    def repeats(self, a: np.ndarray) -> bool:
        """In-range ids `a` name a block twice: each block marked with its id's position, then
        read back; a block named twice holds one position only, so another reads wrong. Two
        passes over the ids, none over the cache's blocks, no sort; stale marks are all written
        over before they are read."""
        n = a.shape[0]
        with self.lock:  # the marks are shared: one check at a time writes them
            if self.marks is None:
                self.marks = np.empty(self.num_blocks, dtype=np.int32)
            if self.order.shape[0] < n:
                self.order = np.arange(max(n, 2 * self.order.shape[0]), dtype=np.int32)
            at = self.order[:n]
            self.marks[a] = at
            return bool((self.marks[a] != at).any())


def host_checker(kv: PagedKV) -> HostIds:
    h = kv.plans.get(HOST_IDS_KEY)
    if h is None:
        h = kv.plans[HOST_IDS_KEY] = HostIds(kv)
    return h


def host_ids(kv: PagedKV, ids, unique: bool, checked: bool, checker: HostIds | None = None) -> np.ndarray:
    """Ids on the host (a list/tuple/range of ints, a CPU tensor or a numpy array) as a 1-D int32
    or int64 numpy array, checked (in range; distinct when `unique`) when `checked`. A copy of a
    list; a view of a tensor or array."""
    name = "block_ids"
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected a 1-D int32/int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
        if not ids.is_cpu:
            raise ValueError(f"{name}: on {ids.device}, expected the CPU or the cache's {kv.device}")
        a = ids.numpy()
    elif isinstance(ids, np.ndarray) and ids.dtype in (np.int32, np.int64) and ids.ndim == 1:
        a = ids
    else:
        try:
            a = np.frombuffer(array.array("q", ids), dtype=np.int64)  # ints only: no float, no str
        except (TypeError, ValueError, OverflowError):
            raise _bad_ids(kv, ids) from None
    if checked and a.shape[0]:
        if a.view(np.uint64 if a.dtype == np.int64 else np.uint32).max() >= kv.num_blocks:  # negative: huge
            j = int(np.flatnonzero((a < 0) | (a >= kv.num_blocks))[0])
            raise ValueError(f"{name}[{j}] = {int(a[j])} out of range: the cache has {kv.num_blocks} blocks")
        if unique and a.shape[0] > 1 and (checker or host_checker(kv)).repeats(a):
            raise ValueError(f"{name}: duplicate block ids; a block cannot be written twice in one copy")
    return a


def _bad_ids(kv: PagedKV, ids) -> ValueError:
    """The error for what `array.array("q")` refused: no sequence, an item that is no int (a
    float is never truncated to one), or an int past 64 bits."""
    name = "block_ids"
    try:
        items = list(ids)
    except TypeError:
        return ValueError(f"{name}: expected a flat sequence of ints, got {type(ids).__name__}")
    for j, x in enumerate(items):
        try:
            v = operator.index(x)
        except TypeError:
            return ValueError(f"{name}[{j}]: expected a flat sequence of ints, got {type(x).__name__} {x!r}")
        if not 0 <= v < kv.num_blocks:
            return ValueError(f"{name}[{j}] = {v} out of range: the cache has {kv.num_blocks} blocks")
    return ValueError(f"{name}: expected a flat sequence of ints")
