"""Progress of a command that works for more than a moment: what it is doing now and the time
left, on stderr (a tqdm bar, as `kvtier bench` shows), so a long run never looks hung.

    with Steps(total=7, desc="demo") as step:
        step("building the model")           # a step starts; the one before it is done
        step("request 1 of 4", weight=3)     # a step 3x as long as a plain one
        ...

`total` is the sum of the steps' weights. The time left is tqdm's estimate from the steps done so
far. `enabled=False` (e.g. under --json, or a caller's own display) shows nothing.
"""

from __future__ import annotations

import sys

BAR = "{desc}: {percentage:3.0f}%|{bar:20}| {elapsed} elapsed, about {remaining} left{postfix}"


class Steps:
    def __init__(self, total: float, desc: str, *, enabled: bool = True) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            total=total,
            desc=desc,
            unit="step",
            file=sys.stderr,
            disable=not enabled,
            dynamic_ncols=True,
            bar_format=BAR,
        )
        self._weight = 0.0

    def __call__(self, what: str, weight: float = 1.0) -> None:
        """Step `what` starts (the previous one is done)."""
        self._done()
        self._weight = weight
        self._bar.set_postfix_str(what[:60], refresh=True)

    @property
    def total(self) -> float:
        return self._bar.total

    @total.setter
    def total(self, value: float) -> None:
        """The weights once known better (e.g. after the device is known)."""
        self._bar.total = value
        self._bar.refresh()

    def _done(self) -> None:
        if self._weight:
            self._bar.update(min(self._weight, self._bar.total - self._bar.n))
        self._weight = 0.0

    def close(self) -> None:
        self._done()
        self._bar.close()

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
