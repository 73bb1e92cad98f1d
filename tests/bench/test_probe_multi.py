"""`probe --all-gpus` on the CPU: a fake device side and a fake NVML; the ceilings it writes (version 2,
version 1 still read) and `path --shared-by` using the measured contended rate."""

import json
import sys

import pytest
from click.testing import CliRunner
from test_bench_nvml import _fake_pynvml

import kvtier.cli.analysis  # noqa: F401 - registers `path`
import kvtier.cli.measure  # noqa: F401 - registers `probe`
from kvtier.bench import nvml
from kvtier.bench.probe_multi import Measure, run_multi, summary_lines, topology
from kvtier.ceilings import Ceilings, CeilingsError
from kvtier.cli import cli

ALONE, TOGETHER = 55.0, 40.0  # GB/s per GPU: alone, and while all four copy at once


def fake(n=4, fail=()):
    def host_device(gpus, nbytes, direction):
        if ("host", direction) in fail:
            raise RuntimeError("copy engine fell over")
        rate = ALONE if len(gpus) == 1 else TOGETHER
        return [rate - (0.5 if direction == "d2h" else 0.0)] * len(gpus)

    def peer(i, j, nbytes):
        if ("peer", i, j) in fail:
            raise RuntimeError("no route")
        return 48.0 if abs(i - j) == 1 else 20.0

    return Measure(lambda: n, host_device, peer, lambda i, j: abs(i - j) == 1)


def fake_read(i):
    return {"numa_node": i // 2, "peers": [{"nvml_index": j, "path": "NODE" if i // 2 == j // 2 else "SYS"}
                                           for j in range(4) if j != i]}  # fmt: skip


def test_four_gpus_alone_together_pairs_topology():
    steps = []
    r = run_multi(size=1 << 20, measure=fake(), read=fake_read, on_step=steps.append)
    assert r.gpus == 4 and r.note is None and not r.errors
    assert r.alone["h2d"] == [ALONE] * 4 and r.together["h2d"] == [TOGETHER] * 4
    assert r.total("h2d") == 4 * TOGETHER
    assert r.peer_gbps[0][1] == 48.0 and r.peer_gbps[0][3] == 20.0 and r.peer_gbps[2][2] is None
    assert r.peer_access[0][1] is True and r.peer_access[0][2] is False
    assert r.topology[0] == ["X", "NODE", "SYS", "SYS"] and r.numa_nodes == [0, 0, 1, 1]
    assert "h2d all gpus" in steps and "peer 3->2" in steps
    lines = summary_lines(r.to_json())
    assert any("all GPUs at once: 160.0 GB/s total" in x for x in lines)


def test_ceilings_version_2_round_trip(tmp_path):
    base = Ceilings({"h2d_pinned_gbps": 54.0, "host_memcpy_gbps": 9.0}, gpu="NVIDIA H200", gpu_key="h200")
    c = run_multi(measure=fake(), read=fake_read).ceilings(base)
    assert c.get("h2d_pinned_all_gpus_gbps") == 160.0 and c.get("d2h_pinned_all_gpus_gbps") == 158.0
    assert c.get("peer_gbps") == 20.0 and c.get("h2d_pinned_gbps") == 54.0  # the single probe's figure kept
    assert c.gpus_measured == 4 and c.multi_gpu["topology"][3][0] == "SYS"
    f = tmp_path / "c.json"
    c.save(f)
    assert json.loads(f.read_text())["kvtier_ceilings"] == 2
    back = Ceilings.load(f)
    assert back.to_json() == c.to_json()
    assert back.shared_gbps("h2d", 4) == 40.0 and back.shared_gbps("h2d", 2) == 54.0  # never above alone
    assert back.shared_gbps("h2d", 8) == 20.0


def test_version_1_files_still_load_and_are_written_as_1(tmp_path):
    f = tmp_path / "v1.json"
    f.write_text(json.dumps({"kvtier_ceilings": 1, "figures": {"h2d_pinned_gbps": 50}}))
    c = Ceilings.load(f)
    assert c.multi_gpu is None and c.gpus_measured is None and c.shared_gbps("h2d", 4) is None
    assert c.to_json()["kvtier_ceilings"] == 1


@pytest.mark.parametrize(
    ("multi", "match"),
    [({"gpus": 2, "bogus": 1}, "unknown keys"), ({"gpus": 0}, "positive int"), ([1], "expected an object")],
)
def test_bad_multi_gpu_block(multi, match):
    with pytest.raises(CeilingsError, match=match):
        Ceilings.from_json({"kvtier_ceilings": 2, "figures": {}, "multi_gpu": multi})


def test_one_gpu_says_so():
    r = run_multi(measure=fake(n=1), read=fake_read)
    assert "1 GPU visible" in r.note and r.together == {} and r.peer_gbps == [[None]]
    c = r.ceilings()
    assert c.get("h2d_pinned_gbps") == ALONE and c.get("h2d_pinned_all_gpus_gbps") is None
    assert c.gpus_measured == 1 and c.to_json()["kvtier_ceilings"] == 2  # the block is there: version 2


def test_no_gpu():
    r = run_multi(measure=fake(n=0), read=fake_read)
    assert "0 GPUs visible" in r.note and r.topology == [] and r.ceilings().figures == {}


def test_a_failing_step_keeps_the_others():
    r = run_multi(measure=fake(fail={("host", "d2h"), ("peer", 0, 1)}), read=fake_read)
    assert "d2h gpu0 alone" in r.errors and "peer 0->1" in r.errors
    assert r.total("d2h") is None and r.total("h2d") == 160.0 and r.peer_gbps[1][0] == 48.0
    assert "d2h_pinned_all_gpus_gbps" not in r.ceilings().figures


def test_topology_through_fake_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(nvmlDeviceGetNumaNodeId=lambda h: int(h[1])))
    matrix, numa, err = topology(2)
    assert err is None and matrix == [["X", "NODE"], ["NODE", "X"]] and numa == [0, 1]
    monkeypatch.setitem(
        sys.modules, "pynvml", _fake_pynvml(nvmlInit=lambda: (_ for _ in ()).throw(OSError("x")))
    )
    matrix, numa, err = topology(2)
    assert "NVML is not available" in err and numa == [nvml.UNKNOWN] * 2


def _path(f, shared):
    r = CliRunner().invoke(cli, ["path", "--ceilings", str(f), "--shared-by", str(shared), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    return d, next(h for h in d["path"]["hops"] if "GPU <-> host" in h["name"])


def test_path_shared_by_uses_the_measured_contended_rate(tmp_path):
    f = tmp_path / "c.json"
    base = Ceilings({"h2d_pinned_gbps": 54.0, "d2h_pinned_gbps": 53.0}, gpu="NVIDIA H200", gpu_key="h200")
    run_multi(measure=fake(), read=fake_read).ceilings(base).save(f)
    d, hop = _path(f, 4)
    assert hop["gbps"] == pytest.approx(TOGETHER) and "--all-gpus" in d["link"]["source"]
    d, hop = _path(f, 1)
    assert hop["gbps"] == 54.0  # alone: the single-GPU measurement
    v1 = tmp_path / "v1.json"
    v1.write_text(json.dumps({"kvtier_ceilings": 1, "gpu_key": "h200", "figures": {"h2d_pinned_gbps": 54.0}}))
    d, hop = _path(v1, 4)
    assert hop["gbps"] == pytest.approx(54.0 / 4)  # no contended figure: the alone rate divided


def test_cli_all_gpus_on_this_machine(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() >= 2:
        pytest.skip("a real multi-GPU run is the gpu tests' business")
    save = tmp_path / "c.json"
    r = CliRunner().invoke(cli, ["probe", "--quick", "--all-gpus", "--json", "--save", str(save)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert "visible" in doc["multi_gpu"]["note"]
    assert Ceilings.load(save).to_json() == doc["ceilings"]
    r = CliRunner().invoke(cli, ["probe", "--size", "4MiB", "--all-gpus"])
    assert r.exit_code == 0 and "visible: nothing is shared" in r.output


@pytest.mark.gpu
def test_real_gpus_quick():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = run_multi(quick=True)
    n = torch.cuda.device_count()
    assert r.gpus == n and not r.errors, r.errors
    assert all(v > 0 for v in r.alone["h2d"] + r.alone["d2h"])
    if n >= 2:
        assert r.total("h2d") > 0 and r.total("d2h") > 0 and r.slowest_peer() > 0
        assert all(r.peer_access[i][j] in (True, False) for i in range(n) for j in range(n) if i != j)
        c = r.ceilings()
        assert c.get("h2d_pinned_all_gpus_gbps") and c.multi_gpu["topology"][0][0] == "X"
