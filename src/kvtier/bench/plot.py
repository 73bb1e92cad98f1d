"""The result plot of `kvtier bench`, read at a glance:

  paths      one bar per suite and path (its headline row: 16-token blocks at the largest size,
             else its largest row; of several, e.g. layout orders, its first): payload GB/s
             with the slowest-fastest run as an error bar, over a grey bar of its same-run
             ceiling with that ceiling's spread, and the ratio written beside it ("over" in red
             where the row beat its ceiling: a measurement problem, never a speed)
  sizes      GB/s over transfer size, 1 MiB - 1 GiB (the `sizes` suite), each ceiling a dashed line
  blocks     % of the same-run ceiling over block size, where a suite swept three or more

Time-to-first-token rows are not GB/s and are left to the table. Nothing is drawn (None) when no
row has a rate to show.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

MiB, GiB = 1 << 20, 1 << 30
NOT_RATES = ("ttft",)  # suites whose rows are times, not transfers


def _rate_range(r: dict) -> tuple[float, float]:
    """(slowest, fastest) GB/s of a row's runs."""
    return r["bytes"] / r["max_ms"] / 1e6, r["bytes"] / r["min_ms"] / 1e6


def path_of(r: dict) -> str:
    """What a row measures: its `path`, or the op it calls (`op_cost`: one bar across the kinds of
    ids), without the layout order it ran in (one bar across the orders)."""
    p = r["params"]
    if p.get("path"):
        name = p["path"]
    elif p.get("op"):
        name = f"ops.{p['op']}, " + ("one layer" if p.get("layer_range") == "one" else "all layers")
    else:
        name = r["case"]
    return " ".join(name.replace(str(p.get("order", "\0")), "").split())


def bars(rows: list[dict]) -> list[tuple[dict, list[dict]]]:
    """(row drawn, the rows it stands for) per suite and path: 16-token blocks at the largest size,
    else the largest; of several such (layout orders, grids, shapes), the suite's first: its own
    headline."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        if r["suite"] not in NOT_RATES and r["suite"] != "sizes":
            groups[(r["suite"], path_of(r))].append(r)
    out = []
    for rs in groups.values():
        at16 = [r for r in rs if r["params"].get("block_size") == 16] or rs
        biggest = max(r["bytes"] for r in at16)
        same = [r for r in at16 if r["bytes"] == biggest]
        out.append((same[0], same))
    return out


def size_lines(rows: list[dict]) -> dict[str, list[dict]]:
    """path -> the `sizes` rows of that path, by size."""
    out: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["suite"] == "sizes":
            out[r["params"].get("path") or r["case"]].append(r)
    return {k: sorted(v, key=lambda r: r["bytes"]) for k, v in out.items()}


def block_lines(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """`suite: path` -> [(block size, ratio)] for paths measured at three block sizes or more."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for r in rows:
        bs = r["params"].get("block_size")
        if isinstance(bs, int) and bs > 0 and r["suite"] not in NOT_RATES and r["suite"] != "sizes":
            key = f"{r['suite']}: {path_of(r)}"
            out[key].setdefault(bs, r["ratio"])  # the first row at a block size: its headline shape
    return {k: sorted(v.items()) for k, v in out.items() if len(v) >= 3}


def _size_label(n: float) -> str:
    return f"{n / GiB:g} GiB" if n >= GiB else f"{n / MiB:g} MiB"


def plot(rows: list[dict], path: str | Path, title: str, spread: dict | None = None) -> Path | None:
    """Write the PNG to `path`; None (and no file) when there is nothing to draw. spread: the
    result file's `environment.ceilings_spread` (each ceiling's median, min, max, runs, bytes)."""
    fig = figure(rows, title, spread)
    if fig is None:
        return None
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def figure(rows: list[dict], title: str, spread: dict | None = None):
    """The matplotlib Figure of `plot` (None: nothing to draw), one panel per kind of figure."""
    drawn, sweep, blocks = bars(rows), size_lines(rows), block_lines(rows)
    panels = [p for p, has in (("paths", drawn), ("sizes", sweep), ("blocks", blocks)) if has]
    if not panels:
        return None
    from matplotlib.figure import Figure  # the OO API: no pyplot, no display backend needed

    heights = {"paths": max(2.5, 0.32 * len(drawn) + 1.2), "sizes": 4.2, "blocks": 4.2}
    fig = Figure(figsize=(12, sum(heights[p] for p in panels) + 0.8), layout="constrained")
    fig.get_layout_engine().set(h_pad=0.2, hspace=0.12)  # an axis label never runs into the next title
    axes = fig.subplots(len(panels), 1, height_ratios=[heights[p] for p in panels], squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels, strict=True):
        {"paths": _paths, "sizes": _sizes, "blocks": _blocks}[panel](ax, rows, spread or {})
    fig.suptitle(title)
    return fig


def _ticks(ax, axis: str, log: bool) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    a = ax.xaxis if axis == "x" else ax.yaxis
    a.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 0.001, 1, 50: never "0.000"
    if log:
        a.set_minor_formatter(NullFormatter())


def _paths(ax, rows: list[dict], spread: dict) -> None:
    picked = bars(rows)
    drawn = [r for r, _ in picked]
    suites = list(dict.fromkeys(r["suite"] for r in drawn))
    colours = {s: f"C{i % 10}" for i, s in enumerate(suites)}
    ys = list(range(len(drawn)))[::-1]  # the first row on top
    values = [r["gbps"] for r in drawn] + [r["ceiling_gbps"] for r in drawn]
    log = max(values) / min(values) > 30
    for y, r in zip(ys, drawn, strict=True):
        c = spread.get(r["ceiling"], {})
        lo, hi = c.get("min", r["ceiling_gbps"]), c.get("max", r["ceiling_gbps"])
        ceiling = r["ceiling_gbps"] / r["params"].get("traffic_factor", 1.0)  # in the row's payload GB/s
        scale = ceiling / r["ceiling_gbps"]
        ax.barh(y, ceiling, height=0.8, color="0.88", edgecolor="0.6", linewidth=0.5)
        err = [[max(0.0, ceiling - lo * scale)], [max(0.0, hi * scale - ceiling)]]
        ax.errorbar(ceiling, y + 0.3, xerr=err, fmt="none",
                    ecolor="0.45", capsize=2, linewidth=0.8)  # fmt: skip
        slow, fast = _rate_range(r)
        over = r["ratio"] > 1.0
        ax.barh(y, r["gbps"], height=0.45, color="white" if over else colours[r["suite"]],
                edgecolor="red" if over else colours[r["suite"]], hatch="//" if over else None)  # fmt: skip
        err = [[max(0.0, r["gbps"] - slow)], [max(0.0, fast - r["gbps"])]]
        ax.errorbar(r["gbps"], y, xerr=err, fmt="none", ecolor="black", capsize=2, linewidth=0.8)
        note = f"over {r['ceiling']}: measurement problem" if over else f"{r['ratio']:.0%} of {r['ceiling']}"
        ax.annotate(note, (max(r["gbps"], ceiling, fast), y), xytext=(6, -3), textcoords="offset points",
                    fontsize=7, color="red" if over else "0.2")  # fmt: skip
    labels = [_short(f"{r['suite']}: {path_of(r)}", 52) + _others(same) for r, same in picked]
    ax.set_yticks(ys, labels, fontsize=8)
    if log:
        ax.set_xscale("log")
    _ticks(ax, "x", log)
    ax.set_xlim(right=max(values) * (8 if log else 1.45))  # room for the notes on the right
    ax.set_xlabel("GB/s of payload (bar: median, whiskers: slowest-fastest run; grey: its same-run ceiling)")
    ax.set_title("each path against its same-run ceiling", fontsize=10, loc="left")
    ax.grid(True, axis="x", which="major", alpha=0.3)


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1].rsplit(" ", 1)[0] + "…"


def _others(same: list[dict]) -> str:
    """What the rows a bar stands for span, when it stands for more than one."""
    if len(same) < 2:
        return ""
    lo, hi = f"{min(r['ratio'] for r in same):.0%}", f"{max(r['ratio'] for r in same):.0%}"
    return f" ({len(same)} rows: {lo})" if lo == hi else f" ({len(same)} rows: {lo}-{hi})"


def _sizes(ax, rows: list[dict], spread: dict) -> None:
    lines = size_lines(rows)
    sizes = sorted({r["bytes"] for rs in lines.values() for r in rs})
    for i, (label, rs) in enumerate(lines.items()):
        xs, ys = [r["bytes"] for r in rs], [r["gbps"] for r in rs]
        lo = [max(0.0, r["gbps"] - _rate_range(r)[0]) for r in rs]
        hi = [max(0.0, _rate_range(r)[1] - r["gbps"]) for r in rs]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", ms=4, capsize=2, color=f"C{i % 10}", label=label)
        over = [r for r in rs if r["ratio"] > 1.0]
        if over:  # faster than its ceiling: a cache or a ceiling measured low, not a speed
            ax.plot([r["bytes"] for r in over], [r["gbps"] for r in over], "o", ms=9, mfc="none", mec="red")
    for j, name in enumerate(dict.fromkeys(r["ceiling"] for rs in lines.values() for r in rs)):
        gbps = next(r["ceiling_gbps"] for rs in lines.values() for r in rs if r["ceiling"] == name)
        c = spread.get(name, {})
        size = f", {_size_label(c['bytes'])}" if c.get("bytes") else ""
        ax.axhline(gbps, color="0.4", linestyle=(0, (4, 2 + j)), linewidth=1)
        ax.annotate(f"ceiling {name} {gbps:.3g} GB/s{size}", (sizes[0], gbps), xytext=(2, 3),
                    textcoords="offset points", fontsize=7, color="0.3")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [_size_label(s) for s in sizes])
    ax.minorticks_off()
    values = [r["gbps"] for rs in lines.values() for r in rs]
    log = max(values) / min(values) > 30  # a copy that fits a cache runs far above the others
    if log:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    _ticks(ax, "y", log)
    ax.set_xlabel("bytes of one transfer")
    ax.set_ylabel("GB/s (median, slowest-fastest)")
    ax.set_title("GB/s over transfer size (red ring: above its ceiling, a measurement problem)",
                 fontsize=10, loc="left")  # fmt: skip
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _blocks(ax, rows: list[dict], spread: dict) -> None:
    lines = block_lines(rows)
    sizes = sorted({bs for pts in lines.values() for bs, _ in pts})
    for i, (label, pts) in enumerate(lines.items()):
        style = "-" if i < 10 else "--"
        ax.plot([p[0] for p in pts], [min(p[1], 1.1) * 100 for p in pts], style, marker="o", ms=3,
                color=f"C{i % 10}", label=_short(label, 48))  # fmt: skip
    ax.axhline(100, color="0.4", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.minorticks_off()
    ax.set_ylim(0, 112)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("% of same-run ceiling")
    ax.set_title("every block size against its ceiling (above 100%: clipped; a measurement problem)",
                 fontsize=10, loc="left")  # fmt: skip
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
