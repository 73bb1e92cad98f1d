"""Figures a user trusts at a glance: every ceiling is a spread over repeated runs on buffers past
any cache (disk: several IOs in flight, past the page cache); a row above its ceiling is shown as
the measurement problem it is, never as a speed; the ttft table gives p50 / p90 / p99 and each
row's prediction error; the plot draws bars per path against their ceiling and the size sweep."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvtier.bench.stats import Rate, summarize

SRC = str(Path(__file__).resolve().parents[2] / "src")
MiB = 1 << 20


def test_a_rate_keeps_its_spread_through_copies_and_reads_as_its_median():
    r = Rate.of(2 * 10**9, summarize([900.0, 1000.0, 1100.0]), nbytes=2 * 10**9)
    assert float(r) == pytest.approx(2.0) and r.low < r < r.high and r.samples == 3
    for c in (copy.deepcopy(r), pickle.loads(pickle.dumps(r))):
        assert (c.low, c.high, c.samples, c.nbytes) == (r.low, r.high, r.samples, r.nbytes)
    assert json.loads(json.dumps({"x": r})) == {"x": pytest.approx(2.0)}


def test_a_run_ceiling_is_a_spread_over_repeated_runs_past_the_caches():
    from kvtier.bench import Context

    ctx = Context("cpu", quick=True)  # quick too: a 16 MiB copy sits in a large last-level cache
    r = ctx.ceiling("host_memcpy")
    assert isinstance(r, Rate) and r.samples >= 3 and r.low <= r <= r.high
    assert r.nbytes >= 256 * MiB


def test_the_disk_ceiling_reads_past_the_page_cache_with_several_ios_in_flight(tmp_path, monkeypatch):
    from kvtier.bench import probes_io
    from kvtier.bench.timing import Timer

    readers, real = set(), os.preadv

    def preadv(fd, bufs, offset):
        readers.add(threading.get_ident())
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    r = probes_io.disk_read(Timer("cpu", min_reps=3, budget_s=0.05), MiB, root=tmp_path)
    assert r.nbytes >= 256 * MiB and r.samples >= 3 and r.low <= r <= r.high
    assert len(readers) > 1  # a device reaches its rate only with IOs in flight
    assert list(tmp_path.iterdir()) == []  # the probe's file is gone


def _row(suite, case, gbps, ceiling, ceiling_gbps, **params):
    nbytes = 64 * MiB
    ms = nbytes / gbps / 1e6
    return {
        "suite": suite, "case": case, "bytes": nbytes, "median_ms": ms, "min_ms": 0.9 * ms,
        "max_ms": 1.2 * ms, "gbps": gbps, "ceiling": ceiling, "ceiling_gbps": ceiling_gbps,
        "ratio": gbps / ceiling_gbps, "params": {"traffic_factor": 1.0} | params, "correct": True,
    }  # fmt: skip


def _doc():
    timing = {"p10_ms": 25.0, "p50_ms": 27.2, "p90_ms": 33.3, "p99_ms": 44.4, "count": 5}
    rows = [
        _row("sglang", "raw disk read", 1.78, "disk_read", 0.739, path="raw disk read"),
        _row("store", "load disk", 0.465, "disk_read", 0.739, path="disk tier load"),
        _row(
            "ttft",
            "256 load host",
            0.02,
            "host_memcpy",
            2.12,
            predicted_ms=57.3,
            error_pct=111.0,
            timing=timing,
        ),
    ]
    rows[2]["median_ms"] = 27.2
    spread = {
        "disk_read": {"median": 0.739, "min": 0.70, "max": 0.78, "samples": 10, "bytes": 256 * MiB},
        "host_memcpy": {"median": 2.12, "min": 2.0, "max": 2.2, "samples": 10, "bytes": 256 * MiB},
    }
    env = {"ceilings": {"disk_read": 0.739, "host_memcpy": 2.12}, "ceilings_spread": spread}
    return {"environment": env, "rows": rows, "suites": {}}


def _print_bench_at_80(doc) -> str:
    code = (
        f"import json; from kvtier.bench.report import print_bench as p; p(json.loads({json.dumps(doc)!r}))"  # noqa: E501
    )
    env = os.environ | {"COLUMNS": "80", "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert max(len(x) for x in r.stdout.splitlines()) <= 80, r.stdout
    return r.stdout


def test_a_row_over_its_ceiling_is_a_measurement_problem_not_a_speed():
    out = _print_bench_at_80(_doc())
    assert "241%" not in out and "over a" in out  # 1.78 / 0.739: never printed as a ratio
    flat = " ".join(out.split())
    assert "sglang/raw disk read 1.78 GB/s against disk_read 0.739" in flat
    assert "measurement problem, not a speed" in flat
    assert "63% b" not in out and "63% a" in out  # the row under its ceiling keeps its ratio
    assert "disk_read 0.739 GB/s (0.7-0.78 over 10 runs of 256 MiB)" in flat


def test_the_ttft_table_gives_percentiles_and_each_rows_prediction_error():
    out = _print_bench_at_80(_doc())
    lines = out.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("ttft:"))
    assert all(w in " ".join(lines[head : head + 5]) for w in ("p50", "p90", "p99", "predicted", "error"))
    row = next(x for x in lines if x.lstrip().startswith("256 load host"))
    assert row.split()[3:8] == ["27.2", "33.3", "44.4", "57.3", "+111%"]


def test_results_markdown_names_an_over_ceiling_row_and_the_ceilings_spread():
    from kvtier.bench.summary import markdown

    doc = _doc()
    doc["environment"] |= {k: "x" for k in ("gpu", "driver", "torch", "triton", "commit", "date")}
    md = markdown(doc)
    assert "over its ceiling (1.78 against 0.739 GB/s)" in md and "241" not in md
    assert "disk_read 0.74 GB/s (0.70-0.78, 10 runs)" in md


def test_the_probe_table_shows_each_figures_spread_and_flags_one_above_its_datasheet(capsys):
    from kvtier.bench.report import print_probe

    fig = {"name": "h2d_pinned_gbps", "value": 57.0, "min": 55.0, "max": 57.5, "samples": 10, "unit": "GB/s",
           "what": "host->device", "datasheet": 50.0, "datasheet_what": "PCIe Gen5 typical", "ratio": 1.14,
           "error": None}  # fmt: skip
    print_probe({"no_gpu_reason": "none here", "sizes": {"host": 256 * MiB}, "figures": [fig]})
    out = capsys.readouterr().out
    assert "55-57.5 (10)" in out and "114%" not in out and "over" in out


def test_the_plot_draws_bars_per_path_against_their_ceiling_and_the_size_sweep(tmp_path):
    from kvtier.bench import plot

    rows = [_row("vllm", f"save {o} 128 tokens", 0.03 + i / 100, "host_memcpy", 2.12, order=o, block_size=16)
            for i, o in enumerate(("LBHNC", "BHLNC", "BLNHC"))]  # fmt: skip
    rows += [_row("sglang", "raw disk read", 1.78, "disk_read", 0.739, path="raw disk read")]
    rows += [_row("ttft", "256 load host", 0.02, "host_memcpy", 2.12)]
    for i, n in enumerate((1, 4, 16, 64, 256, 1024)):
        ms = n * MiB / (1.0 + i) / 1e6
        r = _row("sizes", f"memcpy {n} MiB", 1.0 + i, "host_memcpy", 8.0, path="memcpy")
        rows.append(r | {"bytes": n * MiB, "median_ms": ms, "min_ms": 0.9 * ms, "max_ms": 1.2 * ms})
    picked = plot.bars(rows)
    assert [(r["case"], len(same)) for r, same in picked] == [
        ("save LBHNC 128 tokens", 3),
        ("raw disk read", 1),
    ]
    fig = plot.figure(rows, "t", _doc()["environment"]["ceilings_spread"])
    paths, sizes = fig.axes[:2]
    labels = [t.get_text() for t in paths.get_yticklabels()]
    assert sorted(labels) == ["sglang: raw disk read", "vllm: save 128 tokens (3 rows: 1%-2%)"]
    notes = [t.get_text() for t in paths.texts]
    assert "over disk_read: measurement problem" in notes and not any("241" in n for n in notes)
    assert len(paths.containers) >= 2 * len(picked)  # a bar and its ceiling's, each with error bars
    ticks = [t.get_text() for t in sizes.get_xticklabels()]
    assert ticks == ["1 MiB", "4 MiB", "16 MiB", "64 MiB", "256 MiB", "1 GiB"]
    fig.canvas.draw()  # tick labels are formatted at draw time
    shown = [t.get_text() for ax in fig.axes for t in ax.get_xticklabels() + ax.get_yticklabels()]
    assert "0.000" not in shown and not any(t.endswith(".000") for t in shown)
    legend = sizes.get_legend()
    assert legend is not None and legend.get_bbox_to_anchor().x0 >= sizes.get_window_extent().x1 - 1
    assert plot.plot(rows, tmp_path / "p.png", "t") == tmp_path / "p.png"
    assert plot.plot([r for r in rows if r["suite"] == "ttft"], tmp_path / "q.png", "t") is None
