"""The hf suite's token check: exact, a bf16 near-tie, or wrong."""

import pytest
import torch

from lab.suites.hf_check import noise, same_or_tie, summary


def _logits(top: int, second: int, gap: float) -> list[torch.Tensor]:
    step = torch.linspace(-1, 1, 100)  # std ~0.58
    step[top], step[second] = 3.0, 3.0 - gap
    return [step.clone() for _ in range(4)]


def test_exact_tie_and_wrong():
    ref = [5, 6, 7, 8]
    near = _logits(5, 9, gap=0.01)  # 0.01 < 0.05 std: a near-tie at step 0
    assert same_or_tie(ref, ref, near) == (True, True)
    assert same_or_tie([9, 1, 2, 3], ref, near) == (True, False)  # diverged at a near-tie
    far = _logits(5, 9, gap=1.0)
    assert same_or_tie([9, 1, 2, 3], ref, far) == (False, False)  # a clear winner was not taken
    assert same_or_tie([5, 6, 7], ref, near) == (False, False)  # a short run never passes


def test_summary_counts():
    ref, near = [5, 6, 7, 8], _logits(5, 9, gap=0.01)
    s = summary([[5, 6, 7, 8], [9, 0, 0, 0]], ref, near)
    assert s == dict(
        correct=True,
        exact_runs=1,
        near_tie_runs=1,
        runs=2,
        worst_margin_std=pytest.approx(0.01 / float(near[0].std())),  # the margin at step 0, in std
    )
    assert summary([], ref, near)["correct"] is False  # no run: nothing shown correct


def test_gpu_noise_widens_the_tie_and_is_measured_where_contexts_agree():
    ref, far = [5, 6, 7, 8], _logits(5, 9, gap=0.2)  # ~0.3 std: no tie by the std rule
    assert same_or_tie([9, 1, 2, 3], ref, far) == (False, False)
    assert same_or_tie([9, 1, 2, 3], ref, far, noise=0.09) == (False, False)  # 2 x 0.09 < 0.2
    assert same_or_tie([9, 1, 2, 3], ref, far, noise=0.11) == (True, False)  # each logit moved by 0.11
    a = [x.clone() for x in far]
    b = [x.clone() for x in far]
    b[0][3] += 0.05  # step 0: the same context, a small move
    b[2][4] += 9.0  # step 2: after the runs picked differently at step 1, not noise
    assert noise(([5, 6, 7, 8], a), ([5, 1, 7, 8], b)) == pytest.approx(0.05)
    assert noise(([5, 6, 7, 8], a), ([5, 6, 7, 8], a)) == 0.0
