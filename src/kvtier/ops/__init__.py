"""ops: the wrappers of kvtier's copy kernels, and the staged (gather + DMA) paths.

    gather(kv, block_ids, dst)         paged cache -> contiguous chunk (GPU or pinned host, UVA)
    scatter(kv, block_ids, src)        contiguous chunk -> paged cache
    save_staged / load_staged          the same through GPU staging buffers and large pinned DMAs
    block_ids(kv, ids, ...)            ids checked once, reusable (`BlockIds`)

Layouts and the chunk format: `kvtier.layout`. PyTorch references: `kvtier.reference`.
"""

from kvtier.ops.checks import INTERPRETING, BlockIds, block_ids
from kvtier.ops.kv_copy import gather, scatter
from kvtier.ops.staged import load_staged, make_staging, save_staged

__all__ = [
    "INTERPRETING",
    "BlockIds",
    "block_ids",
    "gather",
    "load_staged",
    "make_staging",
    "save_staged",
    "scatter",
]
