"""What the `vllm` suite's failover row needs of vLLM beyond the worker's hooks, with no vLLM
installed: a request and a scheduler output as the connector's scheduler side reads them, and
vLLM's forward over one step of a request (its blocks read as they are, its new KV written).

    Request(rid, ids, block_size)        request_id, block_hashes (a hash chain over the token
                                         ids, per block, as vLLM's), num_tokens
    output(new=..., cached=...)          a SchedulerOutput's fields the scheduler side reads
    Blocks(ids)                          what vLLM's ``update_state_after_alloc`` hands over
    paged_step(lean, r, blocks, ids, start, end)
                                         the model over tokens [start, end): each layer waits for
                                         its load (``wait_for_layer_load``), attends the blocks of
                                         [0, start) and the new tokens, writes their K, V into
                                         their blocks; the last position's logits
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch


class Request:
    """A request of token ``ids`` ([1, n]) as the scheduler side reads it."""

    def __init__(self, rid: str, ids: torch.Tensor, block_size: int) -> None:
        self.request_id, tokens = rid, ids[0].tolist()
        self.num_tokens = len(tokens)
        self.block_hashes, h = [], b""
        for i in range(len(tokens) // block_size):  # full blocks only, each naming its whole prefix
            h = hashlib.sha256(h + repr(tokens[i * block_size : (i + 1) * block_size]).encode()).digest()
            self.block_hashes.append(h)


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = list(ids)

    def get_block_ids(self) -> tuple[list[int]]:
        return (self.ids,)


def output(*, new=(), cached=()) -> SimpleNamespace:
    """new: (rid, block ids, tokens computed before, tokens scheduled); cached: (rid, tokens
    computed before, tokens scheduled) of a request already running (no new blocks)."""
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            new_block_ids=[None for _ in cached],
            resumed_req_ids=set(),
            num_computed_tokens=[c for _, c, _ in cached],
        ),
        num_scheduled_tokens={r: n for r, *_, n in [*new, *cached]},
    )


@torch.no_grad()
def paged_step(lean, r, blocks: list[int], ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """vLLM's forward of one step over tokens [start, end) of ``ids`` in ``r``'s cache (a `Replay`),
    the request's ``blocks`` in order; the last position's logits (fp32 [vocab])."""
    dev, n_blk = ids.device, r.kv.block_size
    x, cos, sin = lean.embed(ids[:, start:end], torch.arange(start, end, device=dev)[None])
    mask = lean.tail_mask(start, end - start, dev)
    table = torch.tensor(blocks, device=dev)
    before, new = torch.arange(start, device=dev), torch.arange(start, end, device=dev)
    for i, name in enumerate(r.names):
        r.ws.wait_layer(name)  # attention of layer i reads its blocks only once they landed
        if not r.ctx.on_gpu:
            r.dev.current_stream().synchronize()  # the host runs the layer next: its copies landed
        view = r.cache[i]  # [blocks, H, N, K||V]

        def prefix(view=view):
            kv = view[table[before // n_blk], :, before % n_blk].permute(1, 0, 2)[None]  # [1, H, start, C]
            d = kv.shape[-1] // 2
            return kv[..., :d], kv[..., d:]

        keep: list = []
        x = lean.layer(i, x, cos, sin, prefix if start else None, mask, keep=keep)
        k, v = keep[0]  # [1, H, m, D]: this step's own K, V, written where attention reads them
        view[table[new // n_blk], :, new % n_blk] = torch.cat([k, v], -1)[0].permute(1, 0, 2).to(view.dtype)
    return lean.head(x)
