"""`kvtier calibrate`: predicted vs measured transfers, decode steps and prefills; one fitted
correction per quantity; the error of every point before and after it."""

from __future__ import annotations

from pathlib import Path

import click

from kvtier.cli import cli
from kvtier.cli.analysis import _emit, common_json


@cli.command("calibrate")
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="Where to measure; auto: CUDA when present (Llama-3-8B shape, bf16), else the CPU (tiny model).",
)
@click.option("--quick", is_flag=True, help="Tiny model, small sizes, few repeats: a smoke test only.")
@click.option(
    "--ceilings",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Predict with these probed ceilings (`kvtier probe --save`) instead of measuring them now.",
)
@click.option("--reps", type=click.IntRange(1, 1000), default=None, help="Timed runs per point at least.")
@click.option("--save", type=click.Path(dir_okay=False), default=None, help="Write the JSON here.")
@common_json
def calibrate_cmd(device, quick, ceilings, reps, save, as_json):
    """Predict, measure, fit per quantity, and show each point's error before and after the fit."""
    if save is not None and not Path(save).resolve().parent.is_dir():
        raise click.UsageError(f"--save: folder {str(Path(save).parent)!r} does not exist")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device: cuda asked for, but torch finds no CUDA GPU")
    measured = None if ceilings is None else _ceilings_for(ceilings, device, torch)
    from kvtier.bench import calibrate
    from kvtier.bench.progress import Steps

    with Steps(calibrate.steps(device, quick, measured), "calibrate", enabled=not as_json) as step:
        doc = calibrate.run(device, quick, measured, reps, on_step=step)
    if save is not None:
        calibrate.save(doc, save)
        doc["saved"] = save
    _emit(doc, as_json, _print)


def _ceilings_for(path: str, device: str, torch):
    """The ceilings file, checked: it must hold what the predictions on this device need."""
    from kvtier.ceilings import Ceilings, CeilingsError
    from kvtier.specs import gpu_from_device_name

    try:
        measured = Ceilings.load(path)
    except CeilingsError as e:
        raise click.UsageError(f"--ceilings: {e}") from None
    need = {"h2d_pinned_gbps", "d2h_pinned_gbps"}
    spec = None
    if device != "cpu" and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        spec = gpu_from_device_name(name)
        if measured.gpu_key not in (None, getattr(spec, "key", None)):
            raise click.UsageError(f"--ceilings: {path!r} was measured on {measured.gpu_key}, this is {name}")
    if spec is None:  # no datasheet entry stands behind it: HBM and matmul rates must be measured
        need |= {"d2d_copy_gbps", "bf16_tflops"}
    if missing := need - set(measured.figures):
        why = (
            "" if measured.gpu_key or measured.gpu else " (measured without a GPU: leave --ceilings out here)"
        )
        raise click.UsageError(f"--ceilings: {path!r} lacks {', '.join(sorted(missing))}{why}")
    return measured


def _print(d: dict) -> None:
    from kvtier.bench.terminal import Footnotes, compact_table, console, say

    con = console()

    m = d["model"]
    whys = Footnotes()
    t = compact_table(
        f"Calibration on {d['gpu']}: {m['shape']} ({m['dtype']}), ceilings {d['ceilings_source']}",
        "point", "role", "predicted ms", "measured ms", "error", "error after fit", "why",
    )  # fmt: skip
    for p in d["points"]:
        after = p["calibrated_error_pct"]
        t.add_row(
            p["case"],
            p["role"],
            f"{p['predicted_ms']:.4g}",
            f"{p['measured_ms']:.4g}",
            f"{p['error_pct']:+.0f}%",
            f"{after:+.1f}%" if abs(after) <= 10 else f"[bold]{after:+.0f}%[/bold]",
            whys.ref(p["why"]),
        )
    con.print(t)
    say("role: fit (a point the fit was made from) or check (a point it predicts); error: "
        "(measured - predicted) / predicted, before and after the fit (JSON: calibrated_ms). Why a "
        "point is still beyond 10% after the fit:")  # fmt: skip
    whys.print_new()
    f = compact_table("Fits: measured ~ overhead + predicted / efficiency", "quantity", "overhead ms",
                      "efficiency", "fit points")  # fmt: skip
    for q, fit in d["fits"].items():
        f.add_row(q, f"{fit['overhead_ms']:.4g}", f"{fit['efficiency']:.3f}", str(fit["fit_points"]))
    con.print(f)
    eff = d["effective"]
    say(", ".join(f"{k} {v:,.3g}" for k, v in eff.items()) or "no effective rates")
    if d.get("forward_floor_ms"):
        ff = d["forward_floor"]
        say(
            f"forward floor {d['forward_floor_ms']:.3g} ms: generate's first token for a "
            f"{ff['tail_tokens']}-token tail over {ff['cached_tokens']} cached tokens "
            "(the planner's least time per forward)"
        )
    p10 = d["p10"]
    say(
        f"predictions ({p10['scope']}): {p10['within_before']}/{p10['points']} points within 10% "
        "before calibration, "
        f"{p10['within_after']}/{p10['points']} after: {p10['status']}"
        + (f"; saved to {d['saved']}" if d.get("saved") else "")
    )
