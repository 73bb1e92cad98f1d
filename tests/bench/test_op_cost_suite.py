"""`kvtier bench --suite op_cost --quick` on whatever this machine has (tiny shapes on the CPU)."""

import json

import pytest
from click.testing import CliRunner

import kvtier.cli.measure  # noqa: F401 - registers the commands
from kvtier.bench import result
from kvtier.cli import cli

torch = pytest.importorskip("torch")


def test_op_cost_quick_writes_rows_with_host_us(tmp_path):
    r = CliRunner().invoke(
        cli,
        ["bench", "--quick", "--suite", "op_cost", "--out", str(tmp_path), "--no-plot", "--json"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    result.validate(doc)
    assert doc["suites"]["op_cost"]["status"] == "ran"
    rows = [x for x in doc["rows"] if x["suite"] == "op_cost"]
    ops_seen = {x["params"]["op"] for x in rows}
    assert ops_seen == {"gather", "scatter", "scatter_slots", "save_staged", "load_staged"}
    kinds = {x["params"]["id_kind"] for x in rows}
    assert {"list", "cpu_tensor", "block_ids"} <= kinds
    for x in rows:
        p = x["params"]
        assert p["host_us"] > 0 and p["queued_ms"] > 0 and p["index_select_ms"] > 0 and p["copy_ms"] > 0
        assert x["correct"] is not False
