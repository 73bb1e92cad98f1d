"""Timer: how long a callable takes on the device it runs on, as a distribution.

GPU work is asynchronous: a call returning means *submitted*, not *done*. So on CUDA the clock
is a pair of CUDA events around the work on the current stream, read only after the end event
has completed; on the host the clock (`perf_counter`) stops only after `sync()` returned. Both
warm up first (lazy init, compilation, caches, clocks), then repeat until `min_reps` are in
and either the spread is small enough or the time budget is spent.

`fn` must do all its GPU work on the current stream, or make the current stream wait for the
streams it used before it returns (`current.wait_stream(s)`): the end event only sees work
ordered before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.bench.profile import stage
from kvtier.bench.stats import Timing, summarize

_FLUSH_MIN_BYTES = 128 << 20  # L2 size unknown: larger than any L2 we know (H200: 60 MB)


class TimingError(RuntimeError):
    """The callable cannot be timed the way it was asked (e.g. it cannot be graph-captured)."""


@dataclass(slots=True)
class Timer:
    """Times callables; one Timer per device, reusable.

    device: "cuda", "cuda:1", "cpu", a torch.device, or None (CUDA when available, else CPU).
    sync:   host path only: waits for all work `fn` submitted (e.g. a fake asynchronous device
            in tests). CPU torch ops are synchronous, so the default does nothing.
    on_time: called with each measurement's name as it starts (a command's progress display).
    """

    device: Any = None
    warmup: int = 2
    min_reps: int = 5
    max_reps: int = 200
    budget_s: float = 1.0
    rel_spread: float = 0.02
    sync: Callable[[], None] | None = None
    on_time: Callable[[str], None] | None = None  # told the name of each measurement as it starts
    _kind: str = field(default="", init=False, repr=False)
    _flush_buf: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup: expected an int >= 0, got {self.warmup!r}")
        if not isinstance(self.min_reps, int) or self.min_reps < 1:
            raise ValueError(f"min_reps: expected an int >= 1, got {self.min_reps!r}")
        if not isinstance(self.max_reps, int) or self.max_reps < self.min_reps:
            raise ValueError(
                f"max_reps: expected an int >= min_reps ({self.min_reps}), got {self.max_reps!r}"
            )
        if not self.budget_s > 0:
            raise ValueError(f"budget_s: expected > 0 seconds, got {self.budget_s!r}")
        if not self.rel_spread >= 0:
            raise ValueError(f"rel_spread: expected >= 0, got {self.rel_spread!r}")
        self.device, self._kind = _resolve_device(self.device)

    @property
    def on_cuda(self) -> bool:
        return self._kind == "cuda"

    def time(
        self,
        fn: Callable[[], object],
        *,
        flush_l2: bool = False,
        graph: bool = False,
        setup: Callable[[], object] | None = None,
        name: str | None = None,
    ) -> Timing:
        """Time `fn()`; `setup()` runs before each run, untimed (e.g. poison the output).

        flush_l2: overwrite a buffer larger than the (L2 / last-level) cache before each run, so
                  `fn` reads its inputs from memory, as it would in real use.
        graph:    capture `fn` once into a CUDA graph and time its replay (launch-bound work).
        name:     NVTX / profiler range around the whole measurement.
        """
        if not callable(fn):
            raise ValueError(f"fn: expected a callable, got {type(fn).__name__}")
        if graph and not self.on_cuda:
            raise ValueError("graph: CUDA graphs need a CUDA device; this timer runs on the host")
        if self.on_time is not None:
            self.on_time(name or getattr(fn, "__name__", "timed"))
        with stage(name or getattr(fn, "__name__", "timed")):
            if self.on_cuda:
                return self._time_cuda(fn, flush_l2, graph, setup)
            return self._time_host(fn, flush_l2, setup)

    def _done(self, samples: list[float], elapsed_s: float) -> bool:
        n = len(samples)
        if n >= self.max_reps:
            return True
        if n < self.min_reps:
            return False
        return elapsed_s >= self.budget_s or summarize(samples).spread <= self.rel_spread

    def _time_host(self, fn, flush_l2, setup) -> Timing:
        sync = self.sync or (lambda: None)
        for _ in range(self.warmup):
            fn()
        sync()  # warm-up work still running would be billed to the first timed run
        samples: list[float] = []
        t_begin = time.perf_counter()
        while True:
            if setup is not None:
                setup()
            if flush_l2:
                self._host_flush()
            sync()  # setup work must be done before the clock starts
            t0 = time.perf_counter()
            fn()
            sync()  # stop the clock when the work is done, not when it was submitted
            samples.append((time.perf_counter() - t0) * 1e3)
            if self._done(samples, time.perf_counter() - t_begin):
                return summarize(samples, "perf_counter")

    def _time_cuda(self, fn, flush_l2, graph, setup) -> Timing:
        import torch

        run, clock = (self._capture(fn), "cuda_graph") if graph else (fn, "cuda_events")
        for _ in range(self.warmup):
            run()
        torch.cuda.synchronize(self.device)  # lazy init / warm-up must not overlap the first timed run
        flush = self._cuda_flush_buffer() if flush_l2 else None
        stream = torch.cuda.current_stream(self.device)
        samples: list[float] = []
        t_begin = time.perf_counter()
        while True:
            if setup is not None:
                setup()
            if flush is not None:
                flush.zero_()  # evicts fn's inputs from L2; ordered before the start event, so untimed
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)  # on fn's stream: the clock starts when the GPU reaches fn, not the CPU
            run()
            end.record(stream)  # after fn's last kernel on that stream: only work ordered before it counts
            end.synchronize()  # elapsed_time is valid only once the end event completed on the GPU
            samples.append(start.elapsed_time(end))
            if self._done(samples, time.perf_counter() - t_begin):
                return summarize(samples, clock)

    def _capture(self, fn) -> Callable[[], None]:
        import torch

        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)  # the side stream must see inputs written before the capture
        with torch.cuda.stream(side):
            for _ in range(max(1, self.warmup)):
                fn()  # capture needs warmed-up libraries (cuBLAS handles, Triton compiles) first
        current.wait_stream(side)  # the warm-up writes finish before anything after them reads
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                fn()
        except Exception as e:
            raise TimingError(
                f"fn cannot be captured in a CUDA graph ({type(e).__name__}: {e}); time it with graph=False"
            ) from e
        return g.replay

    def _cuda_flush_buffer(self):
        import torch

        if self._flush_buf is None:
            props = torch.cuda.get_device_properties(self.device)
            l2 = int(getattr(props, "L2_cache_size", 0) or 0)
            self._flush_buf = torch.empty(
                max(2 * l2, _FLUSH_MIN_BYTES), dtype=torch.uint8, device=self.device
            )
        return self._flush_buf

    def _host_flush(self) -> None:
        import numpy as np

        if self._flush_buf is None:
            self._flush_buf = np.empty(_FLUSH_MIN_BYTES, dtype=np.uint8)
        self._flush_buf.fill(len(self._flush_buf) & 0xFF)


def _resolve_device(device: Any) -> tuple[Any, str]:
    """(device, "cuda" | "cpu"); torch is imported only when needed."""
    if device is None:
        try:
            import torch
        except ImportError:
            return "cpu", "cpu"
        device = "cuda" if torch.cuda.is_available() else "cpu"
    text = str(device)
    if text == "cpu":
        return device, "cpu"
    if text.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device: {text!r} asked for, but torch finds no CUDA device")
        return torch.device(text), "cuda"
    raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
