"""The result plot: payload GB/s vs block size, one line per path, and the same as % of each row's
same-run ceiling. Rows without a `block_size` param are not plotted."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def lines(rows: list[dict]) -> dict[str, list[tuple[int, float, float]]]:
    """path label -> sorted [(block_size, gbps, ratio)] from result rows."""
    out: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for r in rows:
        bs = r.get("params", {}).get("block_size")
        if isinstance(bs, int) and bs > 0:
            label = r["params"].get("path") or r["suite"]
            out[f"{label} [{r['ceiling']}]"].append((bs, r["gbps"], r["ratio"]))
    return {k: sorted(v) for k, v in sorted(out.items())}


def plot(rows: list[dict], path: str | Path, title: str) -> Path | None:
    """Write the PNG to `path`; None (and no file) when no row has a block size."""
    data = lines(rows)
    if not data:
        return None
    from matplotlib.figure import Figure  # the OO API: no pyplot, no display backend needed
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig = Figure(figsize=(13, 5))
    gb_ax, pct_ax = fig.subplots(1, 2)
    for label, pts in data.items():
        xs = [p[0] for p in pts]
        gb_ax.plot(xs, [p[1] for p in pts], marker="o", label=label)
        pct_ax.plot(xs, [p[2] * 100 for p in pts], marker="o", label=label)
    sizes = sorted({p[0] for pts in data.values() for p in pts})
    for ax in (gb_ax, pct_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("block size (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    gb_ax.set_yscale("log")
    gb_ax.yaxis.set_major_formatter(ScalarFormatter())
    gb_ax.yaxis.set_minor_formatter(NullFormatter())
    gb_ax.set_ylabel("GB/s of payload")
    pct_ax.set_ylabel("% of same-run ceiling")
    pct_ax.axhline(100, color="gray", linestyle="--", linewidth=1)
    pct_ax.legend(fontsize=7, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path
