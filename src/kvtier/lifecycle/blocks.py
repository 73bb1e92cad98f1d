"""GPU-block pending accesses and which must wait for which (`BlockTracker`)."""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvtier.device.base import Event
from kvtier.lifecycle.errors import LifecycleError, sanitize_enabled


class Access(enum.Enum):
    READ = "READING"  # compute reads the blocks (attention)
    WRITE = "WRITING"  # compute writes the blocks (new KV)
    SAVE = "SAVING"  # a copy out to the pool
    LOAD = "LOADING"  # a copy in from the pool

    __hash__ = object.__hash__  # members are singletons: a dict lookup by kind makes no Python call


A = Access
# A new access must be ordered after pending accesses of these kinds to the same blocks.
MUST_FOLLOW: dict[Access, tuple[Access, ...]] = {
    A.READ: (A.LOAD,),
    A.WRITE: (A.LOAD, A.SAVE, A.READ),
    A.SAVE: (A.WRITE, A.LOAD),
    A.LOAD: (A.READ, A.WRITE, A.SAVE, A.LOAD),
}
WHY: dict[tuple[Access, Access], str] = {
    (A.READ, A.LOAD): "compute would read the block before the load into it completed",
    (A.WRITE, A.LOAD): "compute would write the block while a load still writes it",
    (A.WRITE, A.SAVE): "compute would overwrite the block before its save completed",
    (A.WRITE, A.READ): "compute would overwrite the block while a read still needs the old data",
    (A.SAVE, A.WRITE): "the save would copy KV the compute has not finished writing (vLLM #31341/#45704)",
    (A.SAVE, A.LOAD): "the save would copy a block a load still writes",
    (A.LOAD, A.READ): "the load would overwrite a block that is still being read (vLLM #47282)",
    (A.LOAD, A.WRITE): "the load would race a compute write to the block",
    (A.LOAD, A.SAVE): "the load would overwrite a block before its save completed",
    (A.LOAD, A.LOAD): "two loads into one block would race",
}


class CheckedBlocks:
    """Block ids a caller has checked already (the engine's `IdCheck`): a 1-D int32 numpy array
    `ids` of ids in [0, `bound`) that nobody writes any more. The tracker keeps it as is: no copy,
    no check. (A plain slotted class: made once per job, it must cost next to nothing.)"""

    __slots__ = ("bound", "ids")

    def __init__(self, ids: np.ndarray, bound: int):
        self.ids, self.bound = ids, bound


# Block ids: a list, set, frozenset, range, 1-D integer tensor or numpy array, or CheckedBlocks.
Blocks = Iterable[int] | torch.Tensor | np.ndarray | CheckedBlocks


MASK_MAX = 1 << 24  # ids below it are checked through the scratch mask (1 B each), others by a sort


class _Pending:
    """One submitted access (a plain slotted class: one per job, it must cost next to nothing)."""

    __slots__ = ("blocks", "event", "hi", "kind", "stream")

    def __init__(self, kind: Access, blocks: np.ndarray, hi: int, event: Event):
        self.kind = kind
        self.blocks = blocks  # int64 [n] (int32 from the engine's IdCheck), owned by the tracker
        self.hi = hi  # above every id in `blocks`
        self.event = event
        self.stream = event.stream  # where it was recorded (registered events are not re-recorded)


def _same(a: object, b: object) -> bool:
    """Stream `a` is stream `b` (b None: no stream given, never the same); identity first, cheap."""
    return b is not None and (a is b or a == b)


class BlockTracker:
    """Pending accesses to the serving engine's GPU blocks. Thread-safe.

    Each access's blocks are one integer numpy array; a call costs a few numpy passes over its own
    blocks and over those of the pending accesses it could conflict with (a scratch mask of the
    new blocks, gathered at each candidate's ids): no Python loop or set per block, no sort.
    A count of the pending accesses of each kind lets a call that follows none of the kinds
    pending skip the list. Events are compared by identity: register the object
    `stream.record()` returned.
    """

    def __init__(self, sanitize: bool | None = None, name: str = "gpu block"):
        self.sanitize = sanitize_enabled(sanitize)
        self.name = name
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._kinds = dict.fromkeys(Access, 0)  # how many of `_pending` are of each kind
        self._prune_at = 16  # the list length that triggers the next full prune
        self._mask = np.zeros(0, dtype=bool)  # scratch, all False between calls; covers every id seen

    def _blocks(self, blocks: Blocks, kind: Access) -> tuple[np.ndarray, int]:
        """`blocks` as an int64 array the tracker owns (callers may reuse their buffers), and a
        bound above every id in it."""
        if not isinstance(kind, Access):
            raise ValueError(f"kind must be an Access, got {kind!r}")
        if isinstance(blocks, CheckedBlocks):
            if len(self._mask) < blocks.bound:  # usually covered already: then no call
                self._cover(blocks.bound)
            return blocks.ids, blocks.bound
        if isinstance(blocks, torch.Tensor):
            blocks = blocks.detach().cpu().numpy()
        if isinstance(blocks, range):
            a = np.arange(blocks.start, blocks.stop, blocks.step, dtype=np.int64)
        elif isinstance(blocks, np.ndarray):
            a = blocks
        else:
            seq = blocks if isinstance(blocks, list | tuple) else list(blocks)
            try:
                a = np.array(seq)
            except (TypeError, ValueError, OverflowError):
                a = np.array(seq, dtype=object)
        if a.ndim != 1 or not len(a):
            raise ValueError(f"blocks must name at least one block (a flat sequence), got shape {a.shape}")
        if a.dtype.kind not in "iu" or (a.dtype == np.uint64 and a.max() > np.iinfo(np.int64).max):
            raise ValueError(f"blocks must be ints >= 0, got {sorted(a.tolist(), key=str)[:8]}")
        a = a.astype(np.int64)  # a copy: the pending access must not change with the caller's buffer
        if a.min() < 0:
            raise ValueError(f"blocks must be ints >= 0, got {sorted(a.tolist())[:8]}")
        hi = int(a.max()) + 1
        self._cover(hi)
        return a, hi

    def _cover(self, size: int) -> None:
        """Grow the scratch mask to hold ids below `size` (up to MASK_MAX); call without the lock."""
        if len(self._mask) < size <= MASK_MAX:
            with self._lock:
                if len(self._mask) < size:
                    grown = np.zeros(max(size, 2 * len(self._mask)), dtype=bool)
                    grown[: len(self._mask)] = self._mask  # all False: no call is between mark and clear
                    self._mask = grown

    def _overlapping(self, a: np.ndarray, hi: int, cands: list[_Pending]) -> list[_Pending]:
        """The candidates that share a block with `a` (ids below `hi`); call with the lock held."""
        if not cands:
            return []
        m = self._mask
        if hi > len(m) or any(p.hi > len(m) for p in cands):  # ids past MASK_MAX: sort-based
            return [p for p in cands if np.isin(p.blocks, a).any()]
        m[a] = True
        try:
            return [p for p in cands if m[p.blocks].any()]
        finally:
            m[a] = False  # scratch stays all False between calls

    def _prune(self) -> None:
        """Drop completed accesses. Submits call it only once the list has doubled since the last
        prune (`_prune_at`: amortized O(1) queries per access; a completed access left in the list
        only makes a caller wait on an event that has completed, which costs nothing)."""
        self._keep([p for p in self._pending if not p.event.query()])
        self._prune_at = 2 * len(self._pending) + 16

    def _keep(self, pending: list[_Pending]) -> None:
        """Make `pending` the pending list, and count its kinds again."""
        self._pending, kinds = pending, dict.fromkeys(Access, 0)
        for p in pending:
            kinds[p.kind] += 1
        self._kinds = kinds

    def waits_for(self, kind: Access, blocks: Blocks, stream: object = None) -> list[Event]:
        """Events a new `kind` access to `blocks` must wait for (those on `stream` are implied)."""
        if type(blocks) is CheckedBlocks and type(kind) is Access and len(self._mask) >= blocks.bound:
            a, hi = blocks.ids, blocks.bound  # the engine's checked ids, covered: `_blocks` has nothing to do
        else:
            a, hi = self._blocks(blocks, kind)
        follow = MUST_FOLLOW[kind]
        with self._lock:
            if len(self._pending) >= self._prune_at:
                self._prune()
            kinds = self._kinds
            for k in follow:
                if kinds[k]:
                    break
            else:
                return []  # the usual case for a save in a loop of saves: no pass over the list
            if stream is None:
                cands = [p for p in self._pending if p.kind in follow]
            else:  # those on `stream` are ordered by it already (identity first: it is the usual match)
                pend, s = self._pending, stream
                cands = [p for p in pend if p.kind in follow and p.stream is not s and p.stream != s]
            if not cands:
                return []  # the usual case for a save: nothing of a kind it must follow is pending
            # Completed ones first (a query each): the block masks cost O(blocks).
            done = {id(p) for p in cands if p.event.query()}
            if done:  # completed: they order nothing any more, and are not queried again
                cands = [p for p in cands if id(p) not in done]
                self._keep([p for p in self._pending if id(p) not in done])
            return [p.event for p in self._overlapping(a, hi, cands)]

    def register(self, kind: Access, blocks: Blocks, event: Event, waited: Sequence[Event] = ()) -> None:
        """Record that a `kind` access to `blocks` was submitted, followed by `event`.

        `waited`: the events its stream waited for before the access. With the sanitizer on,
        every conflicting pending access must be waited, on the same stream, or completed.
        """
        if type(blocks) is CheckedBlocks and type(kind) is Access and len(self._mask) >= blocks.bound:
            a, hi = blocks.ids, blocks.bound  # as in waits_for
        else:
            a, hi = self._blocks(blocks, kind)
        with self._lock:
            if len(self._pending) >= self._prune_at:
                self._prune()
            if self.sanitize:
                follow = MUST_FOLLOW[kind]
                cands = [
                    p
                    for p in self._pending
                    if p.kind in follow
                    and not any(p.event is w for w in waited)
                    and not _same(p.stream, event.stream)
                ]
                for p in self._overlapping(a, hi, cands):
                    if p.event.query():
                        continue  # completed since the prune: ordered by completion
                    block = f"{self.name} {int(np.intersect1d(a, p.blocks).min())}"
                    raise LifecycleError(kind.name.lower(), block, p.kind.value, p.event, WHY[(kind, p.kind)])
            self._pending.append(_Pending(kind, a, hi, event))
            self._kinds[kind] += 1

    def state(self, block: int) -> str:
        """IDLE, or the kinds of the pending accesses to `block` joined by '+'."""
        with self._lock:
            self._prune()
            kinds = sorted({p.kind.value for p in self._pending if bool((p.blocks == block).any())})
        return "+".join(kinds) or "IDLE"

    def pending(self) -> int:
        with self._lock:
            self._prune()
            return len(self._pending)

    def debug_state(self) -> dict:
        """The pending list as it stands (no prune): "kinds", the kind of each access in order, and
        "counts", the per-kind counts a call reads to skip the list (always those of "kinds")."""
        with self._lock:
            return {"kinds": [p.kind for p in self._pending], "counts": dict(self._kinds)}

    # Named shorthands for the four accesses.
    def compute_read(self, blocks, event: Event, waited: Sequence[Event] = ()) -> None:
        self.register(A.READ, blocks, event, waited)

    def compute_write(self, blocks, event: Event, waited: Sequence[Event] = ()) -> None:
        self.register(A.WRITE, blocks, event, waited)

    def begin_save(self, blocks, event: Event, waited: Sequence[Event] = ()) -> None:
        self.register(A.SAVE, blocks, event, waited)

    def begin_load(self, blocks, event: Event, waited: Sequence[Event] = ()) -> None:
        self.register(A.LOAD, blocks, event, waited)
