"""`kvtier bench --suite vllm --quick` on the CPU: the connector's worker hooks replayed per step
on every vLLM 0.33 layout order (tiny shape, SimDevice), loads bit-exact."""

import json

import pytest
from click.testing import CliRunner

import kvtier.cli.measure  # noqa: F401 - registers the commands
from kvtier.bench import result
from kvtier.cli import cli

torch = pytest.importorskip("torch")


def test_vllm_quick_rows_per_order_exact_with_host_costs(tmp_path):
    r = CliRunner().invoke(
        cli,
        ["bench", "--quick", "--suite", "vllm", "--out", str(tmp_path), "--no-plot", "--json"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    result.validate(doc)
    assert doc["suites"]["vllm"]["status"] == "ran", doc["suites"]["vllm"]
    rows = [x for x in doc["rows"] if x["suite"] == "vllm"]
    from kvtier.layout import VLLM_ORDERS

    assert {(x["params"]["order"], x["params"]["direction"]) for x in rows} == {
        (o, d) for o in VLLM_ORDERS for d in ("save", "load")
    }
    for x in rows:
        p = x["params"]
        assert p["submit_us"] > 0 and p["idle_step_us"] > 0 and x["gbps"] > 0
        if p["direction"] == "load":
            assert x["correct"] is True, x["case"]
