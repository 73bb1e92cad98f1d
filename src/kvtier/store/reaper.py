"""Completions of the store's engine jobs, applied once their events have completed.

A saved chunk becomes READY in the host, and a load's pin on its slot drops, only when the
job's event has completed — never when a call returned, never on a timeout. Applied by any
store call, by handle waits, and by this thread (so pins do not linger when the caller never
waits): it queries the oldest job's event once per slice, asleep in between, and applies what
completed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Reaper:
    """apply(job, entry, kind): called once per completed job, after the engine settled it.
    count(**events): the store's counters (errors of this thread are counted, not lost)."""

    def __init__(
        self,
        apply: Callable[[object, object, str], None],
        count: Callable[..., None],
        *,
        slice_s: float = 0.005,
    ) -> None:
        self._apply, self._count = apply, count
        self._slice_s = slice_s
        self._lock = threading.Lock()
        self._inflight: list[tuple[object, object, str]] = []  # (job, entry, kind), oldest first
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-store-reaper", daemon=True)
        self._thread.start()

    def track(self, job, entry, kind: str) -> None:
        with self._lock:
            self._inflight.append((job, entry, kind))
        self._wake.set()

    def track_many(self, items) -> None:
        """`track` for each (job, entry, kind) of `items`, in order: one lock, one wake-up (the
        jobs of one engine call)."""
        with self._lock:
            self._inflight.extend(items)
        self._wake.set()

    def jobs(self) -> list:
        with self._lock:
            return [job for job, _, _ in self._inflight]

    def __len__(self) -> int:
        with self._lock:
            return len(self._inflight)

    def reap(self) -> int:
        """Apply every job whose event has completed; returns how many."""
        seen: dict = {}  # this pass: event id -> completed, and stream -> False past its first incomplete
        with self._lock:
            # Taken out under the lock: two threads reaping at once must not apply a job twice.
            done = [it for it in self._inflight if self._completed(it[0].event, seen)]
            if not done:
                return 0
            gone = {id(d) for d in done}
            self._inflight = [it for it in self._inflight if id(it) not in gone]
        first_error = None
        for job, entry, kind in done:
            try:  # every completed job is applied even if one fails: no pin may be left behind
                job.done()  # settles in the engine: the slot READY after a save, the read ended after a load
                self._apply(job, entry, kind)
            except Exception as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return len(done)

    @staticmethod
    def _completed(event, seen: dict) -> bool:
        """One query per event and none past a stream's first incomplete event in a pass (events
        of one stream complete in the order they were recorded, which is the order jobs are
        tracked; a job tracked out of that order is only reaped a pass later, never early): a
        32K-token load is 128 jobs sharing one event, queried under the GIL while the caller's
        forward needs it."""
        stream = getattr(event, "stream", None)
        if stream is not None and seen.get(("stream", id(stream))) is False:
            return False
        key = ("event", id(event))
        if key not in seen:
            seen[key] = event.query()
            if not seen[key] and stream is not None:
                seen[("stream", id(stream))] = False
        return seen[key]

    def close(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)  # the thread applies completions: stop it before the store drains

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                oldest = self._inflight[0][0] if self._inflight else None
            try:
                if oldest is None:
                    self._wake.wait(0.05)  # idle: woken by track(); nothing can complete meanwhile
                    self._wake.clear()
                    continue
                if not oldest.event.query():
                    # One query a slice, asleep in between: each wake-up takes the GIL from the
                    # caller's thread (a forward's launches beside a load), so wake-ups stay rare;
                    # callers' own store calls and waits reap sooner.
                    self._stop.wait(self._slice_s)
                    continue
                self.reap()
            except Exception:  # a device error reaches the caller through its own waits, not here
                log.exception("kvstore reaper")
                self._count(background_errors=1)
                self._stop.wait(0.05)  # do not spin on a sticky device error
