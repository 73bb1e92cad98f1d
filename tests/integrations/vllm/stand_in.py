"""A stand-in model for the connector's tests: its KV depends on each token's whole prefix and on
what attention read, across TP ranks, and every read is checked against the true KV.

For layer l, TP rank r and each position p a step computes, in order of p:

    reads     the KV of positions 0..p-1 of the request in layer l of rank r, from the paged cache
              through the request's block table (as attention does)
    attn_p    sum over ranks of sum over q < p of (the sum of the elements read at q) * (q + 1)
              (mod P): the attention output after TP's all-reduce
    below_p   token_p at layer 0, else the sum over ranks of value[l - 1, p]: the layer below
    value     mix(token_p, below_p, attn_p, l, r, p), an int below 2**23 (exact in fp32),
              written into every element of position p's [heads, K||V] in layer l of rank r

so a layer that reads bad KV writes bad KV, on every rank, in every later position and layer, as a
real model does. The sampled token is the top layer's value at the step's last position (summed
over ranks) mod the vocabulary: bad KV anywhere upstream changes it.

    truth(tokens, upto)        the true values [layer][rank][position] of a token sequence
    StandIn.layer(...)         one layer of one step over every rank's cache; records violations
    StandIn.violations         every read that differed from the true KV (never raised mid-step)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

P = 8388593  # a prime below 2**23: every value is exact in fp32, every sum of a row exact in fp64


def mix(token: int, below: int, attn: int, layer: int, rank: int, pos: int) -> int:
    return (token * 1000003 + below * 7919 + attn * 31 + layer * 101 + rank * 17 + pos * 7 + 1) % P


@dataclass
class Violation:
    step: int
    req_id: str
    rank: int
    layer: int
    positions: list[int]  # the first few positions whose KV read differed from the truth

    def __str__(self) -> str:
        return f"step {self.step} {self.req_id} rank {self.rank} layer {self.layer}: {self.positions}"


class Truth:
    """The true values of one request's positions, extended as its tokens grow."""

    def __init__(self, layers: int, ranks: int, elements: int) -> None:
        self.layers, self.ranks, self.e = layers, ranks, elements
        self.tokens: list[int] = []
        self.values = [[[] for _ in range(ranks)] for _ in range(layers)]  # [l][r][p]
        self._attn = [0] * layers  # running all-reduced attention sum per layer

    def upto(self, tokens: list[int]) -> Truth:
        """Extended (or rebuilt, where a token differs) to cover ``tokens``."""
        same = 0
        while same < min(len(tokens), len(self.tokens)) and tokens[same] == self.tokens[same]:
            same += 1
        if same < min(len(tokens), len(self.tokens)):  # another sequence: rebuilt from the start
            self.__init__(self.layers, self.ranks, self.e)
        for p in range(len(self.tokens), len(tokens)):
            below = tokens[p]
            for li in range(self.layers):
                vals = [mix(tokens[p], below, self._attn[li], li, r, p) for r in range(self.ranks)]
                for r, v in enumerate(vals):
                    self.values[li][r].append(v)
                self._attn[li] = (self._attn[li] + sum(v * self.e % P for v in vals) * (p + 1)) % P
                below = sum(vals) % P
            self.tokens.append(tokens[p])
        return self


class StandIn:
    """The model over ``caches`` (one logical [L, B, H, N, C] cache per TP rank), ``block_size``
    tokens per block, ``vocab`` sampled tokens."""

    def __init__(self, caches: list[torch.Tensor], block_size: int, vocab: int = 1000) -> None:
        self.caches, self.bs, self.vocab = caches, block_size, vocab
        self.layers, self.ranks = caches[0].shape[0], len(caches)
        self.e = caches[0].shape[2] * caches[0].shape[4]  # elements of one position: heads x K||V
        self.violations: list[Violation] = []
        self.reads = 0  # positions read, every rank and layer (a test can see the checker ran)
        self._truth: dict[str, Truth] = {}
        self.step_no = 0

    def truth(self, req_id: str, tokens: list[int]) -> Truth:
        t = self._truth.get(req_id)
        if t is None:
            t = self._truth[req_id] = Truth(self.layers, self.ranks, self.e)
        return t.upto(tokens)

    def forget(self, req_id: str) -> None:
        self._truth.pop(req_id, None)

    def layer(self, li: int, work: list[tuple[str, list[int], list[int], int, int]], below: dict) -> None:
        """Layer ``li`` of one step: ``work`` holds (req id, tokens, block ids, start, n) per
        scheduled request (positions start..start+n-1 computed); ``below`` maps a req id to the
        layer below's all-reduced value per computed position (filled for the next layer)."""
        for rid, tokens, blocks, start, n in work:
            truth = self.truth(rid, tokens[: start + n])
            attn = 0
            for r, cache in enumerate(self.caches):
                attn += self._read(li, r, cache[li], rid, blocks, start, truth)
            vals_below = below.get(rid) or tokens[start : start + n]
            out = []
            for i, p in enumerate(range(start, start + n)):
                vals = [mix(tokens[p], vals_below[i], attn % P, li, r, p) for r in range(self.ranks)]
                for r, cache in enumerate(self.caches):
                    cache[li, blocks[p // self.bs], :, p % self.bs, :] = float(vals[r])
                attn = (attn + sum(v * self.e % P for v in vals) * (p + 1)) % P
                out.append(sum(vals) % P)
            for r, cache in enumerate(self.caches):  # read back: the writes landed where attention reads
                self._read(li, r, cache[li], rid, blocks, start + n, truth, skip=start)
            below[rid] = out

    def sample(self, top: list[int]) -> int:
        return top[-1] % self.vocab

    def _read(self, li, r, layer, rid, blocks, upto: int, truth: Truth, skip: int = 0) -> int:
        """Attention's read of positions [skip, upto) of layer ``li`` on rank ``r``: checked against
        the truth (violations recorded), and its all-reduce term over [0, upto) returned."""
        if upto <= skip:
            return 0
        pos = torch.arange(skip, upto)
        bids = torch.tensor(blocks, dtype=torch.long)[pos // self.bs]
        got = layer[bids, :, pos % self.bs, :]  # [positions, H, C]
        want = torch.tensor(truth.values[li][r][skip:upto], dtype=got.dtype)
        bad = (got != want[:, None, None]).flatten(1).any(1)
        self.reads += upto - skip
        if bool(bad.any()):
            self.violations.append(Violation(self.step_no, rid, r, li, pos[bad][:8].tolist()))
        sums = got.double().flatten(1).sum(1).long()  # exact: fp32 ints, a row's sum below 2**53
        weights = pos + 1
        return int(((sums % P) * weights % P).sum()) % P
