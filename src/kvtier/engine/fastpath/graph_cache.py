"""The data of the staged-graph cache (graphs.py): the LRU, the key, the stats, and an entry --
a captured graph, its execs (each pointed at one slot), its device ids buffer and the ring of
pinned host buffers its ids are copied from."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.engine.fastpath.graph_nodes import SlotNodes
from kvtier.engine.fastpath.ring import HostRing


class LRU:
    """A bounded mapping, least recently used first out. `put` returns the entries it evicted.
    `by_key`: the OrderedDict itself, for a hot path that does `get`'s two steps inline (a hit is
    moved to the end: most recently used)."""

    def __init__(self, max_size: int):
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_graphs: expected a positive int, got {max_size!r}")
        self.max_size = max_size
        self.by_key: OrderedDict = OrderedDict()

    def get(self, key):
        value = self.by_key.get(key)
        if value is not None:
            self.by_key.move_to_end(key)
        return value

    def put(self, key, value) -> list:
        self.by_key[key] = value
        self.by_key.move_to_end(key)
        evicted = []
        while len(self.by_key) > self.max_size:
            evicted.append(self.by_key.popitem(last=False)[1])
        return evicted

    def clear(self) -> list:
        values = list(self.by_key.values())
        self.by_key.clear()
        return values

    def pop(self, key):
        return self.by_key.pop(key, None)

    def keys(self) -> list:
        return list(self.by_key)  # oldest first

    def __len__(self) -> int:
        return len(self.by_key)

    def __contains__(self, key) -> bool:
        return key in self.by_key


def graph_key(direction: str, slot_nbytes: int, n: int, last_valid: int, staging: tuple):
    """What a staged graph bakes in besides the block ids and the slot address (module docstring)."""
    return (direction, slot_nbytes, n, last_valid, staging)


def pinned_key(key: tuple, slot_ptr: int) -> tuple:
    """The key of a graph whose DMA nodes could not be retargeted: it serves one slot address only."""
    return (*key, slot_ptr)


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    misses: int = 0
    evictions: int = 0
    failures: int = 0
    retargets: int = 0  # replays that first moved the graph's DMA nodes to another slot
    pinned: int = 0  # captures whose DMA nodes could not be retargeted (keyed by slot address)
    execs: int = 0  # further execs made for recent slots (slot_execs > 1)


@dataclass(eq=False)
class Exec:
    handle: int  # cudaGraphExec_t (0: unknown, only torch's replay can launch it)
    nodes: SlotNodes | None  # its DMA nodes, retargetable (None: pinned to one slot)
    owned: bool = False  # made by Launcher.instantiate, destroyed by graphs.py; torch owns the first


@dataclass(frozen=True, slots=True)
class HostBuf:
    tensor: torch.Tensor  # int32 [n], pinned: the source of one ids copy
    array: np.ndarray  # the same memory, filled without a torch op
    ptr: int


@dataclass(eq=False)
class Entry:
    graph: object  # torch.cuda.CUDAGraph
    ids_dev: torch.Tensor  # int32 [n] on the cache's device: the graph reads the ids from here
    stream: torch.cuda.Stream  # the copy stream it was captured on and is replayed on
    nodes: SlotNodes | None = None  # its DMA nodes, retargetable to another slot (None: pinned)
    ring: HostRing | None = None  # pinned sources of the ids copies
    execs: list[Exec] = field(default_factory=list)  # most recently used first; one is torch's
    main: Exec | None = None  # torch's exec (what CUDAGraph.replay launches)
    ids_ptr: int = field(init=False)  # ids_dev's address, read once (a replay passes it on)

    def __post_init__(self) -> None:
        self.ids_ptr = self.ids_dev.data_ptr()


def host_buf(n: int) -> HostBuf:
    t = torch.empty(n, dtype=torch.int32, pin_memory=True)  # once per ring buffer, at capture
    return HostBuf(t, t.numpy(), t.data_ptr())
