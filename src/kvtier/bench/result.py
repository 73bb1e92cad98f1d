"""The benchmark result file: `<out>/<gpu-slug>-<YYYY-MM-DD>[-N].json`.

    {
      "kvtier_bench": 1,
      "environment": {gpu, driver, cuda, torch, triton, python, kvtier, commit, hostname, date,
                      ceilings: {name: GB/s measured in this run (the median run)},
                      ceilings_spread: {name: {median, min, max, samples, bytes}}, quick, ...},
      "suites": {name: {"status": "ran" | "skipped" | "failed", "rows": n, "reason": str | null}},
      "skipped_cases": [{suite, case, reason}],
      "rows": [{suite, case, bytes, median_ms, min_ms, max_ms, gbps, ceiling, ceiling_gbps, ratio,
                params, correct}]
    }

`validate` is the schema, and checks what makes a row trustworthy: its ceiling was measured in
this same run, and gbps and ratio follow from bytes, median and that ceiling. A ratio above 1.0
says one of the two is not what it claims (the row's bytes in a cache, a ceiling measured low by
noise or a cold or too small probe): a measurement problem, never a speed (`over_ceiling`).
Pure Python.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

FORMAT_VERSION = 1
ENV_KEYS = (
    "gpu",
    "driver",
    "cuda",
    "torch",
    "triton",
    "python",
    "kvtier",
    "commit",
    "hostname",
    "date",
    "ceilings",
)
ROW_TYPES: dict[str, tuple[type, ...]] = {
    "suite": (str,),
    "case": (str,),
    "bytes": (int,),
    "median_ms": (float, int),
    "min_ms": (float, int),
    "max_ms": (float, int),
    "gbps": (float, int),
    "ceiling": (str,),
    "ceiling_gbps": (float, int),
    "ratio": (float, int),
    "params": (dict,),
    "correct": (bool, type(None)),
}
STATUSES = ("ran", "skipped", "failed")


class ResultSchemaError(ValueError):
    """A result document that does not follow the schema; the message lists every problem."""


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def _row_problems(i: int, row: object, ceilings: dict) -> list[str]:
    if not isinstance(row, dict):
        return [f"rows[{i}]: expected an object"]
    where = f"rows[{i}] ({row.get('suite')}/{row.get('case')})"
    errs = []
    missing, extra = set(ROW_TYPES) - set(row), set(row) - set(ROW_TYPES)
    if missing or extra:
        return [f"{where}: missing fields {sorted(missing)}, unknown fields {sorted(extra)}"]
    for k, types in ROW_TYPES.items():
        v = row[k]
        if (isinstance(v, bool) and bool not in types) or not isinstance(v, types):
            errs.append(f"{where}.{k}: expected {'/'.join(t.__name__ for t in types)}, got {v!r}")
    if errs:
        return errs
    if row["bytes"] <= 0:
        errs.append(f"{where}.bytes: must be > 0")
    nums = ("median_ms", "min_ms", "max_ms", "gbps", "ceiling_gbps", "ratio")
    if any(not math.isfinite(row[k]) or row[k] <= 0 for k in nums):
        return errs + [f"{where}: {', '.join(nums)} must be finite and > 0"]
    if not row["min_ms"] <= row["median_ms"] <= row["max_ms"]:
        errs.append(f"{where}: needs min_ms <= median_ms <= max_ms")
    if not _close(row["gbps"], row["bytes"] / row["median_ms"] / 1e6):
        errs.append(
            f"{where}.gbps: {row['gbps']} is not bytes / median ({row['bytes'] / row['median_ms'] / 1e6})"
        )
    if row["ceiling"] not in ceilings:
        errs.append(f"{where}.ceiling: {row['ceiling']!r} was not measured in this run")
    elif not _close(row["ceiling_gbps"], ceilings[row["ceiling"]]):
        errs.append(
            f"{where}.ceiling_gbps: {row['ceiling_gbps']} differs from this run's {ceilings[row['ceiling']]}"
        )
    tf = row["params"].get("traffic_factor", 1.0)
    if not isinstance(tf, (int, float)) or tf <= 0:
        errs.append(f"{where}.params.traffic_factor: expected a number > 0, got {tf!r}")
    elif not _close(row["ratio"], row["gbps"] * tf / row["ceiling_gbps"]):
        errs.append(f"{where}.ratio: {row['ratio']} is not gbps * traffic_factor / ceiling_gbps")
    return errs


OVER_CEILING = 1.0  # a row above its ceiling: the measurement, not the speed, is the news


def over_ceiling(row: dict) -> bool:
    """Whether `row` ran faster than its same-run ceiling: a measurement problem to show as one."""
    return row["ratio"] > OVER_CEILING


def problems(doc: object) -> list[str]:
    """Every way `doc` breaks the schema; empty when it is a valid result document."""
    if not isinstance(doc, dict):
        return ["document: expected a JSON object"]
    if doc.get("kvtier_bench") != FORMAT_VERSION:
        return [f'document: not a kvtier result file (needs "kvtier_bench": {FORMAT_VERSION})']
    errs = []
    env = doc.get("environment")
    ceilings: dict = {}
    if not isinstance(env, dict):
        errs.append("environment: expected an object")
    else:
        errs += [f"environment.{k}: missing" for k in ENV_KEYS if k not in env]
        ceilings = env.get("ceilings") if isinstance(env.get("ceilings"), dict) else {}
        for k, v in ceilings.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or not math.isfinite(v):
                errs.append(f"environment.ceilings.{k}: expected GB/s > 0, got {v!r}")
    suites = doc.get("suites")
    if not isinstance(suites, dict):
        errs.append("suites: expected an object")
        suites = {}
    for name, s in suites.items():
        if not isinstance(s, dict) or s.get("status") not in STATUSES or not isinstance(s.get("rows"), int):
            errs.append(f"suites.{name}: expected {{status: {'|'.join(STATUSES)}, rows: int, reason}}")
    if not isinstance(doc.get("skipped_cases", []), list):
        errs.append("skipped_cases: expected a list")
    rows = doc.get("rows")
    if not isinstance(rows, list):
        return errs + ["rows: expected a list"]
    for i, row in enumerate(rows):
        errs += _row_problems(i, row, ceilings)
    counts: dict[str, int] = {}
    for row in rows:
        if isinstance(row, dict):
            counts[row.get("suite")] = counts.get(row.get("suite"), 0) + 1
    for name, n in counts.items():
        if name not in suites:
            errs.append(f"rows: suite {name!r} has rows but no entry in suites")
        elif isinstance(suites[name], dict) and suites[name].get("rows") != n:
            errs.append(f"suites.{name}.rows: says {suites[name].get('rows')}, the file has {n}")
    return errs


def validate(doc: object) -> None:
    """Raise ResultSchemaError listing every problem; return None for a valid document."""
    errs = problems(doc)
    if errs:
        raise ResultSchemaError(f"{len(errs)} problem(s): " + "; ".join(errs[:20]))


def build(environment: dict, suites: dict, rows: list[dict], skipped_cases: list[dict]) -> dict:
    return {
        "kvtier_bench": FORMAT_VERSION,
        "environment": environment,
        "suites": suites,
        "skipped_cases": skipped_cases,
        "rows": rows,
    }


def result_path(out_dir: str | Path, gpu_slug: str, date: str) -> Path:
    """`<out>/<gpu_slug>-<date>.json`, or -2, -3 ... when taken: a result is never overwritten."""
    out = Path(out_dir)
    path, n = out / f"{gpu_slug}-{date}.json", 2
    while path.exists():
        path, n = out / f"{gpu_slug}-{date}-{n}.json", n + 1
    return path


def write(doc: dict, out_dir: str | Path, gpu_slug: str, date: str) -> Path:
    """Validate `doc`, then write it to a fresh `result_path`; returns the path."""
    validate(doc)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = result_path(out_dir, gpu_slug, date)
    with open(path, "x") as f:  # "x": fail rather than overwrite if another run took the name
        f.write(json.dumps(doc, indent=1) + "\n")
    return path


def load(path: str | Path) -> dict:
    doc = json.loads(Path(path).read_text())
    validate(doc)
    return doc
