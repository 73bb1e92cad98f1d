"""A result file in a few lines: per suite and path, the headline row (16-token blocks, Llama-3-8B
shape), the worst and the best row of the sweep, each as GB/s and its ratio to the same-run ceiling.

Everything is read from the file: nothing here measures or rounds a figure before printing it. A
ratio above 100% is printed as what it is, a measurement problem (a cache, or a ceiling measured
low), never as a speed.
"""

from __future__ import annotations

from collections import defaultdict

from kvtier.bench.result import over_ceiling


def _group(rows: list[dict]) -> dict[tuple[str, str, str], list[dict]]:
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["suite"], r["params"].get("path", "?"), r["ceiling"])].append(r)
    return groups


def headline(rows: list[dict]) -> dict | None:
    """The first 16-token row at the largest size (None without 16-token rows)."""
    cands = [r for r in rows if r["params"].get("block_size") == 16]
    if not cands:
        return None
    biggest = max(r["bytes"] for r in cands)
    return next(r for r in cands if r["bytes"] == biggest)


def summarize(doc: dict) -> list[dict]:
    """One entry per (suite, path, ceiling) group, in file order: {suite, path, ceiling, rows,
    all_correct, headline, worst, best}."""
    out = []
    for (suite, path, ceiling), rows in _group(doc["rows"]).items():
        out.append(
            {
                "suite": suite,
                "path": path,
                "ceiling": ceiling,
                "rows": len(rows),
                "all_correct": all(r["correct"] is not False for r in rows),
                "headline": headline(rows),
                "worst": min(rows, key=lambda r: r["ratio"]),
                "best": max(rows, key=lambda r: r["ratio"]),
            }
        )
    return out


def header_lines(doc: dict) -> list[str]:
    """The machine, software and same-run ceilings (median, slowest-fastest over their runs) of a
    result file, as markdown lines."""
    env = doc["environment"]
    spread = env.get("ceilings_spread", {})

    def ceiling(k: str, v: float) -> str:
        s = spread.get(k)
        return f"{k} {v:,.2f} GB/s" + (
            f" ({s['min']:,.2f}-{s['max']:,.2f}, {s['samples']} runs)" if s else ""
        )

    machine = f"{env['gpu']} · driver {env.get('driver')}" if env.get("gpu") else "CPU (no GPU)"
    return [
        f"{machine} · torch {env.get('torch')} "
        f"· triton {env.get('triton')} · commit {env.get('commit') or 'not recorded'} · {env.get('date')}",
        "",
        "same-run ceilings: " + ", ".join(ceiling(k, v) for k, v in sorted(env.get("ceilings", {}).items())),
        "",
    ]


def ratio_text(row: dict) -> str:
    """A row's ratio to its ceiling; above 100% it is named the measurement problem it is."""
    if over_ceiling(row):
        return (
            f"**over its ceiling ({row['gbps']:,.3g} against {row['ceiling_gbps']:,.3g} GB/s): "
            "a measurement problem**"
        )
    return f"{row['ratio']:.1%}"


def group_cells(s: dict) -> str:
    """One summarized group as the markdown cells suite .. best row (no leading or trailing bar)."""
    h, w, b = s["headline"], s["worst"], s["best"]
    head = f"{h['gbps']:,.1f} GB/s = {ratio_text(h)} ({h['case']})" if h else "-"
    ok = "" if s["all_correct"] else " **(a row was not bit-exact)**"
    return (
        f"{s['suite']} | {s['path']}{ok} | {s['ceiling']} | {head} | {ratio_text(w)} ({w['case']}) "
        f"| {ratio_text(b)} ({b['case']})"
    )


def markdown(doc: dict) -> str:
    """The header and one table row per (suite, path, ceiling) group."""
    lines = header_lines(doc) + [
        "| suite | path | vs ceiling | headline (16-token blocks) | worst row | best row |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {group_cells(s)} |" for s in summarize(doc)]
    return "\n".join(lines)
