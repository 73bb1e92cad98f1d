"""The `ttft` suite's lean rows: the same requests through `integrations.lean.LeanRunner` (kvtier's
own first-token forward over the same weights, without transformers' per-forward host cost), so
load, recompute and split are also compared like against like for a runner as lean as a serving
engine's.

    <n> lean recompute          LeanRunner over the whole prompt (once per n)
    <n> lean load <tier>        kvt.cache (the prefix loads layer-major) + LeanRunner over the tail
    <n> lean split <tier>       LeanRunner.split_first_token at the planner's s: [0, s) computed
                                while [s, n) loads on a thread, then the tail over both

On CUDA a hit's tail runs as per-layer CUDA graphs, captured in the warm-up run (params graphs,
captures, capture_ms, gqa_flash). predicted_ms: the planner with no floor for the tail's forward
and, with graphs, the split's front (their graphs have next to none beyond the floor's growth with
the prefix), and the lean runner's own hit cost (`lean_costs`: a one-chunk hit measured on first
use, beyond the planner's prediction of it; param planner_hit_fixed_ms); the lean recompute, an
eager forward, keeps the floor. Load rows: speedup_vs_recompute
(lean recompute / lean load). Split rows: split_vs_best (over min(lean load, lean recompute)),
load_vs_recompute, its two halves each timed alone in this run (split_front_ms: the forward over [0,
s); split_back_ms: [s, n) loaded, then the tail's forward; split_vs_longer_half) and split_why; and
the planner's choice among the three lean rows: plan_choice_ms, best_measured, regret_pct.
`correct`: the first token equals the transformers recompute run's (the prompt's top-2 margin keeps
bf16 rounding from flipping it) and every loaded chunk came from the tier; in fp32 (CPU) also its
logits within 1e-3 of that run's.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from kvtier.bench.suites.ttft_rig import Rig, regret


def lean_rows(rig: Rig, kvt, tier: str, n: int, runs):
    """Yield the lean rows of prefix n from `tier`; `runs` is the suite's `_runs`."""
    from kvtier.integrations.hf_split import read_options, split_cache
    from kvtier.integrations.lean import LeanRunner
    from kvtier.integrations.lean_costs import planner_options as lean_planner_options
    from kvtier.planner import plan

    lean = LeanRunner(rig.model)
    ids = rig.prompt(n)
    want = int(rig.reference[n][0, ids.shape[1]])  # the transformers recompute's first new token
    # With graphs the tail after a hit and a split's front replay CUDA graphs: no floor of their
    # own (the front only up to FRONT_GRAPH_TOKENS; a longer one computes longer than any floor).
    # A hit's fixed host cost is the lean runner's own, measured on first use (lean_costs.py).
    opts = rig.plan_opts | lean_planner_options(lean, rig.spec, rig.gpu, rig.plan_opts, rig.ceilings)
    if tier != "host":  # the tier's reads as the store's loads saw them (the rows before read from it)
        opts |= read_options(kvt.store, tier)
    p = plan(rig.spec, rig.gpu, tier, n, rig.new, rig.ceilings, chunk_tokens=rig.chunk, **opts)
    split = p.options["split"].recompute_tokens if "split" in p.options else None

    def recompute(ids):
        t0 = time.perf_counter()
        tok, logits = lean.first_token(ids)  # int(): the host has the token, so the GPU made it
        return tok, time.perf_counter() - t0, {"tiers": (), "front": n, "logits": logits}

    def load(ids):
        t0 = time.perf_counter()
        cache = kvt.cache(ids)
        tok, logits = lean.first_token(ids, cache)
        dt = time.perf_counter() - t0
        cache.finish(None)  # waits for the load, gives the blocks back; nothing new is saved
        return tok, dt, {"tiers": cache.hit_tiers, "front": 0, "logits": logits}

    def split_run(ids):
        t0 = time.perf_counter()
        tok, logits, cache = lean.split_first_token(kvt, ids, split)
        dt = time.perf_counter() - t0
        cache.finish(None)
        return tok, dt, {"tiers": cache.hit_tiers, "front": cache.front, "logits": logits}

    def front_alone(ids):  # the split's first half alone: the forward over [0, s)
        t0 = time.perf_counter()
        lean.prefill_kv(ids[:, :split])
        _sync(ids)  # the front's kernels ran: the host clock covers them
        return None, time.perf_counter() - t0, {}

    def back_alone(ids, front_kv):  # the second half alone: [s, n) loaded, then the tail's forward
        t0 = time.perf_counter()
        cache = split_cache(kvt, rig.model, ids, split, front=lambda _: front_kv)
        tok, _ = lean.first_token(ids, cache)
        dt = time.perf_counter() - t0
        cache.finish(None)
        return tok, dt, {}

    ms = rig.lean_ms.setdefault(n, {})
    modes = [("lean load", load, "load"), ("lean split", split_run, "split")]
    if "lean recompute" not in ms:
        modes.insert(0, ("lean recompute", recompute, "recompute"))
    for mode, fn, option in modes:
        case = f"{rig.label(n)} {mode}" + ("" if option == "recompute" else f" {tier}")
        if option == "split" and split is None:
            rig.ctx.skip(case, f"no split: a hit of {n} tokens has no chunk boundary inside it")
            continue
        t, toks, infos = runs(
            rig, case, fn, ids, before=None if option == "recompute" else rig.cold_host(kvt, tier)
        )
        ms[mode if option == "recompute" else f"{mode} {tier}"] = t.median_ms
        source_ok = all(list(i["tiers"]) == [tier] * ((n - i["front"]) // rig.chunk) for i in infos)
        diff = max(float((i["logits"] - rig.reference_logits[n]).abs().max()) for i in infos)
        # fp32 (CPU): the logits too, not only one token of a tiny random model; bf16: the token
        ok = all(tok == want for tok in toks) and source_ok and (rig.on_gpu or diff < 1e-3)
        row_tier = "-" if option == "recompute" else tier
        params = rig.params(n, row_tier, mode, p.options[option].ms, t.median_ms) | {
            "path": f"{mode} (LeanRunner)",
            "first_token_matches_recompute": all(tok == want for tok in toks),
            "source_ok": source_ok,
            "logits_max_abs_diff": diff,
            "graphs": lean.graphs,
            "gqa_flash": lean.gqa_flash,
            "captures": lean.captures,
            "capture_ms": lean.capture_s * 1e3,
            "plan_choice": p.choice,
            "plan_split_tokens": p.split_tokens,
            "planner_hit_fixed_ms": opts["hit_fixed_ms"],  # the lean runner's, not generate's
            **rig.read_params(p),
            "split_tokens": {"split": split, "recompute": n}.get(option, 0),
        }
        if option == "load":
            params |= _speedup(ms["lean recompute"], t.median_ms)
        if option == "split":
            cold = rig.cold_host(kvt, tier)
            front_t = runs(rig, f"{case} front alone", front_alone, ids)[0]
            front_kv = lean.prefill_kv(ids[:, :split])  # computed once, outside the timing
            back_t = runs(
                rig, f"{case} back alone", partial(back_alone, front_kv=front_kv), ids, before=cold
            )[0]
            del front_kv
            params |= _split(ms["lean recompute"], ms[f"lean load {tier}"], t.median_ms, front_t, back_t)
            lean_ms = {
                "recompute": ms["lean recompute"],
                "load": ms[f"lean load {tier}"],
                "split": t.median_ms,
            }
            params |= {"plan_choice_ms": lean_ms[p.choice]} | regret(lean_ms, lean_ms[p.choice])
        yield rig.ctx.row(
            case, rig.kv_bytes(n), t, "disk_read" if tier == "disk" else rig.link, correct=ok, **params
        )
    lean.pieces.clear()  # its graphs hold this KVTier's pages


def _speedup(recompute_ms: float, load_ms: float) -> dict:
    sp = recompute_ms / load_ms
    why = f"lean recompute {recompute_ms:.1f} ms / lean load {load_ms:.1f} ms = {sp:.1f}x"
    return dict(speedup_vs_recompute=sp, load_why=why)


def _split(recompute_ms: float, load_ms: float, split_ms: float, front, back) -> dict:
    """The split against the better of lean load and lean recompute, and against its two halves,
    each timed alone in this run (front: the forward over [0, s); back: [s, n) loaded, then the
    tail's forward): overlapped, the split takes about the longer one."""
    lo, ratio = min(recompute_ms, load_ms), max(recompute_ms, load_ms) / min(recompute_ms, load_ms)
    bound = max(front.median_ms, back.median_ms)
    why = (
        f"lean split {split_ms:.1f} ms vs min(load, recompute) {lo:.1f} ms; its halves alone: the "
        f"front {front.median_ms:.1f} ms, [s, n) loaded + the tail {back.median_ms:.1f} ms; "
        f"{split_ms / bound:.2f}x the longer"
    )
    return dict(
        split_vs_best=split_ms / lo,
        load_vs_recompute=ratio,
        split_why=why,
        split_front_ms=front.median_ms,
        split_back_ms=back.median_ms,
        split_vs_longer_half=split_ms / bound,
    )


def _sync(ids: torch.Tensor) -> None:
    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)
