"""The lifecycle protocol: states of every buffer, the legal moves, and the sanitizer.

Submitted is not completed: a buffer that a copy touches changes state only when the
event recorded after that copy has completed. Two trackers hold the states.

Pool slot (`SlotTracker`, one per `PinnedPool`)::

    FREE -alloc-> ALLOCATED -begin_fill(e_save)-> FILLING -fill_done-> READY
    READY -begin_read(e_load)-> READING (one entry per read) -end_read-> ... -> READY
    ALLOCATED | READY -release-> FREE;  any live state -retire-> FREE once events complete

GPU block (`BlockTracker`; blocks belong to the serving engine): IDLE, or a pending
access whose event has not completed — LOADING(e_load), SAVING(e_save), compute
READING(e_read) or WRITING(e_write). `MUST_FOLLOW` says which pending accesses a new one
must wait for; `waits_for(kind, blocks)` returns exactly those events, so the protocol code and the
checks come from one table.

The trackers always keep the states and events (the protocol needs them). With the
sanitizer on (`KVTIER_SANITIZE=1` or `sanitize=True`) every illegal move raises
`LifecycleError` naming the buffer, its state, and the missing event; off, the moves are
applied as asked — which is how the tests show each bug producing wrong data.

Per-layer "landed" flags (`FlagTracker`, one per flag array; `kvtier.engine.flags` is the
protocol): LANDED -arm-> ARMED(step) -seal-> SEALED(step) -> LANDED once the seal's event
completed. Re-arming before a flag was set, on a stream not ordered after the seal, and a load or
wait through a stale step's handle are the illegal moves (`flags.py`).

Stale handles are refused with or without the sanitizer: a `Slot` carries its generation (its
`id`, unique per allocation), and `PinnedPool.check(slot)` / `free(slot)` compare it in O(1) with
the allocation that lives at its address now, raising `StaleSlotError` (a `LifecycleError`) for
a released, reused or foreign handle. The sanitizer adds the full state tracking on top.
"""

from kvtier.lifecycle.blocks import MUST_FOLLOW, WHY, Access, BlockTracker
from kvtier.lifecycle.errors import LifecycleError, StaleSlotError, sanitize_enabled
from kvtier.lifecycle.flags import FlagState, FlagTracker
from kvtier.lifecycle.slots import SLOT_MOVES, SlotState, SlotTracker

__all__ = [
    "MUST_FOLLOW",
    "SLOT_MOVES",
    "WHY",
    "Access",
    "BlockTracker",
    "FlagState",
    "FlagTracker",
    "LifecycleError",
    "SlotState",
    "SlotTracker",
    "StaleSlotError",
    "sanitize_enabled",
]
