"""`plan_request` without a calibration: the model's forward floor and prefill rate are measured on
first use, said once on stderr, kept per machine and model, and read back after (CPU, tiny model)."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from kvtier.bench.llama_rig import build_llama  # noqa: E402
from kvtier.ceilings import Ceilings  # noqa: E402
from kvtier.device import SimDevice  # noqa: E402
from kvtier.integrations import hf_costs  # noqa: E402
from kvtier.integrations.hf import KVTier  # noqa: E402
from kvtier.integrations.hf_split import plan_request  # noqa: E402
from kvtier.specs import GPU  # noqa: E402

CPU = GPU(
    "measured", "CPU", 2, 0, 0, 20.0, 0.2, 0.2, None, 4, "test", measured=("mem_bw_gbps", "bf16_tflops")
)
FIGURES = Ceilings(figures={"h2d_pinned_gbps": 10.0})


@pytest.fixture
def kvt_model(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    model = build_llama("tiny", "cpu", torch.float32, attn_implementation="sdpa")
    dev = SimDevice()
    kvt = KVTier.for_model(model, device=dev, num_blocks=64, block_size=16, model_id="t", chunk_tokens=64)
    yield kvt, model, tmp_path / "cache"
    kvt.close()
    dev.close()


def test_first_use_measures_once_says_so_and_plans_with_it(kvt_model, capsys):
    kvt, model, cache = kvt_model
    ids = torch.randint(1, 1000, (1, 300))
    p = plan_request(kvt, model, ids, CPU, FIGURES)
    err = capsys.readouterr().err
    assert "on first use" in err and "forward floor" in err
    files = list(cache.glob("model-costs-*.json"))
    assert len(files) == 1 and files[0] == hf_costs.cache_path(model)
    doc = json.loads(files[0].read_text())
    assert (
        doc["forward_floor_ms"] > 0
        and doc["prefill_ms"] > 0
        and doc["machine"]["shape"]["hidden_size"] == 128
    )
    floor0, _ = hf_costs.floor_line(doc)
    assert doc["forward_floor_ms"] / 2 <= floor0 <= doc["forward_floor_ms"]  # the floor at no cached token
    assert p.options["recompute"].ms >= floor0  # every forward: at least the floor
    again = plan_request(kvt, model, ids, CPU, FIGURES)
    assert capsys.readouterr().err == ""  # said once: read back from the file now
    assert again.predicted_ms == p.predicted_ms


def test_given_options_win_and_first_use_can_be_off(kvt_model, capsys):
    kvt, model, cache = kvt_model
    ids = torch.randint(1, 1000, (1, 300))
    given = dict(efficiency=1.0, forward_floor_ms=0.0, floor_ms_per_token=0.0, hit_fixed_ms=0.0)
    p = plan_request(kvt, model, ids, CPU, FIGURES, **given)
    assert not cache.exists() and capsys.readouterr().err == ""
    q = plan_request(kvt, model, ids, CPU, FIGURES, first_use=False)
    assert not cache.exists() and q.predicted_ms == p.predicted_ms


def test_a_calibration_keeps_the_first_use_growth_and_hit_cost(kvt_model, capsys):
    """A calibration gives the prefill rate and the floor; the floor's growth with the prefix and a
    hit's fixed cost it does not measure: those still come from first use."""
    kvt, model, cache = kvt_model
    ids = torch.randint(1, 1000, (1, 300))
    cal = dict(efficiency=1.0, forward_floor_ms=0.0)
    p = plan_request(kvt, model, ids, CPU, FIGURES, **cal)
    assert "on first use" in capsys.readouterr().err
    opts = hf_costs.planner_options(model, hf_costs_spec(model), CPU)
    assert opts["efficiency"] != 1.0 or opts["forward_floor_ms"] != 0.0  # the first-use ones differ
    same = plan_request(kvt, model, ids, CPU, FIGURES, **opts | cal)
    assert p.predicted_ms == same.predicted_ms and capsys.readouterr().err == ""


def test_a_stale_or_broken_file_is_measured_again(kvt_model, capsys):
    kvt, model, cache = kvt_model
    path = hf_costs.cache_path(model)
    path.parent.mkdir(parents=True)
    path.write_text("{")
    got = hf_costs.model_costs(model)
    assert "on first use" in capsys.readouterr().err and json.loads(path.read_text()) == got
    opts = hf_costs.planner_options(model, hf_costs_spec(model), CPU, costs=got)
    (p0, f0), (p1, f1) = got["floor_points"]
    assert 0 < opts["efficiency"] <= 1 and p0 < p1 and f0 == got["forward_floor_ms"]
    # the floor as a line through its two points, never falling with the prefix
    line = opts["forward_floor_ms"] + opts["floor_ms_per_token"] * p0
    assert opts["floor_ms_per_token"] >= 0 and (line == pytest.approx(f0) or opts["forward_floor_ms"] == 0)
    assert opts["hit_fixed_ms"] == got["hit_fixed_ms"] == max(0.0, got["hit_ms"] - f0)


def test_the_floor_line_and_the_hit_reach_the_plan(kvt_model):
    """planner_options of made-up costs: the floor's growth and the hit's cost are in the plan."""
    kvt, model, cache = kvt_model
    costs = {"prefill_tokens": 256, "prefill_ms": 1.0, "floor_points": [[256, 30.0], [8192, 40.0]]}
    opts = hf_costs.planner_options(model, hf_costs_spec(model), CPU, costs=costs | {"hit_fixed_ms": 9.0})
    assert opts["floor_ms_per_token"] == pytest.approx(10 / 7936)
    assert opts["forward_floor_ms"] == pytest.approx(30 - 256 * 10 / 7936)
    flat = hf_costs.planner_options(
        model,
        hf_costs_spec(model),
        CPU,
        costs=costs | {"floor_points": [[256, 30.0], [8192, 25.0]], "hit_fixed_ms": 0},
    )
    assert flat["floor_ms_per_token"] == 0 and flat["forward_floor_ms"] == 30.0  # noise never shrinks it


def hf_costs_spec(model):
    from kvtier.bench.calibrate import model_spec

    return model_spec(model)


def test_a_noisy_long_floor_point_never_extrapolates_the_floor_away():
    assert hf_costs.floor_line({"floor_points": [[256, 10.0], [512, 11.0]]}) == pytest.approx((9.0, 1 / 256))
    floor, slope = hf_costs.floor_line({"floor_points": [[256, 10.0], [512, 100.0]]})  # a noisy second run
    assert floor == pytest.approx(5.0) and slope == pytest.approx(10.0 / 512)
    assert hf_costs.floor_line({"floor_points": [[256, 10.0], [512, 8.0]]}) == (10.0, 0.0)  # never shrinks
