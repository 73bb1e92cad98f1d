"""The device-run scripts of benchmarks/ that have a CPU mode run there (so they do not rot
between GPU sessions): profile_submit's dry pass on an inline SimDevice, host_jitter, and
probe_ce_gather's refusal without a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU modes of the scripts")


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)


@no_gpu
@pytest.mark.parametrize("how", [[], ["--hot"], ["--hot", "--spin-ms", "0.5"]])
def test_profile_submit_dry_pass_checks_bytes(how):
    r = run("profile_submit.py", "--reps", "3", "--cases", "bs16", *how)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("{'saves': 2, 'loads': 2} of 2 saves / 2 loads bit-exact") == 2  # both modes
    assert ("hot: each right after another" in r.stdout) == bool(how)
    assert "cpu_us=" in r.stdout and "BYTES WRONG" not in r.stdout


@no_gpu
def test_host_jitter_prints_both_sizes():
    r = run("host_jitter.py")
    assert r.returncode == 0, r.stderr
    assert "512 ids: hot loop" in r.stdout and "8192 ids: hot loop" in r.stdout


@no_gpu
def test_probe_ce_gather_needs_a_gpu():
    r = run("probe_ce_gather.py")
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stdout
