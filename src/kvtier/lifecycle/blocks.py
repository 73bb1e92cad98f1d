"""GPU-block pending accesses and which must wait for which (`BlockTracker`)."""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvtier.device.base import Event
from kvtier.lifecycle.errors import LifecycleError, sanitize_enabled


class Access(enum.Enum):
    READ = "READING"  # compute reads the blocks (attention)
    WRITE = "WRITING"  # compute writes the blocks (new KV)
    SAVE = "SAVING"  # a copy out to the pool
    LOAD = "LOADING"  # a copy in from the pool


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


Blocks = Iterable[int] | torch.Tensor  # block ids: a list, set, range or 1-D integer tensor


@dataclass(slots=True, frozen=True)
class _Pending:
    kind: Access
    blocks: frozenset[int]
    event: Event


class BlockTracker:
    """Pending accesses to the serving engine's GPU blocks. Thread-safe.

    Cost per call is O(pending accesses) set operations in C, not a Python loop per block.
    Events are compared by identity: register the object `stream.record()` returned.
    """

    def __init__(self, sanitize: bool | None = None, name: str = "gpu block"):
        self.sanitize = sanitize_enabled(sanitize)
        self.name = name
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []

    def _blocks(self, blocks: Blocks, kind: Access) -> frozenset[int]:
        if not isinstance(kind, Access):
            raise ValueError(f"kind must be an Access, got {kind!r}")
        s = frozenset(blocks.tolist() if isinstance(blocks, torch.Tensor) else blocks)
        if not s:
            raise ValueError("blocks must name at least one block")
        if self.sanitize and not all(isinstance(b, int) and b >= 0 for b in s):
            raise ValueError(f"blocks must be ints >= 0, got {sorted(s, key=str)[:8]}")
        return s

    def _prune(self) -> None:
        self._pending = [p for p in self._pending if not p.event.query()]

    def waits_for(self, kind: Access, blocks: Blocks, stream: object = None) -> list[Event]:
        """Events a new `kind` access to `blocks` must wait for (those on `stream` are implied)."""
        s = self._blocks(blocks, kind)
        with self._lock:
            self._prune()
            hits = [p for p in self._pending if p.kind in MUST_FOLLOW[kind] and not s.isdisjoint(p.blocks)]
        return [p.event for p in hits if stream is None or p.event.stream != stream]

    def register(self, kind: Access, blocks: Blocks, event: Event, waited: Sequence[Event] = ()) -> None:
        """Record that a `kind` access to `blocks` was submitted, followed by `event`.

        `waited`: the events its stream waited for before the access. With the sanitizer on,
        every conflicting pending access must be waited, on the same stream, or completed.
        """
        s = self._blocks(blocks, kind)
        with self._lock:
            self._prune()
            if self.sanitize:
                for p in self._pending:
                    if p.kind not in MUST_FOLLOW[kind] or s.isdisjoint(p.blocks):
                        continue
                    if any(p.event is w for w in waited) or p.event.stream == event.stream or p.event.query():
                        continue  # ordered by a wait, by stream order, or already done
                    block = f"{self.name} {min(s & p.blocks)}"
                    raise LifecycleError(kind.name.lower(), block, p.kind.value, p.event, WHY[(kind, p.kind)])
            self._pending.append(_Pending(kind, s, event))

    def state(self, block: int) -> str:
        """IDLE, or the kinds of the pending accesses to `block` joined by '+'."""
        with self._lock:
            self._prune()
            kinds = sorted({p.kind.value for p in self._pending if block in p.blocks})
        return "+".join(kinds) or "IDLE"

    def pending(self) -> int:
        with self._lock:
            self._prune()
            return len(self._pending)

    # Named shorthands for the four accesses.
    def compute_read(self, blocks, event: Event, waited: Sequence[Event] = ()) -> None:
        self.register(A.READ, blocks, event, waited)

    def compute_write(self, blocks, event: Event, waited: Sequence[Event] = ()) -> None:
        self.register(A.WRITE, blocks, event, waited)

    def begin_save(self, blocks, event: Event, waited: Sequence[Event] = ()) -> None:
        self.register(A.SAVE, blocks, event, waited)

    def begin_load(self, blocks, event: Event, waited: Sequence[Event] = ()) -> None:
        self.register(A.LOAD, blocks, event, waited)
