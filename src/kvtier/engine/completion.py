"""The completion side of `TransferEngine`: jobs settle here, and only here.

A job is settled once its event has completed — never on a timeout, never because a call
returned: a save's slot turns READY, a load's read of its slot ends. `release` only retires a
slot; the slot tracker frees it once no copy into/out of it is pending.

A submit that fails after its mover may have enqueued part of the job (`_quiesce`) waits for the
job's stream and the mover's helper streams before the error reaches the caller: a save's slot
goes back to the pool only then, and a load's blocks and slot are no longer touched by it.
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING

from kvtier.engine.jobs import SaveJob, _Job
from kvtier.engine.options import check_slot

if TYPE_CHECKING:
    from kvtier.lifecycle import SlotTracker
    from kvtier.pool import Slot


class Completion:
    """Mixed into `TransferEngine`, which owns the state below (set in its `__init__`)."""

    _lock: threading.RLock
    _jobs: list[_Job]  # submitted, not settled
    slots: SlotTracker

    def poll(self) -> int:
        """Settle every job whose event has completed; return how many were settled."""
        with self._lock:
            # A stream runs in order: past its first incomplete job, none of its later ones can have
            # completed, so each poll queries the completed jobs and one more per stream, not all.
            done, blocked = [], set()
            for j in self._jobs:
                stream = j.event.stream
                if stream is not None and stream in blocked:
                    continue
                if j.event.query():
                    done.append(j)
                elif stream is not None:
                    blocked.add(stream)
            for j in done:
                self._settle(j)
            self.slots.poll()  # retired slots whose events completed go back to the pool
        return len(done)

    def wait(self, job: _Job, timeout: float | None = None) -> bool:
        """Block until `job` completed and settle it; False on timeout: nothing is released."""
        if not isinstance(job, _Job) or job.engine is not self:
            raise ValueError(f"job: expected a SaveJob or LoadJob of this engine, got {job!r}")
        if not job.event.synchronize(timeout):  # every event checks its timeout
            return False  # in flight: the slot stays FILLING/READING, the blocks stay pending
        self._settle(job)
        return True

    def _settle(self, job: _Job) -> None:
        with self._lock:
            if job.settled:
                return
            if not job.event.query():
                raise RuntimeError(f"internal: settling {job.event.label} before it completed")
            if isinstance(job, SaveJob):
                if not job.slot_released:
                    self.slots.fill_done(job.slot)  # e_save completed: the slot holds the data
            else:
                self.slots.end_read(job.slot, job.event)  # e_load completed: the copy read it all
            job.settled = True
            self._jobs.remove(job)

    def _quiesce(self, stream) -> bool:
        """After a failed submit: wait until nothing it may have enqueued is in flight (`stream`,
        the job's, and the mover's helper streams). False, with a warning, when the wait itself
        failed (the device is lost): the caller then keeps the job's buffers out of reuse."""
        try:
            stream.synchronize()  # copies enqueued before the failure still read / write the buffers
            self.mover.synchronize()  # and its helper streams' gathers / scatters
        except Exception as e:  # the submit's own error is the one to raise
            why = f"kvtier: a failed job's copies could not be waited for ({e}); its slot is kept"
            warnings.warn(why, stacklevel=3)
            return False
        return True

    def release(self, slot: Slot) -> None:
        """The owner drops `slot`; it returns to the pool once no copy into/out of it is pending."""
        check_slot(slot)
        with self._lock:
            self.poll()
            for j in self._jobs:
                if j.slot is slot and isinstance(j, SaveJob):
                    j.slot_released = True  # the retired slot turns READY by itself on completion
            # retire, not release: a copy may still be in flight (never free on a timeout).
            self.slots.retire(slot)
