"""Rich tables for `kvtier probe` and `kvtier bench`: every figure with its reference and ratio."""

from __future__ import annotations

from rich.table import Table


def _num(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def _pct(r: float | None) -> str:
    return "-" if r is None else f"{r * 100:.0f}%"


def probe_header(doc: dict) -> list[str]:
    """Lines above the probe table: GPU, link, NUMA, sizes; or why there is no GPU."""
    env = doc.get("environment", {})
    if doc.get("no_gpu_reason"):
        return [f"[bold yellow]No GPU:[/] {doc['no_gpu_reason']}. Measuring what this CPU machine can."]
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
    sizes = ", ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in doc.get("sizes", {}).items() if v)
    lines.append(f"sizes: {sizes}")
    return lines


def probe_table(doc: dict) -> Table:
    t = Table(title="kvtier probe: measured ceilings vs datasheet")
    for col, just in (
        ("figure", "left"),
        ("measured", "right"),
        ("unit", "left"),
        ("datasheet", "right"),
        ("ratio", "right"),
        ("what", "left"),
    ):
        t.add_column(col, justify=just)
    for f in doc["figures"]:
        measured = f"[red]failed: {f['error']}[/]" if f["error"] else _num(f["value"])
        ref = "-" if f["datasheet"] is None else f"{_num(f['datasheet'])}"
        t.add_row(f["name"], measured, f["unit"], ref, _pct(f["ratio"]), f["what"])
    return t


def bench_table(doc: dict) -> Table:
    t = Table(title="kvtier bench")
    for col in ("suite", "case", "MiB", "median ms", "GB/s", "ceiling GB/s", "ratio", "correct", "notes"):
        t.add_column(col, justify="left" if col in ("suite", "case", "notes") else "right")
    for r in doc["rows"]:
        ok = {True: "[green]yes[/]", False: "[bold red]NO[/]", None: "-"}[r["correct"]]
        notes = []
        tf = r["params"].get("traffic_factor", 1.0)
        if tf != 1.0:
            notes.append(f"x{tf:g} traffic")
        if "submit_ms" in r["params"]:
            notes.append(
                f"submit {r['params']['submit_ms']:.1f} ms CPU for {r['params'].get('copies')} copies"
            )
        t.add_row(
            r["suite"],
            r["case"],
            f"{r['bytes'] / 2**20:,.1f}",
            f"{r['median_ms']:.3f}",
            _num(r["gbps"]),
            f"{r['ceiling']} {_num(r['ceiling_gbps'])}",
            _pct(r["ratio"]),
            ok,
            "; ".join(notes),
        )
    return t


def bench_status_lines(doc: dict) -> list[str]:
    out = []
    for name, s in doc["suites"].items():
        if s["status"] != "ran":
            colour = "red" if s["status"] == "failed" else "yellow"
            out.append(f"[{colour}]{s['status']}[/] {name}: {s['reason']}")
    for c in doc.get("skipped_cases", []):
        out.append(f"[yellow]skipped[/] {c['suite']}/{c['case']}: {c['reason']}")
    return out
