"""The fast path beneath the CUDA mover (`engine/cuda_mover.py`), its only user: a reader
follows a save in plain Python first (`engine/engine.py`, then the mover), and meets this
package only where a staged job is replayed from a CUDA graph or a job goes as a batched copy.

    graphs.StagedGraphs    staged jobs captured once as CUDA graphs, replayed for later jobs
                           (one way: `_launch`, the C helper's call when built, else ctypes)
    graph_cache            the LRU of captured graphs, their keys, execs and stats
    graph_capture          the capture on the copy stream, and the search for its DMA nodes
    graph_nodes            DMA nodes moved to another slot; `Launcher`, the runtime calls
    graph_fused            a replay as one call of the C helper
    ring.HostRing          pinned ids buffers, each reused only after its copy has read it
    fast                   the optional C helper (`_fast.c`): the replay, and the id check
                           that `engine/ids.py` uses at the engine's entry
    batch                  `cudaMemcpyBatchAsync`: every piece of a job (of one slot or several)
                           in one call; the sim mover runs the same copies on a `SimDevice`
"""
