"""`SubmitTrace`: an opt-in timer of the phases of each submit (the CPU time a save / load costs
its caller), and `NO_TRACE`, what the fast path's own phases mark when none is set.

The engine runs a traced submit as a separate code path, chosen once when `engine.trace` is set:
the plain submit carries no trace checks.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque

# The runtime calls of a staged graph replay (the C helper's call split by its own stamps when
# traced, graph_fused.STEPS: the guard's query where asked, the device check, the ids copy, the
# launch, the record); the rest of the call (Python around it, its arguments, the ids' fill)
# counts as kvtier's work.
CALL_PHASES = ("guard", "device", "ids_h2d", "launch", "event")


class SubmitTrace:
    """Where the CPU time of each save()/load() goes: perf_counter_ns deltas between the engine's
    marks (ids, slot, tracker_wait, graph_lookup, retarget, ids_fill, replay_prep, replay_args,
    guard, device, ids_h2d, launch, event, replay_return, eager, capture, mover,
    tracker_begin, ...), one dict per job, the last `keep` jobs. Set `engine.trace =
    SubmitTrace()` or KVTIER_SUBMIT_TRACE=1; off (None) the engine makes no mark at all. The
    record in progress is per thread."""

    def __init__(self, keep: int = 4096):
        self.records: deque[dict] = deque(maxlen=keep)
        self._local = threading.local()

    def begin(self, job: str) -> None:
        loc = self._local
        loc.rec = {"job": job}
        loc.t0 = loc.t = time.perf_counter_ns()

    def mark(self, phase: str) -> None:
        """Charge the time since the last mark to `phase` (added up when a phase repeats)."""
        loc = self._local
        rec = getattr(loc, "rec", None)
        if rec is not None:
            t = time.perf_counter_ns()
            rec[phase] = rec.get(phase, 0) + t - loc.t
            loc.t = t

    def mark_steps(self, phases, stamps) -> None:
        """Charge the time from the last mark to each stamp (perf_counter_ns readings, e.g. those the
        C helper took with the same clock) to its phase, in order, skipping stamps of 0 (steps not
        reached); the next mark counts from the last stamp. One call for a traced C replay's split:
        the trace's own cost stays out of the phases it times as far as it can."""
        loc = self._local
        rec = getattr(loc, "rec", None)
        if rec is None:
            return
        last = loc.t
        for phase, t in zip(phases, stamps, strict=True):
            if t:
                rec[phase] = rec.get(phase, 0) + t - last
                last = t
        loc.t = last

    def end(self) -> None:
        loc = self._local
        if getattr(loc, "rec", None) is None:
            return
        self.mark("other")
        loc.rec["total"] = loc.t - loc.t0
        self.records.append(loc.rec)
        loc.rec = None

    def medians(self, job: str | None = None) -> dict[str, float]:
        """Median microseconds per phase over the records of `job` ("save"/"load"; None: all);
        a phase a job did not pass counts 0 for it."""
        recs = [r for r in self.records if job is None or r["job"] == job]
        phases = dict.fromkeys(k for r in recs for k in r if k != "job")
        return {k: statistics.median(r.get(k, 0) for r in recs) / 1e3 for k in phases}

    def split(self, job: str | None = None) -> dict[str, float | None]:
        """Medians over the records of `job` of `calls_us` (the phases that are one runtime call
        each on a staged replay: CALL_PHASES), `py_us` (the rest: kvtier's Python, the trace's
        own marks included) and `total_us` (the traced submit, whole). Two versions make the same
        calls: where their `calls_us` differ, the host differed."""
        recs = [r for r in self.records if job is None or r["job"] == job]
        if not recs:
            return {"calls_us": None, "py_us": None, "total_us": None}
        calls = [sum(r.get(k, 0) for k in CALL_PHASES) / 1e3 for r in recs]
        py = [r["total"] / 1e3 - c for r, c in zip(recs, calls, strict=True)]
        total = statistics.median(r["total"] for r in recs) / 1e3
        return {"calls_us": statistics.median(calls), "py_us": statistics.median(py), "total_us": total}

    def clear(self) -> None:
        self.records.clear()


class _NoTrace:
    """What the fast path marks when no trace is set: nothing."""

    def begin(self, job: str) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass

    def mark_steps(self, phases, stamps) -> None:
        pass

    def end(self) -> None:
        pass


NO_TRACE = _NoTrace()
