"""The `vllm` suite's `hybrid` row for a model with state layers: a hit on Qwen3-Next (gated delta
net layers, three to one full-attention layer) through the connector's worker hooks, one store
per KV cache group (`integrations.vllm.groups`: a FULL group of the attention layers, a STATE
group of the linear-attention layers, one state per block as vLLM's prefix caching keeps it).

  ttft_hit hybrid <model> <n>   an n-token prefix hit from the host tier: start_load_kv of a
                                background load (the full group's every chunk, the state group's
                                one block: the state after exactly n tokens) -> get_finished ->
                                the next token's forward, its attention reading the loaded K/V
                                and its linear-attention layers starting from the loaded state
                                -> the first token on the host

The model: transformers' Qwen3NextForCausalLM with random weights (seeded) from a small config,
fp32 (its linear attention's reference kernels). The KV and the states the hit loads are the
prompt's own, from a prefill: each state layer's tensors (its conv and recurrent states, as
transformers keeps them) packed into one block of bytes, as vLLM packs a state layer's page.
The hit's forward runs on a copy of the prefill's cache whose K/V and state tensors are first
poisoned, then written from the loaded blocks: only the loads can make its token right.

Params: speedup (recompute over hit, medians), hit_ms, recompute_ms, ``first_token_match``,
``logits_match`` (every hit's next-token logits within LOGITS_TOL of a recompute's, relative to
their largest: the state the hit started from is the prefix's; logits_max_diff),
loaded_mb per group, state_bytes (one layer's packed state); ``correct``: every run loaded from
the host with no failed receipt, and every group's loaded blocks equal their saved ones bit for
bit. One warm-up and 3 timed runs (quick: 2), perf_counter.
"""

from __future__ import annotations

import copy

import torch

from kvtier.bench.suite import Context
from kvtier.bench.suites.vllm_hybrid import GroupRig, attention_kv

BLOCK = 16
POISON = 7.0
LOGITS_TOL = 1e-3  # a hit's logits within this share of the largest of a recompute's: the same state
MODELS = {  # transformers Qwen3NextConfig fields; full_attention_interval 4: 3 linear to 1 full
    "qwen3next-small": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_value_heads=8,
        linear_num_key_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        decoder_sparse_step=1,
        full_attention_interval=4,
        max_position_embeddings=16384,
    ),
    "qwen3next-tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
        full_attention_interval=4,
        max_position_embeddings=4096,
    ),
}
GPU_TOKENS, CPU_TOKENS = (8192,), (256,)


def state_rows(ctx: Context):
    """Per token count, one ttft_hit row of the state model (a skip without its transformers)."""
    try:
        from transformers import Qwen3NextForCausalLM  # noqa: F401
    except ImportError as exc:
        ctx.skip("ttft_hit hybrid qwen3next", f"the state model needs transformers' Qwen3-Next: {exc}")
        return
    name = "qwen3next-small" if ctx.on_gpu else "qwen3next-tiny"
    for n in GPU_TOKENS if ctx.on_gpu else CPU_TOKENS:
        rig = StateRig(ctx, name, n)
        try:
            yield rig.row()
        finally:
            rig.close()
        if ctx.on_gpu:
            torch.cuda.empty_cache()


def state_tensors(cache, layer: int) -> list[torch.Tensor]:
    """The tensors transformers keeps as linear-attention layer ``layer``'s state in ``cache``
    (its conv and recurrent states), in a fixed order: the tensors of the cache's layer object,
    else its per-layer lists (``conv_states``, ``recurrent_states``)."""
    found: list[torch.Tensor] = []

    def walk(x) -> None:
        if torch.is_tensor(x):
            found.append(x)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)

    layers = getattr(cache, "layers", None)
    if layers is not None and layer < len(layers):
        for key in sorted(vars(layers[layer])):
            walk(vars(layers[layer])[key])
    if not found:
        for attr in ("conv_states", "recurrent_states"):
            walk(getattr(cache, attr, [None] * (layer + 1))[layer])
    return found


class StateRig(GroupRig):
    """Model ``name`` of `MODELS`, its groups' caches (the full group: the n-token prefix twice,
    the blocks it was saved from and the blocks a hit loads into; the state group: three blocks,
    vLLM's null block, the saved state's, the loaded state's) and a `WorkerSide` over them."""

    def __init__(self, ctx: Context, name: str, n: int) -> None:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        from kvtier.integrations.vllm.groups import FULL, STATE, Group, GroupPlan
        from kvtier.integrations.vllm.settings import VllmSettings
        from kvtier.integrations.vllm.worker import WorkerSide

        self.ctx, self.name, self.n = ctx, name, n
        spec = MODELS[name]
        cfg = Qwen3NextConfig(**spec)
        torch.manual_seed(0)
        self.model = Qwen3NextForCausalLM(cfg).to(ctx.device, torch.float32).eval()
        kinds = list(cfg.layer_types)
        self.attn = [i for i, k in enumerate(kinds) if k == "full_attention"]
        self.lin = [i for i, k in enumerate(kinds) if k == "linear_attention"]
        g = torch.Generator().manual_seed(n)
        self.ids = torch.randint(1, spec["vocab_size"], (1, n + 1), generator=g).to(ctx.device)
        with torch.no_grad():
            self.prefix = self.model(self.ids[:, :n], use_cache=True).past_key_values
        self.state_bytes = sum(t.numel() * t.element_size() for t in state_tensors(self.prefix, self.lin[0]))
        names = [f"model.layers.{i}.attn" for i in range(len(kinds))]
        self.groups = [
            Group(0, FULL, BLOCK, tuple(names[i] for i in self.attn), "FullAttentionSpec"),
            Group(
                1,
                STATE,
                BLOCK,
                tuple(names[i] for i in self.lin),
                "MambaSpec:gdn",
                state_bytes=self.state_bytes,
            ),
        ]
        self.nblk = n // BLOCK
        self.src = list(range(1, self.nblk + 1))  # block 0: vLLM's null block
        self.dst = list(range(self.nblk + 1, 2 * self.nblk + 1))
        heads, c = spec["num_key_value_heads"], 2 * spec["head_dim"]
        self.kv = torch.zeros(len(self.attn), 2 * self.nblk + 1, heads, BLOCK, c, device=ctx.device)
        self.states = torch.zeros(
            len(self.lin), 3, 1, 1, self.state_bytes, dtype=torch.int8, device=ctx.device
        )
        views = {names[i]: self.kv[p] for p, i in enumerate(self.attn)}
        views |= {names[i]: self.states[p] for p, i in enumerate(self.lin)}
        views = {k: views[k] for k in names}  # the model's layer order, as vLLM's dict
        ct = 16 * BLOCK
        self.chunks = n // ct
        per_chunk = self.kv[:, 0].numel() * 4 * (ct // BLOCK) + self.states[:, 0].numel()
        s = VllmSettings(chunk_tokens=ct, host_bytes=4 * (self.chunks + 8) * per_chunk, layerwise=False)
        self.ws = WorkerSide(
            s, f"hybrid-{name}", order="LBHNC", block_size=BLOCK, groups=self.groups, tiers=[]
        )
        self.ws.register(views)
        self.plan = GroupPlan(self.groups, ct)
        self.chunk_ids = [f"{name}:{n}:{i}".encode() for i in range(self.chunks)]
        self._tag = 0
        self.diffs: list[float] = []  # per hit: its logits' largest difference from the recompute's
        self._want: torch.Tensor | None = None
        self._fill_and_save()

    # -- set-up ----------------------------------------------------------------------------------

    def _tables(self, full: list[int], state_block: int) -> list[list[int]]:
        """The request's block table per group: the state group's holds ``state_block`` at the
        hit's last position (vLLM's null block before it)."""
        return [full, [0] * (self.nblk - 1) + [state_block]]

    @torch.no_grad()
    def _fill_and_save(self) -> None:
        """The prefill's K/V into the source blocks and its state after n tokens into state block
        1, saved through the hooks as vLLM's hand-off of that state; then every chunk held."""
        from kvtier.integrations.vllm.metadata import ChunkRun, KVTierMetadata

        src = torch.tensor(self.src, device=self.ctx.device)
        for p, i in enumerate(self.attn):
            kv = torch.cat(attention_kv(self.prefix, i), -1)[0]  # [H, n, K||V]
            self.kv[p][src] = kv.view(kv.shape[0], self.nblk, BLOCK, -1).permute(1, 0, 2, 3)
        for p, i in enumerate(self.lin):
            self.states[p, 1, 0, 0] = _packed(state_tensors(self.prefix, i))

        def make(g, ids, b):
            return ChunkRun("save", ids, b, group=g)

        tables = self._tables(self.src, 1)
        _, runs = self.plan.saves(self.chunk_ids, tables, 0, 0, make)
        runs += self.plan.states(self.chunk_ids, [(1, 1, self.n)], make)
        self.ws.save(KVTierMetadata(saves=runs, release={"save"}, step=1))
        self._sync()
        self.ws.finished(set())  # the saves settled: their chunks held

    # -- the row ---------------------------------------------------------------------------------

    @torch.no_grad()
    def recompute(self) -> int:
        logits = self.model(self.ids).logits[0, -1]
        if self._want is None:
            self._want = logits.clone()  # the first recompute's: what every hit is checked against
        return int(logits.argmax())

    def load_tables(self) -> list[list[int]]:
        return self._tables(self.dst, 2)

    @torch.no_grad()
    def hit(self) -> tuple[int, bool]:
        """One hit: (its first token, every chunk of every group delivered from the host)."""
        cache = copy.deepcopy(self.prefix)  # the hit's forward writes its token's K/V and state
        ok = self.load()
        dst = torch.tensor(self.dst, device=self.ctx.device)
        for p, i in enumerate(self.attn):
            keys, values = attention_kv(cache, i)
            blocks = self.kv[p][dst]  # [blocks, H, N, K||V]
            kv = blocks.permute(1, 0, 2, 3).reshape(blocks.shape[1], -1, blocks.shape[3])[None]
            d = kv.shape[-1] // 2
            keys.fill_(POISON).copy_(kv[..., :d])
            values.fill_(POISON).copy_(kv[..., d:])
        for p, i in enumerate(self.lin):
            tensors = state_tensors(cache, i)
            for t in tensors:
                t.fill_(POISON)  # only the loaded state can make the token right
            _unpack(self.states[p, 2, 0, 0], tensors)
        logits = self.model(self.ids[:, self.n :], past_key_values=cache, use_cache=True).logits[0, -1]
        self.diffs.append(float((logits - self._want).abs().max()))
        return int(logits.argmax()), ok

    def exact(self) -> bool:
        """Every group's loaded blocks equal, bit for bit, the blocks they were saved from."""
        kv = torch.equal(self.kv[:, self.dst], self.kv[:, self.src])
        return kv and torch.equal(self.states[:, 2], self.states[:, 1])

    def poison(self) -> None:
        self.kv[:, self.dst] = POISON
        self.states[:, 2] = 7

    def row(self):
        want, rec, t, firsts, ok = self.measure()
        mb = self.loaded_mb()
        link = "h2d_pinned" if self.ctx.on_gpu else "host_memcpy"
        return self.ctx.row(
            f"ttft_hit hybrid {self.name} {self.n}",
            max(int(sum(mb.values()) * 1e6), 1),
            t,
            link,
            correct=ok,
            model=self.name,
            prefix_tokens=self.n,
            chunk_tokens=self.plan.ct,
            state_bytes=self.state_bytes,
            hit_ms=t.median_ms,
            recompute_ms=rec.median_ms,
            speedup=rec.median_ms / t.median_ms,
            first_token_match=all(f == want for f in firsts),
            logits_max_diff=max(self.diffs),
            logits_match=max(self.diffs) <= LOGITS_TOL * float(self._want.abs().max()),
            path="hit: background load per group (the state at the hit's end), then transformers' forward",
            **mb,
        )


def _packed(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, one after the other: a state layer's page."""
    return torch.cat([t.detach().contiguous().view(-1).view(torch.int8) for t in tensors])


def _unpack(page: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Each tensor written from its bytes of ``page`` (`_packed`'s order)."""
    at = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        t.copy_(page[at : at + nbytes].view(t.dtype).view(t.shape))
        at += nbytes


__all__ = ["StateRig", "state_rows", "state_tensors"]
