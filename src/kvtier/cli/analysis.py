"""Subcommands that need no GPU: `specs`, `roofline`, `path`."""

from __future__ import annotations

import functools
import json

import click

from kvtier.cli import cli
from kvtier.cli.options import plot_option
from kvtier.cli.report import path_json, roofline_json, specs_json
from kvtier.cli.tables import print_path, print_roofline, print_specs
from kvtier.planner import MAX_TOKENS  # no context is longer: a larger count is a typo

MAX_BATCH = 1 << 30
POSITIVE = click.IntRange(min=1, max=MAX_BATCH)
TOKENS = click.IntRange(min=0, max=MAX_TOKENS)
POSITIVE_TOKENS = click.IntRange(min=1, max=MAX_TOKENS)


def usage_errors(fn):
    """Bad input becomes a one-line usage error (exit code 2), never a traceback. OverflowError:
    a number too large for a float, from an input that no check caught."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, OverflowError) as e:
            raise click.UsageError(str(e)) from None

    return wrapper


def _ceilings(path: str | None):
    if path is None:
        return None
    from kvtier.ceilings import Ceilings

    return Ceilings.load(path)


def _finish(data: dict, as_json: bool, printer, plot: str | None, plotter: str) -> None:
    """Draw the PNG if asked (matplotlib is imported only then), then print. A configuration
    that does not fit the GPU has no times to draw: no PNG, and the fit says why."""
    if plot and data["fits"]["fits"]:
        from kvtier.cli import plots

        try:
            getattr(plots, plotter)(data, plot)
        except OSError as e:  # e.g. the disk filled up, or the folder went away since the check
            raise click.UsageError(f"--plot: cannot write {plot!r}: {e.strerror or e}") from None
        data["plot"] = plot
    _emit(data, as_json, printer)


def _emit(data: dict, as_json: bool, printer) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        printer(data)


common_model = click.option(
    "--model", "-m", default="llama-3-8b", show_default=True, help="Preset name or path to a config.json."
)
common_gpu = click.option(
    "--gpu",
    "-g",
    default=None,
    help="GPU key (see `kvtier specs`); default: the --ceilings GPU, else h100-sxm.",
)
common_dtype = click.option(
    "--dtype", default="bf16", show_default=True, help="Weight dtype, for the memory fit (fp8 halves it)."
)


DEFAULT_GPU = "h100-sxm"


def _gpu_key(gpu: str | None, ceilings, where: str = "--ceilings") -> str:
    """--gpu, else the GPU the ceilings were measured on, else the default. A ceilings file whose
    GPU kvtier does not know (or measured without one) cannot say which GPU to predict for."""
    if gpu:
        return gpu
    if ceilings is None:
        return DEFAULT_GPU
    if ceilings.gpu_key:
        return ceilings.gpu_key
    on = f"on {ceilings.gpu}, which `kvtier specs` does not list" if ceilings.gpu else "without a GPU"
    raise ValueError(f"{where}: measured {on}: name the GPU to predict for with --gpu")


common_ceilings = click.option(
    "--ceilings", type=click.Path(dir_okay=False), help="Measured ceilings (from `kvtier probe --save`)."
)
common_kv_dtype = click.option(
    "--kv-dtype", default="bf16", show_default=True, help="KV cache dtype (fp8 halves it)."
)


def efficiency_option(help_text: str):
    """--efficiency: the fraction of peak FLOPs assumed reachable (0, 1]."""
    return click.option(
        "--efficiency",
        type=click.FloatRange(min=0, min_open=True, max=1),
        default=1.0,
        show_default=True,
        help=help_text,
    )


common_json = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")


@cli.command()
@common_ceilings
@common_json
@usage_errors
def specs(ceilings: str | None, as_json: bool) -> None:
    """List the GPUs, links and models kvtier knows, with the source of every figure."""
    _emit(specs_json(_ceilings(ceilings)), as_json, print_specs)


@cli.command()
@common_model
@common_gpu
@click.option("--batch", "-b", type=POSITIVE, default=1, show_default=True, help="Requests decoded together.")
@click.option("--context", "-c", type=TOKENS, default=8192, show_default=True, help="Tokens per request.")
@click.option(
    "--prefill",
    "prefill_tokens",
    type=POSITIVE_TOKENS,
    default=8192,
    show_default=True,
    help="Prefill length.",
)
@click.option("--dtype", default="bf16", show_default=True, help="Weight and compute dtype.")
@common_kv_dtype
@efficiency_option("Fraction of peak FLOPs assumed reachable.")
@click.option(
    "--amdahl", metavar="FRACTION:SPEEDUP", help="End-to-end gain of speeding a part up, e.g. 0.1:1.2."
)
@common_ceilings
@common_json
@plot_option("Draw the roofline with operating points to a PNG.")
@usage_errors
def roofline(
    model, gpu, batch, context, prefill_tokens, dtype, kv_dtype, efficiency, amdahl, ceilings, as_json, plot
):
    """Is a decode step or a prefill bound by compute or by memory? Lower bounds for one GPU."""
    amdahl_args = _parse_amdahl(amdahl) if amdahl else None
    measured = _ceilings(ceilings)
    data = roofline_json(
        model,
        _gpu_key(gpu, measured),
        batch,
        context,
        prefill_tokens,
        dtype,
        kv_dtype,
        efficiency,
        measured,
        amdahl_args,
    )
    _finish(data, as_json, print_roofline, plot, "plot_roofline")


def _parse_amdahl(text: str) -> tuple[float, float]:
    try:
        fraction, speedup = (float(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--amdahl: expected FRACTION:SPEEDUP like 0.1:1.2, got {text!r}") from None
    return fraction, speedup


@cli.command()
@common_model
@click.option(
    "--tokens", "-t", type=POSITIVE_TOKENS, default=8192, show_default=True, help="Tokens of KV to move."
)
@click.option(
    "--link", "-l", default=None, help="GPU <-> host link (pcie3..pcie6); default: the GPU's PCIe gen."
)
@click.option("--tier", type=click.Choice(["host", "disk", "remote"]), default="host", show_default=True)
@click.option("--direction", type=click.Choice(["load", "save"]), default="load", show_default=True)
@common_gpu
@click.option("--nic", default="nic200", show_default=True, help="NIC for the remote tier (nic100/200/400).")
@click.option("--gpudirect", is_flag=True, help="GPUDirect RDMA / Storage: skip host DRAM.")
@click.option(
    "--shared-by", type=POSITIVE, default=1, show_default=True, help="GPUs sharing the link at once."
)
@common_dtype
@common_kv_dtype
@efficiency_option("Fraction of peak FLOPs reachable when recomputing.")
@common_ceilings
@common_json
@plot_option("Draw load vs recompute time over prefix length.")
@usage_errors
def path(
    model,
    tokens,
    link,
    tier,
    direction,
    gpu,
    nic,
    gpudirect,
    shared_by,
    dtype,
    kv_dtype,
    efficiency,
    ceilings,
    as_json,
    plot,
):
    """Hop-by-hop path of moving a KV range, its bottleneck, and load vs recompute."""
    measured = _ceilings(ceilings)
    data = path_json(
        model,
        tokens,
        link,
        tier,
        direction,
        _gpu_key(gpu, measured),
        nic,
        gpudirect,
        shared_by,
        kv_dtype,
        efficiency,
        measured,
        dtype,
    )
    _finish(data, as_json, print_path, plot, "plot_load_vs_recompute")
