"""The lab's kept scripts run on the CPU too (so they do not rot between GPU sessions): host_jitter,
host_load (the noisy-host workers), and ab_native_summary's table."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU modes of the scripts")


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "lab" / script), *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120, check=False)


@no_gpu
def test_host_jitter_prints_both_sizes():
    r = run("host_jitter.py")
    assert r.returncode == 0, r.stderr
    assert "512 ids: hot loop" in r.stdout and "8192 ids: hot loop" in r.stdout


def test_ab_native_summary_pairs_the_rounds_of_each_side(tmp_path):
    for native, us in (("1", (40.0, 44.0)), ("0", (80.0, 88.0))):
        for r, u in enumerate(us, 1):
            d = tmp_path / f"n{native}r{r}"
            d.mkdir()
            row = {"suite": "submit_overhead", "case": "save bs16 1GiB", "params": {"submit_hot_us": u}}
            (d / "x.json").write_text(json.dumps({"rows": [row]}))
    r = run("ab_native_summary.py", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "| save bs16 1GiB | 42.0 (40, 44) | 84.0 (80, 88) | 2.00 |" in r.stdout


@pytest.mark.parametrize("kind", ["copy", "spin"])
def test_host_load_runs_its_workers_for_the_time_given(kind):
    r = run("host_load.py", "--procs", "2", "--kind", kind, "--mib", "1", "--seconds", "0.5")
    assert r.returncode == 0, r.stderr
    assert f"host_load: 2 {kind} workers" in r.stdout
    assert run("host_load.py", "--procs", "0").returncode == 2


def test_host_load_stopped_leaves_no_worker():
    import signal
    import time

    script = str(ROOT / "lab" / "host_load.py")
    cmd = [sys.executable, script, "--procs", "2", "--mib", "1", "--seconds", "60"]
    p = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert "host_load: 2 copy workers" in p.stdout.readline()
        kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        assert len(kids) >= 2
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
        time.sleep(0.2)
        assert not [k for k in kids if Path(f"/proc/{k}").exists() and "Z" not in _state(k)]
    finally:
        p.kill()
        p.wait()


def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


def test_probe_mac_prints_every_candidate():
    r = run("probe_mac.py", "--mib", "0.25", "--reps", "2")
    assert r.returncode == 0, r.stderr
    for name in ("xxh3_64", "gmac", "hmac-sha256", "blake2b keyed", "aes-256-gcm decrypt_into"):
        assert name in r.stdout
