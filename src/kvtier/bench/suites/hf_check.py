"""Token checks of the `hf` suite that tell a bf16 near-tie from wrong KV.

Random weights give nearly flat logits: on a GPU, two bf16 runs of the same prompt may pick
different greedy tokens where the top two logits are a rounding apart, and the recompute runs
themselves then disagree. A run passes when its tokens equal the reference's, or when at the
first token where they differ the reference's own logits rated the two within `TIE_STD` of their
spread (a near-tie). Wrong KV moves the logits far more than that, and is also caught bit for
bit by the suite's loaded-KV = saved-KV check.
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


def same_or_tie(got: list[int], ref: list[int], logits: list[torch.Tensor], tie_std: float = TIE_STD):
    """(passes, exact): `got` equals `ref`, or first differs where the reference saw a near-tie."""
    if len(got) != len(ref):
        return False, False
    i = next((i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b), None)
    if i is None:
        return True, True
    step = logits[i]
    margin = float(step[ref[i]] - step[got[i]])  # >= 0: the reference took its argmax
    return margin <= tie_std * float(step.std()), False


def summary(runs: list[list[int]], ref: list[int], logits: list[torch.Tensor]) -> dict:
    """`correct` (every run passes) and how many runs were exact / near-ties."""
    checks = [same_or_tie(t, ref, logits) for t in runs]
    return dict(
        correct=bool(checks) and all(ok for ok, _ in checks),
        exact_runs=sum(exact for _, exact in checks),
        near_tie_runs=sum(ok and not exact for ok, exact in checks),
        runs=len(checks),
    )
