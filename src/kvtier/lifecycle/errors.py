"""LifecycleError, StaleSlotError and the sanitizer switch."""

from __future__ import annotations

import os

from kvtier.device.base import Event


class LifecycleError(RuntimeError):
    """An illegal move: `buffer` in `state` needs `missing_event` (None: no event can help)."""

    def __init__(self, action: str, buffer: str, state: str, missing_event: Event | None, why: str):
        self.action, self.buffer, self.state, self.missing_event = action, buffer, state, missing_event
        ev = missing_event.label if missing_event is not None else "none"
        super().__init__(f"{action}: {buffer} is {state}; missing event: {ev} — {why}")


class StaleSlotError(LifecycleError):
    """A slot handle that is not the live allocation at its address: released (and perhaps
    handed to a new owner since), or a slot of another pool. Refused always, sanitizer or not.

    `generation`: the handle's (`Slot.id`, unique per allocation); `live`: the generation that
    owns its address now, None when nothing does (or the slot is foreign).
    """

    def __init__(self, action: str, name: str, slot_name: str, generation: int, live: int | None, why: str):
        self.generation, self.live = generation, live
        super().__init__(action, f"{name} {slot_name}", "stale", None, why)


def sanitize_enabled(flag: bool | None = None) -> bool:
    """The flag when given, else the environment variable KVTIER_SANITIZE."""
    if flag is not None:
        return bool(flag)
    return os.environ.get("KVTIER_SANITIZE", "").strip().lower() in {"1", "true", "yes", "on"}
