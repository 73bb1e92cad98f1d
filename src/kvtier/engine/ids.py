"""Block ids of a job, checked on the CPU without a Python loop per block (and without a sort)."""

from __future__ import annotations

import threading

import numpy as np
import torch


class IdCheck:
    """Checks ids against a cache of `num_blocks` blocks of `block_size` tokens. Thread-safe."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._lock = threading.Lock()
        self._mark = np.empty(num_blocks, dtype=np.int64)  # scratch of the duplicate check
        self._arange = np.arange(0, dtype=np.int64)

    def __call__(self, block_ids, unique: bool, num_tokens: int | None = None) -> torch.Tensor:
        """int64 [n] CPU block ids, in range (distinct when `unique`), num_tokens fitting n blocks."""
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    f"block_ids: expected 1-D int32/int64, got {block_ids.dtype} {tuple(block_ids.shape)}"
                )
            ids = block_ids.to("cpu", torch.int64)
        else:
            try:
                ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
            except (TypeError, ValueError, RuntimeError, OverflowError) as e:
                raise ValueError(f"block_ids: expected a sequence of ints ({e})") from None
        if ids.dim() != 1 or len(ids) == 0:
            raise ValueError("block_ids: expected a non-empty flat sequence of ints")
        lo, hi = torch.aminmax(ids)  # one pass
        if int(lo) < 0 or int(hi) >= self.num_blocks:
            raise ValueError(f"block_ids: out of range; the cache has {self.num_blocks} blocks")
        if unique and self.has_duplicates(ids):
            raise ValueError("block_ids: duplicate ids; a load cannot write one block twice")
        if num_tokens is not None:
            bs, n = self.block_size, len(ids)
            if (
                isinstance(num_tokens, bool)
                or not isinstance(num_tokens, int)
                or not (n - 1) * bs < num_tokens <= n * bs
            ):
                raise ValueError(f"num_tokens: {num_tokens!r} does not fit {n} blocks of {bs} tokens")
        return ids

    def has_duplicates(self, ids: torch.Tensor) -> bool:
        """`ids` (in range) repeat an id. O(n), no sort: write each position at its id and read
        it back; with a repeated id one of its positions reads another's (whichever write won)."""
        a = ids.numpy()
        with self._lock:
            if len(self._arange) < len(a):
                self._arange = np.arange(max(len(a), 2 * len(self._arange)), dtype=np.int64)
            pos = self._arange[: len(a)]
            self._mark[a] = pos
            return not np.array_equal(self._mark[a], pos)
