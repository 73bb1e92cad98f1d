"""The `ttft` suite: time to first token of a prefix hit, each way of getting the prefix's KV,
beside the planner's prediction (`kvtier.planner`, `integrations.hf_split`).

A prompt is a random prefix of n tokens and m = 64 new ones (CPU / --quick: 16). On a GPU the
model is the Llama-3-8B shape in bf16 with random weights, n = 2K, 8K, 32K; on the CPU, or with
--quick, the tiny Llama in fp32 (greedy ties are not decided by rounding), n = 256, 512 (CPU
without --quick: 512, 1024). Per n and tier, after one cold request saved the prefix:

  recompute  transformers' generate with a DynamicCache: n + m tokens prefilled (one row per n)
  load       `kvt.cache`: the n tokens load from the tier, layer by layer under the m new ones
  split      `split_cache` at the planner's split point s: [0, s) recomputed while [s, n) loads
  choice     `plan_request` (timed too), then the option it chose

plus the lean rows (`ttft_lean.py`: kvtier's own first-token forward — recompute once per n, load
and split per tier — like against like without transformers' per-forward host cost), and, beside
the host load row, the floor: the same generate over a DynamicCache that already holds the prefix
(no transfer; params forward_floor_ms, floor_bound_speedup = recompute / floor).

Tiers: host (the pinned pool); disk (`DiskTier` in a temp dir under $KVTIER_BENCH_DIR, O_DIRECT
where the filesystem allows, else its files dropped from the page cache before each run); remote
(`ThrottledTier` over a `MemoryTier`, reads at $KVTIER_TTFT_REMOTE_GBPS, default 2 GB/s; CPU:
0.05). Before each run of a lower tier the host is emptied, so every chunk comes from the tier.
$KVTIER_TTFT_TIERS (comma-separated, default host,disk,remote) measures only those tiers.

TTFT: perf_counter from before the request (lookup and plan included) to the first new token out
of generate (a streamer; torch.cuda.synchronize first); one warm-up and 5 timed runs (quick: 3):
the row's median, and p90 / p99 in params.timing (with so few runs, p99 is near the slowest).
Rows: bytes = KV bytes of the prefix; ceiling h2d_pinned (GPU) or host_memcpy (CPU),
disk_read for disk rows (gbps = prefix KV bytes / TTFT). Params: predicted_ms (the planner with
this run's ceilings: device copy, bf16 matmul, pinned H2D, disk read, throttle rate as the remote's
GET hop; each row planned just before its runs, from a lookup of the prefix in its tier; a
lower tier's read at the rate the store measured on its earlier loads from it, once it has read
from it: params planner_read_gbps, planner_read_source),
error_pct = predicted / measured - 1, calibrated (whether a
calibration file fed the planner) and planner_costs (where its per-model costs came from), the
plan's choice and split, and plan_why (the plan's one line). `correct`: every run's tokens equal
the recompute run's and every loaded chunk came from the tier. Figures derived across a prefix's
rows (`ttft_checks.derived`): speedup_vs_recompute on load rows (with the floor's bound on the
host), split_vs_best and load_vs_recompute on split rows, best_measured and regret_pct on choice rows.
$KVTIER_CALIBRATION=FILE (from `kvtier calibrate --save`) gives the planner the fitted prefill
TFLOP/s, fixed cost of a forward, forward floor and H2D GB/s; without one, `plan_request` measures
the model's forward floor (at two cached lengths), a host hit's fixed cost and the prefill rate on
first use (`integrations.hf_costs`; params planner_floor_ms_per_token, planner_hit_fixed_ms).
"""

from __future__ import annotations

import gc
import time
from contextlib import ExitStack

import torch

from kvtier.bench.profile import stage
from kvtier.bench.stats import summarize
from kvtier.bench.suite import Context, register
from kvtier.bench.suites.ttft_rig import Rig, derived, first_token

MODES = ("load", "split", "choice")


@register("ttft", needs_gpu=False, description="time to first token: recompute / load / split vs the planner")
def ttft(ctx: Context):
    with ExitStack() as stack:
        rig = Rig(ctx, stack)
        for n in rig.prefixes:
            rig.recompute[n] = _runs(rig, f"{n} recompute", lambda ids: _recompute(rig, ids), rig.prompt(n))
        yield from _recompute_rows(rig)
        for tier in rig.tiers:
            with ExitStack() as tstack:
                kvt = rig.kvtier(tier, tstack)
                if kvt is None:
                    continue
                for n in rig.prefixes:
                    yield from _tier_rows(rig, kvt, tier, n)
            gc.collect()
            if rig.on_gpu:
                torch.cuda.empty_cache()  # this tier's paged cache goes before the next one's


def _recompute(rig: Rig, ids):
    t0 = time.perf_counter()
    out, t1, logits = first_token(rig.model, ids, None, rig.new_out)
    return out, t1 - t0, {"logits": logits}


def _request(rig: Rig, kvt, ids, how: str, split: int = 0):
    """One request the way `how` says; (tokens, TTFT s, what it did)."""
    from kvtier.integrations.hf_split import plan_request, split_cache

    t0 = time.perf_counter()
    info = {}
    if how == "choice":
        p = plan_request(kvt, rig.model, ids, rig.gpu, rig.ceilings, **rig.plan_opts)
        how, split, info = p.choice, p.split_tokens, {"choice": p.choice, "split_tokens": p.split_tokens}
        if how == "recompute":
            out, t1, logits = first_token(rig.model, ids, None, rig.new_out)
            return out, t1 - t0, info | {"tiers": (), "logits": logits}
    cache = kvt.cache(ids) if how == "load" else split_cache(kvt, rig.model, ids, split)
    out, t1, logits = first_token(rig.model, ids, cache, rig.new_out)
    cache.finish(None)  # waits for the load, gives the blocks back; nothing new is saved
    return out, t1 - t0, info | {"tiers": cache.hit_tiers, "front": cache.front, "logits": logits}


def _runs(rig: Rig, name: str, once, ids, before=None):
    """Warm-up + timed runs of `once(ids)`; (Timing, outputs, infos)."""
    samples, outs, infos = [], [], []
    if rig.ctx.on_progress:
        rig.ctx.on_progress(name)
    with stage(f"ttft/{name}"):
        for i in range(rig.warmup + rig.reps):
            if before is not None:
                before()
            if rig.on_gpu:
                torch.cuda.synchronize()  # the previous run's GPU work must not be billed to this one
            out, s, info = once(ids)
            outs.append(out)
            infos.append(info)
            if i >= rig.warmup:
                samples.append(s * 1e3)
    return summarize(samples, "perf_counter"), outs, infos


def _recompute_rows(rig: Rig):
    for n in rig.prefixes:
        t, outs, infos = rig.recompute[n]
        rig.reference[n] = outs[0]
        rig.reference_logits[n] = infos[0]["logits"]
        same = all(torch.equal(o, outs[0]) for o in outs)
        p = rig.plan(n)
        pred = p.options["recompute"].ms
        params = rig.params(n, "-", "recompute", pred, t.median_ms) | {"path": "recompute (DynamicCache)"}
        yield rig.ctx.row(f"{rig.label(n)} recompute", rig.kv_bytes(n), t, rig.link, correct=same, **params)


def _tier_rows(rig: Rig, kvt, tier: str, n: int):
    ids = rig.prompt(n)
    why = rig.too_slow(tier, n) or rig.cold(kvt, tier, ids, rig.reference[n])
    if why is not None:
        for mode in MODES:
            rig.ctx.skip(f"{rig.label(n)} {mode} {tier}", why)
        return
    from kvtier.integrations.hf_split import plan_request

    measured = {"recompute": rig.recompute[n][0].median_ms}
    if tier == "host":
        measured["floor"] = rig.floor_ms[n] = _floor(rig, n)
    elif n in rig.floor_ms:
        measured["floor"] = rig.floor_ms[n]  # the why of a split's miss cites it
    rows = {}
    for mode in MODES:
        case = f"{rig.label(n)} {mode} {tier}"
        # Planned as a request is, from a lookup: with the prefix back in the tier alone (the
        # rows before promoted what they read into the host).
        before = rig.cold_host(kvt, tier)
        if before is not None:
            before()
        plan = plan_request(kvt, rig.model, ids, rig.gpu, rig.ceilings, **rig.plan_opts)
        if mode == "split" and "split" not in plan.options:
            rig.ctx.skip(case, f"no split: a hit of {n} tokens has no chunk boundary inside it")
            continue
        pred = plan.ms if mode == "choice" else plan.options[mode].ms
        s = plan.options["split"].recompute_tokens if mode == "split" else 0
        t, outs, infos = _runs(
            rig,
            case,
            lambda ids, m=mode, s=s: _request(rig, kvt, ids, m, s),
            ids,
            before=before,
        )
        measured[mode] = t.median_ms
        tokens_ok, ref = all(torch.equal(o, rig.reference[n]) for o in outs), rig.reference_logits[n]
        source_ok = all(list(i["tiers"]) == _expected(i, mode, tier, n, rig.chunk) for i in infos)
        p = rig.params(n, tier, mode, pred, t.median_ms) | {
            "path": f"{mode} from {tier}",
            "plan_choice": plan.choice,
            "plan_split_tokens": plan.split_tokens,
            **rig.read_params(plan),
            "split_tokens": infos[-1].get("split_tokens", s) if mode != "load" else 0,
            "tokens_identical": tokens_ok,
            "source_ok": source_ok,
            "logits_max_abs_diff": max(float((i["logits"] - ref).abs().max()) for i in infos),
            "chunks_by_source": ",".join(sorted({x for i in infos for x in i["tiers"]})) or "-",
        }
        ceiling = "disk_read" if tier == "disk" else rig.link
        rows[mode] = rig.ctx.row(case, rig.kv_bytes(n), t, ceiling, correct=tokens_ok and source_ok, **p)
    derived(tier, rows, measured)
    yield from rows.values()
    from kvtier.bench.suites.ttft_lean import lean_rows

    yield from lean_rows(rig, kvt, tier, n, _runs)


def _floor(rig: Rig, n: int) -> float:
    """Median ms of the same generate over a DynamicCache already holding the n-token prefix (made
    untimed): the first token with no transfer at all, the least any load through generate takes."""
    from transformers import DynamicCache

    def once(ids):
        cache = DynamicCache()
        with torch.no_grad():
            rig.model(ids[:, :n], past_key_values=cache, use_cache=True)
        if rig.on_gpu:
            torch.cuda.synchronize()  # the prefix's KV exists before the clock starts
        t0 = time.perf_counter()
        out, t1, _ = first_token(rig.model, ids, cache, rig.new_out)
        return out, t1 - t0, {}

    return _runs(rig, f"{rig.label(n)} forward floor", once, rig.prompt(n))[0].median_ms


def _expected(info: dict, mode: str, tier: str, n: int, chunk: int) -> list[str]:
    """The source of every chunk a run should have loaded: [s, n) from `tier` (none if recomputed)."""
    if info.get("choice", mode) == "recompute":
        return []
    return [tier] * ((n - info["front"]) // chunk)


def markdown(doc: dict) -> str:
    """The ttft rows of a result file as a table: measured vs predicted TTFT, whether a calibration
    fed the prediction, and the figures derived across a prefix's rows.

    python -c "import sys; from kvtier.bench import result; from kvtier.bench.suites.ttft import markdown;
    print(markdown(result.load(sys.argv[1])))" kvtier-results/<file>.json"""
    lines = [
        "| case | TTFT ms | predicted ms | error | calibrated | s (recomputed) | plan | vs others "
        "| correct |",
        "|" + " --- |" * 9,
    ]
    for r in (r for r in doc["rows"] if r["suite"] == "ttft"):
        p = r["params"]
        plan = f"{p['plan_choice']} (s={p['plan_split_tokens']})" if "plan_choice" in p else "-"
        ms = f"{r['median_ms']:,.1f} | {p['predicted_ms']:,.1f} | {p['error_pct']:+.0f}%"
        s = p.get("split_tokens", p["prefix_tokens"])
        cal = p.get("calibrated", "-")
        lines.append(f"| {r['case']} | {ms} | {cal} | {s} | {plan} | {compared(p)} | {r['correct']} |")
    keys = ("load_why", "split_why")
    whys = [
        f"- {r['case']}: {r['params'][k]}"
        for r in doc["rows"]
        if r["suite"] == "ttft"
        for k in keys
        if k in r["params"]
    ]
    return "\n".join(lines + [""] + whys)


def compared(p: dict) -> str:
    """A row's figure against the prefix's other rows: speedup, split vs the best, or regret."""
    out = []
    if "speedup_vs_recompute" in p:
        out.append(f"{p['speedup_vs_recompute']:.1f}x recompute")
    if "split_vs_best" in p:
        out.append(f"{p['split_vs_best']:.2f}x min(load, recompute)")
    if "regret_pct" in p:
        out.append(f"regret {p['regret_pct']:+.0f}% ({p['best_measured']} fastest)")
    return "; ".join(out)
