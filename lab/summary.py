"""A result file judged against kvtier's targets: kvtier's summary table (headline, worst and best
row per suite and path) with how many rows meet the target that applies (`lab.targets`), then every
row of the engine and store suites with the figure its target speaks of and the verdict the suite
recorded, and one line on the submit target over the 1 GiB rows.

Everything is read from the file: nothing here measures or rounds a figure before printing it.
"""

from __future__ import annotations

from kvtier.bench.summary import group_cells, header_lines, summarize
from lab.targets import P6_US, ratio_target

ENGINE_SUITES = ("bidir", "save_beside_matmul", "submit_overhead", "store")


def judge(doc: dict) -> list[dict]:
    """kvtier's summary groups, each with `target` ((name, minimum ratio) or None) and
    `rows_meeting_target` (None without a target)."""
    out = []
    for s in summarize(doc):
        target = ratio_target(s["suite"], s["path"], s["ceiling"])
        key = (s["suite"], s["path"], s["ceiling"])
        rows = [r for r in doc["rows"] if (r["suite"], r["params"].get("path", "?"), r["ceiling"]) == key]
        meeting = sum(r["ratio"] >= target[1] for r in rows) if target else None
        out.append(s | {"target": target, "rows_meeting_target": meeting})
    return out


def markdown(doc: dict) -> str:
    lines = header_lines(doc) + [
        "| suite | path | vs ceiling | headline (16-token blocks) | worst row | best row | rows ≥ target |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in judge(doc):
        t = s["target"]
        tgt = f"{t[0]} ≥ {t[1]:.0%}: {s['rows_meeting_target']}/{s['rows']}" if t else "-"
        lines.append(f"| {group_cells(s)} | {tgt} |")
    engine = engine_markdown(doc)
    return "\n".join(lines) + ("\n\nEngine and store suites, every row:\n\n" + engine if engine else "")


def engine_figure(r: dict) -> str:
    """The figure an engine row's target speaks of, from its params."""
    p = r["params"]
    if "slowdown_pct" in p:
        return f"matmul time {p['slowdown_pct']:+.1f}% (alone spread {p.get('alone_spread_pct', 0):.1f}%)"
    if "submit_us" in p:
        return submit_figure(p)
    if "us_per_chunk" in p:
        return f"{p['us_per_chunk']:.2f} us per chunk, {p['us_per_prompt']:,.0f} us per prompt"
    if "vs_path" in p:
        return f"{p['vs_path']:.0%} of the path model's bottleneck"
    if "held_runs" in p:  # bidir: runs started after a hold, so both jobs were enqueued first
        unheld = f", {p['unheld_ratio']:.1%} without it" if p.get("unheld_ratio") is not None else ""
        beside = ""
        if p.get("beside_ratio") is not None:  # P4's verdict: the copies timed in turn with the jobs
            gbps = p["beside_ceiling_gbps"]
            beside = f"; {p['beside_ratio']:.1%} of the bidirectional copy timed beside it ({gbps:.1f} GB/s)"
        return f"held {p['hold_ms']:g} ms before each run ({p['held_runs']} fully enqueued){unheld}{beside}"
    return "-"


def submit_figure(p: dict) -> str:
    """A submit row: the figure its verdict reads first (hot, or in files before the hot verdict
    the one after a wait), then the others, the split of the hot one and the host's yardstick."""
    hot = p.get("submit_hot_us")
    split = ""
    if p.get("submit_hot_py_us") is not None:  # kvtier's Python apart from its runtime calls
        py, calls = f"{p['submit_hot_py_us']:,.0f} Python", f"{p['submit_hot_calls_us']:,.0f} runtime calls"
        if p.get("submit_traced_us") is not None:  # a traced pass of its own: its marks cost time too
            split = f" (traced pass {p['submit_traced_us']:,.0f} us: {py} with the trace's marks + {calls})"
        else:  # files before the traced total was kept
            split = f" ({py} + {calls})"
    busy = ""
    if p.get("submit_busy_us") is not None:
        busy = f", {p['submit_busy_us']:,.0f} us after {p.get('busy_ms', 0):g} ms of host work"
    if p.get("p6_reads") == "hot":
        head = f"submit {hot:,.0f} us hot{split}, {p['submit_us']:,.0f} us after a GPU wait{busy}"
    else:
        head = (
            f"submit {p['submit_us']:,.0f} us"
            + (f", {hot:,.0f} us hot{split}" if hot is not None else "")
            + busy
        )
    ref = ""
    if p.get("host_ref_hot_us") is not None:  # the host's own first step, hot / after a wait
        ref = f" (host: 512-id check {p['host_ref_hot_us']:.1f} / {p['host_ref_after_wait_us']:.0f} us)"
    return f"{head} for {p.get('blocks', '?')} blocks{ref}"


def verdict(p: dict) -> str:
    """yes / no / -; a submit row also says how its other figures fare (P6's verdict reads the
    hot submit; files written before it read the one after a wait and carry `meets_target_hot`)."""
    meets = p.get("meets_target")
    out = "-" if meets is None else ("yes" if meets else "no")
    names = {"hot": "hot", "cold": "after a wait", "busy": "busy"}
    more = [
        f"{n} {'yes' if p[f'meets_target_{k}'] else 'no'}"
        for k, n in names.items()
        if f"meets_target_{k}" in p
    ]
    return f"{out} ({', '.join(more)})" if more and meets is not None else out


def engine_markdown(doc: dict) -> str:
    """Every row of the engine and store suites (P4 bidir, P5 save beside matmul, P6 submit
    overhead; store lookup cost and per-tier throughput)."""
    lines = [
        "| suite | case | GB/s | vs ceiling | target figure | meets target |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["rows"]:
        if r["suite"] not in ENGINE_SUITES:
            continue
        lines.append(
            f"| {r['suite']} | {r['case']} | {r['gbps']:,.1f} | {r['ratio']:.1%} of {r['ceiling']} "
            f"| {engine_figure(r)} | {verdict(r['params'])} |"
        )
    if len(lines) == 2:
        return ""
    p6 = p6_summary(doc["rows"])
    return "\n".join(lines) + (f"\n\n{p6}" if p6 else "")


def p6_summary(rows: list[dict]) -> str:
    """One line on P6 over the submit rows of 1 GiB jobs: how many hot medians are <= 100 us, their
    range, and the largest over the smallest median per direction ("" without such rows). Files
    from before the hot verdict are read the same way, through their `submit_hot_us`."""
    mine = [
        (r["case"].split()[0], r["params"]["submit_hot_us"])
        for r in rows
        if r["suite"] == "submit_overhead"
        and r["params"].get("p6_row", "4GiB" not in r["case"])  # older files: no p6_row
        and r["params"].get("submit_hot_us") is not None
    ]
    if not mine:
        return ""
    hot = [h for _, h in mine]
    flat = []
    for direction in ("save", "load"):
        d = [h for k, h in mine if k == direction]
        flat += [f"{direction} {max(d) / min(d):.2f}"] if d else []
    return (
        f"P6 (hot submit of a 1 GiB job <= {P6_US:g} us, flat in block count): "
        f"{sum(h <= P6_US for h in hot)} "
        f"of {len(hot)} rows, {min(hot):,.0f}-{max(hot):,.0f} us; largest over smallest median: "
        f"{', '.join(flat)}."
    )
