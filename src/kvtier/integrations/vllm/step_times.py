"""StepTimes: how long this engine's forward takes, fitted from the steps vLLM ran. Torch-free.

The scheduler side sees each step twice: when it builds the step's metadata (the tokens vLLM
scheduled, and how many each request had computed before) and when the workers' report of that
step comes back. The time between the two is the step's forward (under vLLM's asynchronous
scheduling, from the later of its build and the previous step's report). A step's time is fitted
as

    ms = a + b * tokens + c * work,    work = sum over its requests of n * (computed + n / 2)

(a: the step's fixed cost, b: per token, c: attention's per (query, key) pair: n new tokens after
``computed`` cached ones attend to ``computed + n / 2`` keys on average), least squares over the
recent steps, every coefficient at least 0, refitted without the steps far slower than the fit
(a first use, a stall). The steps are kept per size class (powers of two of
their tokens), the newest `PER_CLASS` of each, so a stream of decode steps never pushes the few
prefills that show b and c out of the fit.

    times.built(step, tokens, work)     a step's metadata was built (its number, what it runs)
    times.reported(step)                its workers' report came back: its time is observed
    times.observe(tokens, work, ms)     one step
    times.ready(tokens)                 a step of at least ``tokens`` tokens was seen (a prefill)
    times.prefill_ms(tokens, prefix)    a prefill of ``tokens`` after ``prefix`` cached ones, in
                                        steps of at most ``step_tokens`` (vLLM's chunked prefill)
    times.step_ms()                     the median of the recent steps, empty ones included: a
                                        request whose load lands waits about half of one for the
                                        next step that can schedule it
    times.loading(step)                 that step carries a load in the step (layer by layer under
                                        its forward): its time is not fitted as a forward's
    times.in_step_seen(missed_ms)       a first token loaded in the step came this much later than
                                        its plan said without `in_step_extra_ms` (what such a load
                                        costs beyond its copies' overlap with the forward)
    times.in_step_extra_ms()            the median of those (0 before one was seen; a process's
                                        first is left out: a path's first use may pay what no
                                        later one does)
"""

from __future__ import annotations

import statistics
import time
from collections import deque

PER_CLASS = 8  # the newest steps kept per power of two of their tokens
RECENT = 8  # steps `step_ms` takes its median over: the batch running now
PENDING = 64  # steps built and not reported yet, at most (a report that never comes is dropped)
OUTLIER, OUTLIER_PASSES, MIN_ROWS = 3.0, 3, 3  # a step this far over the fit is left out of it


class StepTimes:
    """step_tokens: the most tokens vLLM schedules in one step (``max_num_batched_tokens``)."""

    def __init__(self, step_tokens: int) -> None:
        if isinstance(step_tokens, bool) or not isinstance(step_tokens, int) or step_tokens < 1:
            raise ValueError(f"step_tokens: an int >= 1, got {step_tokens!r}")
        self.step_tokens = step_tokens
        self._classes: dict[int, deque[tuple[float, float, float]]] = {}
        self._recent: deque[float] = deque(maxlen=RECENT)
        self._coef: tuple[float, float, float] | None = None  # (a, b, c); None: to refit
        self._largest = 0
        self._built: dict[int, tuple[float, int, float]] = {}  # step -> (when built, tokens, work)
        self._last_report = 0.0
        self._loading: set[int] = set()  # steps built with a load in the step
        self._extra: deque[float] = deque(maxlen=RECENT)  # loads in a step: their time over the plan's
        self._first_load_seen = False

    def built(self, step: int, tokens: int, work: float, now: float | None = None) -> None:
        self._built[step] = (time.monotonic() if now is None else now, tokens, work)
        while len(self._built) > PENDING:
            self._loading.discard(oldest := next(iter(self._built)))
            del self._built[oldest]

    def reported(self, step: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for old in [s for s in self._built if s < step]:
            del self._built[old]  # their reports never came: nothing to time them by
            self._loading.discard(old)
        got = self._built.pop(step, None)
        if got is not None:
            t0, tokens, work = got
            # Under vLLM's asynchronous scheduling a step is built while the one before runs.
            ms = (now - max(t0, self._last_report)) * 1e3
            if step in self._loading:
                if 0 <= ms < float("inf"):
                    self._recent.append(ms)  # a step of the batch, not a forward to fit
            else:
                self.observe(tokens, work, ms)
        self._loading.discard(step)
        self._last_report = now

    def loading(self, step: int) -> None:
        if step in self._built:
            self._loading.add(step)

    def in_step_seen(self, missed_ms: float) -> None:
        if not -float("inf") < missed_ms < float("inf"):
            return
        if not self._first_load_seen:
            self._first_load_seen = True  # a first use's one-time costs would stick: no later sample
            return
        self._extra.append(max(0.0, missed_ms))

    def in_step_extra_ms(self) -> float:
        return statistics.median(self._extra) if self._extra else 0.0

    def observe(self, tokens: int, work: float, ms: float) -> None:
        if not 0 <= ms < float("inf"):
            return
        self._recent.append(ms)
        if tokens <= 0:
            return  # an empty step (requests waiting for their loads): no forward to fit
        self._classes.setdefault(tokens.bit_length(), deque(maxlen=PER_CLASS)).append(
            (float(tokens), float(work), float(ms))
        )
        self._largest = max(self._largest, tokens)
        self._coef = None

    def ready(self, tokens: int) -> bool:
        return self._largest >= tokens

    def step_ms(self) -> float:
        return statistics.median(self._recent) if self._recent else 0.0

    def prefill_ms(self, tokens: int, prefix: int = 0) -> float:
        a, b, c = self.coefficients()
        ms, done = 0.0, 0
        while done < tokens:
            n = min(self.step_tokens, tokens - done)
            ms += a + b * n + c * n * (prefix + done + n / 2)
            done += n
        return ms

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c) of the fit; (0, 0, 0) before any step."""
        if self._coef is None:
            rows = [s for q in self._classes.values() for s in q]
            self._coef = _fit(rows)
        return self._coef


def _fit(rows: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """`_fit_once`, then again without the steps far slower than it (a first use's compiles and
    allocations, a stall): one such step among a size class's few would pull every prediction up.
    A step is far slower when it is over the fit by more than OUTLIER times the median miss and
    more than a tenth of its own time; at most OUTLIER_PASSES passes, never below MIN_ROWS steps."""
    coef = _fit_once(rows)
    for _ in range(OUTLIER_PASSES):
        miss = [ms - (coef[0] + coef[1] * n + coef[2] * w) for n, w, ms in rows]
        typical = statistics.median(abs(m) for m in miss) if miss else 0.0
        keep = [r for r, m in zip(rows, miss, strict=True) if m <= max(OUTLIER * typical, 0.1 * r[2])]
        if len(keep) == len(rows) or len(keep) < MIN_ROWS:
            break
        rows, coef = keep, _fit_once(keep)
    return coef


def _fit_once(rows: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least squares of ms over (1, tokens, work) with every coefficient >= 0: the full fit, else
    the best of the fits over fewer terms whose coefficients are all >= 0."""
    if not rows:
        return 0.0, 0.0, 0.0
    best, best_sse = None, float("inf")
    for terms in ((0, 1, 2), (0, 1), (1, 2), (1,), (0,)):
        coef = _solve(rows, terms)
        if coef is None or any(x < 0 for x in coef):
            continue
        full = [0.0, 0.0, 0.0]
        for t, x in zip(terms, coef, strict=True):
            full[t] = x
        sse = sum((ms - full[0] - full[1] * n - full[2] * w) ** 2 for n, w, ms in rows)
        if sse < best_sse * (1 - 1e-9):  # more terms first: a tie keeps the fuller fit
            best, best_sse = tuple(full), sse
    return best if best is not None else (0.0, 0.0, 0.0)


def _solve(rows, terms: tuple[int, ...]) -> list[float] | None:
    """The normal equations of ms over the columns ``terms`` of (1, tokens, work), solved by
    Gaussian elimination; None when they are singular (too few distinct steps)."""
    k = len(terms)
    cols = [[(1.0, n, w)[t] for t in terms] for n, w, _ in rows]
    m = [[sum(x[i] * x[j] for x in cols) for j in range(k)] for i in range(k)]
    v = [sum(x[i] * r[2] for x, r in zip(cols, rows, strict=True)) for i in range(k)]
    for i in range(k):
        p = max(range(i, k), key=lambda r: abs(m[r][i]))
        if abs(m[p][i]) <= 1e-12 * max(1.0, max(abs(m[r][r]) for r in range(k))):
            return None
        m[i], m[p], v[i], v[p] = m[p], m[i], v[p], v[i]
        for r in range(i + 1, k):
            f = m[r][i] / m[i][i]
            m[r] = [a - f * b for a, b in zip(m[r], m[i], strict=True)]
            v[r] -= f * v[i]
    out = [0.0] * k
    for i in reversed(range(k)):
        out[i] = (v[i] - sum(m[i][j] * out[j] for j in range(i + 1, k))) / m[i][i]
    return out
