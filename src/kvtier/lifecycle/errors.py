"""LifecycleError and the sanitizer switch."""

from __future__ import annotations

import os

from kvtier.device.base import Event


class LifecycleError(RuntimeError):
    """An illegal move: `buffer` in `state` needs `missing_event` (None: no event can help)."""

    def __init__(self, action: str, buffer: str, state: str, missing_event: Event | None, why: str):
        self.action, self.buffer, self.state, self.missing_event = action, buffer, state, missing_event
        ev = missing_event.label if missing_event is not None else "none"
        super().__init__(f"{action}: {buffer} is {state}; missing event: {ev} — {why}")


def sanitize_enabled(flag: bool | None = None) -> bool:
    """The flag when given, else the environment variable KVTIER_SANITIZE."""
    if flag is not None:
        return bool(flag)
    return os.environ.get("KVTIER_SANITIZE", "").strip().lower() in {"1", "true", "yes", "on"}
