"""Subcommands `kvtier probe` (this machine's ceilings), `kvtier bench` (suites -> result file) and
`kvtier results` (a result file as a table).

    kvtier probe --save ceilings.json && kvtier bench --out kvtier-results

`bench` measures its own ceilings in the same run; the result file records the command, commit,
software versions and those ceilings. Heavy imports (torch, matplotlib) happen inside commands.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import click

from kvtier.cli import cli
from kvtier.cli.options import plot_option

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
}


class ByteSize(click.ParamType):
    """Bytes: 1073741824, 1GiB, 512MiB, 64M (decimal), at least 1 MiB, a multiple of 4 KiB."""

    name = "bytes"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            n = value
        else:
            m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
            unit = m.group(2).lower() if m else None
            if not m or unit not in _UNITS:
                self.fail(f"{value!r} is not a size (examples: 1073741824, 1GiB, 256MiB)", param, ctx)
            n = int(float(m.group(1)) * _UNITS[unit])
        if n < 1 << 20 or n % 4096:
            self.fail(f"{value!r}: needs at least 1 MiB and a multiple of 4096 bytes", param, ctx)
        return n


def _console():
    from kvtier.bench.terminal import console

    return console()


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (nothing else on stdout).")
@click.option("--save", type=click.Path(dir_okay=False), default=None, help="Write the ceilings file here.")
@click.option(
    "--size", type=ByteSize(), default=None, help="Bytes per transfer [GPU: 1GiB host<->device, 4GiB d2d]."
)
@click.option("--quick", is_flag=True, help="Small sizes, few repeats: a smoke test, not figures.")
@click.option(
    "--all-gpus",
    is_flag=True,
    help="Also every GPU alone vs all at once (host<->device), GPU<->GPU pairs, NVML topology, NUMA.",
)
def probe(as_json: bool, save: str | None, size: int | None, quick: bool, all_gpus: bool = False) -> None:
    """Measure this machine's ceilings (copies, PCIe, launch, matmul) next to the datasheet."""
    if save is not None and not Path(save).resolve().parent.is_dir():
        raise click.UsageError(f"--save: folder {str(Path(save).parent)!r} does not exist")
    from kvtier.bench.progress import Steps

    console = _console()
    with Steps(2, "probe", enabled=not as_json) as step:
        step("loading torch")
        try:
            from kvtier.bench.probe import probe_steps, run_probe
        except ImportError as e:
            raise click.UsageError(f"probe needs torch: {e}") from None
        step.total = 1 + probe_steps()
        report = run_probe(size=size, quick=quick, on_step=lambda s: step(f"measuring {s}"))
    doc = report.to_json()
    ceilings, multi = report.ceilings(), None
    if all_gpus:
        from kvtier.bench.probe_multi import run_multi

        if as_json:
            multi = run_multi(size=size, quick=quick)
        else:
            with _err_console().status("probing all GPUs") as status:
                multi = run_multi(size=size, quick=quick, on_step=lambda s: status.update(f"measuring {s}"))
        ceilings = multi.ceilings(ceilings)
        doc["multi_gpu"] = multi.to_json()
        doc["ceilings"] = ceilings.to_json()
    if save is not None:
        ceilings.save(save)
    if as_json:
        click.echo(json.dumps(doc, indent=1))
        return
    from kvtier.bench.report import print_probe

    print_probe(doc)
    if multi is not None:
        from kvtier.bench.probe_multi import summary_lines

        for line in summary_lines(doc["multi_gpu"]):
            console.print(line)
    if save is not None:
        use = f"roofline / path / plan --ceilings {save}" + ("" if ceilings.gpu_key else " --gpu KEY")
        why = "" if ceilings.gpu_key else f" ({ceilings.gpu or 'no GPU'}: name the GPU to predict for)"
        console.print(f"ceilings written to {save}; use with {use}{why}")


def _err_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _list_suites() -> None:
    from kvtier.bench.runner import suites

    for name, info in sorted(suites().items()):
        click.echo(f"{name:24s} {'GPU' if info.needs_gpu else 'any'}  {info.description}")


@cli.command()
@click.option(
    "--suite", "names", multiple=True, help="Suite to run (repeatable). Default: all that can run here."
)
@click.option("--quick", is_flag=True, help="Tiny sizes (CPU / CI smoke): not figures to compare.")
@click.option("--out", type=click.Path(file_okay=False), default="kvtier-results", show_default=True)
@click.option(
    "--plot/--no-plot", default=True, show_default=True, help="Write a PNG next to the result file."
)
@click.option(
    "--profile",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a Chrome-trace timeline (Perfetto / Nsight); timings then use few repeats.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result document as JSON.")
@click.option("--list", "list_only", is_flag=True, help="List the suites and exit.")
def bench(names, quick, out, plot, profile, as_json, list_only) -> None:
    """Run benchmark suites; write <out>/<gpu>-<date>.json with same-run ceilings."""
    if list_only:
        _list_suites()
        return
    if profile is not None and not Path(profile).resolve().parent.is_dir():
        raise click.UsageError(f"--profile: folder {str(Path(profile).parent)!r} does not exist")
    try:
        from kvtier.bench.runner import plan, run_bench
    except ImportError as e:
        raise click.UsageError(f"bench needs torch: {e}") from None
    import torch

    try:
        plan(names, torch.cuda.is_available())
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    run = run_bench(names, quick=quick, out_dir=out, plot=plot, profile=profile, progress=not as_json)
    if as_json:
        click.echo(json.dumps(run.doc, indent=1))
    else:
        from kvtier.bench.report import bench_status_lines, print_bench

        console = _console()
        env = run.doc["environment"]
        if not env.get("gpu"):
            console.print("[bold yellow]No GPU found[/]: ran the suites that need none.")
        if run.doc["rows"]:
            print_bench(run.doc)
        else:
            console.print("[yellow]no rows[/]: every suite chosen was skipped here (reasons below)")
        for line in bench_status_lines(run.doc):
            console.print(line)
        console.print(
            f"wrote {run.path}"
            + (f" and {run.plot}" if run.plot else " (no plot: no row has a GB/s to draw)")
        )
        if profile:
            console.print(f"timeline: {profile} (open in ui.perfetto.dev or Nsight Systems)")
    if run.failed or run.incorrect:
        for f in run.failed:
            click.echo(f"FAILED suite {f}", err=True)
        for c in run.incorrect:
            click.echo(f"WRONG RESULT {c}", err=True)
        sys.exit(1)


@cli.command()
@click.argument("result_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@plot_option("Draw the file's plot (as `kvtier bench` does) to this PNG.")
def results(result_file: str, as_json: bool, plot: str | None) -> None:
    """Summarize a result file of `kvtier bench`: per suite and path, the headline row and the worst
    and best rows (markdown table); --plot draws it."""
    from kvtier.bench.result import validate
    from kvtier.bench.summary import markdown, summarize

    try:
        doc = json.loads(Path(result_file).read_text())
        validate(doc)
    except (json.JSONDecodeError, ValueError) as e:
        raise click.UsageError(f"{result_file}: not a valid kvtier result file ({e})") from None
    if plot is not None:
        from kvtier.bench.plot import plot as draw

        env = doc["environment"]
        title = f"{env.get('gpu') or 'CPU (no GPU)'} - {env.get('date', '')[:10]} - {Path(result_file).name}"
        if draw(doc["rows"], plot, title, env.get("ceilings_spread")) is None:
            raise click.UsageError(f"--plot: {result_file} has no row with a GB/s to draw")
        click.echo(f"plot: {plot}", err=True)
    if as_json:
        click.echo(json.dumps(summarize(doc), indent=2, default=str))
    else:
        click.echo(markdown(doc))
