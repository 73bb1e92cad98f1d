"""A hit's tail forward through `LeanRunner` as CUDA graphs, one per step: the embedding, each
decoder layer (its prefix read from kvtier's blocks included), the final norm and lm_head.

Per hit the host queues on the compute stream: the copy of the tail's token ids and the hit's
block ids into static inputs, the embedding's replay, then per layer the wait for that layer's
load event and its replay (`KVTierCache._read`), then the head's replay: ~35 launches instead of
~1,200, and compute still starts layer i as soon as layer i has landed. Graphs are captured per
(KVTier, split front, loaded prefix, prompt length, block count): they hold the addresses of the
KVTier's pages. A split's front (`LeanRunner.split_first_token`) is copied into static buffers
per hit, before each layer's replay.
On a CPU device the same steps run through the same static inputs without capture (tested there).
"""

from __future__ import annotations

from functools import partial

import torch

from kvtier.integrations.hf import gather_blocks
from kvtier.integrations.lean import front_tokens


class Pieces:
    def __init__(self, runner, cache, input_ids: torch.Tensor) -> None:
        front = getattr(cache, "front_kv", None)  # a split: [0, s) computed by the runner
        hit = cache.hit_tokens + front_tokens(cache)
        n, dev = input_ids.shape[1], input_ids.device
        self.runner, self.owner, self.hit = runner, cache.owner, hit
        # A split's front, copied in per hit (its tensors are the request's own, not static).
        self.front = [(torch.empty_like(k), torch.empty_like(v)) for k, v in front] if front else None
        self.num_layers = len(runner.inner.layers)
        # Static inputs, rewritten per hit in stream order (after the previous hit's replays read them).
        self.ids = torch.zeros(1, n - hit, dtype=torch.long, device=dev)
        self.blocks = torch.zeros(len(cache.blocks), dtype=torch.long, device=dev)
        self.pos = torch.arange(hit, n, device=dev)[None]
        self.mask = runner.tail_mask(hit, n - hit, dev)
        self.x: list[torch.Tensor | None] = [None] * (self.num_layers + 1)  # x[i]: layer i's input
        self.cos = self.sin = self.out = None
        self.steps = [self._embed] + [partial(self._layer, i) for i in range(self.num_layers)] + [self._head]
        self.graphs: list[torch.cuda.CUDAGraph] | None = None

    def _embed(self) -> None:
        self.x[0], self.cos, self.sin = self.runner.embed(self.ids, self.pos)

    def _layer(self, i: int) -> None:
        x = self.x[i]
        self.x[i + 1] = self.runner.layer(
            i, x, self.cos, self.sin, partial(self._prefix, i, x.dtype), self.mask
        )

    def _prefix(self, i: int, dtype: torch.dtype):
        k, v = gather_blocks(self.owner.kv, i, self.blocks, dtype)
        if self.front is None:
            return k, v
        return torch.cat([self.front[i][0], k], 2), torch.cat([self.front[i][1], v], 2)

    def _layer_step(self, front_kv, i: int) -> None:
        if self.front is not None:  # queued after the front's forward on this stream
            self.front[i][0].copy_(front_kv[i][0])
            self.front[i][1].copy_(front_kv[i][1])
        self._step(i + 1)

    def _head(self) -> None:
        self.out = self.runner.head(self.x[-1])

    @torch.no_grad()  # a CPU device runs steps on its stream's thread, outside the caller's no_grad
    def _step(self, j: int) -> None:
        if self.graphs is None:
            self.steps[j]()
        else:
            self.graphs[j].replay()

    def run(self, cache, input_ids: torch.Tensor) -> torch.Tensor:
        """The last position's logits of this hit, queued on the compute stream."""
        o, tail = cache.owner, input_ids[:, self.hit :]
        blocks = torch.as_tensor(cache.blocks, dtype=torch.long)

        def embed() -> None:
            self.ids.copy_(tail)
            # non_blocking from pageable memory: the driver has staged `blocks` when copy_ returns.
            self.blocks.copy_(blocks, non_blocking=True)
            self._step(0)

        o.device.launch(embed, o.compute)
        for i in range(self.num_layers):
            cache._read(
                i, partial(self._layer_step, cache.front_kv if self.front else None, i)
            )  # after its load
        out: list[torch.Tensor] = []

        def head() -> None:
            self._step(self.num_layers + 1)
            out.append(self.out.clone())  # the next hit's replay rewrites self.out

        o.device.launch(head, o.compute)
        if input_ids.device.type == "cpu":
            o.compute.record("lean-logits").synchronize()  # a CPU device runs the steps on its own thread
        return out[0]

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every step as a CUDA graph (one memory pool, replayed in capture order)."""
        # The eager hit that built these pieces has run: its loads landed, its blocks are still
        # held by its cache, so the warm-up below reads the right bytes and races no load.
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # warm-up on a side stream before capture, as torch asks
            for step in self.steps:
                step()
        torch.cuda.synchronize()  # the warm-up is done before its buffers are captured over
        pool, graphs = torch.cuda.graph_pool_handle(), []
        for step in self.steps:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                step()
            graphs.append(g)
        self.graphs = graphs
