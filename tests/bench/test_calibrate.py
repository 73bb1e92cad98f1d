"""`kvtier calibrate` on the CPU (tiny model, --quick): the fit, the points' structure before and
after calibration, a `why` for every miss, the saved file, and bad input exiting 2."""

import json
import math

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers")

import kvtier.cli.calibrate  # noqa: E402, F401 - registers the command
from kvtier.bench import calibrate  # noqa: E402
from kvtier.bench.calibrate_fit import QUANTITIES, Point, assign_roles, fit, why  # noqa: E402
from kvtier.bench.calibrate_fit import calibrate as fit_points  # noqa: E402
from kvtier.cli import cli  # noqa: E402

ON_GPU = torch.cuda.is_available()


def _run(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_fit_recovers_overhead_and_efficiency():
    pairs = [(p, 0.5 + p / 0.8) for p in (1.0, 4.0, 16.0, 64.0)]
    f = fit(pairs)
    assert f.overhead_ms == pytest.approx(0.5) and f.efficiency == pytest.approx(0.8) and f.fit_points == 4
    assert f.apply(8.0) == pytest.approx(10.5)
    f = fit([(2.0, 1.0)])  # one point: efficiency only
    assert f.overhead_ms == 0 and f.efficiency == pytest.approx(2.0)
    f = fit([(1.0, 0.5), (10.0, 9.0)])  # a negative overhead is refused: through the origin
    assert f.overhead_ms == 0 and 1 < f.efficiency < 2
    with pytest.raises(ValueError, match="pairs"):
        fit([(0.0, 1.0)])
    with pytest.raises(ValueError, match="pairs"):
        fit([])


def pt(q, predicted, measured, spread=1.0, **params):
    return Point(q, f"{q} {predicted}", predicted, measured, measured, measured, spread, params)


def test_roles_alternate_and_keep_both_ends():
    five = [pt("h2d", p, p) for p in (5, 1, 4, 2, 3)]
    four = [pt("d2h", p, p) for p in (1, 2, 3, 4)]
    assign_roles(five + four)
    assert [p.role for p in sorted(five, key=lambda p: p.predicted_ms)] == [
        "fit",
        "check",
        "fit",
        "check",
        "fit",
    ]
    assert [p.role for p in four] == ["fit", "check", "fit", "fit"]


def test_a_point_off_the_line_gets_a_why_and_the_rest_none():
    pts = [pt("decode", p, 1 + 2 * p, kv_share=0.1) for p in (1.0, 2.0, 3.0, 4.0, 5.0)]
    pts[1].measured_ms *= 1.5  # a held-out point 50% slower than the line
    pts[3].spread_pct = 40.0
    pts[3].measured_ms *= 0.8
    assign_roles(pts)
    fits = fit_points(pts)
    assert set(fits) == {"decode"} and fits["decode"].efficiency == pytest.approx(0.5)
    assert [p.why is not None for p in pts] == [False, True, False, True, False]
    assert "not affine" in pts[1].why and "noisy measurement" in pts[3].why
    assert abs(pts[0].calibrated_error_pct) < 1e-6
    assert pts[0].to_json()["within_tolerance"] is True and pts[1].to_json()["within_tolerance"] is False
    pts[0].calibrated_ms = pts[0].measured_ms  # an exact prediction (error 0.0) is within it too
    assert pts[0].to_json()["within_tolerance"] is True
    f = fits["decode"]
    assert "KV is 90%" in why(pt("decode", 9.0, 100.0, kv_share=0.9), f, 1.0, 5.0)
    assert "beyond the fitted range" in why(pt("decode", 9.0, 100.0), f, 1.0, 5.0)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One real `kvtier calibrate --quick --device cpu --json --save` (the CPU dry run)."""
    save = tmp_path_factory.mktemp("cal") / "cal.json"
    r = _run(["calibrate", "--quick", "--device", "cpu", "--json", "--save", str(save)])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), save


def test_cli_quick_cpu_document(cli_run):
    doc, save = cli_run
    assert doc["device"] == "cpu" and doc["model"]["shape"] == "tiny" and doc["quick"] is True
    assert doc["ceilings_source"] == "measured in this run" and doc["ceilings"]["bf16_tflops"] > 0
    assert set(doc["fits"]) == set(QUANTITIES)
    for f in doc["fits"].values():
        assert f["efficiency"] > 0 and f["overhead_ms"] >= 0 and f["fit_points"] >= 1
    seen = {q: 0 for q in QUANTITIES}
    for p in doc["points"]:
        seen[p["quantity"]] += 1
        assert p["predicted_ms"] > 0 and p["measured_ms"] > 0 and p["calibrated_ms"] > 0
        assert p["min_ms"] <= p["measured_ms"] <= p["max_ms"] and p["role"] in ("fit", "check")
        assert p["error_pct"] == pytest.approx((p["predicted_ms"] / p["measured_ms"] - 1) * 100)
        after = p["calibrated_error_pct"]
        assert after == pytest.approx((p["calibrated_ms"] / p["measured_ms"] - 1) * 100)
        assert (
            (p["why"] is not None) == (abs(after) > 10) == (not p["within_tolerance"])
        )  # every miss explained
        if p["quantity"] == "decode":
            assert 0 < p["params"]["kv_share"] < 1 and p["params"]["batch"] >= 1
    assert all(n >= 3 for n in seen.values()) and all(
        any(p["role"] == "check" for p in doc["points"] if p["quantity"] == q) for q in QUANTITIES
    )
    p10 = doc["p10"]
    assert p10["points"] == len(doc["points"]) and p10["within_after"] + len(p10["misses"]) == p10["points"]
    assert p10["status"] == ("pass" if not p10["misses"] else "miss") and "dry run" in p10["scope"]
    assert all(m["why"] for m in p10["misses"])
    assert set(doc["effective"]) == {"prefill_tflops", "h2d_gbps", "decode_gbps"}
    assert all(math.isfinite(v) and v > 0 for v in doc["effective"].values())
    loaded = calibrate.load(save)
    assert loaded["fits"] == doc["fits"] and calibrate.effective_rates(loaded) == doc["effective"]
    assert doc["forward_floor_ms"] > 0 and doc["forward_floor"] == {"tail_tokens": 16, "cached_tokens": 256}
    from kvtier.bench.calibration_file import planner_inputs

    assert planner_inputs(loaded, 100.0)["forward_floor_ms"] == doc["forward_floor_ms"]


def test_cli_table_output(cli_run, tmp_path):
    _, save = cli_run
    ceilings = tmp_path / "c.json"
    doc = json.loads(save.read_text())
    figures = {k: v for k, v in doc["ceilings"].items()}
    ceilings.write_text(json.dumps({"kvtier_ceilings": 1, "figures": figures}))
    r = _run(["calibrate", "--quick", "--device", "cpu", "--ceilings", str(ceilings), "--reps", "1"])
    assert r.exit_code == 0, r.output
    assert "predicted" in r.output and "after fit" in r.output and "within" in r.output  # 2-line headers
    assert "ceilings file" in " ".join(r.output.split())  # the figures came from the file, not a probe
    assert "forward floor" in r.output
    progress = r.stderr.replace("\r", "\n")  # what it is doing and the time left, as it runs
    assert "calibrate:" in progress and "left" in progress and "calibrate/prefill/" in progress


@pytest.mark.parametrize(
    "args, option",
    [
        (["--reps", "0"], "--reps"),
        (["--device", "tpu"], "--device"),
        (["--save", "/nonexistent-kvtier/cal.json"], "--save"),
        (["--ceilings", "/nonexistent-kvtier/c.json"], "--ceilings"),
    ],
)
def test_cli_bad_input_exits_2_naming_the_option(args, option):
    r = _run(["calibrate", "--quick", *args])
    assert r.exit_code == 2 and option in r.output, r.output


def test_cli_bad_ceilings_file_and_missing_cuda(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text("{")
    r = _run(["calibrate", "--quick", "--ceilings", str(bad)])
    assert r.exit_code == 2 and "--ceilings" in r.output and "JSON" in r.output
    bad.write_text(json.dumps({"kvtier_ceilings": 1, "figures": {"bf16_tflops": 1.0}}))
    r = _run(["calibrate", "--quick", "--ceilings", str(bad)])
    assert r.exit_code == 2 and "h2d_pinned_gbps" in r.output
    if not ON_GPU:
        r = _run(["calibrate", "--quick", "--device", "cuda"])
        assert r.exit_code == 2 and "--device" in r.output and "CUDA" in r.output


def test_load_rejects_what_is_not_a_calibration(tmp_path):
    f = tmp_path / "x.json"
    for text in (
        "{",
        json.dumps({"kvtier_calibration": 2}),
        json.dumps({"kvtier_calibration": 1, "fits": {}}),
    ):
        f.write_text(text)
        with pytest.raises(ValueError, match="calibration"):
            calibrate.load(f)
    with pytest.raises(ValueError, match="calibration"):
        calibrate.load(tmp_path / "missing.json")


def test_decode_step_groups_query_heads_like_repeat_kv():
    """The decode step's GQA trick: the `group` query heads of KV head j as one query of `group`
    rows equals transformers' repeat_kv (query head h reads KV head h // group)."""
    b, kv_heads, group, c, d = 2, 3, 4, 17, 8
    q = torch.randn(b, kv_heads * group, d)
    k, v = torch.randn(b, kv_heads, c, d), torch.randn(b, kv_heads, c, d)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ours = calibrate.grouped_attention(q.view(b, kv_heads, group, d), k, v).reshape(b, kv_heads * group, d)
    rep = lambda x: x.repeat_interleave(group, dim=1)  # noqa: E731 - transformers' repeat_kv
    theirs = sdpa(q.unsqueeze(2), rep(k), rep(v)).squeeze(2)
    torch.testing.assert_close(ours, theirs)


def test_decode_step_runs_the_model_weights():
    from kvtier.bench.llama_rig import build_llama

    model = build_llama("tiny", "cpu")
    step = calibrate.decode_step_fn(model, 3, 40)
    a, b = step(), step()
    assert a.shape == (3, model.config.vocab_size) and torch.isfinite(a).all() and torch.equal(a, b)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2)  # the step reads the model's own weights
    assert not torch.equal(step(), a)
