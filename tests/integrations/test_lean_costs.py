"""`lean_costs`: the lean runner's hit measured on first use (a one-chunk host hit), said once,
kept per machine and model, and turned into the planner's hit cost (CPU, tiny model)."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from kvtier.bench.llama_rig import build_llama  # noqa: E402
from kvtier.ceilings import Ceilings  # noqa: E402
from kvtier.integrations import lean_costs  # noqa: E402
from kvtier.integrations.lean import LeanRunner  # noqa: E402
from kvtier.planner import plan  # noqa: E402
from kvtier.specs import GPU  # noqa: E402

CPU = GPU(
    "measured", "CPU", 2, 0, 0, 20.0, 0.2, 0.2, None, 4, "test", measured=("mem_bw_gbps", "bf16_tflops")
)
FIGURES = Ceilings(figures={"h2d_pinned_gbps": 10.0})


def test_measured_once_said_once_and_planned_with(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    model = build_llama("tiny", "cpu", torch.float32, attn_implementation="sdpa")
    lean = LeanRunner(model)
    doc = lean_costs.lean_costs(lean)
    assert "lean runner's hit" in capsys.readouterr().err
    assert lean_costs.cache_path(lean).exists() and doc["hit_ms"] > 0 and doc["machine"]["graphs"] is False
    assert lean_costs.lean_costs(lean) == doc and capsys.readouterr().err == ""  # read back, not said again
    assert not lean.pieces  # the throwaway KVTier's graphs (none on the CPU) are not kept

    from kvtier.bench import calibrate

    spec = calibrate.model_spec(model)
    base = dict(efficiency=1.0, forward_floor_ms=5.0, prefill_overhead_ms=3.0)  # a calibration's overhead
    opts = lean_costs.planner_options(lean, spec, CPU, base, FIGURES)
    assert opts["tail_floor_ms"] == opts["tail_overhead_ms"] == 0.0
    assert "front_floor_ms" not in opts and "front_overhead_ms" not in opts  # no graphs: an eager front
    tail = {"tail_floor_ms": 0.0, "tail_overhead_ms": 0.0}
    bare = plan(spec, CPU, "host", 256, 16, FIGURES, chunk_tokens=256, **base | tail)
    assert opts["hit_fixed_ms"] == pytest.approx(max(0.0, doc["hit_ms"] - bare.options["load"].ms))
    # a slower measured hit is a larger fixed cost, never a negative one
    slow = lean_costs.planner_options(
        lean, spec, CPU, base, FIGURES, costs=doc | {"hit_ms": doc["hit_ms"] + 50}
    )
    assert slow["hit_fixed_ms"] == pytest.approx(max(0.0, doc["hit_ms"] + 50 - bare.options["load"].ms))
    fast = lean_costs.planner_options(lean, spec, CPU, base, FIGURES, costs=doc | {"hit_ms": 0.0})
    assert fast["hit_fixed_ms"] == 0.0


def test_a_stale_file_is_measured_again(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    model = build_llama("tiny", "cpu", torch.float32, attn_implementation="sdpa")
    lean = LeanRunner(model)
    path = lean_costs.cache_path(lean)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kvtier_lean_costs": 0}))
    doc = lean_costs.lean_costs(lean)
    assert doc["kvtier_lean_costs"] == lean_costs.FORMAT and "on first use" in capsys.readouterr().err
    path.write_text("{not json")
    assert lean_costs.lean_costs(lean)["hit_ms"] > 0
