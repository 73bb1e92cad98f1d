"""The states of per-layer "landed" flags (`FlagTracker`), and the sanitizer's checks on them.

The flags of one array move together, one step at a time (the protocol: `kvtier.engine.flags`)::

    LANDED -arm(step g)-> ARMED(g) -writers register-> ARMED(g) -seal-> SEALED(g)
    SEALED(g) -> LANDED once the seal's event completed (each layer's flag was set after that
    layer's copies of every writer of step g landed)

A flag is a buffer like a slot: reusing it early is a race. Two moves are illegal:

- re-arming (step g + 1) while a flag of step g is not set yet, on a stream not ordered after the
  seal of step g: step g's late "landed" write would then satisfy step g + 1's wait before step
  g + 1's copies landed. The error names the first such layer's flag, SEALED (step g), and the
  event still missing (that layer's copies, or the seal's write after them);
- a load or a wait through the handle of a step that is not the live one, or a load joining a
  step already sealed (a stale generation): its copies would land after a wait found the flag set
  (a load registered with step g after its seal is waited for by no one).

With the sanitizer off the moves are applied as asked, which is how the tests show each bug
producing wrong bytes; the tracker's records then cost a few attribute stores per step.
(`kvtier.engine.flags.LayerFlags` refuses a stale step's load whether the sanitizer is on or not,
with `stale_error`: a cheap check, as a stale slot handle is refused.)
"""

from __future__ import annotations

import enum
import threading

from kvtier.device.base import Event
from kvtier.lifecycle.errors import LifecycleError, sanitize_enabled


class FlagState(enum.Enum):
    LANDED = "LANDED"  # set: no step pending (never armed, or the last seal's event completed)
    ARMED = "ARMED"  # re-armed for a step: loads may join it; nothing sets the flags before its seal
    SEALED = "SEALED"  # the seal is enqueued: each flag is set once its layer of every load landed


_EARLY = (
    "re-arming before the flag was set: step {g}'s late 'landed' write would satisfy the next step's "
    "wait before its copies landed (the arming stream must wait for the seal's event)"
)
_STALE_LOAD = (
    "a stale generation: step {g} was sealed, so no wait covers this load; its copies would land after "
    "a wait found the flag set (re-arm the flags for this step, LayerFlags.arm)"
)
_STALE_WAIT = "a stale generation: step {g} is not the live step ({live}); its flags belong to another step"


class _Step:
    __slots__ = ("generation", "layers", "sealed")

    def __init__(self, generation: int):
        self.generation = generation
        self.layers: list[Event] | None = None  # the last load's per-layer events (layer l landed)
        self.sealed: Event | None = None  # after the seal's writes: every flag of the step is set


class FlagTracker:
    """The steps of one flag array (`name`, `num_layers` flags). Thread-safe."""

    def __init__(self, name: str, num_layers: int, sanitize: bool | None = None):
        self.name, self.num_layers = name, num_layers
        self.sanitize = sanitize_enabled(sanitize)
        self._lock = threading.Lock()
        self._live: _Step | None = None  # the latest step armed

    @property
    def generation(self) -> int:
        """Steps armed so far (the live step's number; 0 before the first)."""
        live = self._live
        return 0 if live is None else live.generation

    def state(self) -> FlagState:
        live = self._live
        if live is None or (live.sealed is not None and live.sealed.query()):
            return FlagState.LANDED
        return FlagState.ARMED if live.sealed is None else FlagState.SEALED

    def _label(self, layer: int | None = None) -> str:
        return self.name if layer is None else f"layer flag {layer} of {self.name}"

    def arm(self, stream: object, waited=()) -> int:
        """A new step armed on `stream`, after it waited for `waited`; its generation. With the
        sanitizer on, every flag of the step before must be set, or `stream` ordered after its seal."""
        with self._lock:
            prev = self._live
            if self.sanitize and prev is not None:
                self._check_rearm(prev, stream, waited)
            self._live = _Step(1 if prev is None else prev.generation + 1)
            return self._live.generation

    def _check_rearm(self, prev: _Step, stream: object, waited) -> None:
        g, sealed = prev.generation, prev.sealed
        if sealed is None:
            why = f"step {g} was never sealed: its flags stay ARMED and its waits would never pass"
            raise LifecycleError("arm", self._label(), f"ARMED (step {g})", None, why)
        if any(sealed is w for w in waited) or sealed.stream is stream or sealed.query():
            return  # ordered after the seal, or set already
        for layer, ev in enumerate(prev.layers or ()):
            if not ev.query():  # the first flag whose copies are still landing
                raise LifecycleError("arm", self._label(layer), f"SEALED (step {g})", ev, _EARLY.format(g=g))
        raise LifecycleError("arm", self._label(0), f"SEALED (step {g})", sealed, _EARLY.format(g=g))

    def join(self, generation: int) -> None:
        """A load joins step `generation` (before it submits anything). With the sanitizer on, the
        step must be the live one and not sealed yet (`stale_error` otherwise)."""
        if not self.sanitize:
            return
        with self._lock:
            live = self._live
            if live is not None and live.generation == generation and live.sealed is None:
                return
            raise self.stale_error(generation)

    def stale_error(self, generation: int) -> LifecycleError:
        """The error for a load joining step `generation`, which is sealed or not the live step."""
        live = self._live
        if live is None:
            state = "LANDED"
        elif live.generation == generation:
            state = f"SEALED (step {generation})"
        else:
            state = f"{self.state().value} (step {live.generation})"
        return LifecycleError("load", self._label(), state, None, _STALE_LOAD.format(g=generation))

    def loaded(self, generation: int, layer_events: list[Event]) -> None:
        """A load of step `generation` was submitted; `layer_events[l]` completes once its layer l
        landed. The last one submitted is the one the flags follow (one copy stream: it lands last)."""
        with self._lock:
            live = self._live
            if live is not None and live.generation == generation:
                live.layers = layer_events

    def seal(self, generation: int, sealed: Event) -> None:
        """Step `generation`'s seal was enqueued; `sealed` completes once every flag is set."""
        with self._lock:
            live = self._live
            if live is not None and live.generation == generation:
                live.sealed = sealed

    def check_wait(self, generation: int, layer: int) -> None:
        """A wait on flag `layer` through the handle of step `generation`: the live step's only."""
        if not self.sanitize:
            return
        live = self._live
        if live is None or live.generation != generation:
            state = "LANDED" if live is None else f"{self.state().value} (step {live.generation})"
            missing = None if live is None else live.sealed
            why = _STALE_WAIT.format(g=generation, live=0 if live is None else live.generation)
            raise LifecycleError("wait", self._label(layer), state, missing, why)
