"""Circuit breaker: after N consecutive failures a tier is skipped for a while.

A tier that keeps timing out would otherwise cost every request its full timeout; skipping
it turns the failure into a cheap miss (the caller recomputes) until a probe succeeds.
Plain Python, thread-safe, with an injectable clock for tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class CircuitBreaker:
    """Closed → (``failure_threshold`` consecutive failures) → open for ``cooldown_s`` →
    half-open: one caller is let through as a probe; its success closes the breaker, its
    failure opens it again for another ``cooldown_s``.
    """

    failure_threshold: int = 3
    cooldown_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    _failures: int = field(default=0, init=False)
    _open_until: float | None = field(default=None, init=False)
    _probing: bool = field(default=False, init=False)
    _trips: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.failure_threshold, int) or self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be an int >= 1, got {self.failure_threshold!r}")
        if not self.cooldown_s >= 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s!r}")

    def allow(self) -> bool:
        """True if the caller may use the tier now (closed, or the half-open probe)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or self.clock() < self._open_until:
                return False
            # Only one probe at a time: a burst of callers after the cooldown would each pay
            # the full timeout of a tier that is still down.
            self._probing = True
            return True

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._open_until = None
            self._probing = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._probing or self._failures >= self.failure_threshold:
                if self._open_until is None or self._probing:
                    self._trips += 1
                self._open_until = self.clock() + self.cooldown_s
                self._probing = False

    def trip(self) -> None:
        """Open now, as after ``failure_threshold`` failures (a tier found down at start)."""
        with self._lock:
            self._failures = max(self._failures, self.failure_threshold)
            if self._open_until is None:
                self._trips += 1
            self._open_until = self.clock() + self.cooldown_s
            self._probing = False

    @property
    def is_open(self) -> bool:
        """True while callers are being turned away (open, or half-open with a probe out)."""
        with self._lock:
            return self._open_until is not None and (self._probing or self.clock() < self._open_until)

    @property
    def trips(self) -> int:
        """How many times the breaker has opened (a failed probe counts again)."""
        return self._trips
