"""Per-layer "landed" flags a CUDA graph can wait on: layer-wise loads inside one graph of the
whole forward.

    flags = engine.layer_flags()          at start: device words, a flag stream, batches prepared
    flags.wait(layer, stream)             before attention of `layer` reads its blocks: enqueue the
                                          wait (capture it once; every replay runs it)
    with flags.arm(compute) as step:      a step with loads: re-arm the flags (one host call) ...
        engine.load(..., flags=step)      ... each load sets its progress per layer ...
    (the `with` ends: step.seal())        ... and the seal sets flag l once layer l of every load
                                          of the step landed. A step without loads does nothing.

The words (`kvtier.device` flags, 2L of them): flag l (the graph's) and progress l (the loads').
A graph waits for flag l == LANDED, a constant: a step with no load finds every flag set and
replays the same graph. `arm` stores ARMED into every flag on the compute stream, before the
forward, so no "landed" of an earlier step can satisfy this step's waits; it is ordered after the
previous step's seal (the compute stream waits for its event), so no late write of that step can
either. A load takes a sequence number s (increasing in submission order, under the engine's lock)
and stores s into progress l after its layer l's copies, on the engine's load stream (a whole-job
load: into every progress word at its end). The seal, on the flag stream after the re-arm's event,
waits per layer for progress l >= s of the step's last load, then stores LANDED into flag l. One
load stream runs its loads in order, so the last load's layer l lands after every earlier load's
copies: flag l is set only once layer l of every request of the step landed, however many loads
the step made. The seal costs one batched call; the waits in the graph cost the host nothing.

A failure never leaves a wait blocked: a load that fails after it took its number stores it into
every progress word once its enqueued copies finished (the caller reports those blocks as failed),
and the step is sealed when its `with` block ends, by an exception too (or at the next `arm`, or
at `close`). A load through a stale step's handle (sealed, or not the live one) is refused with
LifecycleError, sanitizer or not. The sanitizer (`kvtier.lifecycle.FlagTracker`) also catches
re-arming before the flags of the step before were set, and a wait through a stale handle.

One rule for a caller that submits loads on another thread than the forward's: seal step g (after
its last load) before arming step g + 1; `arm` seals a step left unsealed, and a load of step g
that comes after that is refused (it would land after step g's waits passed).

On a SimDevice the same code runs over simulated flags (`kvtier.device.sim`); on CUDA the words
are device memory and the operations the driver's stream memory operations (`cuda_flags.py`).
"""

from __future__ import annotations

import threading
import warnings

from kvtier.device.base import Device, Event, FlagOp, Stream
from kvtier.lifecycle.flags import FlagTracker

ARMED, LANDED = 0, 1  # a flag's two values; graphs wait for LANDED


class LayerFlags:
    """The flags of one `TransferEngine`'s loads (`engine.layer_flags()`): `num_layers` flags and
    as many progress words on `device`, a flag stream, and the batches the steps run, made here,
    at start. Loads of this engine only (the one load stream whose order the seal relies on)."""

    def __init__(self, device: Device, load_stream: Stream, num_layers: int, *, sanitize: bool, name: str):
        self.device, self.load_stream, self.num_layers, self.name = device, load_stream, num_layers, name
        n = num_layers
        self.words = device.new_flags(2 * n, LANDED, label=name)  # [0, n): flags, [n, 2n): progress
        self.stream = device.new_stream(f"{name}-seal")
        layers = range(n)
        # Progress starts at 0 and sequence numbers at 1: no load of this engine has landed yet.
        device.flag_ops(self.words, [FlagOp(True, n + i, 0) for i in layers], self.stream)
        self.stream.synchronize()  # the words hold their first values before any stream uses them
        self._arm = device.flag_batch(self.words, [FlagOp(True, i, ARMED) for i in layers])
        self._set = device.flag_batch(self.words, [FlagOp(True, i, LANDED) for i in layers])
        seal = [op for i in layers for op in (FlagOp(False, n + i, 1, geq=True), FlagOp(True, i, LANDED))]
        self._seal = device.flag_batch(self.words, seal)
        self._progress = device.flag_batch(self.words, [FlagOp(True, n + i, 1) for i in layers])
        self._write_progress = device.flag_writer(self.words, load_stream)  # (word, value), checked once
        self.tracker = FlagTracker(name, n, sanitize)
        self._lock = threading.Lock()
        self._seq = 0  # the last sequence number handed to a load (mod 2**32; compared cyclically)
        self._live: FlagStep | None = None
        self._streams: dict[int, Stream] = {}  # torch stream handle -> its wrapper (CUDA, `current`)

    # ---- what the forward calls ----------------------------------------------------------------
    def arm(self, stream: Stream) -> FlagStep:
        """Re-arm every flag on `stream` (the compute stream, before the forward) for a step with
        loads: one batched call. Returns the step: pass it to the step's loads (`flags=`), then seal
        it (`with flags.arm(...) as step:` seals on exit). An unsealed previous step is sealed first."""
        with self._lock:
            prev = self._live
            if prev is not None and prev.sealed is None:
                self._seal_locked(prev)  # its flags must be set one day: its waits may be enqueued
            waited = ()
            if prev is not None:
                # A late "landed" of the previous step must not overwrite this re-arm.
                stream.wait_event(prev.sealed)
                waited = (prev.sealed,)
            generation = self.tracker.arm(stream, waited)
            self.device.flag_run(self._arm, stream)
            # The seal's writes, and every copy of this step's loads, follow the re-arm.
            armed = stream.record(f"{self.name}:armed#{generation}")
            self._live = step = FlagStep(self, generation, armed)
            return step

    def wait(self, layer: int, stream: Stream | None = None) -> None:
        """Later work on `stream` waits until flag `layer` is set (no host blocking). None: the
        stream the caller's work goes to now (on CUDA torch's current stream: the capturing one
        inside `torch.cuda.graph`, so the wait becomes a node of the graph)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        # Attention of `layer` must not read its blocks before every load of the step landed them.
        self.device.flag_wait(self.words, layer, LANDED, stream or self.current_stream())

    def current_stream(self) -> Stream:
        """The stream work is queued on now: torch's current stream on CUDA (wrapped once per
        stream), the compute stream on a SimDevice."""
        wrap = getattr(self.device, "wrap_stream", None)
        if wrap is None:
            return self.device.current_stream()
        import torch

        raw = torch.cuda.current_stream(self.device.index)
        s = self._streams.get(raw.cuda_stream)
        if s is None:
            s = self._streams[raw.cuda_stream] = wrap(raw, f"{self.name}-waiter")
        return s

    @property
    def live(self) -> FlagStep | None:
        """The latest step armed (None before the first)."""
        return self._live

    def close(self) -> None:
        """Seal the live step (its waits pass) and wait for the flag stream."""
        with self._lock:
            if self._live is not None and self._live.sealed is None:
                self._seal_locked(self._live)
        self.stream.synchronize()  # the seal's writes ran before the words can go

    # ---- what a step and the engine's loads call -----------------------------------------------
    def _seal_locked(self, step: FlagStep) -> None:
        """Enqueue step's seal on the flag stream (the lock held): after its re-arm, each flag set
        once its layer of the step's last load landed."""
        self.stream.wait_event(step.armed)  # a flag is set only after the re-arm stored ARMED in it
        if step.last is None:
            self.device.flag_run(self._set, self.stream)  # no load joined: set them at once
        else:
            self._seal.set_values(range(0, 2 * self.num_layers, 2), step.last)
            self.device.flag_run(self._seal, self.stream)
        step.sealed = self.stream.record(f"{self.name}:sealed#{step.generation}")
        self.tracker.seal(step.generation, step.sealed)

    def join(self, step: FlagStep, stream: Stream) -> Writer:
        """A load of this engine joins `step` (the engine's lock held): its sequence number."""
        if not isinstance(step, FlagStep) or step.flags is not self:
            raise ValueError(f"flags: expected a FlagStep of this engine's LayerFlags, got {step!r}")
        if stream is not self.load_stream:
            raise ValueError("flags: a step's loads must all run on the engine's load stream")
        with self._lock:
            if step is not self._live or step.sealed is not None:
                # A stale step: no wait covers this load (its waits passed, or belong to a new step).
                raise self.tracker.stale_error(step.generation)
            self._seq = (self._seq + 1) & 0xFFFFFFFF or 1
            step.last = self._seq  # the seal waits for this load's layers
            return Writer(self, step, self._seq)


class FlagStep:
    """One step's arming of a `LayerFlags`: `armed` (the re-arm's event on the arming stream),
    `generation`, `sealed` (the seal's event, once sealed), `last` (the sequence number of its last
    load, None: no load joined). Loads join it with `flags=step`; `seal()` ends it."""

    def __init__(self, flags: LayerFlags, generation: int, armed: Event):
        self.flags, self.generation, self.armed = flags, generation, armed
        self.sealed: Event | None = None
        self.last: int | None = None

    def seal(self) -> None:
        """Every flag is set once its layer of every load of this step landed (the flag stream
        waits, the host does not). Idempotent; after the step's last load, or on its failure."""
        f = self.flags
        with f._lock:
            if self.sealed is None:
                f._seal_locked(self)

    def wait(self, layer: int, stream: Stream | None = None) -> None:
        """`LayerFlags.wait`, through this step's handle (the sanitizer checks it is the live one)."""
        self.flags.tracker.check_wait(self.generation, layer)
        self.flags.wait(layer, stream)

    def __enter__(self) -> FlagStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.seal()  # by an exception too: no wait of this step may block forever

    def __repr__(self) -> str:
        state = "sealed" if self.sealed is not None else "armed"
        return f"<FlagStep {self.flags.name} step {self.generation} {state}>"


class Writer:
    """One load's part in a step (`LayerFlags.join`): progress words := its number, per layer
    (`layer`) or at the job's end (`finish`), or, on a failure, once its copies finished (`fail`)."""

    __slots__ = ("flags", "marked", "seq", "step")

    def __init__(self, flags: LayerFlags, step: FlagStep, seq: int):
        self.flags, self.step, self.seq, self.marked = flags, step, seq, 0

    def layer(self, layer: int) -> None:
        """Enqueued on the load stream right after layer `layer`'s copies: it has landed then."""
        f = self.flags
        f._write_progress(f.num_layers + layer, self.seq)
        self.marked += 1

    def finish(self, layer_events: list[Event] | None) -> None:
        """The load was submitted; `layer_events[l]` completes once its layer l landed (None: its
        bookkeeping failed after the copies were enqueued; the progress is set all the same)."""
        f = self.flags
        if self.marked < f.num_layers:  # a whole-job path: every layer lands with the job's last copy
            self._all(f)
        if layer_events is not None:
            f.tracker.loaded(self.step.generation, layer_events)

    def fail(self, quiesced: bool) -> None:
        """The load failed after it took its number: its progress words get it all the same, so the
        seal never waits forever (`quiesced`: its enqueued copies finished; the caller reports its
        blocks as failed)."""
        f = self.flags
        if not quiesced:
            warnings.warn(
                f"kvtier: a failed load's copies could not be waited for; {f.name} set anyway", stacklevel=3
            )
        try:
            self._all(f)
        except Exception as e:  # the load's own error is the one to raise
            warnings.warn(
                f"kvtier: could not set the progress of a failed load on {f.name}: {e}", stacklevel=3
            )

    def _all(self, f: LayerFlags) -> None:
        with f._lock:  # the batch is shared: its values and the run go together
            f._progress.set_values(range(f.num_layers), self.seq)
            f.device.flag_run(f._progress, f.load_stream)
