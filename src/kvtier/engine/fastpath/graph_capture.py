"""Capturing a staged job as a CUDA graph (for `graphs.StagedGraphs`): the capture on the copy
stream and the search for the graph's DMA nodes, so one graph can serve every slot of a size
(the module docstring of `graphs.py` has the whole design)."""

from __future__ import annotations

import contextlib
import warnings

import torch

from kvtier.engine.fastpath.graph_cache import Entry, Exec, host_buf
from kvtier.engine.fastpath.graph_nodes import SlotNodes
from kvtier.engine.fastpath.ring import HostRing
from kvtier.ops.staged import load_chunks, save_chunks

# Id buffers one graph may have in flight: one per job queued and not yet done (a buffer is
# guarded by its job's event), so a request of many chunks (a 32K-token prefix in 256-token
# chunks is 128 jobs) is queued without the host waiting for the first ones to land. Each
# buffer holds one job's ids; they are made only as the queue deepens.
RING_MAX = 1024


def find_nodes(graphs, g, direction, base, nbytes, n, staging) -> SlotNodes | None:
    """The graph's DMA nodes, or None (with one warning per engine): the graph stays pinned."""
    per = staging[0].numel() // graphs.kv.block_nbytes  # blocks per chunk, as ops.staged plans them
    spans = [(t.data_ptr(), t.numel()) for t in staging]
    host_side = "dst" if direction == "save" else "src"
    try:
        return SlotNodes.find(g, host_side, base, nbytes, spans, -(-n // per))
    except Exception as e:  # noqa: BLE001 - anything unexpected: address-keyed, as before
        from kvtier.device.cudart import clear_last_error

        clear_last_error()  # a failed query's error must not surface at an unrelated launch
        graphs.stats.pinned += 1
        if not graphs._warned:
            graphs._warned = True
            warnings.warn(f"kvtier: staged graphs keyed by slot address: {e}", stacklevel=4)
        return None


def capture_entry(graphs, direction, n, last_valid, slot_tensor, staging, side, stream) -> Entry:
    """Capture one staged save / load of `n` blocks into `slot_tensor` on the copy stream `stream`
    (its helper stream `side` forked and joined inside), with its own device ids buffer and ring;
    retargetable (`Entry.nodes`) when `graphs.retarget` and the DMA nodes were found. Raises on a
    failed capture (the caller disables graphs)."""
    kv = graphs.kv
    keep = graphs.retarget
    try:
        # keep_graph: the cudaGraph_t stays alive, its node handles address the exec's nodes.
        g = torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()
    except TypeError:  # a torch without keep_graph
        g, keep, graphs.retarget = torch.cuda.CUDAGraph(), False, False
    with torch.cuda.device(graphs._device), torch.cuda.stream(stream):
        # Allocated on the copy stream: freed later, its memory is reused only by work ordered
        # after this stream's replays.
        ids_dev = torch.zeros(n, dtype=torch.int32, device=graphs._device)
        # "relaxed": other threads are not affected (unlike "global"), and the zero-size tensor
        # aliases the op wrappers make are legal here even when torch's caching allocator is
        # off (PYTORCH_NO_CUDA_MEMORY_CACHING=1 under compute-sanitizer: cudaMalloc(0) / cudaFree).
        g.capture_begin(capture_error_mode="relaxed")
        try:
            if direction == "save":
                save_chunks(
                    kv,
                    ids_dev,
                    last_valid,
                    slot_tensor,
                    staging=staging,
                    gather_stream=side,
                    copy_stream=stream,
                )
            else:
                load_chunks(
                    kv,
                    ids_dev,
                    last_valid,
                    slot_tensor,
                    staging=staging,
                    copy_stream=stream,
                    scatter_stream=side,
                )
        except BaseException:
            with contextlib.suppress(Exception):
                g.capture_end()  # leave capture mode; the capture is lost anyway
            raise
        g.capture_end()
        nodes = None
        if keep:
            g.instantiate()  # keep_graph defers it; the exec must exist before its nodes are read
            base, nbytes = slot_tensor.data_ptr(), slot_tensor.numel() * slot_tensor.element_size()
            nodes = find_nodes(graphs, g, direction, base, nbytes, n, staging)
        ring = HostRing(lambda: host_buf(n), torch.cuda.Event, depth=2, max_depth=RING_MAX)
    handle = int(g.raw_cuda_graph_exec() or 0)
    if not handle:  # a replay is the runtime's own launch of this exec (`StagedGraphs._launch`)
        raise RuntimeError("torch gave no cudaGraphExec_t handle for the captured graph")
    main = Exec(handle, nodes)
    return Entry(g, ids_dev, stream, nodes, ring, [main], main)
