"""`kvtier trace` on the simulator: the PNG is written, the JSON holds the intervals and the ordering
facts, and compute that skips its per-layer waits turns the fact false (the check can fail)."""

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from kvtier.bench.timeline import check_facts  # noqa: E402
from kvtier.cli import cli, trace  # noqa: E402, F401 - registers the command


def _run(tmp_path, *args):
    out = tmp_path / "trace.png"
    res = CliRunner().invoke(cli, ["trace", "--device", "sim", "--out", str(out), "--json", *args])
    return res, out


def test_trace_writes_png_and_facts_hold(tmp_path):
    res, out = _run(tmp_path, "--layers", "4", "--tokens", "40")
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(res.output)
    assert doc["ok"] and doc["facts"]["compute_after_layer"] and doc["facts"]["copy_waits_real"]
    assert doc["facts"]["per_layer"] == [True] * 4
    assert {w["event"] for w in doc["facts"]["waits"]} >= {"e_write", "e_read"}
    # the load was submitted while a decode still read its destination blocks: it visibly waited
    assert any(i["stream"] == "load" and i["kind"] == "wait" for i in doc["intervals"])
    streams = {i["stream"] for i in doc["intervals"]}
    assert streams == {"compute", "save", "load"}
    assert all(i["end_ms"] > i["start_ms"] >= 0 for i in doc["intervals"])
    attn = [i for i in doc["intervals"] if i["label"].startswith("attn")]
    assert len(attn) == 4 and len(doc["markers"]) == 4 and len(doc["links"]) == 4
    for link in doc["links"]:  # the picture's arrows: layer event -> attention start, never backwards
        assert link["to_ms"] >= link["from_ms"] - 1e-3
    assert doc["params"]["load_path"] == "kernel"  # auto: a true event per layer


def test_trace_staged_load_all_layers_wait_for_the_job(tmp_path):
    res, _ = _run(tmp_path, "--layers", "3", "--path", "staged")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["ok"] and doc["params"]["load_path"] == "staged"
    times = {round(m["t_ms"], 6) for m in doc["markers"]}
    assert len(times) == 1  # staged: every layer's event is the job's final event


def test_trace_without_layer_waits_fails(tmp_path):
    res, out = _run(tmp_path, "--layers", "4", "--no-wait")
    assert res.exit_code == 1  # a false fact fails the command
    doc = json.loads(res.output)
    assert not doc["ok"] and not doc["facts"]["compute_after_layer"]
    assert not doc["facts"]["per_layer"][0]  # attention 0 started before layer 0 landed
    assert out.exists()  # the picture is drawn anyway: that is where the red arrows show


def test_trace_human_output(tmp_path):
    out = tmp_path / "t.png"
    res = CliRunner().invoke(cli, ["trace", "--device", "sim", "--layers", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "compute started layer i only after layer i arrived: True" in res.output


def test_trace_bad_out_folder(tmp_path):
    res = CliRunner().invoke(cli, ["trace", "--device", "sim", "--out", str(tmp_path / "no" / "t.png")])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_check_facts_catches_unrecorded_and_late_waits():
    good = {"stream": "save", "event": "e", "recorded": True, "t_ms": 1.0, "guards_end_ms": 2.0}
    f = check_facts([1.0, 2.0], [1.5, 2.0], [good])
    assert f["compute_after_layer"] and f["copy_waits_real"]
    assert not check_facts([1.0, 2.0], [1.5, 1.9], [good])["compute_after_layer"]
    nothing = good | {"recorded": False, "t_ms": None}  # a wait on an event never recorded
    assert not check_facts([1.0], [1.0], [nothing])["copy_waits_real"]
    late = good | {"t_ms": 3.0}  # the guarded copy finished before the event it should follow
    assert not check_facts([1.0], [1.0], [late])["copy_waits_real"]
