"""FirstTokens: per request with a hit, the choice made for it and its first token, planned and
measured, on the scheduler side (for vLLM's logged metrics and Prometheus). Torch-free.

A request's clock starts at its first lookup (when vLLM first asks the connector about it) and
stops when the workers' report of the step that computed its last prompt token comes back: that
step's output carries the first token.

    firsts.asked(rid, choice)          a lookup's choice (the first one starts the clock)
    firsts.scheduled(rid, step)        the step that computes its last prompt token
    firsts.reported(step)              that step's report came back
    firsts.take() -> [[kind, tier, predicted_ms, measured_ms], ...]   done since the last take
                                       (each also to ``on_first(choice, measured_ms)`` at once)
    firsts.forget(rid)
"""

from __future__ import annotations

import time

from .choice import Choice


class FirstTokens:
    """on_first(choice, measured_ms): called with each first token measured."""

    def __init__(self, on_first=None) -> None:
        self._on_first = on_first
        self._asked: dict[str, tuple[float, Choice]] = {}  # rid -> (first lookup, latest choice)
        self._steps: dict[int, list[str]] = {}  # step -> rids whose first token it computes
        self._done: list[list] = []

    def asked(self, rid: str, choice: Choice, now: float | None = None) -> None:
        t0 = self._asked[rid][0] if rid in self._asked else (time.monotonic() if now is None else now)
        self._asked[rid] = (t0, choice)

    def scheduled(self, rid: str, step: int) -> None:
        if rid in self._asked:
            self._steps.setdefault(step, []).append(rid)

    def reported(self, step: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for old in [s for s in self._steps if s <= step]:
            for rid in self._steps.pop(old):
                got = self._asked.pop(rid, None)
                if got is not None and old == step:
                    t0, c = got
                    self._done.append([c.kind, c.tier, c.predicted_ms, (now - t0) * 1e3])
                    if self._on_first is not None:
                        self._on_first(c, (now - t0) * 1e3)

    def take(self) -> list[list]:
        out, self._done = self._done, []
        return out

    def forget(self, rid: str) -> None:
        self._asked.pop(rid, None)
