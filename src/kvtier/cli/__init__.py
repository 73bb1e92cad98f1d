"""`kvtier` command line: a click group; each subcommand lives in its own module and imports heavy
libraries (torch, matplotlib) inside the command, so `kvtier --help` stays fast."""

import click

from kvtier import __version__
from kvtier.cli.options import OneLineErrors


class Commands(click.Group):
    command_class = OneLineErrors  # every subcommand's usage errors: one line, exit code 2


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvtier")
def cli() -> None:
    """Move the KV cache of LLM serving between GPU, host, disk and remote - and explain its speed."""


def main() -> None:
    # each import registers its subcommands on `cli`
    import kvtier.cli.calibrate  # noqa: F401
    from kvtier.cli import analysis, demo, measure, plan, trace  # noqa: F401

    cli(prog_name="kvtier")
