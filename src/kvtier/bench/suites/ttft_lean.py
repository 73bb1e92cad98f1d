"""The `ttft` suite's lean rows: a host hit and a recompute through `integrations.lean.LeanRunner`
(kvtier's own first-token forward over the same weights, without transformers' per-forward host
cost), so P8 is also shown like against like for a runner as lean as a serving engine's.

    <n> lean recompute        LeanRunner over the whole prompt
    <n> lean load host        kvt.cache (the prefix loads layer-major) + LeanRunner over the tail
                              (on CUDA: per-layer CUDA graphs, captured in the warm-up run;
                              params graphs, captures, capture_ms, gqa_flash)

Params as the other rows, predicted_ms from the planner without a forward floor (the lean forward
has next to none), `p8_lean` = pass | miss | n/a on the load row (lean recompute / lean load).
`correct`: the first token equals the transformers recompute run's (the prompt's top-2 margin
keeps bf16 rounding from flipping it) and every loaded chunk came from the host.
"""

from __future__ import annotations

import time

from kvtier.bench.suites.ttft_rig import P8_SPEEDUP, Rig


def lean_rows(rig: Rig, kvt, n: int, runs):
    """Yield the two lean rows of prefix n (host tier); `runs` is the suite's `_runs`."""
    from kvtier.integrations.lean import LeanRunner
    from kvtier.planner import plan

    lean = LeanRunner(rig.model)
    ids = rig.prompt(n)
    want = int(rig.reference[n][0, ids.shape[1]])  # the transformers recompute's first new token
    opts = rig.plan_opts | {"forward_floor_ms": 0.0}
    p = plan(rig.spec, rig.gpu, "host", n, rig.new, rig.ceilings, chunk_tokens=rig.chunk, **opts)

    def recompute(ids):
        t0 = time.perf_counter()
        tok, _ = lean.first_token(ids)  # int(): the host has the token, so the GPU made it
        return tok, time.perf_counter() - t0, {"tiers": ()}

    def load(ids):
        t0 = time.perf_counter()
        cache = kvt.cache(ids)
        tok, _ = lean.first_token(ids, cache)
        dt = time.perf_counter() - t0
        cache.finish(None)  # waits for the load, gives the blocks back; nothing new is saved
        return tok, dt, {"tiers": cache.hit_tiers}

    ms = {}
    for mode, fn, tier, option in (
        ("lean recompute", recompute, "-", "recompute"),
        ("lean load", load, "host", "load"),
    ):
        case = f"{rig.label(n)} {mode}" + (" host" if tier == "host" else "")
        t, toks, infos = runs(rig, case, fn, ids)
        ms[mode] = t.median_ms
        source_ok = tier == "-" or all(list(i["tiers"]) == ["host"] * (n // rig.chunk) for i in infos)
        ok = all(tok == want for tok in toks) and source_ok
        params = rig.params(n, tier, mode, p.options[option].ms, t.median_ms) | {
            "path": f"{mode} (LeanRunner)", "first_token_matches_recompute": all(tok == want for tok in toks),
            "source_ok": source_ok, "graphs": lean.graphs, "gqa_flash": lean.gqa_flash,
            "captures": lean.captures, "capture_ms": lean.capture_s * 1e3,
        }  # fmt: skip
        if mode == "lean load":
            params |= _p8(rig, n, ms["lean recompute"], t.median_ms)
        yield rig.ctx.row(case, rig.kv_bytes(n), t, rig.link, correct=ok, **params)


def _p8(rig: Rig, n: int, recompute_ms: float, load_ms: float) -> dict:
    sp = recompute_ms / load_ms
    why = f"lean recompute {recompute_ms:.1f} ms / lean load {load_ms:.1f} ms = {sp:.1f}x (target >= 8x)"
    status = "pass" if sp >= P8_SPEEDUP else "miss"
    dry = None if rig.on_gpu and rig.shape == "llama-3-8b" else f"dry run ({rig.shape} on {rig.ctx.device})"
    if dry or n < 8192:
        why, status = f"{dry or 'a prefix under 8K'}, not P8's case: would be {status}: {why}", "n/a"
    return dict(p8_lean=status, p8_lean_speedup=sp, p8_lean_why=why)
