"""`python -m lab`: kvtier's bench with the lab's suites registered, and result files judged
against kvtier's targets.

    python -m lab bench --suite submit_overhead [--out DIR] [--quick]   (default out: lab/results)
    python -m lab bench --list
    python -m lab results lab/results/<file>.json
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvtier.cli.measure import bench


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "default_map": {"bench": {"out": "lab/results"}}}
)
def main() -> None:
    """kvtier's lab: its suites beside kvtier's, and verdicts against kvtier's targets."""
    import lab.suites  # noqa: F401 - registers the lab's suites before any command reads the registry


main.add_command(bench)


@main.command()
@click.argument("result_file", type=click.Path(exists=True, dir_okay=False))
def results(result_file: str) -> None:
    """A result file as a markdown table, each group and engine row judged against its target."""
    from kvtier.bench.result import validate
    from lab.summary import markdown

    try:
        doc = json.loads(Path(result_file).read_text())
        validate(doc)
    except (json.JSONDecodeError, ValueError) as e:
        raise click.UsageError(f"{result_file}: not a valid kvtier result file ({e})") from None
    click.echo(markdown(doc))


if __name__ == "__main__":
    main(prog_name="python -m lab")
