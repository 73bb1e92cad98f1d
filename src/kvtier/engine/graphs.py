"""CUDA graphs of the staged path: the per-job GPU sequence of a staged save / load (gathers +
DMAs, or DMAs + scatters, over the two staging buffers) captured once, replayed for later jobs.

Submitting a staged job eagerly costs ~1-3 ms of CPU (a Triton launch, stream switches and an
event pair per chunk); a replay is one small H2D copy of the block ids into the graph's own
device buffer and one `cudaGraphLaunch`, both on the engine's copy stream.

Key: everything the graph bakes in besides the ids and the slot address -- direction, slot size,
number of blocks, valid tokens of the last block, the staging buffers. The ids are data: each
replay first copies them (pinned, non_blocking, on the copy stream) into the entry's device
buffer. The slot address is baked into the DMA (memcpy) nodes; after capture `graph_nodes.py`
finds those nodes, and a replay for another slot of the same size first moves their host side
(cudaGraphExecMemcpyNodeSetParams on the exec graph), so one graph serves every slot. Where the
nodes are not as expected (or the update API fails), that graph is keyed by its slot address
too (`pinned_key`), as before: a replay never writes bytes anywhere but the job's slot.
The cache is an LRU of `max_graphs` entries; an evicted entry is kept alive until an event
recorded on its stream at eviction has completed (a queued replay may still read it).
A miss runs the job eagerly (which also warms up every Triton specialization and launch plan)
and then captures its sequence for the next job with the same key.

Capture is on the copy stream itself (`torch.cuda.CUDAGraph`, "relaxed" error mode: no
device sync, other threads unaffected). `ops.save_chunks` / `load_chunks` fork their helper
stream from the copy stream with an event recorded inside the capture and join it back at the
end, and wait only on events recorded inside the capture. On replay the whole graph is one
operation of the copy stream: it starts after everything before it there (the engine's
`after` / tracker waits, the ids copy, earlier jobs using the same staging buffers) and work
recorded after it (e_save / e_load) follows all of its nodes.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvtier.engine.graph_nodes import SlotNodes
from kvtier.ops.staged import load_chunks, save_chunks


class LRU:
    """A bounded mapping, least recently used first out. `put` returns the entries it evicted."""

    def __init__(self, max_size: int):
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_graphs: expected a positive int, got {max_size!r}")
        self.max_size = max_size
        self._d: OrderedDict = OrderedDict()

    def get(self, key):
        value = self._d.get(key)
        if value is not None:
            self._d.move_to_end(key)
        return value

    def put(self, key, value) -> list:
        self._d[key] = value
        self._d.move_to_end(key)
        evicted = []
        while len(self._d) > self.max_size:
            evicted.append(self._d.popitem(last=False)[1])
        return evicted

    def clear(self) -> list:
        values = list(self._d.values())
        self._d.clear()
        return values

    def pop(self, key):
        return self._d.pop(key, None)

    def keys(self) -> list:
        return list(self._d)  # oldest first

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key) -> bool:
        return key in self._d


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


@dataclass(eq=False)
class _Entry:
    graph: object  # torch.cuda.CUDAGraph
    ids_dev: torch.Tensor  # int32 [n] on the cache's device: the graph reads the ids from here
    stream: torch.cuda.Stream  # the copy stream it was captured on and is replayed on
    nodes: SlotNodes | None = None  # its DMA nodes, retargetable to another slot (None: pinned)


def _launch(entry: _Entry, host: torch.Tensor) -> None:
    """On the current stream (the entry's copy stream): ids in, then the graph."""
    # The graph reads its ids buffer: the new ids land first, on the stream that replays it (and
    # after the previous replay of this graph, which read the old ones, on that same stream).
    entry.ids_dev.copy_(host, non_blocking=True)
    entry.graph.replay()


class StagedGraphs:
    """The graph cache of one CudaMover (used under the engine's lock)."""

    def __init__(self, kv, max_graphs: int = 64):
        self.kv = kv
        self.cache = LRU(max_graphs)
        self.stats = GraphStats()
        self.enabled = True
        self.retarget = True  # capture retargetable graphs (off after a failed node update)
        self._warned = False
        self._device = kv.device
        self._dead: list[tuple[torch.cuda.Event, _Entry]] = []  # evicted, maybe still queued

    def replay(self, key, ids: torch.Tensor, stream: torch.cuda.Stream, slot_ptr: int) -> bool:
        """Replay the graph of `key` for the slot at `slot_ptr` with block ids `ids` (int64 CPU,
        checked); False on a miss."""
        if not self.enabled:
            self.stats.misses += 1
            return False
        entry = self.cache.get(key)
        if entry is None:
            key = pinned_key(key, slot_ptr)
            entry = self.cache.get(key)
        if entry is None:
            self.stats.misses += 1
            return False
        # The DMA nodes must point at this job's slot before the replay is enqueued (else the
        # bytes go to / come from the last slot); skipped when they already do.
        if entry.nodes is not None and entry.nodes.base != slot_ptr and not self._move(key, entry, slot_ptr):
            self.stats.misses += 1
            return False
        host = torch.empty(len(ids), dtype=torch.int32, pin_memory=True)  # torch's caching host allocator
        host.copy_(ids)
        prev = torch.cuda.current_stream()  # of the current device
        if prev.device_index != stream.device_index:  # another device is current: the general context
            with torch.cuda.stream(stream):
                _launch(entry, host)
        else:
            torch.cuda.set_stream(stream)  # cheaper than a StreamContext on the usual path
            try:
                _launch(entry, host)
            finally:
                torch.cuda.set_stream(prev)
        self.stats.replays += 1
        return True

    def _move(self, key, entry: _Entry, slot_ptr: int) -> bool:
        """Point the entry's DMA nodes at the slot at `slot_ptr`, before its replay is enqueued
        (earlier launches keep their slot: graph_nodes.py). On failure drop the entry: it is
        never launched half-updated; the job goes eager and later captures are pinned."""
        try:
            entry.nodes.retarget(slot_ptr)
        except Exception as e:  # noqa: BLE001 - NodeError or anything else: never launch it again
            self.cache.pop(key)
            self._retire(entry)  # a replay of it may still be queued: keep it alive until it ran
            self.retarget = False
            self.stats.failures += 1
            msg = f"kvtier: moving a staged graph to another slot failed, graphs keyed by slot: {e}"
            warnings.warn(msg, stacklevel=4)
            return False
        self.stats.retargets += 1
        return True

    def capture(self, key, slot_tensor, staging, side, stream) -> None:
        """Capture the sequence of `key` (after the same job ran eagerly: Triton compiled, plans
        cached). A failure disables graphs for this engine with a warning; the eager path stays."""
        if not self.enabled:
            return
        self._reap()
        direction, _nbytes, n, last_valid, _staging = key
        try:
            entry = self._capture(direction, n, last_valid, slot_tensor, staging, side, stream)
        except Exception as e:  # noqa: BLE001 - any capture failure: fall back to the eager path
            self.enabled = False
            self.stats.failures += 1
            from kvtier.device.cudart import clear_last_error

            clear_last_error()  # the failed capture's error must not surface at an unrelated launch
            warnings.warn(f"kvtier: CUDA graph capture failed, staged jobs stay eager: {e}", stacklevel=3)
            return
        base = slot_tensor.data_ptr()
        if entry.nodes is None:
            key = pinned_key(key, base)
        self.stats.captures += 1
        for old in self.cache.put(key, entry):
            self._retire(old)

    def _find_nodes(self, g, direction, base, nbytes, n, staging) -> SlotNodes | None:
        """The graph's DMA nodes, or None (with one warning per engine): the graph stays pinned."""
        per = staging[0].numel() // self.kv.block_nbytes  # blocks per chunk, as ops.staged plans them
        spans = [(t.data_ptr(), t.numel()) for t in staging]
        host_side = "dst" if direction == "save" else "src"
        try:
            return SlotNodes.find(g, host_side, base, nbytes, spans, -(-n // per))
        except Exception as e:  # noqa: BLE001 - anything unexpected: address-keyed, as before
            from kvtier.device.cudart import clear_last_error

            clear_last_error()  # a failed query's error must not surface at an unrelated launch
            self.stats.pinned += 1
            if not self._warned:
                self._warned = True
                warnings.warn(f"kvtier: staged graphs keyed by slot address: {e}", stacklevel=4)
            return None

    def _capture(self, direction, n, last_valid, slot_tensor, staging, side, stream) -> _Entry:
        kv = self.kv
        keep = self.retarget
        try:
            # keep_graph: the cudaGraph_t stays alive, its node handles address the exec's nodes.
            g = torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()
        except TypeError:  # a torch without keep_graph
            g, keep, self.retarget = torch.cuda.CUDAGraph(), False, False
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            # Allocated on the copy stream: freed later, its memory is reused only by work ordered
            # after this stream's replays.
            ids_dev = torch.zeros(n, dtype=torch.int32, device=self._device)
            # "relaxed": other threads are not affected (unlike "global"), and the zero-size tensor
            # aliases the op wrappers make are legal here even when torch's caching allocator is
            # off (PYTORCH_NO_CUDA_MEMORY_CACHING=1 under compute-sanitizer: cudaMalloc(0) / cudaFree).
            g.capture_begin(capture_error_mode="relaxed")
            try:
                if direction == "save":
                    save_chunks(
                        kv, ids_dev, last_valid, slot_tensor, staging=staging, gather_stream=side,
                        copy_stream=stream,
                    )  # fmt: skip
                else:
                    load_chunks(
                        kv, ids_dev, last_valid, slot_tensor, staging=staging, copy_stream=stream,
                        scatter_stream=side,
                    )  # fmt: skip
            except BaseException:
                with contextlib.suppress(Exception):
                    g.capture_end()  # leave capture mode; the capture is lost anyway
                raise
            g.capture_end()
            nodes = None
            if keep:
                g.instantiate()  # keep_graph defers it; the exec must exist before its nodes are read
                base, nbytes = slot_tensor.data_ptr(), slot_tensor.numel() * slot_tensor.element_size()
                nodes = self._find_nodes(g, direction, base, nbytes, n, staging)
        return _Entry(g, ids_dev, stream, nodes)

    def _retire(self, entry: _Entry) -> None:
        self.stats.evictions += 1
        ev = torch.cuda.Event()
        # A replay of the evicted graph may still be queued: keep its buffer and exec until it ran.
        ev.record(entry.stream)
        self._dead.append((ev, entry))

    def _reap(self) -> None:
        self._dead = [(ev, e) for ev, e in self._dead if not ev.query()]

    def clear(self) -> None:
        """Drop every graph (the caller synchronized the streams they run on)."""
        self.cache.clear()
        self._dead.clear()
