"""Tables keep to an 80-column terminal: `kvtier specs` on one screenful or so, its sources as
footnotes (never a column wrapped letter by letter), and `kvtier calibrate`'s table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")


def at_80(code: str) -> list[str]:
    env = os.environ | {"COLUMNS": "80", "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    too_wide = [x for x in lines if len(x) > 80]
    assert not too_wide, too_wide
    return lines


def test_specs_fits_80_columns_with_sources_as_footnotes():
    from kvtier.cli.report import specs_json

    lines = at_80("from kvtier.cli import main; import sys; sys.argv = ['kvtier', 'specs']; main()")
    assert len(lines) < 100, len(lines)
    text = " ".join(" ".join(lines).split())  # footnotes wrap by words
    d = specs_json()
    for row in d["gpus"] + d["links"] + d["models"]:
        assert any(x.split() and x.split()[0] == row["key"] for x in lines), row["key"]  # the key whole
        assert row["source"] in text.replace("- ", "-"), row["source"]  # each source, once, in full


def test_calibrate_table_fits_80_columns():
    long_why = "noisy measurement: p10-p90 spans 812% of the median; CPU dry run: caches, threads " * 2
    point = {
        "case": "decode b16 c1024",
        "role": "check",
        "predicted_ms": 0.123456,
        "measured_ms": 12.3456,
        "error_pct": -99.0,
        "calibrated_ms": 11.0,
        "calibrated_error_pct": -12345.6,
        "why": long_why.strip(),
    }
    doc = {
        "gpu": "CPU (no GPU)",
        "model": {"shape": "tiny", "dtype": "float32"},
        "ceilings_source": "measured in this run",
        "points": [point, point | {"why": None, "calibrated_error_pct": 1.0}],
        "fits": {"prefill": {"overhead_ms": 32.1, "efficiency": 0.013, "fit_points": 2}},
        "effective": {"prefill_tflops": 0.0017},
        "forward_floor_ms": 121.0,
        "forward_floor": {"tail_tokens": 16, "cached_tokens": 256},
        "p10": {"scope": "CPU dry run", "within_before": 0, "within_after": 1, "points": 2, "status": "miss"},
    }
    lines = at_80(
        f"import json; from kvtier.cli.calibrate import _print; _print(json.loads({json.dumps(doc)!r}))"
    )
    assert any("decode b16 c1024" in x and "-99%" in x for x in lines)
    assert "noisy measurement: p10-p90 spans 812% of the median" in " ".join(" ".join(lines).split())
