"""Block ids of a job, checked once at the engine's entry (`IdCheck`) and trusted below.

`IdCheck` turns what the caller passed (a 1-D int32/int64 tensor, a numpy array, a range or a
sequence of ints) into an int32 array of its own -- the job keeps it, so the caller may reuse its
buffer; int32 because every id of a cache of at most 2**31 blocks fits, and half the bytes are
half the memory traffic of a big job's submit -- and checks it: in range (one pass: a negative id
viewed as unsigned is out of range too), distinct where asked (a mask marked, counted, cleared),
`num_tokens` fitting. The result is a `CheckedIds`: the block tracker takes it as it is, and the
movers turn it into `ops.BlockIds` with no second check (`ops.checks.trusted_block_ids`).

With the C helper (`fastpath/fast.py`) the usual input -- a contiguous int64/int32 tensor or
array, or a list or tuple of ints (vLLM's block ids) -- is copied and checked in one C call
instead of several numpy passes; the errors are the same. For jobs of SPARE_MIN ids or more that
call also picks the job's array from a few spares of that length: one that no job, tracker entry
or view holds any more (a reference count of 1, read under the GIL), so a serving loop of
like-sized jobs touches no new memory per job (a freshly allocated array is cold in the caches
right after a large copy). `check` and `__call__` give int64 tensors (a copy) to callers that
want them; the engine takes `checked`.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch

from kvtier.engine.fastpath.fast import fast as _fast
from kvtier.lifecycle.blocks import CheckedBlocks

SPARE_MIN = 1024  # ids from which a job's array comes from spares (smaller ones: malloc's bins)
SPARE_BYTES = 2 << 20  # spares of one length, at most (64 arrays of 8192 ids)
SPARE_LENGTHS = 4  # lengths with spares, the latest ones (others: a new array per job)
MAX_BLOCKS = 1 << 31  # every id of a cache up to this size fits the int32 copies
NOT_INTS = 3  # the C check's answer for a list with an item that is no int (numpy's path then)


class CheckedIds(CheckedBlocks):
    """Block ids checked once at the entry: `ids` (the job's own int32 numpy array, [n], in
    [0, `bound`), distinct when `unique`) and `last_valid`, the valid tokens of the last block.
    The block tracker keeps it as `CheckedBlocks`; movers trust it (a plain slotted class: made
    once per job, it must cost next to nothing)."""

    __slots__ = ("last_valid", "unique")

    def __init__(self, ids: np.ndarray, bound: int, unique: bool, last_valid: int):
        self.ids, self.bound, self.unique, self.last_valid = ids, bound, unique, last_valid

    def __len__(self) -> int:
        return self.ids.shape[0]

    def split(self, counts, block_size: int) -> list[CheckedIds]:
        """The ids chunk by chunk, `counts[j]` of them each, in order (views of `ids`): only the
        last part keeps `last_valid`, the others hold whole blocks of `block_size` tokens."""
        parts, at = [], 0
        for j, c in enumerate(counts):
            valid = self.last_valid if j == len(counts) - 1 else block_size
            parts.append(CheckedIds(self.ids[at : at + c], self.bound, self.unique, valid))
            at += c
        return parts


class IdCheck:
    """Checks ids against a cache of `num_blocks` blocks of `block_size` tokens. Thread-safe."""

    def __init__(self, num_blocks: int, block_size: int, spares: bool = True, native: bool = True):
        """native: use the C helper where it is built (False: the numpy passes, e.g. to test them)."""
        if not 0 < num_blocks <= MAX_BLOCKS:
            raise ValueError(f"num_blocks: expected 1..{MAX_BLOCKS} (ids are int32), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._spare_min = SPARE_MIN if spares else sys.maxsize  # spares: see the module docstring
        self._lock = threading.Lock()
        self._seen = np.zeros(num_blocks, dtype=bool)  # scratch of the duplicate check, all False between
        self._bits = np.zeros((num_blocks + 63) // 64, dtype=np.uint64)  # the C check's: a bit per block
        self._spares: dict[int, list[np.ndarray]] = {}  # length -> arrays, in order of use (`_fast`)
        self._fast = _fast if native else None

    @property
    def scratch_clear(self) -> bool:
        """True when the repeat checks' scratch masks are all clear, as every check leaves them."""
        with self._lock:
            return not self._seen.any() and not self._bits.any()

    def spare_arrays(self) -> dict[int, int]:
        """How many spare id arrays are kept, by length (at most SPARE_LENGTHS lengths)."""
        with self._lock:
            return {n: len(arrays) for n, arrays in self._spares.items()}

    def __call__(self, block_ids, unique: bool, num_tokens: int | None = None) -> torch.Tensor:
        """int64 [n] CPU block ids (a copy of the caller's), in range (distinct when `unique`),
        num_tokens fitting n blocks. Raises ValueError naming the argument."""
        return self.check(block_ids, unique, num_tokens)[0]

    def check(self, block_ids, unique: bool, num_tokens: int | None = None):
        """(int64 [n] CPU tensor, the same ids as `CheckedIds`)."""
        b = self.checked(block_ids, unique, num_tokens)
        return torch.from_numpy(b.ids).long(), b

    def checked(self, block_ids, unique: bool, num_tokens: int | None = None) -> CheckedIds:
        """The checked ids as `CheckedIds`: `.ids` is the job's own int32 numpy array (no torch
        view made: one call fewer on a submit, whose movers take numpy ids)."""
        got = self._native(block_ids, unique) if self._fast is not None else None
        if got is None:
            a = self._array(block_ids)
            hi = int(a.view(np.uint64).max())  # one pass: negatives wrap to huge values
            bad = 1 if hi >= self.num_blocks else 2 if unique and self.has_duplicates(a, hi) else 0
            if not bad:
                a = a.astype(np.int32)  # in range: every id fits (num_blocks <= 2**31)
        else:
            a, bad = got
        if bad == 1:
            raise ValueError(f"block_ids: out of range; the cache has {self.num_blocks} blocks")
        if bad == 2:
            raise ValueError("block_ids: duplicate ids; a load cannot write one block twice")
        bs = self.block_size
        if num_tokens is None:
            return CheckedIds(a, self.num_blocks, unique, bs)
        n = len(a)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise ValueError(f"num_tokens: expected an int or None, got {num_tokens!r}")
        if not (n - 1) * bs < num_tokens <= n * bs:
            raise ValueError(f"num_tokens: {num_tokens!r} does not fit {n} blocks of {bs} tokens")
        return CheckedIds(a, self.num_blocks, unique, num_tokens - (n - 1) * bs)

    def _native(self, block_ids, unique: bool) -> tuple[np.ndarray, int] | None:
        """The usual input -- a contiguous 1-D int64/int32 CPU tensor or numpy array, or a list or
        tuple of ints -- copied and checked in one C call (`fast.py`): (the copy, 0 / 1 out of
        range / 2 a repeat); None for anything else (the numpy path handles it)."""
        if type(block_ids) is torch.Tensor:  # few torch reads: each is costly on a cold host
            dt, shape = block_ids.dtype, block_ids.shape
            if len(shape) != 1 or not (block_ids.is_cpu and block_ids.is_contiguous()):
                return None
            if dt is not torch.int64 and dt is not torch.int32:
                return None
            n, src, wide = shape[0], block_ids.data_ptr(), dt is torch.int64
        elif type(block_ids) is list or type(block_ids) is tuple:  # vLLM's block ids: a list of ints
            n, src, wide = len(block_ids), block_ids, 2
        elif type(block_ids) is np.ndarray:
            dt = block_ids.dtype
            if block_ids.ndim != 1 or dt.kind != "i" or dt.itemsize not in (4, 8) or not dt.isnative:
                return None
            if not block_ids.flags.c_contiguous:
                return None
            n, src, wide = block_ids.shape[0], block_ids, dt.itemsize == 8
        else:
            return None
        if n == 0:
            return None  # the numpy path raises the error for an empty list
        bits = self._bits if unique else None
        spares = (self._spares.get(n) or self._new_spares(n)) if n >= self._spare_min else None
        if spares is not None:
            if unique:
                with self._lock:  # the scratch mask is shared: one check at a time marks it
                    got = self._fast.check_ids(src, wide, n, self.num_blocks, bits, spares)
            else:
                got = self._fast.check_ids(src, wide, n, self.num_blocks, None, spares)
            if got is not None:  # a free spare held the copy: the array, or what was wrong
                if type(got) is np.ndarray:
                    return got, 0
                return None if got == NOT_INTS else (None, got)
        a = np.empty(n, dtype=np.int32)  # the job's own copy
        if unique:
            with self._lock:  # the scratch mask is shared: one check at a time marks it
                rc = self._fast.check_ids(src, wide, n, self.num_blocks, bits, a)
        else:
            rc = self._fast.check_ids(src, wide, n, self.num_blocks, None, a)
        if rc == NOT_INTS:
            return None  # an item of the list is no int: the numpy path says what is wrong
        if spares is not None and rc == 0 and len(spares) * n * 4 < SPARE_BYTES:
            spares.append(a)  # a spare once the job and the tracker let it go
        return a, rc

    def _new_spares(self, n: int) -> list[np.ndarray]:
        """The spares of length `n` (made now if new); the length that got spares longest ago
        gives them up when more than SPARE_LENGTHS lengths have some."""
        with self._lock:
            spares = self._spares.setdefault(n, [])
            while len(self._spares) > SPARE_LENGTHS:
                del self._spares[next(iter(self._spares))]  # dicts keep insertion order: the oldest
            return spares

    @staticmethod
    def _array(block_ids) -> np.ndarray:
        """A new 1-D int64 array of the ids (never a view of the caller's buffer); `checked`
        narrows it to int32 once the range check passed."""
        if isinstance(block_ids, torch.Tensor):
            if block_ids.ndim != 1 or block_ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    f"block_ids: expected 1-D int32/int64, got {block_ids.dtype} {tuple(block_ids.shape)}"
                )
            if block_ids.is_cpu:
                a = block_ids.numpy().astype(np.int64)  # astype copies
            else:
                a = block_ids.cpu().numpy()  # a copy already (and a sync: the caller's choice)
                a = a if a.dtype == np.int64 else a.astype(np.int64)
        elif isinstance(block_ids, range):
            a = np.arange(block_ids.start, block_ids.stop, block_ids.step, dtype=np.int64)
        else:
            if isinstance(block_ids, np.ndarray):
                a = block_ids
            else:
                try:
                    a = np.array(block_ids if isinstance(block_ids, list | tuple) else list(block_ids))
                except (TypeError, ValueError, OverflowError) as e:
                    raise ValueError(f"block_ids: expected a sequence of ints ({e})") from None
            if a.ndim != 1 or len(a) == 0:
                raise ValueError("block_ids: expected a non-empty flat sequence of ints")
            if a.dtype.kind not in "iu":
                raise ValueError(f"block_ids: expected a sequence of ints, got {a.dtype} values")
            if a.dtype == np.uint64 and a.max() > np.iinfo(np.int64).max:
                raise ValueError("block_ids: out of range")
            a = a.astype(np.int64)  # a copy even when it is int64 already
        if len(a) == 0:
            raise ValueError("block_ids: expected a non-empty flat sequence of ints")
        return a

    def has_duplicates(self, ids, hi: int | None = None) -> bool:
        """`ids` (in range; `hi`: their largest, if known) repeat an id. No sort: mark each id in a
        bool scratch, count the marks up to `hi` (a sequential pass), clear them again; fewer
        marks than ids means a repeat. One byte per block: a quarter of the cache lines a mark of
        positions touches -- the scratch is cold at each job."""
        a = ids.numpy() if isinstance(ids, torch.Tensor) else ids
        if hi is None:
            hi = int(a.max())
        with self._lock:
            m = self._seen
            m[a] = True
            distinct = np.count_nonzero(m[: hi + 1])
            m[a] = False  # all False again for the next call
        return distinct != len(a)
