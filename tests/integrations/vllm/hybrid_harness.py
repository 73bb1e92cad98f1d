"""kvtier's connector on a hybrid model through vLLM 0.33's real Scheduler: the KVCacheConfig
vLLM builds from the model's own config.json (`hybrid_models.py`), every TP rank's worker hooks
over a CPU cache laid out as vLLM lays out its `kv_cache_tensors` (groups overlaying one buffer,
block ids owned by one group at a time), and a stand-in forward per group whose attention reads
are checked.

    HybridEngine      `vllm_harness.Engine`'s stepping over a hybrid model
    HybridStandIn     the stand-in model over every layer of every group, on every rank

The stand-in, per layer l of group g, rank r and each position p a step computes, in order of p:

    reads     the KV of positions [lo(p), p) of layer l on rank r through the request's block
              table of group g: lo = 0 in a full-attention group, p - W + 1 in a sliding window
              of W tokens (what vLLM's attention reads; the blocks before it vLLM frees)
    attn_p    the sum over ranks and those q of value(q) * (q + 1) (mod P): TP's all-reduce
    value     mix(token_p, the layer below's all-reduced value at p, attn_p, l, r, p)

written into every byte of p's page slot as its three low bytes repeated (whatever the page's
dtype: bf16 pages, MLA's latent, the DSA indexer's uint8 keys), so a position's KV depends on
its whole prefix through every layer, and a read that differs from the truth is recorded.

A state layer (Mamba, gated delta net: a `MambaSpec` group under prefix caching) keeps one state
per block, as vLLM's align mode does: a step over positions [s, e) reads the state after s tokens
from the block at position (s - 1) // block_size of its table (vLLM copies it there into the
step's running block first), and writes the state after e tokens into the block at (e - 1) //
block_size. The state after p, on rank r: mix(token_p, the layer below's value at p, the state
before p on rank r, l, r, p); the layer's value at p is the sum of the ranks' states. A state is
written over every byte of the layer's packed state (its conv and SSM tensors, vLLM's [B, 1, 1,
C] view): its value's three low bytes, then a pattern of every byte's position keyed by the value,
so a state read from another block, position or request is recorded.
"""

from __future__ import annotations

from collections import deque

import torch
from hybrid_models import hybrid_kv_cache_config, hybrid_vllm_config
from stand_in import P, Violation, mix
from vllm_harness import STALL_S, Engine
from vllm_utils import _computed_of

POISON = 255  # every byte before anything wrote it: 0xFFFFFF is above every value (< P)


class _Rank:
    """TP rank ``rank``'s worker connector over one CPU buffer holding every group's layer views."""

    def __init__(self, cfg, kcc, rank: int = 0, *, tiers=None, device=None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvtier.device import SimDevice
        from kvtier.integrations.vllm import KVTierConnector

        self.conn = KVTierConnector(cfg, KVConnectorRole.WORKER, kcc)
        ws = self.ws = self.conn.worker_side
        ws.tp_rank = rank  # vLLM's process group names the rank; here we do
        if tiers is not None:
            ws._tiers = tiers
        self.dev = device or SimDevice()
        ws._device = self.dev
        self.views = _views(kcc)
        if not self.conn.idle:
            self.conn.register_kv_caches(self.views)

    @property
    def store(self):
        return self.ws.store

    def close(self) -> None:
        self.conn.shutdown()
        self.dev.close()


class HybridEngine(Engine):
    """vLLM's Scheduler over model ``name`` (`hybrid_models.MODELS`) with kvtier's connector,
    ``tp_size`` ranks (tiers(rank), device(rank): a rank's lower tiers, its SimDevice) and the
    stand-in. num_blocks: about as many blocks as vLLM's pool gets. max_model_len,
    batched: vLLM's limits (a smaller ``batched`` prefills in chunks). async_scheduling: vLLM's
    `AsyncScheduler` and a batch queue of two. retention_interval: vLLM's
    ``prefix_cache_retention_interval``."""

    def __init__(
        self,
        tmp,
        name: str,
        extra: dict,
        *,
        num_blocks: int,
        max_model_len: int = 1024,
        batched: int = 1024,
        tiers=None,
        device=None,
        async_scheduling: bool = False,
        tp_size: int = 1,
        retention_interval: int | None = 0,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.cfg = hybrid_vllm_config(
            tmp, name, extra, max_model_len=max_model_len, batched=batched, tp_size=tp_size
        )
        # vLLM's default (0): a state or window group keeps only the prompt's last boundary
        # (and junctions with other prompts); N: also one every N tokens
        self.cfg.cache_config.prefix_cache_retention_interval = retention_interval
        self.kcc, sched_kcc, sched_bs, hash_bs = hybrid_kv_cache_config(self.cfg, num_blocks)
        self.hash_block_size = hash_bs
        self.cfg.scheduler_config.async_scheduling = async_scheduling
        self.sched = (AsyncScheduler if async_scheduling else Scheduler)(
            self.cfg,
            sched_kcc,
            StructuredOutputManager(self.cfg),
            block_size=sched_bs,
            hash_block_size=hash_bs,
            log_stats=True,
        )
        self.ranks = [
            _Rank(
                self.cfg,
                self.kcc,
                r,
                tiers=None if tiers is None else tiers(r),
                device=None if device is None else device(r),
            )
            for r in range(tp_size)
        ]
        self.model = HybridStandIn(self.kcc, [rk.views for rk in self.ranks])
        self.graphs, self.aggregator = None, KVOutputAggregator(tp_size)
        self.async_, self.step_s_per_token = async_scheduling, 0.0
        self.queue: deque = deque()
        self.requests, self.prompts, self.samples, self.blocks = {}, {}, {}, {}
        self.outputs, self.finished, self.history = {}, {}, []
        self.steps, self.before_execute, self.failed_loads, self.logged = 0, None, set(), {}

    def first_token(self, tokens: list[int]) -> int:
        t = self.model.truth("__reference__", tokens)
        return self.model.sample([sum(r[-1] for r in t.values[-1]) % P])

    def run_loads(self, rid: str) -> list[tuple[int, int]]:
        """(group, chunks) of each load run the scheduler sent for ``rid``, in step order."""
        return [
            (r.group, len(r.ids))
            for so, _ in self.history
            for r in so.kv_connector_metadata.loads
            if r.req_id == rid
        ]

    def failed_receipts(self) -> set[str]:
        return set().union(*(kv.failed_recving or () for _, kv in self.history if kv is not None))

    def _forward(self, so) -> dict[str, list[int]]:
        work = []
        for rid, n in so.num_scheduled_tokens.items():
            start = _computed_of(so, rid)
            work.append((rid, self.tokens(rid, start + n), self.blocks[rid], start, n))
        below: dict = {}
        for li, name in enumerate(self.model.names):
            for r, rk in enumerate(self.ranks):
                rk.conn.wait_for_layer_load(name)
                if not rk.dev.current_stream().record().synchronize(STALL_S):
                    for other in self.ranks:
                        other.dev.close()  # every blocked stream released: the test fails, not hangs
                    raise AssertionError(f"step {self.steps}: rank {r}'s forward blocked before layer {li}")
            if work:
                self.model.layer(li, work, below)
        sampled = {}
        for rid, _, _, start, n in work:
            if start + n >= len(self.prompts[rid]):
                tok = self.model.sample(below[rid])
                self.samples[rid][start + n] = tok
                sampled[rid] = [tok]
        return sampled

    def _track_blocks(self, so) -> None:
        for new in so.scheduled_new_reqs:
            self.blocks[new.req_id] = [list(g) for g in new.block_ids]
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                self.blocks[rid] = [list(g) for g in nb] if nb else []
            elif nb:
                for have, more in zip(self.blocks[rid], nb, strict=True):
                    have.extend(more)


STATE = -1  # a layer's "window" in `_Truth` and `HybridStandIn`: a state layer


class _Truth:
    """The true values [layer][rank][position] of one token sequence, extended as it grows
    (windows: per layer None, a window, or STATE; a state layer's value: the state after p)."""

    def __init__(self, windows: list[int | None], ranks: int) -> None:
        self.windows, self.ranks = windows, ranks
        self.tokens: list[int] = []
        self.values = [[[] for _ in range(ranks)] for _ in windows]
        self._sums = [[[0] for _ in range(ranks)] for _ in windows]  # prefix sums of value(q) * (q + 1)

    def upto(self, tokens: list[int]) -> _Truth:
        if tokens[: len(self.tokens)] != self.tokens[: len(tokens)]:
            self.__init__(self.windows, self.ranks)
        for p in range(len(self.tokens), len(tokens)):
            below = tokens[p]
            for li, w in enumerate(self.windows):
                if w == STATE:
                    prev = [v[p - 1] if p else 0 for v in self.values[li]]
                    vals = [mix(tokens[p], below, prev[r], li, r, p) for r in range(self.ranks)]
                    for r, v in enumerate(vals):
                        self.values[li][r].append(v)
                    below = sum(vals) % P
                    continue
                lo = 0 if w is None else max(0, p - w + 1)
                sums = self._sums[li]
                attn = sum(acc[p] - acc[lo] for acc in sums) % P
                vals = [mix(tokens[p], below, attn, li, r, p) for r in range(self.ranks)]
                for r, v in enumerate(vals):
                    self.values[li][r].append(v)
                    sums[r].append(sums[r][-1] + v * (p + 1))
                below = sum(vals) % P
            self.tokens.append(tokens[p])
        return self


class HybridStandIn:
    """The model over every layer of ``kcc``'s groups (views: per rank, vLLM's per-layer views)."""

    def __init__(self, kcc, views: list[dict]) -> None:
        self.names: list[str] = sorted(views[0], key=_layer_order)
        self.ranks = len(views)
        table_of = {}
        for gi, g in enumerate(kcc.kv_cache_groups):
            for name in g.layer_names:
                spec = getattr(g.kv_cache_spec, "kv_cache_specs", {}).get(name, g.kv_cache_spec)
                kind = STATE if hasattr(spec, "mamba_cache_mode") else getattr(spec, "sliding_window", None)
                table_of[name] = (gi, spec.block_size, kind)
        self.layers = []
        for name in self.names:
            xs = [v[name].unsqueeze(1) if v[name].dim() == 3 else v[name] for v in views]  # MLA: [B, 1, N, C]
            self.layers.append((*table_of[name], [x.view(torch.uint8) for x in xs]))
        self.windows = [w for _, _, w, _ in self.layers]
        self.violations: list[Violation] = []
        self._bases: dict[int, torch.Tensor] = {}  # a state's position pattern, per size
        self.reads = 0
        self.step_no = 0
        self._truth: dict[str, _Truth] = {}

    def truth(self, req_id: str, tokens: list[int]) -> _Truth:
        t = self._truth.get(req_id)
        if t is None:
            t = self._truth[req_id] = _Truth(self.windows, self.ranks)
        return t.upto(tokens)

    def forget(self, req_id: str) -> None:
        self._truth.pop(req_id, None)

    def sample(self, top: list[int]) -> int:
        return top[-1] % 1000

    def layer(self, li: int, work, below: dict) -> None:
        gi, bs, w, x8s = self.layers[li]
        if w == STATE:
            self._state_layer(li, work, below)
            return
        for rid, tokens, blocks, start, n in work:
            truth = self.truth(rid, tokens[: start + n])
            table = torch.tensor(blocks[gi], dtype=torch.long)
            lo0 = 0 if w is None else max(0, start - w + 1)
            sums = []  # per rank, prefix sums of value(q) * (q + 1) from lo0
            for r, x8 in enumerate(x8s):
                got = self._read(li, r, x8, table, bs, lo0, start, truth.values[li][r], rid)
                acc = [0]
                for q, v in zip(range(lo0, start), got, strict=True):
                    acc.append(acc[-1] + v * (q + 1))
                sums.append(acc)
            vals_below = below.get(rid) or tokens[start : start + n]
            out, mine = [], [[] for _ in x8s]
            for i, p in enumerate(range(start, start + n)):
                lo = 0 if w is None else max(0, p - w + 1)
                attn = sum(acc[p - lo0] - acc[lo - lo0] for acc in sums) % P
                vals = [mix(tokens[p], vals_below[i], attn, li, r, p) for r in range(self.ranks)]
                for r, v in enumerate(vals):
                    mine[r].append(v)
                    sums[r].append(sums[r][-1] + v * (p + 1))
                out.append(sum(vals) % P)
            pos = torch.arange(start, start + n)
            for r, x8 in enumerate(x8s):
                pattern = _pattern(mine[r], x8.shape[1] * x8.shape[3]).view(n, *x8.shape[1::2])
                x8[table[pos // bs], :, pos % bs, :] = pattern
                self._read(li, r, x8, table, bs, start, start + n, truth.values[li][r], rid)  # landed
            below[rid] = out

    def _state_layer(self, li: int, work, below: dict) -> None:
        gi, bs, _, x8s = self.layers[li]
        for rid, tokens, blocks, start, n in work:
            truth = self.truth(rid, tokens[: start + n])
            table = blocks[gi]
            state = [0] * self.ranks
            if start:  # the state after `start` tokens, where vLLM keeps it
                col = (start - 1) // bs
                for r, x8 in enumerate(x8s):
                    state[r] = self._read_state(
                        li, r, x8, table[col], truth.values[li][r][start - 1], rid, start
                    )
            vals_below = below.get(rid) or tokens[start : start + n]
            out = []
            for i, p in enumerate(range(start, start + n)):
                state = [mix(tokens[p], vals_below[i], state[r], li, r, p) for r in range(self.ranks)]
                out.append(sum(state) % P)
            block = table[(start + n - 1) // bs]
            for r, x8 in enumerate(x8s):
                x8[block, 0, 0, :] = self._state_pattern(state[r], x8.shape[-1])
                self._read_state(
                    li, r, x8, block, truth.values[li][r][start + n - 1], rid, start + n
                )  # landed
            below[rid] = out

    def _state_pattern(self, value: int, nbytes: int) -> torch.Tensor:
        """A state's bytes: ``value``'s three low bytes, then each byte's position pattern xor a
        byte of ``value``."""
        base = self._bases.get(nbytes)
        if base is None:
            i = torch.arange(nbytes, dtype=torch.int64)
            base = self._bases[nbytes] = ((i * 151 + (i >> 8) * 7 + (i >> 16)) & 255).to(torch.uint8)
        out = base ^ ((value * 2654435761 >> 16) & 255)
        out[:3] = torch.tensor([value & 255, (value >> 8) & 255, (value >> 16) & 255], dtype=torch.uint8)
        return out

    def _read_state(self, li, r, x8, block: int, want: int, rid, tokens: int) -> int:
        """The state in ``block`` of layer ``li`` as the step reads it: checked against ``want``
        (the state after ``tokens`` tokens), its value (decoded from what was read) returned."""
        got = x8[block, 0, 0, :]
        self.reads += 1
        if not torch.equal(got, self._state_pattern(want, got.shape[0])):
            self.violations.append(Violation(self.step_no, rid, r, li, [tokens]))
        g = got[:3].long()
        return int(g[0] + (g[1] << 8) + (g[2] << 16))

    def _read(self, li, r, x8, table, bs, lo, hi, want, rid) -> list[int]:
        """Positions [lo, hi) of layer ``li`` as attention reads them: checked against ``want``,
        their values (decoded from what was read) returned."""
        if hi <= lo:
            return []
        pos = torch.arange(lo, hi)
        got = x8[table[pos // bs], :, pos % bs, :].reshape(hi - lo, -1)
        bad = (got != _pattern(want[lo:hi], got.shape[1])).any(1)
        self.reads += hi - lo
        if bool(bad.any()):
            self.violations.append(Violation(self.step_no, rid, r, li, pos[bad][:8].tolist()))
        g = got[:, :3].long()
        return (g[:, 0] + (g[:, 1] << 8) + (g[:, 2] << 16)).tolist()


def _pattern(values: list[int], nbytes: int) -> torch.Tensor:
    """Each value's three low bytes, repeated over ``nbytes`` bytes: [len(values), nbytes] uint8."""
    v = torch.tensor(values, dtype=torch.long)
    three = torch.stack([v & 255, (v >> 8) & 255, (v >> 16) & 255], 1)
    return three.repeat(1, -(-nbytes // 3))[:, :nbytes].to(torch.uint8)


def _views(kcc) -> dict:
    """vLLM's per-layer views of ``kcc`` in LBHNC (MLA: [B, N, C]) over one zeroed... poisoned
    buffer: each `KVCacheTensor` places its layers at offset + l * layer_stride, blocks
    block_stride apart; tensors whose ranges overlap alias (the groups overlay)."""
    size = max(t.offset + t.size for t in kcc.kv_cache_tensors)
    buf = torch.full((size,), POISON, dtype=torch.uint8)
    spec_of = {}
    for g in kcc.kv_cache_groups:
        inner = getattr(g.kv_cache_spec, "kv_cache_specs", None)
        for name in g.layer_names:
            spec_of[name] = inner[name] if isinstance(inner, dict) else g.kv_cache_spec
    views = {}
    for t in kcc.kv_cache_tensors:
        if t.layers[0] in spec_of and hasattr(spec_of[t.layers[0]], "mamba_cache_mode"):
            views.update(_state_views(buf, kcc, t, spec_of[t.layers[0]]))
            continue
        for li, name in enumerate(t.layers):
            if name not in spec_of:
                continue  # a padding layer
            s = spec_of[name]
            item = torch.empty((), dtype=s.dtype).element_size()
            start = t.offset + li * t.layer_stride
            typed = buf.view(s.dtype) if item == 1 else buf[: size - size % item].view(s.dtype)
            if type(s).__name__.startswith("MLA"):
                shape, stride = (kcc.num_blocks, s.block_size, s.head_size), (s.head_size, 1)
            else:
                c = s.head_size + s.head_size_v
                shape = (kcc.num_blocks, s.num_kv_heads, s.block_size, c)
                stride = (s.block_size * c, c, 1)
            views[name] = typed.as_strided(shape, (t.block_stride // item, *stride), start // item)
    return views


def _state_views(buf, kcc, tensor, spec) -> dict:
    """A state group's per-layer views as vLLM's `allocate_kv_cache` makes them: [B, 1, 1, C]
    int8 (C: the layer's packed state bytes), blocks the padded page apart."""
    from vllm.v1.kv_cache_interface import create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    order = KVCacheLayout[kcc.kv_cache_layout]
    views = create_kv_cache_views(buf.view(torch.int8), spec, kcc.num_blocks, order, tensor)
    return dict(zip(tensor.layers, views, strict=True))


def _layer_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return int(parts[2]), name  # model.layers.<i>....: the model's order, MLA before its indexer
