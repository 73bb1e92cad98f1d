"""What the commands print, for a terminal of its own width (80 columns where output is not a
terminal, or `COLUMNS`): a table that never wraps a number or a name letter by letter, and the
long texts under it (sources, reasons, notes) as numbered footnotes wrapped by words.

    console()                    the console every table goes to (stdout; stderr=True for progress)
    compact_table(title, *cols)  no vertical rules, two-line headers, numbers right-aligned
    Footnotes                    .ref(text) -> "3" in a cell; .print_new() under the table
    say(text)                    a note under a table, wrapped with a hanging indent
"""

from __future__ import annotations

import functools
import textwrap

from rich import box
from rich.console import Console
from rich.table import Table

LEFT = {  # columns of names and words, not numbers
    "key", "name", "case", "point", "role", "why", "src", "suite", "path", "attention", "quantity",
    "request", "from", "option", "hop (data-flow order)",
}  # fmt: skip


@functools.cache
def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False)


def say(text: str, lead: str = "  ", *, markup: bool = False) -> None:
    """A note under a table, wrapped by words to the terminal with a hanging indent."""
    con = console()
    width = max(40, con.width)
    out = textwrap.fill(text, width=width, initial_indent=lead, subsequent_indent=" " * len(lead))
    con.print(out, markup=markup, highlight=False)


class Footnotes:
    """Numbered footnotes: each distinct text gets a number (`ref`), printed once (`print_new`)."""

    def __init__(self, fmt: str = "[{}] ") -> None:
        self.texts: list[str] = []
        self.printed = 0
        self.fmt = fmt

    def ref(self, *texts: str | None) -> str:
        out = []
        for text in texts:
            if not text:
                continue
            if text not in self.texts:
                self.texts.append(text)
            out.append(str(self.texts.index(text) + 1))
        return ",".join(out)

    def print_new(self) -> None:
        """The footnotes not printed yet."""
        for i, text in enumerate(self.texts[self.printed :], self.printed + 1):
            say(text, "  " + self.fmt.format(i))
        self.printed = len(self.texts)


def compact_table(
    title: str, *cols: str, wrap: tuple[str, ...] = ("name", "attention", "case", "hop (data-flow order)")
) -> Table:
    """A table without vertical rules, each header on two lines (at its first space); numbers
    right-aligned and never wrapped, the `wrap` columns wrapped by words."""
    t = Table(
        title=title,
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for c in cols:
        wraps = c in wrap
        justify = "left" if wraps or c in LEFT else "right"
        t.add_column(c.replace(" ", "\n", 1), justify=justify, no_wrap=not wraps)
    return t
