"""`python -m lab results`: a committed result file judged against kvtier's targets; the engine
rows' figures and verdicts, and the submit target's line."""

import json
from pathlib import Path

from click.testing import CliRunner

from lab.__main__ import main
from lab.summary import engine_figure, judge, p6_summary, verdict

RESULT = Path(__file__).resolve().parents[1] / "results" / "nvidia-h200-2026-11-29.json"


def test_judge_counts_rows_against_targets():
    doc = json.loads(RESULT.read_text())
    groups = judge(doc)
    gather = next(g for g in groups if g["suite"] == "gather_d2d" and g["path"].startswith("triton gather"))
    assert gather["target"] == ("P1", 0.92)
    assert gather["rows_meeting_target"] == sum(
        r["ratio"] >= 0.92
        for r in doc["rows"]
        if r["suite"] == "gather_d2d" and r["params"]["path"] == gather["path"]
    )
    assert all(g["target"] is None for g in groups if g["suite"].startswith("baseline"))


def test_lab_results_command_prints_the_verdicts(tmp_path):
    r = CliRunner().invoke(main, ["results", str(RESULT)])
    assert r.exit_code == 0, r.output
    assert "| gather_d2d |" in r.output and "P2 ≥ 97%" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    r = CliRunner().invoke(main, ["results", str(bad)])
    assert r.exit_code == 2 and "not a valid kvtier result file" in r.output


def test_submit_figure_shows_the_hot_submit():
    assert engine_figure({"params": {"submit_us": 500.0, "blocks": 512}}) == "submit 500 us for 512 blocks"
    hot = engine_figure({"params": {"submit_us": 500.0, "submit_hot_us": 90.0, "blocks": 512}})
    assert hot == "submit 500 us, 90 us hot for 512 blocks"


def test_submit_verdict_says_how_the_hot_and_busy_submits_fare():
    assert verdict({}) == "-" and verdict({"meets_target": True}) == "yes"
    p = {"meets_target": False, "meets_target_hot": True, "meets_target_busy": False}
    assert verdict(p) == "no (hot yes, busy no)"  # a file from before the hot verdict
    p = {"meets_target": True, "meets_target_cold": False, "meets_target_busy": False, "p6_reads": "hot"}
    assert verdict(p) == "yes (after a wait no, busy no)"


def test_submit_figure_leads_with_what_the_verdict_reads():
    p = {"submit_us": 412.0, "submit_hot_us": 64.0, "blocks": 512, "p6_reads": "hot"}
    p |= {"submit_hot_py_us": 40.0, "submit_hot_calls_us": 24.0, "submit_busy_us": 150.0, "busy_ms": 3.0}
    assert engine_figure({"params": p}) == (
        "submit 64 us hot (40 Python + 24 runtime calls), 412 us after a GPU wait,"
        " 150 us after 3 ms of host work for 512 blocks"
    )  # a file from before the traced pass's total was kept
    p["submit_traced_us"] = 71.0  # the traced pass whole: more than the hot figure (its marks)
    assert engine_figure({"params": p}).startswith(
        "submit 64 us hot (traced pass 71 us: 40 Python with the trace's marks + 24 runtime calls), 412 us"
    )


def test_p6_line_counts_the_hot_1gib_rows():
    def row(case, hot, **p):
        return {"suite": "submit_overhead", "case": case, "params": {"submit_hot_us": hot, **p}}

    rows = [row("save bs1 1GiB", 120.0), row("save bs16 1GiB", 60.0), row("load bs1 1GiB", 80.0)]
    rows += [row("load bs16 1GiB", 40.0), row("save bs16 4GiB", 300.0)]  # an older file: no p6_row
    rows += [row("load bs16 4GiB", 250.0, p6_row=False), {"suite": "bidir", "case": "x", "params": {}}]
    assert p6_summary(rows) == (
        "P6 (hot submit of a 1 GiB job <= 100 us, flat in block count): 3 of 4 rows, 40-120 us;"
        " largest over smallest median: save 2.00, load 2.00."
    )
    assert p6_summary([{"suite": "bidir", "case": "x", "params": {}}]) == ""


def test_bidir_rows_say_how_they_were_held():
    p = {"hold_ms": 3.0, "held_runs": "10/10", "unheld_ratio": 0.9612}
    want = "held 3 ms before each run (10/10 fully enqueued), 96.1% without it"
    assert engine_figure({"params": p}) == want
    p = {"hold_ms": 3.0, "held_runs": "9/10"}  # an alone row: no unheld figure
    assert engine_figure({"params": p}) == "held 3 ms before each run (9/10 fully enqueued)"
    assert engine_figure({"params": {}}) == "-"  # rows of before the hold
    p = {"hold_ms": 3.0, "held_runs": "10/10", "unheld_ratio": 1.0071, "beside_ratio": 0.9712,
         "beside_ceiling_gbps": 93.04}  # fmt: skip
    want = (
        "held 3 ms before each run (10/10 fully enqueued), 100.7% without it;"
        " 97.1% of the bidirectional copy timed beside it (93.0 GB/s)"
    )
    assert engine_figure({"params": p}) == want
