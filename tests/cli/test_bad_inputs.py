"""Every bad input to the analysis commands (specs, roofline, path, plan) exits 2 with one line
naming what is wrong, at once: run as a real process with a timeout, so a hang fails too."""

import json
import subprocess
import sys

import pytest

TIMEOUT = 20  # seconds; the whole process, interpreter start included (a bad input takes < 1 s)


def kvtier(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtier", *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd
    )


def bad(*args: str, match: str) -> str:
    r = kvtier(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), lines
    assert match in lines[0]
    return lines[0]


@pytest.mark.parametrize("command", [["roofline"], ["path"], ["path", "--tier", "disk"]])
def test_plot_into_a_missing_folder_exits_2_naming_plot(command, tmp_path):
    png = tmp_path / "no" / "such" / "folder" / "x.png"
    line = bad(*command, "--plot", str(png), match="--plot")
    assert "does not exist" in line
    assert not png.parent.exists()


def test_plot_into_a_folder_still_works(tmp_path):
    png = tmp_path / "r.png"
    r = kvtier("roofline", "--plot", str(png), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["plot"] == str(png) and png.stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["plan", "--matched", str(2**40 + 256), "--new", "5"], "--matched"),  # a hang today
        (["plan", "--matched", str(10**30), "--new", "5"], "--matched"),
        (["plan", "--matched", "512", "--new", str(2**41)], "--new"),
        (["plan", "--matched", "300", "--new", "5"], "multiple of chunk_tokens"),
        (["roofline", "--batch", "0"], "--batch"),
        (["roofline", "--context", str(10**30)], "--context"),
        (["roofline", "--batch", str(10**400)], "--batch"),
        (["path", "--tokens", str(10**400)], "--tokens"),
        (["path", "--shared-by", str(10**400)], "--shared-by"),  # an OverflowError today
        (["roofline", "--efficiency", "nan"], "efficiency"),
        (["roofline", "--model", "gpt-9"], "known: llama-3-8b"),
    ],
)
def test_bad_numbers_exit_2_in_one_line(args, match):
    bad(*args, match=match)


def test_a_config_json_with_bad_moe_fields_exits_2_in_one_line(tmp_path):
    cfg = {
        "hidden_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "intermediate_size": 2048,
        "vocab_size": 1000,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "n_shared_experts": "1",  # a TypeError traceback today
    }
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    for command in (["roofline"], ["path"], ["plan", "--matched", "512", "--new", "5"]):
        bad(*command, "--model", str(p), match="'n_shared_experts'")
    p.write_text(json.dumps(cfg | {"n_shared_experts": 1, "num_hidden_layers": 10**30}))  # a hang today
    bad("roofline", "--model", str(p), match="'num_hidden_layers'")


@pytest.mark.timeout(TIMEOUT)
def test_a_huge_matched_prefix_is_answered_at_once():
    """No GPU holds it: the CLI says so; the planner's search over it still ends at once."""
    from kvtier.planner import plan

    r = kvtier("plan", "--matched", str(2**40), "--new", "5", "--tier", "disk", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["matched_tokens"] == 2**40 and d["fits"]["fits"] is False
    assert plan("llama-3-8b", "h100-sxm", "disk", 2**40, 5).choice in ("load", "split", "recompute")


def test_roofline_says_when_weights_and_kv_do_not_fit_and_what_would():
    args = ["--model", "llama-3-70b", "--gpu", "h200", "--batch", "64", "--context", "32768"]
    fit = json.loads(kvtier("roofline", *args, "--json").stdout)["fits"]
    assert fit["fits"] is False and fit["memory_bytes"] == 141e9
    assert fit["gpus_for_weights"] == 2 and fit["max_batch"] == 0  # bf16 weights alone: 141.1 GB
    assert fit["gpus_needed"] == 6  # 141.1 GB + 64 x 32768 x 320 KiB
    table = kvtier("roofline", *args).stdout
    assert "Does not fit" in table and "need 2 GPUs" in table
    fp8 = json.loads(kvtier("roofline", *args, "--dtype", "fp8", "--json").stdout)["fits"]
    assert fp8["fits"] is False and fp8["max_batch"] == 6 and fp8["gpus_for_weights"] == 1
    small = json.loads(kvtier("roofline", "--gpu", "h200", "--json").stdout)["fits"]
    assert small["fits"] is True and small["max_batch"] > 100


def test_path_and_plan_report_the_fit_too():
    d = json.loads(kvtier("path", "--model", "llama-3-70b", "--gpu", "h200", "--json").stdout)
    assert d["fits"]["fits"] is False and d["fits"]["gpus_for_weights"] == 2
    d = json.loads(kvtier("plan", "--matched", "512", "--new", "5", "--json").stdout)
    assert d["fits"]["fits"] is True and d["fits"]["context"] == 517
