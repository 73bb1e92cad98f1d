"""Every command that works for more than a moment shows what it is doing and the time left, on
stderr (stdout stays the report); and the demo leads with the first token against recomputing."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import kvtier.cli.measure  # noqa: F401 - registers the commands
import kvtier.cli.trace  # noqa: F401
from kvtier.cli import cli

pytest.importorskip("torch")


def _progress(r) -> list[str]:
    return [x for x in r.stderr.replace("\r", "\n").splitlines() if "left" in x]


def test_demo_shows_progress_and_leads_with_recompute():
    pytest.importorskip("transformers")
    from kvtier.cli import demo  # noqa: F401 - registers the command

    r = CliRunner().invoke(cli, ["demo", "--prefix", "256", "--requests", "3", "--new-tokens", "2"])
    assert r.exit_code == 0, r.output
    lines = _progress(r)
    assert any("demo:" in x and "about" in x and "request 1 of 3 (cold)" in x for x in lines), lines
    assert any("host emptied" in x for x in lines) and any("100%" in x for x in lines)
    first = " ".join(r.stdout.split("tokens identical")[0].split())  # the headline, however wrapped
    assert first.startswith("First token") and "sooner with kvtier than recomputing the 256-token" in first
    assert "host" in first and "disk" in first  # each hit's tier and its own factor


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (["probe", "--quick"], "measuring host_memcpy_gbps"),
        (["trace", "--device", "sim"], "save + load beside compute"),
    ],
)
def test_probe_and_trace_show_progress(args, what, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    lines = _progress(r)
    assert any(what in x for x in lines) and any("100%" in x for x in lines), lines
    assert "left" not in r.stdout


def test_no_progress_under_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["trace", "--device", "sim", "--json"])
    assert r.exit_code == 0 and not _progress(r)
