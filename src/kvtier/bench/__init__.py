"""bench: what a user runs to learn about their own machine and model.

    Timer, Timing                CUDA-event / host-clock timer and the distribution it returns
    register(name, ...)          decorator: add a suite `fn(ctx) -> Iterable[Row]` to the registry
    Context, Row, SkipSuite      what a suite gets, what it yields, how it says it cannot run here
    registry() / run_bench(...)  the registry (kvtier's suites and any registered before the call);
                                 run suites into one result file with same-run ceilings

A project outside kvtier registers its own suites with `register` before calling `run_bench` (or
`kvtier.cli.measure.bench`): they run beside kvtier's, into the same result file.
"""

from kvtier.bench.runner import BenchRun, plan, run_bench
from kvtier.bench.runner import suites as registry  # `kvtier.bench.suites` is the package of suites
from kvtier.bench.stats import Timing, summarize
from kvtier.bench.suite import Context, GiB, MiB, Row, SkipSuite, register
from kvtier.bench.timing import Timer

__all__ = [
    "BenchRun",
    "Context",
    "GiB",
    "MiB",
    "Row",
    "SkipSuite",
    "Timer",
    "Timing",
    "plan",
    "register",
    "registry",
    "run_bench",
    "summarize",
]
