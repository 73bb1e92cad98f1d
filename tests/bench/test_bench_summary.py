"""`kvtier results`: a committed result file summarized per suite and path, without verdicts."""

import json
from pathlib import Path

from click.testing import CliRunner

import kvtier.cli.measure  # noqa: F401  (registers the subcommands)
from kvtier.bench.summary import summarize
from kvtier.cli import cli

RESULT = Path(__file__).resolve().parents[2] / "lab" / "results" / "nvidia-h200-2026-11-29.json"


def test_summary_groups_rows_with_headline_worst_and_best():
    doc = json.loads(RESULT.read_text())
    groups = summarize(doc)
    gather = next(g for g in groups if g["suite"] == "gather_d2d" and g["path"].startswith("triton gather"))
    rows = [r for r in doc["rows"] if r["suite"] == "gather_d2d" and r["params"]["path"] == gather["path"]]
    assert gather["rows"] == len(rows) and gather["worst"]["ratio"] == min(r["ratio"] for r in rows)
    assert gather["best"]["ratio"] == max(r["ratio"] for r in rows)
    assert gather["headline"]["params"]["block_size"] == 16
    assert all("target" not in g for g in groups)  # kvtier measures; it does not judge


def test_results_command_prints_markdown_without_verdicts_and_rejects_bad_files(tmp_path):
    r = CliRunner().invoke(cli, ["results", str(RESULT)])
    assert r.exit_code == 0, r.output
    assert "| gather_d2d |" in r.output and "same-run ceilings" in r.output
    assert "target" not in r.output and "P2" not in r.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    r = CliRunner().invoke(cli, ["results", str(bad)])
    assert r.exit_code == 2 and "not a valid kvtier result file" in r.output
