"""The planner's split search is bounded (O(log chunks) predictions, whatever --matched is) and
picks exactly what trying every chunk boundary picks: the least predicted time, the smallest
split among equals. The reference spells out the split's model: the front beside the tier's
read, then the copies under the new tokens."""

import itertools

import pytest

from kvtier import roofline
from kvtier.models import get_model
from kvtier.planner import MAX_TOKENS, overlap, plan, tier_path, transfer_parts
from kvtier.specs import get_gpu


def _every_boundary(model, gpu, tier, n, m, chunk, eff, overhead, floor):
    """(ms, s) of the best split, trying each boundary: the reference."""
    p = tier_path(gpu, tier)

    def pre(tokens, prefix=0):
        ms = roofline.prefill(model, gpu, tokens, prefix, efficiency=eff).ms + overhead
        return max(ms, floor)

    new = pre(m, n)
    best = None
    for s in range(chunk, n, chunk):
        read, copy = transfer_parts(p, n - s, model.kv_bytes_per_token())
        t = (max(pre(s), read) + overlap(copy, new, model.layers), s)
        best = t if best is None else min(best, t)
    return best


CASES = list(
    itertools.product(
        ["llama-3-8b", "llama-3-70b", "deepseek-v3"],
        ["h100-sxm", "l40s"],
        ["host", "disk", "remote"],
        [2, 3, 17, 64, 200],  # chunks matched
        [1, 900],  # new tokens
        [(1.0, 0.0, 0.0), (0.4, 2.0, 30.0)],  # efficiency, overhead ms, floor ms
    )
)


@pytest.mark.parametrize("case", CASES[::7] + CASES[3::11])
def test_the_bounded_search_picks_what_trying_every_boundary_picks(case):
    model_key, gpu_key, tier, chunks, m, (eff, overhead, floor) = case
    model, gpu, chunk = get_model(model_key), get_gpu(gpu_key), 64
    costs = dict(efficiency=eff, prefill_overhead_ms=overhead, forward_floor_ms=floor)
    got = plan(model, gpu, tier, chunks * chunk, m, chunk_tokens=chunk, **costs)
    ms, s = _every_boundary(model, gpu, tier, chunks * chunk, m, chunk, eff, overhead, floor)
    assert (got.options["split"].ms, got.options["split"].recompute_tokens) == (ms, s)


@pytest.mark.timeout(20)
def test_a_huge_hit_costs_a_logarithmic_number_of_predictions(monkeypatch):
    calls = []
    real = roofline.prefill

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("kvtier.planner.prefill", counted)
    p = plan("llama-3-8b", "h100-sxm", "host", 1 << 20, 10, chunk_tokens=256)  # 4096 chunks
    assert p.choice in ("load", "split") and len(calls) < 100  # every boundary: 4096 calls
    calls.clear()
    p = plan("llama-3-8b", "h100-sxm", "disk", MAX_TOKENS, 10, chunk_tokens=256)  # 2**32 chunks
    s = p.options["split"].recompute_tokens
    assert len(calls) < 200 and 0 < s < MAX_TOKENS


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(matched_tokens=MAX_TOKENS + 256), "matched_tokens"),
        (dict(matched_tokens=2**80), "matched_tokens"),
        (dict(new_tokens=2**60), "new_tokens"),
        (dict(chunk_tokens=2**60, matched_tokens=0), "chunk_tokens"),
        (dict(efficiency=float("nan")), "efficiency"),
        (dict(efficiency=True), "efficiency"),
    ],
)
def test_absurd_sizes_are_refused_naming_the_argument(kwargs, name):
    args = dict(matched_tokens=512, new_tokens=10) | kwargs
    with pytest.raises(ValueError, match=name):
        plan("llama-3-8b", "h100-sxm", "host", **args)
