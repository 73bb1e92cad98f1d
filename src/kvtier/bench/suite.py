"""The suite interface: a suite is `fn(ctx) -> Iterable[Row]`, registered by name.

    @register("my_gather", description="torch.index_select gather, GPU->GPU")
    def gather(ctx: Context):
        t = ctx.time(lambda: ..., name="gather/bs16")
        yield ctx.row("bs16", nbytes, t, "d2d_copy", traffic_factor=2, block_size=16, path="torch")

Every row's ratio is computed against a ceiling measured once, in the same run, by
`ctx.ceiling(name)` (repeated runs: the median, with the slowest and the fastest run's rates).
"d2d_copy" counts bytes read + written, so a GPU->GPU gather that reads and writes its payload
once uses traffic_factor=2; the host<->device ceilings count bytes moved.
A suite that cannot run here raises `SkipSuite(reason)`; a case that cannot, calls `ctx.skip`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvtier.bench.stats import Rate, Timing
from kvtier.bench.timing import Timer

MiB, GiB = 1 << 20, 1 << 30


@dataclass(slots=True)
class Row:
    """One result row; `bytes` is the payload moved per run."""

    suite: str
    case: str
    bytes: int
    median_ms: float
    min_ms: float
    max_ms: float
    gbps: float  # payload GB/s (1e9) from the median
    ceiling: str
    ceiling_gbps: float
    ratio: float  # gbps * traffic_factor / ceiling_gbps
    params: dict = field(default_factory=dict)
    correct: bool | None = None  # bit-exact check, where the suite did one


class SkipSuite(Exception):
    """Raised by a suite that cannot run here; the message says why."""


@dataclass(frozen=True, slots=True)
class SuiteInfo:
    name: str
    fn: Callable[[Context], Iterable[Row]]
    needs_gpu: bool
    description: str


SUITES: dict[str, SuiteInfo] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register(name: str, *, needs_gpu: bool = True, description: str = "") -> Callable:
    """Decorator: register `fn(ctx) -> Iterable[Row]` as suite `name`."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"name: expected lower_snake_case, got {name!r}")

    def deco(fn: Callable[[Context], Iterable[Row]]) -> Callable[[Context], Iterable[Row]]:
        old = SUITES.get(name)
        if old is not None and (old.fn.__module__, old.fn.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"name: suite {name!r} is already registered by {old.fn.__module__}")
        doc = (fn.__doc__ or "").strip().splitlines()
        SUITES[name] = SuiteInfo(name, fn, needs_gpu, description or (doc[0] if doc else ""))
        return fn

    return deco


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):  # e.g. a phase -> us table
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v).removeprefix("torch.")  # e.g. torch.bfloat16 -> "bfloat16"


class Context:
    """What a suite gets: the device, quick mode, a timer, and the run's ceilings."""

    def __init__(self, device: Any = "cpu", quick: bool = False, *, profiling: bool = False):
        import torch

        self.device = torch.device(device)
        self.quick = quick
        self.profiling = profiling  # a trace is being recorded: few repeats, keep event counts modest
        self.on_gpu = self.device.type == "cuda"
        self.suite: str | None = None  # set by the runner while a suite runs
        self.ceilings: dict[str, Rate] = {}  # GB/s, measured in this run (median, slowest, fastest)
        self.skipped: list[dict] = []  # {"suite", "case", "reason"}
        self.on_progress: Callable[[str], None] | None = None  # told what is being timed (progress bar)
        reps = {"warmup": 1, "min_reps": 2, "max_reps": 3} if profiling else {}  # a trace, not figures
        budget = 0.2 if quick else 1.0
        n = 3 if quick else 10
        self.timer = Timer(self.device, **({"min_reps": n, "budget_s": budget} | reps))
        self._ceiling_timer = Timer(self.device, **({"min_reps": n, "budget_s": 2 * budget} | reps))
        self.host_timer = Timer("cpu", **({"min_reps": n, "budget_s": budget} | reps))
        # Large enough that no cache holds them (an L2 or a CPU's last-level cache: tens of MB).
        if self.on_gpu:
            sizes = (256 * MiB, 64 * MiB, 256 * MiB) if quick else (4 * GiB, GiB, GiB)
        else:
            sizes = (0, 0, 256 * MiB)
        self.ceiling_bytes = {"d2d": sizes[0], "host_device": sizes[1], "host": sizes[2]}

    def time(
        self,
        fn: Callable[[], object],
        *,
        flush_l2: bool = False,
        graph: bool = False,
        name: str | None = None,
        setup: Callable[[], object] | None = None,
        host: bool = False,
    ) -> Timing:
        """Warm up, repeat, return the distribution; NVTX/profiler range `name` around it.

        setup: runs before each run, untimed. host: time CPU-only work with the host clock."""
        label = f"{self.suite}/{name}" if self.suite and name else name
        if self.on_progress and name:
            self.on_progress(name)
        timer = self.host_timer if host else self.timer
        return timer.time(fn, flush_l2=flush_l2, graph=graph, setup=setup, name=label)

    def ceiling(self, name: str, *, nbytes: int | None = None, **where: Any) -> Rate:
        """GB/s of ceiling `name` (the median of repeated runs, with the slowest and fastest),
        measured once in this run and cached.

        nbytes: the probe's size (default: this run's size for its kind). where: what the probe
        needs (`CeilingDef.needs`, e.g. the directory of a disk probe), given on the call that
        measures it; later calls (and `row`) read the cached figure."""
        from kvtier.bench.probes import CEILINGS

        if name not in CEILINGS:
            raise ValueError(f"ceiling: unknown {name!r}; known: {', '.join(CEILINGS)}")
        if name not in self.ceilings:
            d = CEILINGS[name]
            missing, extra = [k for k in d.needs if k not in where], sorted(set(where) - set(d.needs))
            if missing or extra:
                raise ValueError(
                    f"ceiling: {name!r} is measured with {', '.join(d.needs) or 'no arguments'}; "
                    f"missing {missing}, unexpected {extra} (measure it with ctx.ceiling(name, ...) first)"
                )
            if nbytes is not None and (
                isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0
            ):
                raise ValueError(f"nbytes: expected an int > 0 or None, got {nbytes!r}")
            if self.on_progress:
                self.on_progress(f"ceiling {name}")
            if d.needs_gpu and not self.on_gpu:
                raise ValueError(f"ceiling: {name!r} needs a CUDA device; this run is on {self.device}")
            key = "d2d" if name == "d2d_copy" else "host" if not d.needs_gpu else "host_device"
            got = d.fn(self._ceiling_timer, nbytes or self.ceiling_bytes[key], **where)
            self.ceilings[name] = got if isinstance(got, Rate) else Rate(got, got, got, 1)
            if self.on_gpu:
                import torch

                torch.cuda.empty_cache()  # the probe buffers are not needed again
        return self.ceilings[name]

    def row(
        self,
        case: str,
        nbytes: int,
        timing: Timing,
        ceiling: str,
        *,
        traffic_factor: float = 1.0,
        correct: bool | None = None,
        **params: Any,
    ) -> Row:
        """A row with GB/s of payload and its ratio to the same-run ceiling `ceiling`."""
        if not isinstance(case, str) or not case:
            raise ValueError(f"case: expected a non-empty string, got {case!r}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"nbytes: expected an int > 0, got {nbytes!r}")
        if not isinstance(timing, Timing):
            raise ValueError(f"timing: expected a Timing from ctx.time, got {type(timing).__name__}")
        if not traffic_factor > 0:
            raise ValueError(f"traffic_factor: expected > 0, got {traffic_factor!r}")
        if correct is not None and not isinstance(correct, bool):
            correct = bool(correct)
        ceiling_gbps = self.ceiling(ceiling)
        gbps = timing.gbps(nbytes)
        params = {k: _jsonable(v) for k, v in params.items()} | {"traffic_factor": float(traffic_factor)}
        params["timing"] = {
            "p10_ms": timing.p10_ms,
            "p50_ms": timing.median_ms,
            "p90_ms": timing.p90_ms,
            "p99_ms": timing.percentile_ms(99),
            "count": timing.count,
            "clock": timing.clock,
        }
        return Row(
            suite=self.suite or "unnamed",
            case=case,
            bytes=nbytes,
            median_ms=timing.median_ms,
            min_ms=timing.min_ms,
            max_ms=timing.max_ms,
            gbps=gbps,
            ceiling=ceiling,
            ceiling_gbps=float(ceiling_gbps),
            ratio=gbps * traffic_factor / float(ceiling_gbps),
            params=params,
            correct=correct,
        )

    def skip(self, case: str, reason: str) -> None:
        """Record that `case` could not run here, and why (shown and written to the result file)."""
        self.skipped.append({"suite": self.suite or "unnamed", "case": case, "reason": reason})
