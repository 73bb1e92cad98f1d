"""A result file judged against kvtier's targets: kvtier's summary table (headline, worst and best
row per suite and path) with how many rows meet the target that applies (`lab.targets`), then every
row of the engine and store suites with the figure its target speaks of and the verdict the suite
recorded, one line on the submit target over the 1 GiB rows, and every `ttft` row judged here
against P8 / P9 / P10 / P12 from the figures the suite measured (`ttft_verdicts`).

Everything is read from the file: nothing here measures or rounds a figure before printing it.
"""

from __future__ import annotations

from kvtier.bench.summary import group_cells, header_lines, summarize
from lab.targets import (
    P6_US,
    P8_MIN_PREFIX,
    P8_SPEEDUP,
    P9_FACTOR,
    P9_WITHIN,
    P10_CALIBRATED_PCT,
    P10_PCT,
    P12_FACTOR,
    SPLIT_OVERLAP,
    TTFT_CASE,
    ratio_target,
)

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
    out = "\n".join(lines) + ("\n\nEngine and store suites, every row:\n\n" + engine if engine else "")
    ttft = ttft_markdown(doc)
    return out + ("\n\nTime to first token, every row:\n\n" + ttft if ttft else "")


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


def ttft_verdicts(p: dict) -> dict[str, tuple[str, str]]:
    """A ttft row's params judged: target -> (pass | miss | n/a, why), for the targets that speak of
    this row (P8: host load rows; P9: split rows; P10: every row with a prediction; P12: the
    planner's choice, on choice rows and on lean split rows, which carry the lean choice's regret).
    Files from before the suite reported neutral figures are read through their old names."""
    out: dict[str, tuple[str, str]] = {}
    mode, case = p.get("mode", ""), (p.get("model"), p.get("device"))
    dry = None if case == TTFT_CASE else f"dry run ({p.get('model')} on {p.get('device')})"
    speedup = p.get("speedup_vs_recompute", p.get("p8_speedup", p.get("p8_lean_speedup")))
    if mode in ("load", "lean load") and p.get("tier") == "host" and speedup is not None:
        status = "pass" if speedup >= P8_SPEEDUP else "miss"
        why = f"{speedup:.1f}x faster than recompute (target >= {P8_SPEEDUP:g}x)"
        why += f"; {p['load_why']}" if "load_why" in p else ""
        if dry or p["prefix_tokens"] < P8_MIN_PREFIX:
            status, why = "n/a", f"{dry or 'a prefix under 8K'}, not P8's case: would be {status}: {why}"
        out["P8"] = (status, why)
    vs_best = p.get("split_vs_best", p.get("p9_vs_best", p.get("p9_lean_vs_best")))
    ratio = p.get("load_vs_recompute", p.get("p9_ratio", p.get("p9_lean_ratio")))
    if mode in ("split", "lean split") and vs_best is not None:
        if ratio > P9_WITHIN:
            status = "n/a"
            why = f"load and recompute are not within {P9_WITHIN:g}x ({ratio:.1f}x): P9 does not apply"
        else:
            status = "pass" if vs_best <= P9_FACTOR else "miss"
            why = f"split {vs_best:.2f} x min(load, recompute) (target <= {P9_FACTOR:g})"
            why += f"; {p['split_why']}" if "split_why" in p else ""
            if dry:
                status, why = "n/a", f"{dry}, not P9's case: would be {status}: {why}"
        out["P9"] = (status, why)
    if mode == "lean split" and "split_front_ms" in p and "split_vs_longer_half" in p:
        over = p["split_vs_longer_half"]
        status = "pass" if over <= SPLIT_OVERLAP else "miss"
        why = f"split {over:.2f} x the longer half alone (target <= {SPLIT_OVERLAP:g})"
        out["overlap"] = (status, why + (f"; {p['split_why']}" if "split_why" in p else ""))
    calibrated = calibration_used(p)
    if "error_pct" in p:
        limit = P10_CALIBRATED_PCT if calibrated else P10_PCT
        status = "pass" if abs(p["error_pct"]) <= limit else "miss"
        kind = "calibrated" if calibrated else "uncalibrated"
        out["P10"] = (status, f"predicted {p['error_pct']:+.0f}% ({kind}: within {limit:g}%)")
    if "regret_pct" in p and (mode == "choice" or mode == "lean split"):
        factor = 1 + p["regret_pct"] / 100
        status = "pass" if factor <= P12_FACTOR else "miss"
        why = (
            f"the choice took {factor:.2f}x the fastest ({p.get('best_measured')}; target <= {P12_FACTOR:g}x)"
        )
        if calibrated:
            status, why = "n/a", f"a calibration was in use, not P12's case: would be {status}: {why}"
        out["P12"] = (status, why)
    return out


def calibration_used(p: dict) -> bool:
    """Whether a calibration fed the row's prediction (older files: their `calibration` text)."""
    if "calibrated" in p:
        return bool(p["calibrated"])
    c = str(p.get("calibration", "none"))
    return c != "none" and not c.startswith(("not used", "unreadable"))


def ttft_markdown(doc: dict) -> str:
    """Every ttft row with its verdicts, then each verdict's why ("" without ttft rows)."""
    targets = ("P8", "P9", "P10", "P12", "overlap")
    lines = [
        "| case | TTFT ms | predicted ms | calibrated | " + " | ".join(targets) + " |",
        "|" + " --- |" * (4 + len(targets)),
    ]
    whys = []
    for r in doc["rows"]:
        if r["suite"] != "ttft":
            continue
        p = r["params"]
        v = ttft_verdicts(p)
        cells = " | ".join(v[t][0] if t in v else "" for t in targets)
        pred = f"{p['predicted_ms']:,.1f}" if "predicted_ms" in p else "-"
        lines.append(f"| {r['case']} | {r['median_ms']:,.1f} | {pred} | {calibration_used(p)} | {cells} |")
        whys += [f"- {r['case']} {t}: {v[t][1]}" for t in targets if t in v and t != "P10"]
    if len(lines) == 2:
        return ""
    return "\n".join(lines + [""] + whys)
