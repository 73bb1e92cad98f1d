"""Subcommand `kvtier trace`: a save and a layer-pipelined load beside compute, drawn as one lane per
stream from event timestamps, with the ordering facts checked (`kvtier.bench.timeline`).

    kvtier trace --out trace.png                  # CUDA when present, else the simulator
    kvtier trace --device sim --json              # intervals, markers and facts as JSON

Exit status 1 when a fact is false (compute ran a layer before it arrived, or a copy waited on
an event that was never recorded).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvtier.cli import cli

# (layers, tokens, compute ms per layer, ms of the decode read the load must wait for) by device:
# the simulator's delays make a small run visible
DEFAULTS = {"sim": (8, 64, 0.0, 8.0), "cuda": (32, 4096, 0.4, 2.0)}
SIM_COPY_S, SIM_LAUNCH_S = 0.004, 0.003  # simulated DMA / "kernel" durations


def _device(kind: str):
    import torch

    from kvtier.device import CudaDevice, SimDevice

    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "sim"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise click.UsageError("--device cuda: torch finds no CUDA GPU (use --device sim)")
        return "cuda", CudaDevice()
    return "sim", SimDevice(copy_delay=SIM_COPY_S, launch_delay=SIM_LAUNCH_S)


@cli.command()
@click.option(
    "--out", type=click.Path(dir_okay=False), default="trace.png", show_default=True, help="PNG to write."
)
@click.option(
    "--device",
    "device_kind",
    type=click.Choice(["auto", "cuda", "sim"]),
    default="auto",
    show_default=True,
    help="CUDA GPU, or the CPU simulator (late copies).",
)
@click.option("--layers", type=click.IntRange(1, 256), default=None, help="Layers [sim 8, cuda 32].")
@click.option("--tokens", type=click.IntRange(1, 1 << 20), default=None, help="Tokens [sim 64, cuda 4096].")
@click.option(
    "--path",
    type=click.Choice(["auto", "staged", "kernel", "batch"]),
    default="auto",
    show_default=True,
    help="Copy path of both jobs; auto: the engine's pick for the save, "
    "kernel for the load (an event per layer).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the timeline and facts as JSON.")
@click.option(
    "--no-wait",
    "no_wait",
    is_flag=True,
    hidden=True,
    help="Broken on purpose: compute skips its per-layer waits (the fact must fail).",
)
def trace(
    out: str,
    device_kind: str,
    layers: int | None,
    tokens: int | None,
    path: str,
    as_json: bool,
    no_wait: bool,
) -> None:
    """Draw each stream's timeline of a save and a layer-pipelined load beside compute."""
    if not Path(out).resolve().parent.is_dir():
        raise click.UsageError(f"--out: folder {str(Path(out).parent)!r} does not exist")
    from kvtier.bench.progress import Steps

    with Steps(3, "trace", enabled=not as_json) as step:
        step("loading torch and kvtier")
        try:
            from kvtier.bench.timeline import draw
        except ImportError as e:
            raise click.UsageError(f"trace needs torch and matplotlib: {e}") from None
        kind, device = _device(device_kind)
        tr = _collect(kind, device, layers, tokens, path, no_wait, step)
        step(f"drawing {out}")
        draw(tr, out)
    if as_json:
        click.echo(json.dumps(tr.to_json() | {"png": out}, indent=1))
    else:
        f = tr.facts
        click.echo(f"timeline of {len(tr.spans)} intervals on {tr.device} written to {out}")
        click.echo(f"compute started layer i only after layer i arrived: {f['compute_after_layer']}")
        click.echo(f"every copy-stream wait was on a recorded event:      {f['copy_waits_real']}")
    if not tr.ok:
        raise SystemExit(1)


def _collect(kind: str, device, layers, tokens, path: str, no_wait: bool, step):
    """The save and load beside compute, run (on CUDA twice: the first compiles the kernels, the
    second is drawn); the device closed after."""
    from kvtier.bench.timeline import collect

    d_layers, d_tokens, compute_ms, read_ms = DEFAULTS[kind]
    runs = 2 if kind == "cuda" else 1
    step.total += runs - 1
    try:
        for i in range(runs):
            step(f"save + load beside compute on {kind}" + (" (compiling)" if i < runs - 1 else ""))
            tr = collect(
                device,
                layers=layers or d_layers,
                tokens=tokens or d_tokens,
                heads=8 if kind == "cuda" else 2,
                head_dim=128 if kind == "cuda" else 16,
                path=path,
                compute_ms=compute_ms,
                read_ms=read_ms,
                wait_layers=not no_wait,
            )
    except ValueError as e:  # e.g. a path this device lacks
        raise click.UsageError(str(e)) from None
    finally:
        device.close()
    return tr
