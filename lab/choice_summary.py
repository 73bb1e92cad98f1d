"""The `vllm` suite's choice, beside-read and hybrid rows of one or more result files, judged
against C1 (`choice <tier> <n>`: vs_best), C1's beside bar (`step_beside_read`: slowdown_pct) and
#42's hybrid bar (`ttft_hit hybrid`: speedup at 32K), as Markdown tables. Every figure is read
from the files; a later file's row replaces an earlier one's of the same case.

    python -m lab.choice_summary RESULT.json [RESULT.json ...]
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from lab.targets import C1_BESIDE_PCT, C1_FACTOR, HYBRID_SPEEDUP, HYBRID_TOKENS


def rows_of(paths: list[str]) -> dict[str, tuple[str, dict]]:
    """case -> (the file's name, its row), the later file winning."""
    out: dict[str, tuple[str, dict]] = {}
    for p in paths:
        for r in json.loads(Path(p).read_text())["rows"]:
            if r.get("suite") == "vllm":
                out[r["case"]] = (Path(p).name, r)
    return out


def _ms(x) -> str:
    return "-" if x is None else f"{x:,.1f}"


def tables(rows: dict[str, tuple[str, dict]]) -> list[str]:
    out = [
        "| tier | tokens | recompute ms | full load ms | best split ms | choice ms | choice (each run) "
        f"| vs_best | ≤ {C1_FACTOR} | correct | file |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case, (name, r) in rows.items():
        if not case.startswith("choice "):
            continue
        p = r["params"]
        o = p["options_ms"]
        runs = p.get("runs") or []
        if isinstance(runs, str):  # a list the suite's writer kept as its repr
            runs = ast.literal_eval(runs)
        picks = "; ".join(x.split(":")[0] + ":" + x.split(":")[1].split(",")[0] for x in runs) or p["choice"]
        ok = "yes" if p["vs_best"] <= C1_FACTOR else "NO"
        out.append(
            f"| {p['tier']} | {p['tokens']} | {_ms(o.get('recompute'))} | {_ms(o.get('load'))} "
            f"| {_ms(o.get('split'))} | {_ms(r['median_ms'])} | {picks} | {p['vs_best']:.3f} | {ok} "
            f"| {r['correct']} | {name} |"
        )
    out += [
        "",
        f"| tier | tokens | step ms alone | step ms beside | slowdown % | ≤ {C1_BESIDE_PCT} | file |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case, (name, r) in rows.items():
        if case.startswith("step_beside_read "):
            p = r["params"]
            ok = "yes" if p["slowdown_pct"] <= C1_BESIDE_PCT else "NO"
            out.append(
                f"| {p['tier']} | {p['tokens']} | {p['step_ms_alone']:.2f} | {p['step_ms_beside']:.2f} "
                f"| {p['slowdown_pct']:.2f} | {ok} | {name} |"
            )
    out += [
        "",
        "| model | tokens | recompute ms | hit ms | load / gather / forward ms | speedup | bar | first token "
        "| correct | file |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case, (name, r) in rows.items():
        if case.startswith("ttft_hit hybrid "):
            p = r["params"]
            parts = " / ".join(_ms(p.get(k)) for k in ("load_ms", "gather_ms", "forward_ms"))
            bar = "-"
            if p["prefix_tokens"] == HYBRID_TOKENS:
                bar = "yes" if p["speedup"] >= HYBRID_SPEEDUP else "NO"
            out.append(
                f"| {p['model']} | {p['prefix_tokens']} | {_ms(p['recompute_ms'])} | {_ms(p['hit_ms'])} "
                f"| {parts} | {p['speedup']:.2f} | {bar} | {p['first_token_match']} | {r['correct']} "
                f"| {name} |"
            )
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    print("\n".join(tables(rows_of(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
