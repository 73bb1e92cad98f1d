"""`kvtier bench`: run named suites, measure the ceilings in the same run, write one result file
(plus a PNG plot), optionally a Chrome-trace timeline of the whole run.

A suite that cannot run here (no GPU, build failure) is skipped with its reason; one that raises
is recorded as failed with the error, and the others still run.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier.bench import result
from kvtier.bench.profile import chrome_trace, stage

# measured up front on a GPU, on a cool machine, so every result file carries them
GPU_CEILINGS = ("d2d_copy", "h2d_pinned", "d2h_pinned", "bidir_pinned")
NO_GPU = "needs a CUDA GPU, and torch finds none"


@dataclass(slots=True)
class BenchRun:
    doc: dict
    path: Path | None = None
    plot: Path | None = None
    failed: list[str] = field(default_factory=list)
    incorrect: list[str] = field(default_factory=list)


def suites() -> dict:
    """The registry, after importing kvtier's suite modules (plus any suite registered before)."""
    import kvtier.bench.suites  # noqa: F401 - registers the suites
    from kvtier.bench.suite import SUITES

    return SUITES


def plan(names: list[str] | tuple[str, ...], on_gpu: bool) -> tuple[list[str], dict[str, dict]]:
    """(suites to run, {skipped suite: status entry}); unknown names -> ValueError."""
    from kvtier.bench.suites import IMPORT_ERRORS

    registry = suites()
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(
            f"suite: unknown {', '.join(map(repr, unknown))}; known: {', '.join(sorted(registry))}"
        )
    chosen = list(dict.fromkeys(names)) if names else sorted(registry)
    run, skipped = [], {}
    for n in chosen:
        if registry[n].needs_gpu and not on_gpu:
            skipped[n] = {"status": "skipped", "rows": 0, "reason": NO_GPU}
        else:
            run.append(n)
    for module, err in IMPORT_ERRORS.items():
        skipped[f"module:{module}"] = {"status": "failed", "rows": 0, "reason": f"import failed: {err}"}
    return run, skipped


def run_bench(
    names: list[str] | tuple[str, ...] = (),
    *,
    quick: bool = False,
    out_dir: str | Path | None = "kvtier-results",
    plot: bool = True,
    profile: str | Path | None = None,
    progress: bool = True,
    on_row: Callable[[dict], None] | None = None,
) -> BenchRun:
    """Run the suites; write `<out_dir>/<gpu>-<date>.json` (+ .png) unless out_dir is None."""
    import torch
    from tqdm import tqdm

    from kvtier.bench.env import environment, slug, utc_now
    from kvtier.bench.suite import Context, SkipSuite

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    to_run, status = plan(names, on_gpu)
    registry = suites()
    ctx = Context(device, quick, profiling=profile is not None)
    rows: list[dict] = []
    bar = tqdm(total=len(to_run) + 1, unit="step", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    ctx.on_progress = lambda what: bar.set_postfix_str(what[:60], refresh=True)
    with chrome_trace(profile):
        with stage("ceilings"):
            bar.set_description("ceilings")
            for name in GPU_CEILINGS if on_gpu else ("host_memcpy",):
                ctx.ceiling(name)
            bar.update(1)
        for name in to_run:
            bar.set_description(name)
            ctx.suite = name
            n_before = len(rows)
            try:
                with stage(f"suite/{name}"):
                    for row in registry[name].fn(ctx):
                        rows.append(asdict(row))
                        if on_row:
                            on_row(rows[-1])
                status[name] = {"status": "ran", "rows": len(rows) - n_before, "reason": None}
            except SkipSuite as e:
                status[name] = {"status": "skipped", "rows": len(rows) - n_before, "reason": str(e)}
            except Exception as e:  # one broken suite must not lose the others' figures
                tb = traceback.format_exc(limit=-3).strip().splitlines()
                reason = f"{type(e).__name__}: {e}"[:500] + " | " + " / ".join(tb[-4:])[:500]
                status[name] = {"status": "failed", "rows": len(rows) - n_before, "reason": reason}
            finally:
                ctx.suite = None
                if on_gpu:
                    try:
                        torch.cuda.synchronize()  # a failed suite's work must not run into the next one
                        torch.cuda.empty_cache()  # give the next suite the memory back
                    except Exception as e:  # a sticky CUDA error: record it; later suites will say so too
                        status[name]["reason"] = f"{status[name]['reason'] or ''} | after the suite: {e}"[
                            :1000
                        ]
            bar.update(1)
    bar.close()

    env = environment(device)
    env |= {"ceilings": {k: float(v) for k, v in ctx.ceilings.items()}, "quick": quick}
    env |= {
        "ceilings_spread": {k: v.to_json() for k, v in ctx.ceilings.items()},
        "profiled": profile is not None,
    }
    doc = result.build(env, status, rows, ctx.skipped)
    run = BenchRun(doc)
    run.failed = [f"{n}: {s['reason']}" for n, s in status.items() if s["status"] == "failed"]
    run.incorrect = [f"{r['suite']}/{r['case']}" for r in rows if r["correct"] is False]
    if out_dir is not None:
        stamp = utc_now().date().isoformat()
        gpu = slug(env["gpu"]) if env.get("gpu") else "cpu"
        run.path = result.write(doc, out_dir, gpu, stamp)
        if plot:
            commit = (env.get("commit") or "no commit")[:12]
            title = f"{env.get('gpu') or 'CPU (no GPU)'} - {stamp} - kvtier {env['kvtier']} ({commit})"
            run.plot = _plot(rows, run.path.with_suffix(".png"), title, env["ceilings_spread"])
    return run


def _plot(rows: list[dict], path: Path, title: str, spread: dict) -> Path | None:
    from kvtier.bench.plot import plot

    return plot(rows, path, title, spread)
