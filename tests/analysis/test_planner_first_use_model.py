"""The uncalibrated model against an H200 run of the `ttft` suite (lab/results/
nvidia-h200-2026-12-01-2.ttft-uncal.json): from the components measured there — the first-use
floor over 256 cached tokens, the suite's own floor over 8K (standing in for the first-use second
point), a host hit's fixed cost (the 2K lean host load less its predicted copy and tail) and the
run's ceilings — each host and remote row's prediction is within 25% of what was measured, where
the old model (one floor, no growth, no hit cost, no floor for a lean split's eager front) was not.
"""

import pytest

from kvtier.ceilings import Ceilings
from kvtier.planner import plan
from kvtier.specs import apply_ceilings, gpu_from_device_name

RUN = Ceilings(
    figures={
        "h2d_pinned_gbps": 55.33,
        "d2h_pinned_gbps": 55.16,
        "d2d_copy_gbps": 4264.4,
        "bf16_tflops": 769.4,  # the run's probe, as its 32K recompute prediction implies
        "disk_read_gbps": 1.666,
        "redis_loopback_get_gbps": 2.0,
    },
    gpu="NVIDIA H200",
)
GPU = apply_ceilings(gpu_from_device_name("NVIDIA H200"), RUN)
EFFICIENCY = 0.6354  # the first-use prefill rate of that run
FLOOR_256, FLOOR_8K = 32.65, 42.8  # ms: first use over 256 cached tokens; the suite over 8192
HIT = 14.6 - 5.0  # ms: the 2K lean host load, less the copy and tail the planner predicts for it
SLOPE = (FLOOR_8K - FLOOR_256) / (8192 - 256)
NEW = dict(forward_floor_ms=FLOOR_256 - 256 * SLOPE, floor_ms_per_token=SLOPE, hit_fixed_ms=HIT)
# The lean runner: its tail replays graphs (no floor of its own), its front is an eager forward.
NEW_LEAN = NEW | {"tail_floor_ms": 0.0}
OLD, OLD_LEAN = dict(forward_floor_ms=FLOOR_256), dict(forward_floor_ms=0.0)  # the old lean: none

# (prefix, tier, option, lean, measured ms)
ROWS = [
    (2048, "host", "load", False, 59.4),
    (2048, "host", "split", False, 75.4),
    (2048, "host", "lean load", True, 14.6),
    (2048, "host", "lean split", True, 50.6),
    (8192, "host", "load", False, 54.4),
    (8192, "host", "split", False, 87.7),
    (8192, "host", "lean load", True, 28.1),
    (8192, "host", "lean split", True, 58.7),
    (32768, "host", "load", False, 114.9),
    (32768, "host", "lean load", True, 102.2),
    (32768, "host", "lean split", True, 154.5),
    (2048, "remote", "split", False, 91.2),
    (2048, "remote", "lean split", True, 69.6),
    (8192, "remote", "split", False, 223.2),
    (32768, "remote", "split", False, 925.8),
]


def predicted(n: int, tier: str, option: str, lean: bool, new: bool) -> float:
    costs = (NEW_LEAN if lean else NEW) if new else (OLD_LEAN if lean else OLD)
    p = plan("llama-3-8b", GPU, tier, n, 64, RUN, EFFICIENCY, chunk_tokens=256, **costs)
    return p.options[option.removeprefix("lean ")].ms


@pytest.mark.parametrize("n,tier,option,lean,measured", ROWS)
def test_within_a_quarter_of_the_run(n, tier, option, lean, measured):
    assert abs(predicted(n, tier, option, lean, new=True) / measured - 1) <= 0.25


def test_the_old_model_missed_most_of_them():
    misses = [r for r in ROWS if abs(predicted(*r[:4], new=False) / r[4] - 1) > 0.25]
    assert len(misses) >= 8


def test_the_floor_grows_with_the_prefix_and_a_hit_costs_its_fixed_part():
    base = plan("llama-3-8b", GPU, "host", 32768, 64, RUN, EFFICIENCY, forward_floor_ms=30.0)
    grown = plan(
        "llama-3-8b", GPU, "host", 32768, 64, RUN, EFFICIENCY, forward_floor_ms=30.0, floor_ms_per_token=1e-3
    )
    assert grown.options["load"].new_ms == pytest.approx(30.0 + 32.768)
    assert base.options["recompute"].ms == grown.options["recompute"].ms  # a prefill from scratch
    hit = plan("llama-3-8b", GPU, "host", 32768, 64, RUN, EFFICIENCY, forward_floor_ms=30.0, hit_fixed_ms=7.0)
    assert hit.options["load"].ms == pytest.approx(base.options["load"].ms + 7.0)
    assert hit.options["split"].ms == pytest.approx(base.options["split"].ms + 7.0)
    assert hit.options["recompute"].ms == base.options["recompute"].ms


def test_a_graph_tail_keeps_the_eager_front_floor():
    p = plan("llama-3-8b", GPU, "host", 2048, 64, RUN, EFFICIENCY, forward_floor_ms=30.0, tail_floor_ms=0.0)
    assert p.options["load"].new_ms < 30.0 and p.options["split"].recompute_ms >= 30.0
    with pytest.raises(ValueError, match="tail_floor_ms"):
        plan("llama-3-8b", GPU, "host", 2048, 64, RUN, tail_floor_ms=-1.0)


def test_a_graphed_tail_and_front_pay_no_per_forward_overhead():
    """A calibration's prefill overhead is generate's fixed cost per forward: a graph replay pays
    none, so a runner that graphs its tail (and front) passes 0 for them; recompute keeps it."""
    kw = dict(forward_floor_ms=0.0, prefill_overhead_ms=10.0)
    eager = plan("llama-3-8b", GPU, "host", 2048, 64, RUN, EFFICIENCY, **kw)
    graphed = plan(
        "llama-3-8b",
        GPU,
        "host",
        2048,
        64,
        RUN,
        EFFICIENCY,
        tail_overhead_ms=0.0,
        front_overhead_ms=0.0,
        **kw,
    )
    assert eager.options["load"].new_ms == pytest.approx(graphed.options["load"].new_ms + 10.0)
    assert eager.options["split"].recompute_ms == pytest.approx(graphed.options["split"].recompute_ms + 10.0)
    assert eager.options["recompute"].ms == graphed.options["recompute"].ms
    with pytest.raises(ValueError, match="tail_overhead_ms"):
        plan("llama-3-8b", GPU, "host", 2048, 64, RUN, tail_overhead_ms=-1.0)
