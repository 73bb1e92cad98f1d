"""The `hf` suite: kvtier's HF cache beside transformers' own caches, on a random-weight Llama.

One request (batch 1, greedy) of a prompt = a cached prefix + a short tail, three caches:

  ttft recompute <N>   transformers' DynamicCache: the whole prompt prefilled (the baseline)
  ttft kvtier <N>      `KVTierCache`: the prefix is a host-tier hit (pinned pool -> the device's
                       paged cache -> attention, layer by layer); only the tail is prefilled. The
                       lookup and the load count.
  ttft offloaded <N>   transformers' offloaded cache (``DynamicCache(offloading=True)``,
                       ``OffloadedCache`` or ``cache_implementation="offloaded"``: whichever this
                       transformers has): the whole prompt prefilled, each layer's KV sent to the CPU
  decode <cache> <N>   the decode steps after the first token, per cache

Shapes: on a GPU the Llama-3-8B shape in bf16, prefixes 8K and 32K (quick: 2K, 8K), 32 new
tokens (quick 16); on the CPU the tiny rig in fp32, prefixes 1K / 4K (quick 128 / 512). The
offloaded cache needs CUDA: skipped on the CPU, with the reason. kvtier's paged cache and pinned
pool are sized to the longest request (`store_sizes`; 32K of 8B bf16 KV: 4 GiB each). About two
minutes on an H200, most of it the offloaded cache's decode at 32K.

Timing: host clock. ``torch.cuda.synchronize()`` before the clock starts and at each streamed
token; one warm-up run per cache, then `reps` runs interleaved (recompute, kvtier, offloaded);
median, min, max. TTFT rows: bytes = KV bytes of the prefix, median_ms = TTFT. Decode rows:
bytes = KV bytes of the prompt (read by attention at each step; the offloaded cache also moves
it host->device), median_ms = one decode step. Ceiling: h2d_pinned on a GPU, host_memcpy on the
CPU. For the kvtier TTFT row the ratio says how close TTFT comes to the bare transfer of the hit;
elsewhere it is a scale. The comparisons are params: ttft_ms, speedup_vs_recompute (recompute
TTFT / this TTFT; P8 wants >= 8 for kvtier), tokens_per_s, decode_vs_dynamic.

correct (`hf_check`): a run passes when its tokens equal its reference's, or first differ where
the reference's logits rated the two picks within 0.05 std, or within twice the GPU's run-to-run
noise of that computation (a bf16 near-tie: random weights give flat logits, and on the H200 two
runs of the same computation do not repeat each other exactly). recompute / offloaded: every run
against an untimed DynamicCache run that keeps its logits. kvtier: the cold request against that
reference; every hit against the same computation — a DynamicCache holding the KV the cold
request saved, the tail prefilled over it (run twice: its tokens, logits and noise); and the
loaded prefix KV equals, bit for bit, the saved KV. `exact_runs` / `near_tie_runs` count the two
kinds of pass, `worst_margin_std` the largest margin a run left its reference at;
`tokens_match_recompute` / `first_divergence_from_recompute` compare hits with the full recompute.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from kvtier.bench import Context, SkipSuite, register, summarize
from lab.suites.hf_check import noise, reference, same_or_tie, summary
from lab.suites.hf_run import (  # noqa: F401 - TokenClock, offloaded_cache: the suite's API
    Run,
    TokenClock,
    _kvtier_done,
    dynamic_cache,
    offloaded_cache,
    timed_generate,
)

P8 = 8.0  # target P8: TTFT on a prefix hit >= 8x faster than recomputing
NO_OFFLOAD_ON_CPU = "transformers' offloaded cache moves KV from a CUDA device to the CPU: needs a GPU"


@dataclass(frozen=True, slots=True)
class Plan:
    """What one run measures: model `shape` (llama_rig) in `dtype`, one request per prefix."""

    shape: str
    dtype: str
    prefixes: tuple[int, ...]  # cached prefix tokens, multiples of chunk_tokens
    tail: int  # prompt tokens after the prefix, prefilled on a hit
    new_tokens: int  # generated per run: the first token, then new_tokens - 1 decode steps
    reps: int
    chunk_tokens: int
    block_size: int

    def __post_init__(self) -> None:
        for name, low in (
            ("tail", 1),
            ("new_tokens", 2),
            ("reps", 1),
            ("chunk_tokens", 1),
            ("block_size", 1),
        ):
            v = getattr(self, name)  # new_tokens >= 2: a first token and at least one decode step
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {v!r}")
        if self.chunk_tokens % self.block_size:
            raise ValueError(
                f"chunk_tokens: {self.chunk_tokens} is not a multiple of block_size {self.block_size}"
            )
        if not self.prefixes or any(n < 1 or n % self.chunk_tokens for n in self.prefixes):
            raise ValueError(f"prefixes: expected multiples of chunk_tokens, got {self.prefixes!r}")


def plan_for(on_gpu: bool, quick: bool) -> Plan:
    if on_gpu:
        prefixes, new = ((2048, 8192), 16) if quick else ((8192, 32768), 32)
        return Plan("llama-3-8b", "bfloat16", prefixes, 64, new, 2 if quick else 3, 256, 16)
    prefixes, new = ((128, 512), 4) if quick else ((1024, 4096), 16)
    return Plan("tiny", "float32", prefixes, 16, new, 2 if quick else 3, 64, 16)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """KV bytes of one token, all layers (K and V)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def store_sizes(plan: Plan, bytes_per_token: int) -> tuple[int, int]:
    """(num_blocks, pool_bytes) for the longest request: its blocks, and pinned room for the chunks
    its finish() saves inside the host capacity (the pool less max(1/8, two chunks), StoreConfig)."""
    longest = max(plan.prefixes) + plan.tail + plan.new_tokens
    num_blocks = -(-longest // plan.block_size) + 8
    chunk = -(-plan.chunk_tokens * bytes_per_token // 4096) * 4096  # a pool slot: the chunk, aligned
    need = longest // plan.chunk_tokens * chunk
    pool = max(-(-need * 8 // 7), need + 2 * chunk) + 2 * chunk
    return num_blocks, -(-pool // (2 << 20)) * (2 << 20)


def _tokens(run: Run, prompt: int) -> list[int]:
    return run.sequences[0, prompt:].tolist()


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def _label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _prefix_kv(cache, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(lay.keys[:, :, :n], lay.values[:, :, :n]) for lay in cache.layers]


def after_save(kvt) -> None:
    """Called once the cold request's chunks sit in the host tier, before any hit reads them: a
    test puts a fault here (through kvtier's public objects) to see the suite catch wrong KV."""


def _checks(model, kvt, ids: torch.Tensor, prefix: int, gen, key: str) -> tuple[list[int], dict]:
    """Untimed: the reference tokens, and the kvtier checks (cold = reference, loaded KV = saved KV,
    hit tokens = a DynamicCache holding that KV). Also the warm-up of recompute and of the hit."""
    prompt = ids.shape[1]
    warm = gen(lambda: {key: dynamic_cache(model)})  # warm-up of the recompute path
    n_new = warm.sequences.shape[1] - prompt
    ref, logits = reference(model, ids, n_new, {key: dynamic_cache(model)})
    # Twice: how far the GPU's own run-to-run noise moves this computation's logits.
    ref_noise = noise((ref, logits), reference(model, ids, n_new, {key: dynamic_cache(model)}))
    cold = gen(lambda: {key: kvt.cache(ids)})  # no hit: computes the whole prompt, then saves its KV
    cold_ok = (
        cold.cache.hit_tokens == 0 and same_or_tie(_tokens(cold, prompt), ref, logits, noise=ref_noise)[0]
    )
    handle = cold.cache.finish(cold.sequences)  # returns once the save's copies have landed
    saved = 0 if handle is None else handle.saved
    after_save(kvt)  # a test's fault goes in here; a run changes nothing
    saved_kv = _prefix_kv(cold.cache, prefix)
    # The same computation as a hit (the tail prefilled over this KV), twice: the tokens a hit must
    # give, and how far the GPU's own run-to-run noise moves its logits.
    same_order = reference(model, ids, n_new, {key: dynamic_cache(model, saved_kv)})
    so_noise = noise(same_order, reference(model, ids, n_new, {key: dynamic_cache(model, saved_kv)}))
    hit = gen(lambda: {key: kvt.cache(ids)})  # warm-up of the hit path (first-use compiles, captures)
    loaded = _prefix_kv(hit.cache, prefix) if hit.cache.hit_tokens == prefix else None
    kv_exact = loaded is not None and all(
        torch.equal(a, b) for x, y in zip(loaded, saved_kv, strict=True) for a, b in zip(x, y, strict=True)
    )
    tier = "+".join(sorted(set(hit.cache.hit_tiers))) or "-"
    _kvtier_done(hit)
    k = dict(cold_ok=cold_ok, saved_chunks=saved, kv_bit_exact=kv_exact, tier=tier, same_order=same_order)
    return (ref, logits), k | dict(same_order_noise=so_noise, reference_noise=ref_noise)


def _request(ctx: Context, plan: Plan, model, kvt, prefix: int, offload, why: str, common: dict):
    """The rows of one prefix length: checks and warm-ups (untimed), then interleaved timed runs."""
    from kvtier.integrations.hf import cache_kwarg

    key, prompt = cache_kwarg(model), prefix + plan.tail
    g = torch.Generator().manual_seed(prefix)
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), generator=g).to(ctx.device)
    gen = lambda make: timed_generate(model, ids, plan.new_tokens, make, ctx.on_gpu)
    (ref, logits), k = _checks(model, kvt, ids, prefix, gen, key)
    paths = {"recompute": lambda: {key: dynamic_cache(model)}, "kvtier": lambda: {key: kvt.cache(ids)}}
    if offload is not None:
        try:
            gen(offload)  # warm-up; an offloading that fails in this transformers is skipped, not fatal
            paths["offloaded"] = offload
        except Exception as e:  # noqa: BLE001
            why = f"transformers' offloaded cache failed here: {type(e).__name__}: {e}"[:300]
    runs: dict[str, list[Run]] = {p: [] for p in paths}
    for _ in range(plan.reps):  # interleaved: a drift of clocks or load hits every cache alike
        for name, make in paths.items():
            r = gen(make)
            r = _kvtier_done(r) if name == "kvtier" else r
            r.cache = None
            runs[name].append(r)
    got = {p: [_tokens(r, prompt) for r in rs] for p, rs in runs.items()}
    loads = [r.load_ms for r in runs["kvtier"] if r.load_ms]
    load_ms = statistics.median(loads) if loads else None
    kv_ok = k["cold_ok"] and k["saved_chunks"] >= prefix // plan.chunk_tokens and k["kv_bit_exact"]
    hits = summary(got["kvtier"], *k["same_order"], noise=k["same_order_noise"])
    hits_ok = hits["correct"] and all(r.hit_tokens == prefix for r in runs["kvtier"])
    same = "every run = the reference's tokens, or first differs at a near-tie (0.05 std or 2 x noise)"
    checks = {
        "recompute": dict(
            summary(got["recompute"], ref, logits, noise=k["reference_noise"]),
            check=same,
            reference_noise=k["reference_noise"],
        ),  # fmt: skip
        "kvtier": dict(
            correct=kv_ok and hits_ok,
            check="cold = reference and hits = a DynamicCache holding the same KV (the same "
            "computation), up to near-ties; loaded KV = saved KV bit for bit",
            exact_runs=hits["exact_runs"],
            near_tie_runs=hits["near_tie_runs"],
            worst_margin_std=hits["worst_margin_std"],
            same_order_noise=k["same_order_noise"],
            same_order_tokens_match=all(t == k["same_order"][0] for t in got["kvtier"]),
            kv_bit_exact=k["kv_bit_exact"],
            cold_matches_reference=k["cold_ok"],
            saved_chunks=k["saved_chunks"],
            hit_tier=k["tier"],
            hit_tokens=min(r.hit_tokens for r in runs["kvtier"]),
            tokens_match_recompute=all(t == ref for t in got["kvtier"]),
            first_divergence_from_recompute=_first_divergence(got["kvtier"][0], ref),
            load_ms=load_ms,
            load_gbps=prefix * common["kv_bytes_per_token"] / load_ms / 1e6 if load_ms else None,
        ),  # fmt: skip
        "offloaded": dict(
            summary(got.get("offloaded", []), ref, logits, noise=k["reference_noise"]),
            check=same,
            reference_noise=k["reference_noise"],
        ),  # fmt: skip
    }
    yield from _rows(ctx, plan, prefix, runs, checks, common)
    if "offloaded" not in runs:
        for what in ("ttft", "decode"):
            ctx.skip(f"{what} offloaded {_label(prefix)}", why)


def _rows(ctx: Context, plan: Plan, prefix: int, runs: dict, checks: dict, common: dict):
    bpt, prompt = common["kv_bytes_per_token"], prefix + plan.tail
    ceiling = "h2d_pinned" if ctx.on_gpu else "host_memcpy"
    ttft = {p: summarize([r.ttft_s * 1e3 for r in rs]) for p, rs in runs.items()}
    step = {p: summarize([r.step_s * 1e3 for r in rs]) for p, rs in runs.items()}
    base = dict(common, prefix_tokens=prefix, prompt_tokens=prompt, tail_tokens=plan.tail,
                new_tokens=plan.new_tokens, reps=plan.reps, chunk_tokens=plan.chunk_tokens,
                block_size=plan.block_size)  # fmt: skip
    for p in runs:
        extra = {k: v for k, v in checks[p].items() if k != "correct"}
        t, speed = ttft[p], ttft["recompute"].median_ms / ttft[p].median_ms
        if p == "kvtier":
            extra |= dict(target=f"P8: >= {P8:g}x faster than recompute", meets_target=speed >= P8)
        yield ctx.row(f"ttft {p} {_label(prefix)}", prefix * bpt, t, ceiling, correct=checks[p]["correct"],
                      **base, **extra, cache=p, path=f"ttft {p}", measures="time to first token (ms)",
                      ttft_ms=t.median_ms, speedup_vs_recompute=speed)  # fmt: skip
    for p in runs:
        t = step[p]
        yield ctx.row(f"decode {p} {_label(prefix)}", prompt * bpt, t, ceiling, correct=checks[p]["correct"],
                      **base, cache=p, path=f"decode {p}", measures="one decode step (ms)",
                      tokens_per_s=1e3 / t.median_ms,
                      decode_vs_dynamic=step["recompute"].median_ms / t.median_ms)  # fmt: skip


@register("hf", needs_gpu=False, description="HF transformers: TTFT kvtier hit vs recompute vs offloaded")
def hf(ctx: Context):
    try:
        import transformers

        from kvtier.bench.llama_rig import build_llama
        from kvtier.integrations.hf import KVTier
    except ImportError as e:
        raise SkipSuite(f"needs transformers (pip install 'kvtier[hf]'): {e}") from None
    plan = plan_for(ctx.on_gpu, ctx.quick)
    dtype = getattr(torch, plan.dtype)
    model = build_llama(plan.shape, ctx.device, dtype)
    offload, note = offloaded_cache(model) if ctx.on_gpu else (None, NO_OFFLOAD_ON_CPU)
    bpt = kv_bytes_per_token(model.config, dtype)
    num_blocks, pool = store_sizes(plan, bpt)
    cfg = model.config
    common = dict(model=plan.shape, dtype=dtype, layers=cfg.num_hidden_layers,
                  kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, kv_bytes_per_token=bpt,
                  transformers=transformers.__version__, torch=torch.__version__,
                  attn=getattr(cfg, "_attn_implementation", None), pool_bytes=pool,
                  offload_api=note if offload is not None else None,
                  clock="host perf_counter, device synchronized")  # fmt: skip
    opts = dict(
        num_blocks=num_blocks, block_size=plan.block_size, pool_bytes=pool, chunk_tokens=plan.chunk_tokens
    )
    kvt = KVTier.for_model(model, model_id=f"random-{plan.shape}-seed0", **opts)
    try:
        for prefix in plan.prefixes:
            yield from _request(ctx, plan, model, kvt, prefix, offload, note, common)
            kvt.store.evict()  # the next length starts with an empty host
            if ctx.on_gpu:
                torch.cuda.empty_cache()  # this length's caches are gone: give the memory back
    finally:
        kvt.close()
