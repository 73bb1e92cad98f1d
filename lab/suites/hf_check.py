"""Token checks of the `hf` suite that tell a bf16 near-tie from wrong KV.

Random weights give nearly flat logits: on a GPU, two bf16 runs of the same prompt may pick
different greedy tokens where the top two logits are a rounding apart, and the recompute runs
themselves then disagree. A run passes when its tokens equal the reference's, or when at the
first token where they differ the reference's own logits rated the two within `TIE_STD` of their
spread, or within twice the GPU's own run-to-run noise (`noise`: the largest logit move between
two runs of the same computation) — a near-tie. Wrong KV moves the logits far more than that,
and is also caught bit for bit by the suite's loaded-KV = saved-KV check.
"""

from __future__ import annotations

import torch

TIE_STD = 0.05  # a near-tie: the reference's top logit and the run's pick within 0.05 std


def reference(
    model, ids: torch.Tensor, new_tokens: int, kwargs: dict
) -> tuple[list[int], list[torch.Tensor]]:
    """The greedy tokens of one untimed run and the logits of every step (float32, CPU)."""
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             **kwargs)  # fmt: skip
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    return tokens, [step[0].float().cpu() for step in out.logits]


def margin_std(got: list[int], ref: list[int], logits: list[torch.Tensor]) -> float | None:
    """At the first token where `got` leaves `ref`: the reference's logit of its pick minus that of
    got's, in std of that step's logits (None: no divergence, or runs of other lengths)."""
    if len(got) != len(ref):
        return None
    i = next((i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b), None)
    if i is None:
        return None
    step = logits[i]
    return float(step[ref[i]] - step[got[i]]) / float(step.std())  # >= 0: the reference took its argmax


def same_or_tie(
    got: list[int], ref: list[int], logits: list[torch.Tensor], tie_std: float = TIE_STD, noise: float = 0.0
):
    """(passes, exact): `got` equals `ref`, or first differs at a near-tie of the reference's logits
    (within tie_std of their spread, or within 2 x noise: two logits each moved by up to `noise`)."""
    if len(got) != len(ref):
        return False, False
    m = margin_std(got, ref, logits)
    if m is None:
        return True, True
    i = next(i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b)
    return m <= tie_std or m * float(logits[i].std()) <= 2 * noise, False


def noise(a: tuple[list[int], list[torch.Tensor]], b: tuple[list[int], list[torch.Tensor]]) -> float:
    """The largest logit move between two runs (tokens, logits) of the same computation, over the
    steps both saw the same context (up to and including their first differing pick)."""
    (ta, la), (tb, lb) = a, b
    same = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta) - 1)
    return max(float((x - y).abs().max()) for x, y in zip(la[: same + 1], lb[: same + 1], strict=True))


def summary(runs: list[list[int]], ref: list[int], logits: list[torch.Tensor], noise: float = 0.0) -> dict:
    """`correct` (every run passes), how many runs were exact / near-ties, and the largest margin
    (std) at which a run left the reference."""
    checks = [same_or_tie(t, ref, logits, noise=noise) for t in runs]
    margins = [m for t in runs if (m := margin_std(t, ref, logits)) is not None]
    return dict(
        correct=bool(checks) and all(ok for ok, _ in checks),
        exact_runs=sum(exact for _, exact in checks),
        near_tie_runs=sum(ok and not exact for ok, exact in checks),
        runs=len(checks),
        worst_margin_std=max(margins, default=None),
    )
