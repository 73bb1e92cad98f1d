"""What `kvtier probe` and `kvtier bench` print: every figure with its reference and ratio, each
ceiling with its spread, in tables that keep to the terminal's width (`terminal.py`).

    probe_header(doc) / print_probe(doc)   the machine, then each figure beside its datasheet value
    print_bench(doc)                       a table per suite (the ttft suite: p50 / p90 / p99 and
                                           the planner's error per row), then the ceilings
    bench_status_lines(doc)                skipped and failed suites and cases

A ratio above 100% (a row faster than its ceiling, a measured figure above its datasheet value)
is a measurement problem, never a speed: it is printed as "over" and explained under the table.
"""

from __future__ import annotations

from kvtier.bench.result import over_ceiling
from kvtier.bench.terminal import Footnotes, compact_table, console, say

OVER = "[bold red]over[/]"


def _num(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def _pct(r: float | None) -> str:
    if r is None:
        return "-"
    return OVER if r > 1.0 else f"{r * 100:.0f}%"


def _spread(low: float | None, high: float | None, samples: int | None) -> str:
    if low is None or high is None:
        return "-"
    return f"{_num(low)}-{_num(high)} ({samples})"


def probe_header(doc: dict) -> list[str]:
    """Lines above the probe table: GPU, link, NUMA, sizes; or why there is no GPU."""
    env = doc.get("environment", {})
    sizes = ", ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in doc.get("sizes", {}).items() if v)
    if doc.get("no_gpu_reason"):
        return [
            f"[bold yellow]No GPU:[/] {doc['no_gpu_reason']}. Measuring what this CPU machine can.",
            f"sizes: {sizes}",
        ]
    topo = env.get("topology", {})
    lines = [
        f"[bold]{doc.get('gpu')}[/] ({doc.get('gpu_key') or 'not in kvtier.specs'}), "
        f"driver {env.get('driver')}, CUDA {env.get('cuda')}, torch {env.get('torch')}"
    ]
    if "error" in topo:
        lines.append(f"NVML: {topo['error']}")
    else:
        p = topo.get("pcie", {})
        lines.append(
            f"PCIe link: Gen{p.get('gen_max')} x{p.get('width_max')} max, Gen{p.get('gen_current')} "
            f"x{p.get('width_current')} now (GPU supports Gen{p.get('gen_gpu_max')}); "
            f"bus {topo.get('pci_bus_id')}, "
            f"NUMA node {topo.get('numa_node')}, NVLinks active {topo.get('nvlinks_active')}"
        )
        for peer in topo.get("peers", []):
            lines.append(f"  to GPU {peer['nvml_index']} (NVML index): {peer['path']}")
    if doc.get("link"):
        link = doc["link"]
        lines.append(
            f"datasheet link: {link['name']}, {_num(link.get('theoretical_gbps'))} GB/s per direction in "
            f"theory, {_num(link.get('typical_gbps'))} GB/s typical (kvtier.specs)"
        )
    lines.append(f"sizes: {sizes}")
    return lines


def print_probe(doc: dict) -> None:
    """The header, then each figure: its median, slowest-fastest over its runs, the datasheet."""
    con = console()
    for line in probe_header(doc):
        con.print(line)
    what = Footnotes()
    t = compact_table(
        "kvtier probe: measured ceilings vs datasheet", "figure", "median", "unit", "min-max (runs)",
        "datasheet", "ratio", "what",
    )  # fmt: skip
    over = []
    for f in doc["figures"]:
        if f["error"]:
            t.add_row(f["name"], "[red]failed[/]", f["unit"], "-", "-", "-", what.ref(f["error"]))
            continue
        t.add_row(
            f["name"],
            _num(f["value"]),
            f["unit"],
            _spread(f.get("min"), f.get("max"), f.get("samples")),
            _num(f["datasheet"]),
            _pct(f["ratio"]),
            what.ref(f["what"]),
        )
        if f["ratio"] is not None and f["ratio"] > 1.0:
            ref = f.get("datasheet_what") or "the datasheet"
            over.append(f"{f['name']} {_num(f['value'])} {f['unit']} against {_num(f['datasheet'])} ({ref})")
    con.print(t)
    what.print_new()
    if over:
        say(
            "over: measured above the datasheet, which no device does: "
            + ", ".join(over)
            + ". The measurement is in doubt (a cache, a clock, too small a size), not a speed."
        )


def _ceiling_refs(doc: dict) -> dict[str, str]:
    """A letter per ceiling the rows compare against, in the order they first appear."""
    refs: dict[str, str] = {}
    for r in doc["rows"]:
        if r["ceiling"] not in refs:
            refs[r["ceiling"]] = "abcdefghijklmnopqrstuvwxyz"[len(refs) % 26]
    return refs


def _notes(r: dict) -> list[str]:
    notes = []
    tf = r["params"].get("traffic_factor", 1.0)
    if tf != 1.0:
        notes.append(f"x{tf:g} traffic: the ceiling counts bytes read + written")
    if "submit_ms" in r["params"]:
        notes.append(f"submit {r['params']['submit_ms']:.1f} ms CPU for {r['params'].get('copies')} copies")
    return notes


def _ok(r: dict) -> str:
    return {True: "[green]yes[/]", False: "[bold red]NO[/]", None: "-"}[r["correct"]]


def _rate_table(suite: str, rows: list[dict], refs: dict[str, str], notes: Footnotes):
    t = compact_table(
        f"{suite}: payload GB/s against the same-run ceiling of its hop",
        "case", "MiB", "median ms", "GB/s", "of ceiling", "ok", "note",
    )  # fmt: skip
    for r in rows:
        t.add_row(
            r["case"],
            f"{r['bytes'] / 2**20:,.1f}",
            f"{r['median_ms']:.3f}",
            _num(r["gbps"]),
            f"{_pct(r['ratio'])} {refs[r['ceiling']]}",
            _ok(r),
            notes.ref(*_notes(r)),
        )
    return t


def _ttft_table(rows: list[dict]):
    n = {r["params"].get("timing", {}).get("count") for r in rows}
    runs = f"{n.pop()} runs" if len(n) == 1 else "its runs"
    t = compact_table(
        f"ttft: time to first token in ms over {runs}, and the planner's prediction",
        "case", "p50", "p90", "p99", "predicted", "error", "ok",
    )  # fmt: skip
    for r in rows:
        p, tm = r["params"], r["params"].get("timing", {})
        err = p.get("error_pct")
        t.add_row(
            r["case"],
            f"{r['median_ms']:,.1f}",
            f"{tm['p90_ms']:,.1f}" if "p90_ms" in tm else "-",
            f"{tm['p99_ms']:,.1f}" if "p99_ms" in tm else "-",
            f"{p['predicted_ms']:,.1f}" if "predicted_ms" in p else "-",
            f"{err:+.0f}%" if err is not None else "-",
            _ok(r),
        )
    return t


def print_bench(doc: dict) -> None:
    """A table per suite, then the ceilings (median, slowest-fastest, runs, size), then every row
    that ran over its ceiling, named as the measurement problem it is."""
    con = console()
    refs, notes = _ceiling_refs(doc), Footnotes()
    suites: dict[str, list[dict]] = {}
    for r in doc["rows"]:
        suites.setdefault(r["suite"], []).append(r)
    for suite, rows in suites.items():
        if suite == "ttft":
            con.print(_ttft_table(rows))
            say("error: predicted / measured p50 - 1 (params predicted_ms, error_pct).")
        else:
            con.print(_rate_table(suite, rows, refs, notes))
            notes.print_new()
    spread = doc["environment"].get("ceilings_spread", {})
    ceilings = doc["environment"].get("ceilings", {})
    if refs:
        con.print("ceilings measured in this run: median GB/s (slowest-fastest over its runs, size)")
    for name, letter in refs.items():
        s = spread.get(name)
        more = (
            f" ({_num(s['min'])}-{_num(s['max'])} over {s['samples']} runs of {s['bytes'] / 2**20:,.0f} MiB)"
        )
        con.print(
            f"  {letter}  {name} {_num(ceilings.get(name))} GB/s" + (more if s and s.get("bytes") else "")
        )
    over = [r for r in doc["rows"] if r["suite"] != "ttft" and over_ceiling(r)]
    if over:
        cases = ", ".join(
            f"{r['suite']}/{r['case']} {_num(r['gbps'])} GB/s against {r['ceiling']} "
            f"{_num(r['ceiling_gbps'])}"
            for r in over
        )
        say(
            f"[bold red]over[/]: {len(over)} row(s) ran faster than their ceiling: {cases}. That is a "
            "measurement problem, not a speed: the row's bytes stayed in a cache, or the ceiling was "
            "measured low (noise, a cold or too small a probe: see its slowest-fastest). Re-run on a "
            "quiet machine, or measure the ceiling with `kvtier probe`.",
            markup=True,
        )


def bench_status_lines(doc: dict) -> list[str]:
    out = []
    for name, s in doc["suites"].items():
        if s["status"] != "ran":
            colour = "red" if s["status"] == "failed" else "yellow"
            out.append(f"[{colour}]{s['status']}[/] {name}: {s['reason']}")
    for c in doc.get("skipped_cases", []):
        out.append(f"[yellow]skipped[/] {c['suite']}/{c['case']}: {c['reason']}")
    return out
