"""Pool-slot states and their legal moves (`SlotTracker`); see the package docstring."""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.device.base import Event, check_timeout
from kvtier.lifecycle.errors import LifecycleError, sanitize_enabled


class SlotState(enum.Enum):
    FREE = "FREE"
    ALLOCATED = "ALLOCATED"  # owned, no data yet
    FILLING = "FILLING"  # a copy into it is in flight (e_save)
    READY = "READY"  # holds complete data
    READING = "READING"  # copies out of it are in flight (one e_load per read)


S = SlotState
# action -> the states it is legal from (event conditions are checked on top).
SLOT_MOVES: dict[str, frozenset[SlotState]] = {
    "begin_fill": frozenset({S.ALLOCATED}),
    "fill_host": frozenset({S.ALLOCATED}),
    "fill_done": frozenset({S.FILLING}),
    "begin_read": frozenset({S.READY, S.READING}),
    "end_read": frozenset({S.READING}),
    "abandon_read": frozenset({S.READING}),
    "release": frozenset({S.ALLOCATED, S.READY}),
    "retire": frozenset({S.ALLOCATED, S.FILLING, S.READY, S.READING}),
}

# Why an illegal move is a hazard, for the error message.
_DOUBLE = "double release: the slot was already released (stale handle)"
_ENDED = "no read with this event is in flight (ended twice?)"
SLOT_WHY: dict[tuple[str, SlotState], str] = {
    ("release", S.FILLING): "a copy into it is in flight; never reuse a slot after a timeout: retire() it",
    ("release", S.READING): "a copy out of it is in flight (host buffer released right after submit)",
    ("release", S.FREE): _DOUBLE,
    ("retire", S.FREE): _DOUBLE,
    ("begin_read", S.FILLING): "the copy into the slot has not landed; READY needs its event",
    ("begin_read", S.ALLOCATED): "the slot holds no data yet",
    ("fill_done", S.FILLING): "the copy into the slot has not landed",
    ("end_read", S.FREE): _ENDED,
    ("end_read", S.READY): _ENDED,
    (
        "end_read",
        S.READING,
    ): "the copy out of the slot is in flight; a read ends on completion, never on a timeout",
}


class _SlotLike(Protocol):
    name: str
    nbytes: int


class _PoolLike(Protocol):  # PinnedPool, by duck typing: lifecycle sits beside pool, not above
    def alloc(self, nbytes: int, timeout: float | None, on_pressure: Callable[[int], bool]) -> _SlotLike: ...
    def try_alloc(self, nbytes: int) -> _SlotLike | None: ...
    def free(self, slot: _SlotLike) -> None: ...
    def set_in_flight(self, slot: _SlotLike, busy: bool) -> None: ...


@dataclass(slots=True)
class _SlotRec:
    state: SlotState = S.ALLOCATED
    fill: Event | None = None  # e_save while FILLING
    reads: list[Event] = field(default_factory=list)  # e_load of each read in flight
    abandoned: list[Event] = field(default_factory=list)  # reads given up; dropped once complete
    retired: bool = False  # owner let go: free as soon as no event is pending


class SlotTracker:
    """States of the slots of one pool; wraps its alloc/free. Thread-safe."""

    def __init__(self, pool: _PoolLike, sanitize: bool | None = None):
        self.pool = pool
        self.sanitize = sanitize_enabled(sanitize)
        self._lock = threading.RLock()
        self._recs: dict[_SlotLike, _SlotRec] = {}
        self._watch: dict[_SlotLike, _SlotRec] = {}  # retired or with abandoned reads: what poll visits

    def alloc(
        self, nbytes: int, timeout: float | None = 0.0, on_pressure: Callable[[int], bool] | None = None
    ) -> _SlotLike:
        """A slot in ALLOCATED; waits (back-pressure) while retired slots drain or `on_pressure` evicts."""
        if timeout is not None and (type(timeout) is not float or not timeout >= 0):
            check_timeout(timeout)  # refused even when there is room now (a float >= 0 passes as is)
        slot = self.pool.try_alloc(nbytes)  # the usual case: room now (a submit's one pool call)
        if slot is None:

            def pressure(n: int) -> bool:
                return self.poll() > 0 or (on_pressure is not None and on_pressure(n))

            slot = self.pool.alloc(nbytes, timeout, pressure)
        with self._lock:
            self._recs[slot] = _SlotRec()
        return slot

    def state(self, slot: _SlotLike) -> SlotState:
        rec = self._recs.get(slot)
        return S.FREE if rec is None else rec.state

    def live(self) -> dict[_SlotLike, SlotState]:
        with self._lock:
            return {s: r.state for s, r in self._recs.items()}

    def waiting(self) -> list[_SlotLike]:
        """The slots `poll` visits: retired ones and those with abandoned reads, not yet settled."""
        with self._lock:
            return list(self._watch)

    def _fail(self, action: str, slot: _SlotLike, rec: _SlotRec | None, ev: Event | None, why: str):
        state = "FREE" if rec is None else rec.state.value + (" (retired)" if rec.retired else "")
        return LifecycleError(action, slot.name, state, ev, why)

    def _rec(self, action: str, slot: _SlotLike) -> _SlotRec | None:
        """The slot's record; with the sanitizer on, raise unless `action` is legal now."""
        rec = self._recs.get(slot)
        if not self.sanitize:
            return rec
        if rec is None:
            why = SLOT_WHY.get((action, S.FREE), "the slot was released (stale handle)")
            raise self._fail(action, slot, None, None, why)
        if rec.retired and action not in ("end_read", "abandon_read"):  # readers still end their reads
            raise self._fail(action, slot, rec, None, "the slot was retired; its owner let go of it")
        if rec.state not in SLOT_MOVES[action]:
            pending = rec.fill or next((e for e in rec.reads if not e.query()), None)
            why = SLOT_WHY.get((action, rec.state), f"{action} is legal only from {_names(action)}")
            raise self._fail(action, slot, rec, pending, why)
        return rec

    def _settle(self, slot: _SlotLike, rec: _SlotRec) -> bool:
        """Apply completions on a retired slot or abandoned reads; free when nothing is pending."""
        done = [e for e in rec.abandoned if e.query()]
        for e in done:  # an abandoned read leaves only once its copy has completed
            rec.abandoned.remove(e)
            rec.reads.remove(e)
        if rec.retired and rec.state is S.FILLING and rec.fill is not None and rec.fill.query():
            rec.state, rec.fill = S.READY, None  # nobody will call fill_done for a retired slot
        if rec.state is S.READING and not rec.reads:
            rec.state = S.READY
        self.pool.set_in_flight(slot, rec.state in (S.FILLING, S.READING))
        if rec.retired and rec.state in (S.READY, S.ALLOCATED):
            del self._recs[slot]
            self._watch.pop(slot, None)
            self.pool.free(slot)  # safe: no copy into or out of the slot is pending any more
            return True
        if rec.retired or rec.abandoned:
            self._watch[slot] = rec
        else:
            self._watch.pop(slot, None)
        return False

    def begin_fill(self, slot: _SlotLike, event: Event) -> None:
        """A copy into `slot` was submitted and `event` recorded after it: FILLING."""
        with self._lock:
            rec = self._rec("begin_fill", slot) if self.sanitize else self._recs.get(slot)
            if rec is not None:
                rec.state, rec.fill = S.FILLING, event
                self.pool.set_in_flight(slot, True)

    def fill_host(self, slot: _SlotLike) -> None:
        """The CPU wrote the slot's bytes synchronously (e.g. a disk read): READY."""
        with self._lock:
            if (rec := self._rec("fill_host", slot)) is not None:
                rec.state = S.READY

    def fill_done(self, slot: _SlotLike) -> None:
        """FILLING → READY; legal only once e_save has completed."""
        with self._lock:
            rec = self._rec("fill_done", slot)
            if self.sanitize and rec.fill is not None and not rec.fill.query():
                raise self._fail("fill_done", slot, rec, rec.fill, SLOT_WHY[("fill_done", S.FILLING)])
            if rec is not None:
                rec.state, rec.fill = S.READY, None
                self.pool.set_in_flight(slot, False)

    def wait_filled(self, slot: _SlotLike, timeout: float | None = None) -> bool:
        """Wait for e_save, then fill_done. False on timeout: the slot stays FILLING and
        must not be reused — `retire` it so it is freed when the copy has landed."""
        with self._lock:
            rec = self._recs.get(slot)
            ev = rec.fill if rec is not None else None
        if ev is not None and not ev.synchronize(timeout):
            return False
        self.fill_done(slot)
        return True

    def begin_read(self, slot: _SlotLike, event: Event) -> None:
        """A copy out of `slot` was submitted, `event` recorded after it: READING (+1)."""
        with self._lock:
            rec = self._rec("begin_read", slot) if self.sanitize else self._recs.get(slot)  # as begin_fill
            if rec is not None:
                rec.state = S.READING
                rec.reads.append(event)
                self.pool.set_in_flight(slot, True)

    def end_read(self, slot: _SlotLike, event: Event) -> None:
        """Drop the read of `event`; legal only once it has completed, never on a timeout."""
        with self._lock:
            rec = self._rec("end_read", slot)
            known = rec is not None and any(e is event for e in rec.reads)
            if self.sanitize and not known:
                raise self._fail("end_read", slot, rec, event, _ENDED)
            if self.sanitize and not event.query():
                raise self._fail("end_read", slot, rec, event, SLOT_WHY[("end_read", S.READING)])
            if known:
                rec.reads.remove(event)
                if event in rec.abandoned:
                    rec.abandoned.remove(event)
                self._settle(slot, rec)

    def abandon_read(self, slot: _SlotLike, event: Event) -> None:
        """Give up waiting for a read (timeout); it is dropped by `poll` once it completes."""
        with self._lock:
            rec = self._rec("abandon_read", slot)
            if self.sanitize and not any(e is event for e in rec.reads):
                raise self._fail("abandon_read", slot, rec, event, _ENDED)
            if rec is not None:
                rec.abandoned.append(event)
                self._settle(slot, rec)

    def release(self, slot: _SlotLike) -> None:
        """Free now; legal only with no copy pending (ALLOCATED or READY)."""
        with self._lock:
            self._rec("release", slot)
            self._recs.pop(slot, None)
            self._watch.pop(slot, None)
            self.pool.free(slot)  # the sanitizer (when on) has just proven no copy is pending

    def retire(self, slot: _SlotLike) -> None:
        """Let go of `slot` in any live state; it is freed once its pending events complete."""
        with self._lock:
            if (rec := self._rec("retire", slot)) is not None:
                rec.retired = True
                self._settle(slot, rec)

    def poll(self) -> int:
        """Apply completed events to retired slots and abandoned reads; return slots freed. Visits
        only those slots: O(slots waiting), not O(live slots)."""
        with self._lock:
            return sum(self._settle(s, r) for s, r in list(self._watch.items()))


def _names(action: str) -> str:
    return "/".join(sorted(s.value for s in SLOT_MOVES[action]))
