"""The device-run scripts of benchmarks/ that have a CPU mode run there (so they do not rot
between GPU sessions): the dry passes of profile_submit, probe_hot_submit, probe_py_cost,
probe_ids_cost, probe_process_state, probe_calls and host_jitter, and the refusals without a GPU of
probe_ce_gather, probe_memcpy_size, probe_enqueue_beside and probe_fold_ids."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
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


@no_gpu
def test_probe_hot_submit_dry_pass_checks_bytes():
    variants = ["--variants", "pair", "cross", "small"]
    r = run("probe_hot_submit.py", "--reps", "4", "--block-size", "256", *variants)
    assert r.returncode == 0, r.stdout + r.stderr
    for line in ("save pair", "save cross", "save small", "load pair", "load cross", "load small"):
        assert line in r.stdout
    assert r.stdout.count("slowest 1/4: ids=") == 6
    assert "load of the saved slot equals the source blocks: True" in r.stdout


@no_gpu
def test_probe_py_cost_dry_pass_prints_every_slope():
    r = run("probe_py_cost.py", "--reps", "3", "--ns", "0", "8", "--rounds", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(f"round 1 slope {s}" in r.stdout for s in ("calls", "inline", "objects"))
    assert r.stdout.count("window medians") == 3
    bad = run("probe_py_cost.py", "--ns", "5")
    assert bad.returncode == 2 and "--ns" in bad.stderr  # one count gives no slope


@no_gpu
def test_probe_ids_cost_dry_pass_times_every_step():
    from kvtier.engine import fast

    if fast.fast is None:
        pytest.skip(f"C helper: {fast.why}")
    r = run("probe_ids_cost.py", "--reps", "2", "--block-size", "16")
    assert r.returncode == 0, r.stdout + r.stderr
    for step in (
        "check_fresh",
        "check_reused",
        "empty",
        "fill",
        "read_src",
        "torch_reads",
        "stream_ints",
        "nothing",
    ):
        assert f"tight loop   {step}" in r.stdout and f"after a save {step}" in r.stdout


@no_gpu
def test_probe_calls_dry_pass_counts_the_engines_calls():
    r = run("probe_calls.py", "--top", "200")
    assert r.returncode == 0, r.stdout + r.stderr
    for job in ("save", "load"):
        assert f"## {job} bs16 (sim, path staged): " in r.stdout
    assert "py  engine.py:TransferEngine.save" in r.stdout and "py  engine.py:TransferEngine.load" in r.stdout
    assert "py  blocks.py:BlockTracker.register" in r.stdout  # the protocol's bookkeeping is counted


@no_gpu
def test_probe_process_state_dry_pass_times_every_phase():
    r = run("probe_process_state.py", "--reps", "3", "--rounds", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    labels = ["fresh", "after suites, old #0", "after suites, new #1", "after gc, new", "after caches, new",
              "after freeze, new", "new process"]  # fmt: skip
    for label in labels:
        assert f"{label:24s} save median" in r.stdout and f"{label:24s} load median" in r.stdout
    census = [line for line in r.stdout.splitlines() if line.strip().startswith("threads ")]
    assert len(census) == 9, r.stdout  # a stage each: fresh, 2 x (old, new), gc, caches, freeze, new process
    assert all("main: cpu" in line and "mappings" in line for line in census), census
    assert "suites in-process: {'bidir': 'skipped', 'save_beside_matmul': 'skipped'}" in r.stdout
    assert "loads of the saved slots equal the source blocks: True" in r.stdout
    bad = run("probe_process_state.py", "--reps", "0")
    assert bad.returncode != 0 and "--reps" in bad.stdout + bad.stderr


@no_gpu
@pytest.mark.parametrize("script", ["probe_memcpy_size.py", "probe_enqueue_beside.py", "probe_fold_ids.py"])
def test_gpu_only_probes_say_they_need_a_gpu(script):
    r = run(script)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stdout


@no_gpu
def test_probe_enqueue_beside_refuses_a_negative_gap():
    bad = run("probe_enqueue_beside.py", "--gaps", "-1")
    assert bad.returncode != 0 and "--gaps" in bad.stdout + bad.stderr


def test_probe_cold_steps_times_each_step_hot_and_cold_and_refuses_bad_args():
    r = run("probe_cold_steps.py", "--reps", "2", "--flush-mib", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for step in ("nothing", "t.data_ptr()", "checked(tensor)", "checked(numpy)"):
        assert any(line.startswith(step) and " hot " in line and " cold " in line for line in lines)
    for state in ("hot", "cold"):
        assert f"save phases {state}" in r.stdout and "slot" in r.stdout and "tracker_begin" in r.stdout
    bad = run("probe_cold_steps.py", "--reps", "0")
    assert bad.returncode == 2 and "--reps" in bad.stderr


def test_probe_slab_dry_pass_takes_both_sides_in_turn():
    r = run("probe_slab.py", "--reps", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "c   (pool.native=True)" in r.stdout and "py  (pool.native=False)" in r.stdout
    assert "c   traced:" in r.stdout and "py  traced:" in r.stdout and "slot" in r.stdout
    bad = run("probe_slab.py", "--reps", "0")
    assert bad.returncode == 2 and "--reps" in bad.stderr


@pytest.mark.parametrize("kind", ["copy", "spin"])
def test_host_load_runs_its_workers_for_the_time_given(kind):
    r = run("host_load.py", "--procs", "2", "--kind", kind, "--mib", "1", "--seconds", "0.5")
    assert r.returncode == 0, r.stderr
    assert f"host_load: 2 {kind} workers" in r.stdout
    assert run("host_load.py", "--procs", "0").returncode == 2


def test_host_load_stopped_leaves_no_worker():
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    script = str(ROOT / "benchmarks" / "host_load.py")
    cmd = [sys.executable, script, "--procs", "2", "--mib", "1", "--seconds", "60"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
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
