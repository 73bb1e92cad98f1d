"""The analysis commands flag a configuration that does not fit the GPU's memory, with its numbers
and no times; an empty option value is a usage error; a ceilings file or calibration from another
device is refused, naming it, instead of standing in silently for a GPU it did not measure."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import kvtier.cli.analysis  # noqa: F401  (registers the subcommands)
import kvtier.cli.measure  # noqa: F401
import kvtier.cli.plan  # noqa: F401
from kvtier.ceilings import Ceilings
from kvtier.cli import cli

TIMES = ("ms", "TTFT", "decode step", "transfer")


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["roofline", "--model", "llama-3-70b", "--gpu", "h200", "--batch", "64", "--context", "32768"],
         ["828.3 GB", "5.9x the memory", "the weights alone need 2 GPUs", "GPUs for weights + KV: 6"]),
        (["roofline", "--model", "llama-3.1-405b", "--gpu", "l40s"],
         ["811.7 GB", "the weights alone need 17 GPUs"]),
        (["path", "--model", "llama-3-8b", "--gpu", "h200", "--tokens", "10000000"],
         ["1,310.7 GB", "124.9 GB for KV", "the longest context is 953,212 tokens"]),
        (["plan", "--model", "llama-3-8b", "--gpu", "h200", "--matched", "9999872", "--new", "64"],
         ["1,310.7 GB", "the longest context is 953,212 tokens"]),
        (["roofline", "--model", "llama-3-8b", "--gpu", "h200", "--batch", "2000", "--context", "32768"],
         ["at 32,768 tokens, the largest batch is 29"]),
    ],
)  # fmt: skip
def test_what_does_not_fit_is_flagged_with_its_numbers_and_no_times(args, says, tmp_path):
    r = run(*args)
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Does not fit:"), r.output
    text = " ".join(r.output.split())  # the console may wrap long lines
    for s in says:
        assert s in text, (s, r.output)
    assert not any(t in r.output for t in TIMES), r.output
    d = json.loads(run(*args, "--json").output)
    assert d["fits"]["fits"] is False
    assert not [k for k in d if k.endswith("_ms") or k in ("decode", "prefill", "options", "choice")], d
    if args[0] != "plan":
        png = tmp_path / "x.png"
        assert run(*args, "--plot", str(png)).exit_code == 0 and not png.exists()  # no times to draw


def test_what_fits_still_gets_its_times():
    r = run("roofline", "--model", "llama-3-70b", "--gpu", "h200", "--dtype", "fp8", "--batch", "4")
    assert r.exit_code == 0 and "decode step" in r.output and "Does not fit" not in r.output
    r = run("path", "--model", "llama-3-70b", "--gpu", "h200", "--dtype", "fp8", "--json")
    assert json.loads(r.output)["transfer_ms"] > 0


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["path", "--link", ""], "'--link'"),
        (["plan", "--matched", "256", "--new", "1", "--link", " "], "'--link'"),
        (["roofline", "--gpu", ""], "'--gpu'"),
        (["roofline", "--model", ""], "'--model'"),
        (["path", "--nic", ""], "'--nic'"),
        (["specs", "--ceilings", ""], "'--ceilings'"),
        (["bench", "--suite", ""], "'--suite'"),
    ],
)
def test_an_empty_value_is_a_usage_error_naming_the_option(args, option):
    r = run(*args)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and "empty" in lines[0], r.output


def test_a_ceilings_file_without_a_known_gpu_needs_gpu(tmp_path):
    cpu = tmp_path / "cpu.json"
    Ceilings(figures={"host_memcpy_gbps": 9.0}, gpu=None, gpu_key=None).save(cpu)  # `probe --save`, no GPU
    other = tmp_path / "other.json"
    Ceilings(figures={"d2d_copy_gbps": 900.0}, gpu="NVIDIA RTX 9999", gpu_key=None).save(other)
    for f, why in ((cpu, "without a GPU"), (other, "NVIDIA RTX 9999")):
        for args in (["roofline"], ["path"], ["plan", "--matched", "256", "--new", "8"]):
            r = run(*args, "--ceilings", str(f))
            assert r.exit_code == 2 and why in r.output and "--gpu" in r.output, r.output
            assert "h100" not in r.output.lower()
    d = json.loads(run("roofline", "--ceilings", str(cpu), "--gpu", "h200", "--json").output)
    assert d["gpu"]["key"] == "h200"


def _calibration(tmp_path, **over) -> str:
    doc = {
        "kvtier_calibration": 1, "device": "cuda", "gpu": "NVIDIA H200", "gpu_key": "h200",
        "fits": {"prefill": {"overhead_ms": 5.0, "efficiency": 0.5, "fit_points": 3}},
        "gpu_spec": {"bf16_tflops": 800.0, "mem_bw_gbps": 4800.0},
        "ceilings": {"h2d_pinned_gbps": 50.0},
    } | over  # fmt: skip
    path = tmp_path / f"cal-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_plan_refuses_a_calibration_of_another_device(tmp_path):
    base = ["plan", "--matched", "8192", "--new", "64"]
    cpu = _calibration(
        tmp_path,
        device="cpu",
        gpu="CPU",
        gpu_key=None,
        gpu_spec={"bf16_tflops": 0.2, "mem_bw_gbps": 10.0},
        fits={"prefill": {"overhead_ms": 20.0, "efficiency": 0.9, "fit_points": 3}},
    )
    r = run(*base, "--gpu", "h200", "--calibration", cpu)
    assert r.exit_code == 2 and "--calibration" in r.output and "CPU, not a GPU" in r.output, r.output
    unknown = _calibration(tmp_path, gpu="NVIDIA RTX 9999", gpu_key=None)
    r = run(*base, "--calibration", unknown)
    assert r.exit_code == 2 and "NVIDIA RTX 9999" in r.output and "--gpu" in r.output, r.output
    assert run(*base, "--gpu", "h200", "--calibration", _calibration(tmp_path)).exit_code == 0
