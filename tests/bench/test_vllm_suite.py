"""`kvtier bench --suite vllm --quick` on the CPU: the connector's worker hooks replayed per step
on every vLLM 0.33 layout order (tiny shape, SimDevice), loads bit-exact, and the rows beside a
(tiny) Llama forward."""

import json

import pytest
from click.testing import CliRunner

import kvtier.cli.measure  # noqa: F401 - registers the commands
from kvtier.bench import result
from kvtier.cli import cli

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-suite")
    r = CliRunner().invoke(
        cli,
        ["bench", "--quick", "--suite", "vllm", "--out", str(out), "--no-plot", "--json"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    result.validate(doc)
    assert doc["suites"]["vllm"]["status"] == "ran", doc["suites"]["vllm"]
    return [x for x in doc["rows"] if x["suite"] == "vllm"]


def _kind(row) -> str:
    return row["case"].split()[0]


def test_vllm_quick_rows_per_order_exact_with_host_costs(rows):
    from kvtier.layout import VLLM_ORDERS

    copies = [x for x in rows if _kind(x) in ("save", "load")]
    assert {(x["params"]["order"], x["params"]["direction"]) for x in copies} == {
        (o, d) for o in VLLM_ORDERS for d in ("save", "load")
    }
    for x in copies:
        p = x["params"]
        assert p["submit_us"] > 0 and p["idle_step_us"] > 0 and x["gbps"] > 0
        assert p["ring_waits"] == 0 and p["save_errors"] == 0, x["case"]  # SimDevice: no graphs; room
        if p["direction"] == "load":
            assert x["correct"] is True, x["case"]


def test_vllm_quick_ttft_rows_hit_every_order_against_one_recompute(rows):
    from kvtier.layout import VLLM_ORDERS

    (rec,) = [x for x in rows if _kind(x) == "ttft_recompute"]
    hits = [x for x in rows if _kind(x) == "ttft_hit"]
    assert sorted(x["params"]["order"] for x in hits) == sorted(VLLM_ORDERS)
    for x in hits:
        p = x["params"]
        assert x["correct"] is True, x["case"]  # every chunk from the host, loaded bit for bit
        assert p["prefix_tokens"] == rec["params"]["prefix_tokens"] and p["new_tokens"] > 0
        assert p["hit_ms"] == x["median_ms"] and p["recompute_ms"] == rec["median_ms"]
        assert p["recompute_over_hit"] == pytest.approx(rec["median_ms"] / x["median_ms"])


def test_vllm_quick_forward_beside_save_per_order(rows):
    from kvtier.layout import VLLM_ORDERS

    beside = [x for x in rows if _kind(x) == "forward_beside_save"]
    assert sorted(x["params"]["order"] for x in beside) == sorted(VLLM_ORDERS)
    for x in beside:
        p = x["params"]
        assert p["forward_ms_alone"] > 0 and p["forward_ms_beside"] > 0 and p["save_gbps_beside"] > 0
        assert p["slowdown_pct"] == pytest.approx((p["forward_ms_beside"] / p["forward_ms_alone"] - 1) * 100)
        assert 0 <= p["overlap_pct"] <= 100


def test_vllm_quick_loads_layer_major_by_default_and_whole_beside(rows):
    """The default rows load on the layer-major path (a true event per layer); load_whole and
    ttft_hit_whole run the same request with layerwise: false, on the whole-job DMA paths."""
    from kvtier.layout import VLLM_ORDERS

    for kind in ("load", "ttft_hit"):
        assert {x["params"]["load_path"] for x in rows if _kind(x) == kind} == {"kernel"}
    for kind in ("load_whole", "ttft_hit_whole"):
        whole = [x for x in rows if _kind(x) == kind]
        assert sorted(x["params"]["order"] for x in whole) == sorted(VLLM_ORDERS)
        for x in whole:
            assert x["correct"] is True and x["params"]["layerwise"] is False, x["case"]
            assert x["params"]["load_path"] in ("staged", "batch"), x["case"]
    for x in rows:
        if _kind(x).startswith("ttft_hit"):
            assert x["params"]["tail_ms"] > 0, x["case"]


def test_vllm_quick_failed_load_rows_per_order(rows):
    from kvtier.layout import VLLM_ORDERS

    failed = [x for x in rows if _kind(x) == "load_failed_mid_request"]
    assert sorted(x["params"]["order"] for x in failed) == sorted(VLLM_ORDERS)
    for x in failed:
        assert x["correct"] is True and x["params"]["saves_in_failing_step"] == 0, x["case"]
