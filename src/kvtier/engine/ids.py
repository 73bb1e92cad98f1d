"""Block ids of a job: checked on the CPU in a few numpy passes (no Python loop per block, no
sort), and handed to the GPU through a ring of pinned host buffers (no allocation per job).

`IdCheck` turns what the caller passed (a 1-D int32/int64 tensor, a numpy array, a range or a
sequence of ints) into an int64 array of its own -- the job keeps it, so the caller may reuse its
buffer -- and checks it: in range (one pass: a negative id viewed as unsigned is out of range
too), distinct where asked (one scatter of positions, one gather back), `num_tokens` fitting.

`IdsBuffers` holds the pinned host buffers a graph exec's ids copy node reads. The copy reads its
source when the stream reaches it, not when the launch is enqueued: a buffer is written again
only once the event recorded after its last launch has completed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtier.lifecycle.blocks import CheckedBlocks


class IdCheck:
    """Checks ids against a cache of `num_blocks` blocks of `block_size` tokens. Thread-safe."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._lock = threading.Lock()
        self._mark = np.empty(num_blocks, dtype=np.int32)  # scratch of the duplicate check
        self._pos = np.arange(0, dtype=np.int32)

    def __call__(self, block_ids, unique: bool, num_tokens: int | None = None) -> torch.Tensor:
        """int64 [n] CPU block ids (the job's own copy), in range (distinct when `unique`),
        num_tokens fitting n blocks. Raises ValueError naming the argument."""
        return self.check(block_ids, unique, num_tokens)[0]

    def check(self, block_ids, unique: bool, num_tokens: int | None = None):
        """(int64 [n] CPU tensor, the same ids as `CheckedBlocks` for the block tracker): one array."""
        a = self._array(block_ids)
        n = len(a)
        if a.view(np.uint64).max() >= self.num_blocks:  # one pass: negatives wrap to huge values
            raise ValueError(f"block_ids: out of range; the cache has {self.num_blocks} blocks")
        if unique and self.has_duplicates(a):
            raise ValueError("block_ids: duplicate ids; a load cannot write one block twice")
        if num_tokens is not None:
            bs = self.block_size
            if (
                isinstance(num_tokens, bool)
                or not isinstance(num_tokens, int)
                or not (n - 1) * bs < num_tokens <= n * bs
            ):
                raise ValueError(f"num_tokens: {num_tokens!r} does not fit {n} blocks of {bs} tokens")
        return torch.from_numpy(a), CheckedBlocks(a, self.num_blocks)

    @staticmethod
    def _array(block_ids) -> np.ndarray:
        """A new 1-D int64 array of the ids (never a view of the caller's buffer)."""
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    f"block_ids: expected 1-D int32/int64, got {block_ids.dtype} {tuple(block_ids.shape)}"
                )
            if block_ids.device.type == "cpu":
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

    def has_duplicates(self, ids) -> bool:
        """`ids` (in range) repeat an id. O(n), no sort: write each position at its id and read
        it back; with a repeated id one of its positions reads another's (whichever write won)."""
        a = ids.numpy() if isinstance(ids, torch.Tensor) else ids
        with self._lock:
            if len(self._pos) < len(a):
                self._pos = np.arange(max(len(a), 2 * len(self._pos)), dtype=np.int32)
            pos = self._pos[: len(a)]
            self._mark[a] = pos
            return bool((self._mark[a] != pos).any())


class IdsBuffers:
    """The pinned host buffers one graph exec's ids copy node reads from (the node copies them to
    the graph's device ids buffer at the start of each launch). Each buffer is guarded by the event
    recorded after the last launch that read it; the node reads one buffer at a time, `cur`.
    Not thread-safe (used under the engine's lock).

    make_buffer(): a new buffer (pinned, on CUDA). first: the buffer the node reads now (default:
    a new one). A launch writes `cur` when its guard has completed -- no runtime call; else
    (movable) a free buffer, or a new one up to max_depth, or the next one once its launch ran, and
    the caller points the node there first (a host-side update of the exec, ~2-3 us on the H200);
    an exec that cannot be updated waits for its one buffer.
    """

    def __init__(self, make_buffer: Callable[[], Any], first: Any = None, max_depth: int = 16):
        if max_depth < 1:
            raise ValueError(f"max_depth: expected >= 1, got {max_depth}")
        self._make_buffer, self.max_depth = make_buffer, max_depth
        self.buffers: list = [first if first is not None else make_buffer()]
        self._guards: list = [None]  # per buffer: recorded after its last launch (None: never read)
        self.cur = 0  # the buffer the exec's node reads at its next launch
        self.grown = self.waited = self.moved = 0

    def take(self, movable: bool = True) -> int:
        """A buffer the host may write now: `cur` when free, else another (then the caller
        points the node at it before the launch, and calls `use`)."""
        g = self._guards[self.cur]
        if g is None or g.query():
            return self.cur
        if not movable:
            # Writing it now would change the ids of a launch still queued: wait for that launch.
            g.synchronize()
            self.waited += 1
            return self.cur
        for k, g in enumerate(self._guards):
            if k != self.cur and (g is None or g.query()):
                return k  # a buffer whose last launch has read it
        if len(self.buffers) < self.max_depth:
            self.buffers.append(self._make_buffer())
            self._guards.append(None)
            self.grown += 1
            return len(self.buffers) - 1
        k = (self.cur + 1) % len(self.buffers)  # not cur: the newest launch reads that one
        self._guards[k].synchronize()  # every buffer is still read: wait for the launch that reads k
        self.waited += 1
        return k

    def use(self, k: int, guard) -> None:
        """Buffer `k` is what the node reads from now on; rewritten only after `guard` (the event
        the caller records after the launch; until recorded it reads as complete: the caller
        holds the lock meanwhile)."""
        if k != self.cur:
            self.moved += 1
        self.cur = k
        # Rewritten only after `guard`: the launch before it has copied the ids by then.
        self._guards[k] = guard

    def __len__(self) -> int:
        return len(self.buffers)
