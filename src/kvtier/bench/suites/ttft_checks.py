"""What the `ttft` suite checks a run against: the tiers $KVTIER_TTFT_TIERS asks for, the first
token of a greedy generate (when it came out, its logits, their top-2 margin and the MARGIN a prompt
must clear), and the P8 / P9 / regret checks that `checks` writes into a prefix's rows. Re-exported
by `ttft_rig`, where the `Rig` that uses them lives.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvtier.bench.suites.ttft_rig import Rig

P8_SPEEDUP, P9_FACTOR, P9_WITHIN = 8.0, 0.9, 3.0
# The first token's top-2 logit gap, in std of the logits: several times what bf16 rounding moves a
# logit by (an estimate; each row records the real move as logits_max_abs_diff).
MARGIN = 0.05


def tiers_asked(text: str | None) -> tuple[str, ...]:
    """The tiers $KVTIER_TTFT_TIERS names (comma-separated), in the suite's order; all by default."""
    known = ("host", "disk", "remote")
    if not text:
        return known
    asked = {t.strip() for t in text.split(",") if t.strip()}
    if not asked or asked - set(known):
        raise ValueError(f"KVTIER_TTFT_TIERS: expected a comma-separated subset of {known}, got {text!r}")
    return tuple(t for t in known if t in asked)


class _FirstToken:
    """A generate() streamer noting when the first new token comes out (the prompt comes first)."""

    def __init__(self) -> None:
        self.calls, self.t_first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # the token exists once the GPU has made it, not when queued
            self.t_first = time.perf_counter()

    def end(self) -> None:
        pass


def first_token(model, ids, cache, new_tokens: int):
    """(tokens [1, prompt + new], perf_counter() when the first new token came out, that token's
    logits [vocab] in fp32) of a greedy generate."""
    from kvtier.integrations.hf import cache_kwarg

    extra = {} if cache is None else {cache_kwarg(model): cache}
    clock = _FirstToken()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=clock,
                             output_logits=True, return_dict_in_generate=True, **extra)  # fmt: skip
    return out.sequences, clock.t_first, out.logits[0][0].float()


def margin(logits: torch.Tensor) -> float:
    """Gap between the two largest logits, in standard deviations of all of them."""
    top = logits.topk(2).values
    return float((top[0] - top[1]) / logits.std())


def checks(rig: Rig, n: int, tier: str, rows: dict, ms: dict) -> None:
    """P8 on the host load row, P9 on the split row, regret on the choice row (params)."""
    dry = None if rig.on_gpu and rig.shape == "llama-3-8b" else f"dry run ({rig.shape} on {rig.ctx.device})"
    if tier == "host" and "load" in rows:
        sp = ms["recompute"] / ms["load"]
        why = f"recompute {ms['recompute']:.1f} ms / load {ms['load']:.1f} ms = {sp:.1f}x (target >= 8x)"
        status = "pass" if sp >= P8_SPEEDUP else "miss"
        bound = ms["recompute"] / ms["floor"] if ms.get("floor") else None
        if bound is not None:
            why += (f"; the forward alone over KV already on the GPU takes {ms['floor']:.1f} ms, so no load "
                    f"through generate can beat {bound:.1f}x")  # fmt: skip
            rows["load"].params.update(forward_floor_ms=ms["floor"], p8_bound=bound)
        if dry or n < 8192:
            why, status = f"{dry or 'a prefix under 8K'}, not P8's case: would be {status}: {why}", "n/a"
        rows["load"].params.update(p8=status, p8_speedup=sp, p8_why=why)
    if "split" in rows:
        lo = min(ms["load"], ms["recompute"])
        ratio = max(ms["load"], ms["recompute"]) / lo
        split = ms["split"]
        if ratio > P9_WITHIN:
            status = "n/a"
            why = (
                f"load-only {ms['load']:.1f} ms and recompute-only {ms['recompute']:.1f} ms are not within 3x"
            )
            why += f" ({ratio:.1f}x): P9 does not apply"
            rig.ctx.skip(f"P9 {rig.label(n)} {tier}", why)
        else:
            status = "pass" if split <= P9_FACTOR * lo else "miss"
            why = f"split {split:.1f} ms vs 0.9 x min(load, recompute) = {P9_FACTOR * lo:.1f} ms"
            if status == "miss" and tier == "host" and ms.get("floor"):
                why += (f"; a split runs two forwards and each takes at least the forward floor "
                        f"({ms['floor']:.1f} ms), so it cannot beat {2 * ms['floor']:.1f} ms")  # fmt: skip
            if status == "miss" and tier != "host":
                f = f" ({ms['floor']:.1f} ms on the host rows)" if ms.get("floor") else ""
                why += ("; after [0, s) and the read of [s, n) from the tier (a thread beside it), generate "
                        f"runs a second forward over the tail, whose fixed host cost (the forward floor{f}) "
                        "the split pays on top")  # fmt: skip
            if dry:
                why, status = f"{dry}, not P9's H200 case: would be {status}: {why}", "n/a"
        rows["split"].params.update(p9=status, p9_ratio=ratio, p9_why=why, p9_vs_best=split / lo)
    if "choice" in rows:
        opts = {k: ms[k] for k in ("recompute", "load", "split") if k in ms}
        best = min(opts, key=opts.get)
        rows["choice"].params.update(best_measured=best, regret_pct=(ms["choice"] / opts[best] - 1) * 100)
