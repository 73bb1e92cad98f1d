"""The lab's verdicts on `ttft` rows (P8, P9, P10, P12), from the neutral figures the suite records,
and from files written before it recorded them."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from lab.__main__ import main
from lab.summary import calibration_used, ttft_markdown, ttft_verdicts

OLD = Path(__file__).resolve().parents[1] / "results" / "nvidia-h200-2026-11-29-21.json"
H200 = {"model": "llama-3-8b", "device": "CudaDevice", "prefix_tokens": 8192, "tier": "host"}


def test_p8_on_host_load_rows_of_8k_and_more_on_the_gpu():
    row = H200 | {"mode": "load", "speedup_vs_recompute": 9.7, "load_why": "recompute 257 / load 26.5"}
    assert ttft_verdicts(row)["P8"][0] == "pass" and "recompute 257" in ttft_verdicts(row)["P8"][1]
    assert ttft_verdicts(row | {"speedup_vs_recompute": 5.8})["P8"][0] == "miss"
    assert ttft_verdicts(row | {"mode": "lean load"})["P8"][0] == "pass"
    small = ttft_verdicts(row | {"prefix_tokens": 2048})["P8"]
    assert small[0] == "n/a" and "under 8K" in small[1] and "would be pass" in small[1]
    dry = ttft_verdicts(row | {"model": "tiny", "device": "SimDevice"})["P8"]
    assert dry[0] == "n/a" and "dry run" in dry[1]
    assert "P8" not in ttft_verdicts(row | {"tier": "disk"})


@pytest.mark.parametrize("vs_best, ratio, want", [(0.8, 2.0, "pass"), (0.95, 2.0, "miss"), (0.5, 5.0, "n/a")])
def test_p9_on_split_rows_where_load_and_recompute_are_within_3x(vs_best, ratio, want):
    row = H200 | {"mode": "split", "split_vs_best": vs_best, "load_vs_recompute": ratio, "split_why": "w"}
    assert ttft_verdicts(row)["P9"][0] == want


def test_p10_within_25_percent_uncalibrated_and_10_calibrated():
    row = H200 | {"mode": "load", "error_pct": -20.0, "calibrated": False}
    assert ttft_verdicts(row)["P10"][0] == "pass"
    assert ttft_verdicts(row | {"calibrated": True})["P10"][0] == "miss"
    assert ttft_verdicts(row | {"error_pct": 8.0, "calibrated": True})["P10"][0] == "pass"
    assert calibration_used({"calibration": "lab/results/x.calibration.json"})  # older files
    assert not calibration_used({"calibration": "none"}) and not calibration_used(
        {"calibration": "not used: x"}
    )


def test_p12_judges_the_uncalibrated_choice_and_the_lean_choice():
    row = H200 | {"mode": "choice", "regret_pct": 8.0, "best_measured": "load", "calibrated": False}
    assert ttft_verdicts(row)["P12"][0] == "pass"
    assert ttft_verdicts(row | {"regret_pct": 120.0})["P12"][0] == "miss"  # issue #30's split at 8K
    assert ttft_verdicts(row | {"calibrated": True})["P12"][0] == "n/a"
    lean = H200 | {"mode": "lean split", "regret_pct": 150.0, "best_measured": "load", "calibrated": False}
    assert ttft_verdicts(lean)["P12"][0] == "miss"


def test_an_older_file_is_judged_through_its_old_names():
    doc = json.loads(OLD.read_text())
    md = ttft_markdown(doc)
    assert "- 8K lean load host P8: 9.7x faster than recompute (target >= 8x)" in md
    line = next(x for x in md.splitlines() if x.startswith("| 8K lean load host |"))
    assert "| pass |" in line  # P8 like against like, as the file recorded it
    r = CliRunner().invoke(main, ["results", str(OLD)])
    assert r.exit_code == 0 and "Time to first token, every row" in r.output


def test_a_lean_split_is_judged_against_its_halves_alone():
    row = {"mode": "lean split", "split_front_ms": 16.0, "split_back_ms": 27.0}
    assert ttft_verdicts(row | {"split_vs_longer_half": 1.10})["overlap"][0] == "pass"
    assert ttft_verdicts(row | {"split_vs_longer_half": 2.48})["overlap"][0] == "miss"
    old = {"mode": "lean split", "split_vs_longer_half": 2.48}  # older files: halves estimated, not timed
    assert "overlap" not in ttft_verdicts(old)
