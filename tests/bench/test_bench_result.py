"""The result-file schema: what makes a row trustworthy, file naming, never overwriting."""

import copy
import json

import pytest

from kvtier.bench import result
from kvtier.bench.env import slug
from kvtier.bench.stats import summarize
from kvtier.bench.suite import Context


def _doc() -> dict:
    ctx = Context("cpu", quick=True)
    ctx.ceilings = {"host_memcpy": 10.0, "d2d_copy": 4000.0}  # as if measured in this run
    ctx.suite = "s"
    t = summarize([2.0, 1.0, 3.0])
    rows = [
        ctx.row("a", 2_000_000, t, "host_memcpy", block_size=16, path="p"),
        ctx.row("b", 2_000_000, t, "d2d_copy", traffic_factor=2, correct=True, block_size=4, path="p"),
    ]
    env = {k: None for k in result.ENV_KEYS} | {"ceilings": dict(ctx.ceilings), "python": "3.12"}
    from dataclasses import asdict

    return result.build(
        env, {"s": {"status": "ran", "rows": 2, "reason": None}}, [asdict(r) for r in rows], []
    )


def test_valid_document_passes_and_row_math_holds():
    doc = _doc()
    result.validate(doc)
    a, b = doc["rows"]
    assert a["gbps"] == pytest.approx(1.0) and a["ratio"] == pytest.approx(0.1)
    assert b["ratio"] == pytest.approx(1.0 * 2 / 4000)  # read + write against a read+write ceiling
    assert b["params"]["traffic_factor"] == 2.0 and b["correct"] is True
    json.dumps(doc)  # JSON-ready as is


def _broken(mutate) -> list[str]:
    doc = copy.deepcopy(_doc())
    mutate(doc)
    return result.problems(doc)


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (lambda d: d["rows"][0].update(ratio=0.5), "ratio"),
        (lambda d: d["rows"][1]["params"].update(traffic_factor=1.0), "ratio"),
        (lambda d: d["rows"][0].update(gbps=2.0), "gbps"),
        (lambda d: d["rows"][0].update(ceiling_gbps=11.0), "ceiling_gbps"),  # a ceiling from another run
        (lambda d: d["environment"]["ceilings"].pop("host_memcpy"), "not measured in this run"),
        (lambda d: d["rows"][0].pop("max_ms"), "missing fields"),
        (lambda d: d["rows"][0].update(extra=1), "unknown fields"),
        (lambda d: d["rows"][0].update(bytes=True), "bytes"),
        (lambda d: d["rows"][0].update(bytes="2MB"), "bytes"),
        (lambda d: d["rows"][0].update(correct="yes"), "correct"),
        (lambda d: d["rows"][0].update(min_ms=2.5), "min_ms <= median_ms"),
        (lambda d: d["rows"][0].update(median_ms=float("nan")), "finite"),
        (lambda d: d["suites"]["s"].update(rows=3), "suites.s.rows"),
        (lambda d: d["suites"]["s"].update(status="maybe"), "suites.s"),
        (lambda d: d["suites"].pop("s"), "no entry in suites"),
        (lambda d: d["environment"].pop("commit"), "environment.commit"),
        (lambda d: d["environment"]["ceilings"].update(x=-1), "environment.ceilings.x"),
        (lambda d: d.update(kvtier_bench=2), "not a kvtier result file"),
        (lambda d: d.update(rows={}), "rows"),
    ],
)
def test_schema_violations_are_named(mutate, expect):
    errs = _broken(mutate)
    assert errs and any(expect in e for e in errs), errs


def test_validate_raises_value_error_listing_problems():
    doc = _doc()
    doc["rows"][0]["ratio"] = 9.0
    with pytest.raises(ValueError, match="ratio"):
        result.validate(doc)


def test_file_name_and_no_silent_overwrite(tmp_path):
    doc = _doc()
    paths = [result.write(doc, tmp_path / "out", slug("NVIDIA H200"), "2026-11-29") for _ in range(3)]
    assert [p.name for p in paths] == [
        "nvidia-h200-2026-11-29.json",
        "nvidia-h200-2026-11-29-2.json",
        "nvidia-h200-2026-11-29-3.json",
    ]
    assert result.load(paths[0]) == doc


def test_invalid_document_is_not_written(tmp_path):
    doc = _doc()
    doc["rows"][0]["gbps"] = 123.0
    with pytest.raises(result.ResultSchemaError):
        result.write(doc, tmp_path, "cpu", "2026-11-29")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "name, expect",
    [("NVIDIA H200", "nvidia-h200"), ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"), ("  ", "unknown")],
)
def test_slug(name, expect):
    assert slug(name) == expect


def test_named_commit_wins_over_git(monkeypatch, tmp_path):
    """A GPU box may hold a stale .git: KVTIER_COMMIT (what was copied) wins over its HEAD."""
    from kvtier.bench.env import git_commit

    monkeypatch.setenv("KVTIER_COMMIT", "abc123")
    assert git_commit() == ("abc123", None)
    monkeypatch.delenv("KVTIER_COMMIT")
    commit, _dirty = git_commit(tmp_path)  # no git here: unknown, never another checkout's HEAD
    assert commit is None
