"""What every `kvtier` command shares: usage errors in one line, and a `--plot` option checked at once."""

from __future__ import annotations

import os
from pathlib import Path

import click


class OneLineErrors(click.Command):
    """A command whose usage errors print one line, ``Error: ...`` naming the option, exit code 2:
    no usage banner above it (the error is the news; `--help` has the rest)."""

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as e:
            e.ctx = None  # click prints the usage banner only for an error that carries its context
            raise

    def invoke(self, ctx):
        try:
            _refuse_empty(self, ctx)
            return super().invoke(ctx)
        except click.UsageError as e:
            e.ctx = None
            raise


def _refuse_empty(command: click.Command, ctx: click.Context) -> None:
    """An option given an empty value (`--link ""`) is a usage error: left as it is it would mean
    the default, which the operator did not ask for."""
    for param in command.params:
        value = ctx.params.get(param.name)
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, str) and not v.strip() for v in values):
            raise click.BadParameter("an empty value; give one, or leave the option out", ctx, param)


def png_path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--plot: refused before any work when its folder is missing or not writable."""
    if value is None:
        return None
    folder = Path(value).parent
    if not folder.is_dir():
        raise click.BadParameter(f"folder {str(folder)!r} does not exist", ctx, param)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise click.BadParameter(f"folder {str(folder)!r} is not writable", ctx, param)
    return value


def plot_option(help_text: str):
    """--plot PNG: checked at once (its folder exists and is writable)."""
    return click.option("--plot", type=click.Path(dir_okay=False), callback=png_path, help=help_text)
