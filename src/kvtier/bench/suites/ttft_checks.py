"""What the `ttft` suite measures a run with and derives from it: the tiers $KVTIER_TTFT_TIERS asks
for, the first token of a greedy generate (when it came out, its logits, their top-2 margin and the
MARGIN a prompt must clear), and `derived`: per prefix, the figures its rows carry beside their
own times (a load's speedup over recompute and the forward floor that bounds it, a split against
the better of load and recompute and what bounds it, the planner's regret). Plain values in,
params out: no verdict here (a user's machine is measured, not judged). Re-exported by `ttft_rig`.
"""

from __future__ import annotations

import time

import torch

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
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=clock,
            output_logits=True,
            return_dict_in_generate=True,
            **extra,
        )
    return out.sequences, clock.t_first, out.logits[0][0].float()


def margin(logits: torch.Tensor) -> float:
    """Gap between the two largest logits, in standard deviations of all of them."""
    top = logits.topk(2).values
    return float((top[0] - top[1]) / logits.std())


def derived(tier: str, rows: dict, ms: dict) -> None:
    """Into the params of one prefix's rows of `tier` (rows: mode -> row; ms: mode -> median ms,
    with "recompute" and, where measured, "floor": the forward over KV already on the device):

    load    speedup_vs_recompute; with a floor, forward_floor_ms and floor_bound_speedup
            (recompute / floor: no load through `generate` can beat it) and load_why
    split   split_vs_best (split / min(load, recompute)), load_vs_recompute (the larger of the two
            over the smaller) and split_why: what a split through `generate` cannot avoid
    choice  best_measured and regret_pct (the chosen option's time over the best, minus 1)
    """
    floor = ms.get("floor")
    if "load" in rows:
        sp = ms["recompute"] / ms["load"]
        why = f"recompute {ms['recompute']:.1f} ms / load {ms['load']:.1f} ms = {sp:.1f}x"
        if floor:
            why += (
                f"; the forward alone over KV already on the device takes {floor:.1f} ms, so no load "
                f"through generate can beat {ms['recompute'] / floor:.1f}x"
            )
            rows["load"].params.update(forward_floor_ms=floor, floor_bound_speedup=ms["recompute"] / floor)
        rows["load"].params.update(speedup_vs_recompute=sp, load_why=why)
    if "split" in rows:
        lo = min(ms["load"], ms["recompute"])
        ratio = max(ms["load"], ms["recompute"]) / lo
        why = f"split {ms['split']:.1f} ms vs min(load, recompute) {lo:.1f} ms"
        if tier == "host" and floor:
            why += (
                f"; a split runs two forwards and each takes at least the forward floor ({floor:.1f} ms), "
                f"so it cannot beat {2 * floor:.1f} ms"
            )
        elif tier != "host":
            f = f" ({floor:.1f} ms on the host rows)" if floor else ""
            why += (
                "; after [0, s) and the read of [s, n) from the tier (a thread beside it), generate runs a "
                f"second forward over the tail, whose fixed host cost (the forward floor{f}) the split pays "
                "on top"
            )
        rows["split"].params.update(split_vs_best=ms["split"] / lo, load_vs_recompute=ratio, split_why=why)
    if "choice" in rows:
        rows["choice"].params.update(regret(ms, ms["choice"]))


def regret(ms: dict, chosen_ms: float) -> dict:
    """best_measured (the fastest of recompute / load / split in `ms`) and regret_pct of `chosen_ms`."""
    opts = {k: ms[k] for k in ("recompute", "load", "split") if k in ms}
    best = min(opts, key=opts.get)
    return dict(best_measured=best, regret_pct=(chosen_ms / opts[best] - 1) * 100)
