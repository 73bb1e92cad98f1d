"""`kvtier plan`: for a prefix hit in a tier, load it, recompute it, or both at once (split)?"""

from __future__ import annotations

import click

from kvtier.cli import cli
from kvtier.cli.analysis import (
    MAX_TOKENS,
    _ceilings,
    _emit,
    _gpu_key,
    common_ceilings,
    common_dtype,
    common_gpu,
    common_json,
    common_kv_dtype,
    common_model,
    efficiency_option,
    usage_errors,
)


@cli.command("plan")
@common_model
@common_gpu
@click.option(
    "--tier",
    type=click.Choice(["host", "disk", "remote", "redis"]),
    default="host",
    show_default=True,
    help="Where the matched prefix lives (redis = remote).",
)
@click.option(
    "--matched",
    type=click.IntRange(min=0, max=MAX_TOKENS),
    required=True,
    help="Tokens of the stored prefix hit (whole chunks).",
)
@click.option(
    "--new",
    "new",
    type=click.IntRange(min=1, max=MAX_TOKENS),
    required=True,
    help="Prompt tokens after the prefix.",
)
@click.option(
    "--chunk-tokens",
    type=click.IntRange(min=1, max=MAX_TOKENS),
    default=256,
    show_default=True,
    help="The store's chunk size.",
)
@click.option(
    "--link", "-l", default=None, help="GPU <-> host link (pcie3..pcie6); default: the GPU's PCIe gen."
)
@click.option("--nic", default="nic200", show_default=True, help="NIC for the remote tier (nic100/200/400).")
@efficiency_option("Fraction of peak FLOPs a prefill reaches.")
@common_dtype
@common_kv_dtype
@common_ceilings
@click.option(
    "--calibration",
    type=click.Path(dir_okay=False),
    default=None,
    help="A fit from `kvtier calibrate --save`: its prefill rate and fixed cost and its H2D rate "
    "replace --efficiency and the probed H2D (its ceilings stand in for --ceilings when absent).",
)
@common_json
@usage_errors
def plan_cmd(
    model,
    gpu,
    tier,
    matched,
    new,
    chunk_tokens,
    link,
    nic,
    efficiency,
    dtype,
    kv_dtype,
    ceilings,
    calibration,
    as_json,
):
    """Predict time to first token when the prefix is recomputed, loaded, or split between the two.

    The last line says why, in one line: the choice, then each option's predicted ms and what
    bounds it (--json: "why", and each option's "bound")."""
    import dataclasses

    from kvtier.bench.calibration_file import planner_inputs
    from kvtier.ceilings import Ceilings
    from kvtier.cli.report import unfit_json
    from kvtier.cli.tables import print_unfit
    from kvtier.hfconfig import resolve_model
    from kvtier.planner import plan
    from kvtier.roofline import memory_fit
    from kvtier.specs import get_gpu

    measured = _ceilings(ceilings)
    overhead = floor = 0.0
    doc = _calibration(calibration, gpu) if calibration is not None else None
    if doc is not None and measured is None:  # the file's ceilings stand in for --ceilings
        measured = Ceilings(
            dict(doc["ceilings"]),
            gpu=doc.get("gpu"),
            gpu_key=doc.get("gpu_key"),
            source=f"the ceilings of {calibration}",
        )
    where = "--ceilings" if ceilings is not None else "--calibration"
    m, g = resolve_model(model), get_gpu(_gpu_key(gpu, measured, where), measured)
    fit = memory_fit(m, g, 1, matched + new, dtype, kv_dtype)  # the weights and this request's KV
    if not fit.fits:
        inputs = dict(tier=tier, matched_tokens=matched, new_tokens=new, chunk_tokens=chunk_tokens)
        return _emit(unfit_json(m, g, fit, dtype, kv_dtype, **inputs), as_json, print_unfit)
    if doc is not None:
        got = planner_inputs(doc, g.bf16_tflops)
        efficiency, overhead, floor = got["efficiency"], got["prefill_overhead_ms"], got["forward_floor_ms"]
        if "h2d_gbps" in got:  # the fitted H2D rate for the PCIe hop
            measured = dataclasses.replace(
                measured, figures=measured.figures | {"h2d_pinned_gbps": got["h2d_gbps"]}
            )
    p = plan(
        m,
        g,
        tier,
        matched,
        new,
        measured,
        efficiency,
        link,
        chunk_tokens=chunk_tokens,
        kv_dtype=kv_dtype,
        nic=nic,
        prefill_overhead_ms=overhead,
        forward_floor_ms=floor,
    )
    data = {"model": m.key, "gpu": g.key, "tier": tier, "efficiency": efficiency, "kv_dtype": kv_dtype}
    data |= {"ceilings": ceilings, "calibration": calibration, "prefill_overhead_ms": overhead}
    data |= {"forward_floor_ms": floor}
    data |= {"gpu_measured": list(g.measured)} | p.to_json()
    data["fits"] = fit.to_json()
    _emit(data, as_json, _print)


def _calibration(path: str, gpu: str | None) -> dict:
    """A calibration file with a prefill fit, measured on a GPU: --gpu when one is named. A fit of
    another device (the CPU's tiny model, another GPU) says nothing of this one's prefill."""
    from kvtier.bench.calibration_file import load

    doc = load(path)  # ValueError naming the file: exit code 2
    if "prefill" not in doc["fits"]:
        raise ValueError(f"--calibration: {path!r} has no prefill fit")
    on = doc.get("gpu_key")
    if doc.get("device") != "cuda":
        raise ValueError(
            f"--calibration: {path!r} was measured on {str(doc.get('device')).upper()}, not a GPU: its "
            "fits say nothing of a GPU's prefill; run `kvtier calibrate --save FILE` on the GPU"
        )
    if gpu is not None and on not in (None, gpu):
        raise ValueError(f"--calibration: {path!r} was measured on {on}, not --gpu {gpu}")
    if gpu is None and on is None:
        raise ValueError(
            f"--calibration: {path!r} was measured on {doc.get('gpu')}, which `kvtier specs` does not "
            "list: name the GPU with --gpu"
        )
    return doc


def _print(d: dict) -> None:
    from kvtier.bench.terminal import compact_table, console

    con = console()
    title = (
        f"Plan: {d['model']} on {d['gpu']}, {d['matched_tokens']} tokens matched in {d['tier']}, "
        f"{d['new_tokens']} new (chunks of {d['chunk_tokens']})"
    )
    t = compact_table(
        title, "option", "recompute tokens", "load tokens", "recompute ms", "load ms", "new tokens ms",
        "TTFT ms",
    )  # fmt: skip
    for name, o in d["options"].items():
        t.add_row(
            name + (" (chosen)" if name == d["choice"] else ""),
            str(o["recompute_tokens"]),
            str(o["load_tokens"]),
            f"{o['recompute_ms']:.3f}",
            f"{o['load_ms']:.3f}",
            f"{o['new_ms']:.3f}",
            f"{o['ms']:.3f}",
        )
    con.print(t)
    p = d["path"]
    if d["load_bytes"]:
        h = compact_table(
            f"Load path of {d['load_bytes'] / 1e6:.1f} MB ({d['tier']} -> GPU)",
            "hop (data-flow order)", "GB/s", "time ms alone",
        )  # fmt: skip
        for hop in p["hops"]:
            mark = "  <- bottleneck" if hop["name"] == p["bottleneck"] else ""
            h.add_row(hop["name"] + mark, f"{hop['gbps']:.1f}", f"{hop['time_ms']:.3f}")
        con.print(h)
    con.print("(sources of every figure: --json or `kvtier specs`)")
    for r in d["reasons"]:
        con.print(f"- {r}")
    s = d["split_tokens"]
    con.print(
        f"choice: {d['choice']} (recompute [0, {s}), load [{s}, {d['matched_tokens']})), "
        f"predicted TTFT {d['predicted_ms'][d['choice']]:.3f} ms"
        + (f"; GPU figures measured: {', '.join(d['gpu_measured'])}" if d["gpu_measured"] else "")
    )
    con.print(d["why"], soft_wrap=True, markup=False, highlight=False)  # one line, never wrapped
