"""The handles `TransferEngine.save` / `load` return.

A job is *submitted* when its call returns and *complete* when its event has completed; it is
*settled* once the engine applied that completion to the trackers (slot READY after a save,
the slot's read ended after a load). Nothing is released before its event completed.

`SubmitTrace`: an opt-in timer of the phases of each submit (P6: CPU time per job).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.device.base import Event, Stream
from kvtier.pool import Slot

if TYPE_CHECKING:
    from kvtier.engine.engine import TransferEngine


@dataclass(eq=False)
class _Job:
    engine: TransferEngine = field(repr=False)
    slot: Slot
    event: Event  # e_save / e_load: after it the whole job has landed
    ids: np.ndarray  # int32 [n] block ids (`IdCheck`); read-only (the block tracker holds this memory)
    nbytes: int
    path: str
    submit_s: float  # CPU seconds spent in save()/load()
    settled: bool = False
    slot_released: bool = False  # the owner let go of the slot before this job settled

    @property
    def blocks(self) -> torch.Tensor:
        """The job's block ids as an int64 CPU tensor (a copy of `ids`)."""
        return torch.from_numpy(self.ids).long()

    def done(self) -> bool:
        """True once the job's event has completed (settles it on the way)."""
        if not self.event.query():
            return False
        self.engine._settle(self)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until complete and settled; False on timeout (and nothing is released)."""
        return self.engine.wait(self, timeout)

    def wait_on(self, stream: Stream) -> None:
        """Make later work on `stream` wait for the whole job (no host blocking)."""
        # e.g. compute overwriting saved blocks, or reading loaded ones, must follow the copy.
        stream.wait_event(self.event)
        self.engine._note_wait(stream, self.event)


@dataclass(eq=False)
class SaveJob(_Job):
    """GPU blocks -> one pool slot. The slot is READY (and the blocks free to overwrite) only
    once `event` has completed; `wait()` / `engine.poll()` make it so in the tracker."""


@dataclass(eq=False)
class LoadJob(_Job):
    """One pool slot -> GPU blocks. `layer_events[l]` completes when layer l of every block has
    landed; the last is `event`. On the staged path every layer's event is `event`."""

    layer_events: list[Event] = field(default_factory=list)

    def wait_layer(self, layer: int, stream: Stream) -> None:
        """Later work on `stream` waits until layer `layer` has arrived (the host does not block)."""
        if not isinstance(layer, int) or not 0 <= layer < len(self.layer_events):
            raise ValueError(f"layer: expected 0..{len(self.layer_events) - 1}, got {layer!r}")
        ev = self.layer_events[layer]
        # Attention of layer `layer` must not read its blocks before their bytes have landed.
        stream.wait_event(ev)
        self.engine._note_wait(stream, ev)


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
    SubmitTrace()` or KVTIER_SUBMIT_TRACE=1; off (None) each mark costs one test. The record in
    progress is per thread."""

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
    """What the engine marks when no trace is set: nothing (a method call each, ~50 ns)."""

    def begin(self, job: str) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass

    def mark_steps(self, phases, stamps) -> None:
        pass

    def end(self) -> None:
        pass


NO_TRACE = _NoTrace()
