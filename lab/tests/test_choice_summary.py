"""lab.choice_summary judges the choice, beside-read and hybrid rows it reads, later files winning."""

from __future__ import annotations

import json

from lab.choice_summary import rows_of, tables


def _row(case: str, params: dict, median_ms: float = 10.0) -> dict:
    return {"suite": "vllm", "case": case, "median_ms": median_ms, "params": params, "correct": True}


def test_rows_are_judged_against_their_bars_and_a_later_file_wins(tmp_path):
    choice = {"tier": "disk", "tokens": 8192, "options_ms": {"recompute": 10.0}, "choice": "recompute"}
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"rows": [_row("choice disk 8192 tokens", choice | {"vs_best": 1.2})]}))
    b = tmp_path / "b.json"
    runs = "['recompute: 10.1 ms, 0 chunks landed']"  # a list kept as its repr
    beside = {"tier": "redis", "tokens": 8192, "step_ms_alone": 10.0, "step_ms_beside": 10.5}
    beside["slowdown_pct"] = 5.0
    hybrid = {
        "model": "m", "prefix_tokens": 32768, "recompute_ms": 90.0, "hit_ms": 10.0, "speedup": 9.0,
        "first_token_match": True,
    }  # fmt: skip
    b.write_text(
        json.dumps(
            {
                "rows": [
                    _row("choice disk 8192 tokens", choice | {"vs_best": 1.01, "runs": runs}),
                    _row("step_beside_read redis 8192 tokens", beside),
                    _row("ttft_hit hybrid m 32768", hybrid),
                ]
            }
        )
    )
    out = tables(rows_of([str(a), str(b)]))
    (line,) = [x for x in out if x.startswith("| disk | 8192 |")]
    assert "| 1.010 | yes |" in line and "b.json" in line and "recompute: 10.1 ms" in line
    (line,) = [x for x in out if x.startswith("| redis | 8192 |")]
    assert "| 5.00 | NO |" in line
    (line,) = [x for x in out if x.startswith("| m | 32768 |")]
    assert "| 9.00 | yes |" in line
