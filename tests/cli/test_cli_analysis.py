"""The CLI gives the seed's worked examples in named JSON fields; bad input exits 2 with no traceback."""

import json

import pytest
from click.testing import CliRunner

import kvtier.cli.analysis  # noqa: F401  (registers the subcommands)
from kvtier.cli import cli

GIB = 1 << 30


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_roofline_json_fields():
    r = run(
        "roofline",
        "--model",
        "llama-3-8b",
        "--gpu",
        "h100-sxm",
        "--batch",
        "32",
        "--context",
        "8192",
        "--json",
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["balance_flop_per_byte"] == pytest.approx(295, abs=1)
    assert d["weights_bytes"] / 1e9 == pytest.approx(16, abs=0.1)
    assert d["weights_read_ms"] == pytest.approx(4.8, abs=0.05)
    assert d["kv_bytes_per_token"] == 128 * 1024
    assert d["kv_bytes_per_request"] == GIB
    assert d["kv_read_ms_per_request"] == pytest.approx(0.32, abs=0.005)
    assert d["kv_read_ms"] == pytest.approx(10, abs=0.3)
    assert d["decode"]["bound"] == "memory"
    assert d["decode_batch1"]["bound_ms"] < d["decode"]["bound_ms"]


def test_path_json_fields():
    r = run("path", "--model", "llama-3-8b", "--tokens", "8192", "--link", "pcie4", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["bytes"] == GIB and d["gib"] == 1.0
    assert d["transfer_ms"] == pytest.approx(42, abs=0.6)
    assert d["bottleneck"].startswith("PCIe Gen4")
    lr = d["load_vs_recompute"]
    assert lr["faster"] == "load" and lr["split"]["time_ms"] < lr["load_ms"]
    assert set(lr["break_even_tokens"]) >= {"pcie4", "pcie5", "nic100", "nvme"}


def test_tables_print_units_and_plots_are_written(tmp_path):
    r = run("roofline", "--plot", str(tmp_path / "r.png"), "--amdahl", "0.1:1.2")
    assert r.exit_code == 0, r.output
    assert "FLOP/byte" in r.output and " ms" in r.output and "GB" in r.output and "overall" in r.output
    r = run("path", "--tier", "remote", "--gpudirect", "--plot", str(tmp_path / "p.png"))
    assert r.exit_code == 0, r.output
    assert "GB/s" in r.output and "bottleneck" in r.output
    assert (tmp_path / "r.png").stat().st_size > 10_000 and (tmp_path / "p.png").stat().st_size > 10_000


def test_specs_lists_everything_with_sources():
    d = json.loads(run("specs", "--json").output)
    assert {g["key"] for g in d["gpus"]} >= {"h100-sxm", "h100-pcie", "h200", "a100-80gb", "l40s", "b200"}
    assert all(x["source"] for x in d["gpus"] + d["links"])
    assert "Links" in run("specs").output


def test_ceilings_file_changes_the_answer(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(
        json.dumps(
            {
                "kvtier_ceilings": 1,
                "gpu_key": "h200",
                "figures": {"d2d_copy_gbps": 4000.0, "h2d_pinned_gbps": 40.0},
            }
        )
    )
    d = json.loads(run("roofline", "--gpu", "h200", "--ceilings", str(f), "--json").output)
    assert d["gpu"]["mem_bw_gbps"] == 4000.0 and d["gpu"]["measured"] == ["mem_bw_gbps"]
    d = json.loads(run("path", "--ceilings", str(f), "--json").output)  # the GPU comes from the file
    assert d["gpu"]["key"] == "h200"
    assert d["link"]["typical_gbps"] == 40.0 and "measured" in d["link"]["source"]
    r = run("roofline", "--gpu", "h100-sxm", "--ceilings", str(f))
    assert r.exit_code == 2 and "measured on 'h200'" in r.output


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["roofline", "--model", "gpt-9"], "known: llama-3-8b"),
        (["roofline", "--gpu", "v100"], "known: a100-80gb"),
        (["roofline", "--batch", "0"], "--batch"),
        (["path", "--tokens", "-5"], "--tokens"),
        (["path", "--link", "pcie9"], "known: dram"),
        (["roofline", "--amdahl", "half"], "FRACTION:SPEEDUP"),
        (["roofline", "--ceilings", "/nonexistent.json"], "does not exist"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args, match):
    r = run(*args)
    assert r.exit_code == 2
    assert match in r.output
    assert "Traceback" not in r.output


def test_malformed_config_json_exits_2(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{oops")
    r = run("roofline", "--model", str(bad))
    assert r.exit_code == 2 and "not valid JSON" in r.output
