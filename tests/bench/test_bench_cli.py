"""`kvtier probe` and `kvtier bench` through click's CliRunner, on whatever this machine has."""

import json

import pytest
from click.testing import CliRunner

import kvtier.cli.measure  # noqa: F401 - registers the commands
from kvtier.bench import Context, register, result
from kvtier.ceilings import Ceilings
from kvtier.cli import cli

torch = pytest.importorskip("torch")
ON_GPU = torch.cuda.is_available()


@register("cli_host_copy", needs_gpu=False, description="a user's suite: one host copy")
def host_copy(ctx: Context):
    """A suite registered from outside kvtier through its public names, cheap on any machine."""
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = ctx.time(lambda: dst.copy_(src), name="copy", host=True)
    yield ctx.row("1MiB", src.numel(), t, "host_memcpy", correct=bool(torch.equal(dst, src)))


def _run(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_bench_quick_writes_a_valid_result_file_and_plot(tmp_path):
    r = _run(["bench", "--quick", "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    result.validate(doc)
    files = sorted(p.name for p in tmp_path.iterdir())
    stem = ("nvidia" if ON_GPU else "cpu") + "-"
    assert len(files) == 2 and all(f.startswith(stem) for f in files), files
    assert files[0].endswith(".json") and files[1].endswith(".png")
    on_disk = result.load(tmp_path / files[0])
    assert on_disk["rows"] == doc["rows"] and doc["rows"]
    assert doc["suites"]["cli_host_copy"]["status"] == "ran"
    spread = doc["environment"]["ceilings_spread"]  # every ceiling: median, slowest, fastest, runs
    assert set(spread) == set(doc["environment"]["ceilings"])
    assert all(s["samples"] >= 3 and s["min"] <= s["median"] <= s["max"] for s in spread.values())
    assert all(r["correct"] is not False for r in doc["rows"])
    if not ON_GPU:
        assert doc["suites"]["gather_d2d"] == {
            "status": "skipped",
            "rows": 0,
            "reason": "needs a CUDA GPU, and torch finds none",
        }
    # a second run the same day gets a suffix instead of overwriting
    r = _run(["bench", "--quick", "--out", str(tmp_path), "--no-plot", "--suite", "cli_host_copy", "--json"])
    assert r.exit_code == 0
    assert any(p.name.endswith("-2.json") for p in tmp_path.iterdir())


def test_bench_table_output_and_profile_trace(tmp_path):
    trace = tmp_path / "trace.json"
    out = tmp_path / "results"
    r = _run(["bench", "--quick", "--out", str(out), "--suite", "cli_host_copy", "--profile", str(trace)])
    assert r.exit_code == 0, r.output
    assert "cli_host_copy: payload GB/s" in r.output and "ceilings measured in this run" in r.output
    assert "a  host_memcpy" in r.output
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "suite/cli_host_copy" in names and "ceilings" in names  # the stages show on the timeline
    doc = result.load(next(out.glob("*.json")))
    assert doc["environment"]["profiled"] is True
    png = tmp_path / "again.png"  # a result file drawn again, as `kvtier bench` drew it
    r = _run(["results", str(next(out.glob("*.json"))), "--plot", str(png)])
    assert r.exit_code == 0 and png.stat().st_size > 10_000 and "cli_host_copy" in r.stdout


def test_bench_unknown_suite_is_a_usage_error(tmp_path):
    r = _run(["bench", "--suite", "nope", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "unknown 'nope'" in r.output and "gather_d2d" in r.output
    assert not list(tmp_path.iterdir())


def test_bench_list():
    r = _run(["bench", "--list"])
    assert r.exit_code == 0 and "gather_d2d" in r.output and "cli_host_copy" in r.output


def test_bench_writes_to_kvtier_results_by_default():
    r = _run(["bench", "--help"])
    assert r.exit_code == 0 and "[default: kvtier-results]" in r.output


def test_probe_quick_json_and_save(tmp_path):
    save = tmp_path / "ceilings.json"
    r = _run(["probe", "--quick", "--json", "--save", str(save)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    c = Ceilings.load(save)
    assert c.get("host_memcpy_gbps") > 0
    assert c.to_json() == doc["ceilings"]
    names = {f["name"] for f in doc["figures"]}
    if ON_GPU:
        assert {"d2d_copy_gbps", "h2d_pinned_gbps", "bf16_tflops", "launch_graph_us"} <= names
    else:
        assert doc["no_gpu_reason"] and names == {"host_memcpy_gbps"}


def test_probe_table_says_no_gpu():
    if ON_GPU:
        pytest.skip("this machine has a GPU")
    r = _run(["probe", "--size", "4MiB"])
    assert r.exit_code == 0, r.output
    assert "No GPU" in r.output and "host_memcpy_gbps" in r.output


@pytest.mark.parametrize("size", ["12", "2000000", "lots", "0", "1.5XB"])
def test_probe_bad_size_is_a_usage_error(size):
    r = _run(["probe", "--size", size])
    assert r.exit_code == 2 and "--size" in r.output


def test_probe_save_into_missing_folder_is_a_usage_error(tmp_path):
    r = _run(["probe", "--save", str(tmp_path / "no" / "c.json")])
    assert r.exit_code == 2 and "does not exist" in r.output
