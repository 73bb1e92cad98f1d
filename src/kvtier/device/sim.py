"""SimDevice: the device interface on the CPU, with copies that really land late.

Each stream is a worker thread that executes its queue in order. A copy is a queued item
that sleeps a delay (fixed, or drawn from a seeded range) and then copies the bytes, so a
missing wait produces wrong data deterministically. Events complete only when their
stream's worker reaches them; `wait_event` enqueues an item that blocks that worker until
the event completes. "GPU memory" is ordinary CPU tensors.

Flags (`new_flags`): words kept under the device's lock. A flag write is a queued item that
stores its value when the stream reaches it; a flag wait (or a batch holding one) is an item that
blocks its stream's worker until the word satisfies it, so later work on that stream waits, as a
CUDA stream memory operation makes it. The protocol code over flags therefore runs unchanged here.

One condition variable per device guards all event state: the simulator has a handful of
streams, and a single lock keeps the reasoning simple.

`close()` cancels work not yet started (its events never complete; waiters are released), lets
the item each worker is running finish, and joins the workers. An exit hook closes every
SimDevice still open when the interpreter ends: a worker still inside a torch op at
finalization is killed while it takes the GIL back, through C++ frames that may not unwind
("terminate called without an active exception", SIGABRT). Daemon threads alone do not help.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import queue
import random
import threading
import time
import warnings
import weakref
from collections.abc import Callable

import numpy as np
import torch

from kvtier.device.base import (
    FLAG_MASK,
    Device,
    DeviceError,
    Event,
    FlagBatch,
    FlagOp,
    Flags,
    Stream,
    check_copy_args,
    check_flag_op,
    check_flag_ops,
    check_nbytes,
    check_timeout,
    geq32,
)

Delay = float | tuple[float, float]


def _check_delay(delay: Delay, name: str) -> Delay:
    if isinstance(delay, tuple):
        if len(delay) != 2 or not 0 <= delay[0] <= delay[1]:
            raise ValueError(f"{name} must be seconds >= 0 or a (low, high) range, got {delay!r}")
        return (float(delay[0]), float(delay[1]))
    if not isinstance(delay, int | float) or delay < 0:
        raise ValueError(f"{name} must be seconds >= 0 or a (low, high) range, got {delay!r}")
    return float(delay)


class SimEvent(Event):
    def __init__(self, device: SimDevice, label: str):
        self._dev = device
        self.label = label
        self._stream: SimStream | None = None
        self._armed = 0  # generation of the latest record
        self._reached = 0  # highest generation a worker has reached
        self._t: float | None = None

    @property
    def stream(self) -> SimStream | None:
        return self._stream

    def record(self, stream: Stream) -> None:
        s = self._dev._own(stream, "stream")
        with self._dev._cv:
            self._armed += 1
            gen = self._armed
            self._stream = s
        s._put(lambda: self._reach(gen))

    def _reach(self, gen: int) -> None:
        with self._dev._cv:
            if gen > self._reached:
                self._reached = gen
                self._t = time.perf_counter() - self._dev._epoch
            self._dev._cv.notify_all()

    def _done(self, gen: int) -> bool:
        return self._reached >= gen

    def query(self) -> bool:
        with self._dev._cv:
            return self._reached >= self._armed

    def synchronize(self, timeout: float | None = None) -> bool:
        check_timeout(timeout)
        with self._dev._cv:
            gen = self._armed
            # The host blocks until the worker reached this record: only then is the work done.
            ok = self._dev._cv.wait_for(lambda: self._done(gen) or self._dev.closed, timeout)
        self._dev._raise_error()
        return ok and self._done(gen)

    def time_s(self) -> float:
        with self._dev._cv:
            if self._reached < self._armed or self._t is None:
                raise RuntimeError(f"event {self.label} has not completed; its time is not known yet")
            return self._t


class SimStream(Stream):
    def __init__(self, device: SimDevice, name: str):
        self._dev = device
        self.name = name
        self._q: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._seq = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name=f"kvtier-sim-{name}", daemon=True)
        self._thread.start()

    @property
    def worker_alive(self) -> bool:
        """Whether this stream's worker thread runs (False once its device's close() joined it)."""
        return self._thread.is_alive()

    def _put(self, item: Callable[[], object]) -> None:
        if self._dev.closed:
            raise RuntimeError(f"stream {self.name}: device is closed")
        self._q.put(item)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            if self._dev.closed:
                continue  # cancelled: the device closed before the stream reached it
            try:
                item()
            except BaseException as e:  # noqa: BLE001 - kept and re-raised on the host, like CUDA
                self._dev._set_error(e, self.name)

    def record(self, label: str | None = None) -> SimEvent:
        ev = SimEvent(self._dev, label or f"{self.name}#{next(self._seq)}")
        ev.record(self)
        return ev

    def wait_event(self, event: Event) -> None:
        ev = self._dev._own_event(event)
        with self._dev._cv:
            gen = ev._armed  # CUDA semantics: wait for the record current at this call
        if gen == 0:
            return  # never recorded: complete by definition, nothing to wait for

        def block() -> None:
            # Holding this worker is what makes later items on this stream wait for `ev`.
            with self._dev._cv:
                self._dev._cv.wait_for(lambda: ev._done(gen) or self._dev.closed)

        self._put(block)

    def synchronize(self) -> None:
        # A marker at the tail: when it is reached, everything before it has run.
        self.record(f"{self.name}:sync").synchronize()

    def _stop(self) -> None:
        self._q.put(None)


class SimFlags(Flags):
    """Flag words of a SimDevice: a list guarded by the device's condition variable."""

    def __init__(self, device: SimDevice, n: int, value: int, label: str):
        self._dev, self.n, self.label = device, n, label
        self._words = [value] * n

    def read(self) -> list[int]:
        self._dev.synchronize()  # every queued write has run
        with self._dev._cv:
            return list(self._words)


class SimFlagBatch(FlagBatch):
    def __init__(self, flags: SimFlags, ops: list[FlagOp]):
        self.flags, self.ops = flags, tuple(ops)

    def set_values(self, positions: range, value: int) -> None:
        self._check_set(positions, value)
        ops = list(self.ops)
        for p in positions:
            ops[p] = ops[p]._replace(value=value)
        self.ops = tuple(ops)  # a new tuple: a batch enqueued before keeps the old one


class SimDevice(Device):
    """CPU simulation of a GPU's streams, with late copies.

    Args:
        copy_delay: seconds each copy sleeps before moving its bytes; a (low, high) tuple
            draws uniformly from a `random.Random(seed)` at submit time (reproducible for a
            given submission order).
        launch_delay: the same for `launch`ed work (a kernel that takes time).
        seed: seeds the delay draws.
        batch_copy: emulate the copy engine's batched copy (`cudaMemcpyBatchAsync`, CUDA >= 12.8):
            `copy_batch` works, and the engine's "batch" path with it (False: refused, as on a
            runtime without the call).
    """

    def __init__(
        self, copy_delay: Delay = 0.0, launch_delay: Delay = 0.0, seed: int = 0, batch_copy: bool = False
    ):
        self.name = "sim"
        self.copy_delay = _check_delay(copy_delay, "copy_delay")
        self.launch_delay = _check_delay(launch_delay, "launch_delay")
        if batch_copy is not True and batch_copy is not False:
            raise ValueError(f"batch_copy must be True or False, got {batch_copy!r}")
        self.batch_copy = batch_copy
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._cv = threading.Condition()
        self._closed = False
        self._error: DeviceError | None = None
        self._epoch = time.perf_counter()
        self._streams: list[SimStream] = []
        self._names = itertools.count()
        self._flag_names = itertools.count()
        self._compute = self.new_stream("compute")
        _open.add(self)  # closed at interpreter exit unless closed before

    # -- helpers ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether close() has begun: its streams' workers stop and their waits return."""
        return self._closed

    def _own(self, stream: Stream, name: str) -> SimStream:
        if not isinstance(stream, SimStream) or stream._dev is not self:
            raise ValueError(f"{name} must be a stream of this SimDevice, got {stream!r}")
        return stream

    def _own_event(self, event: Event) -> SimEvent:
        if not isinstance(event, SimEvent) or event._dev is not self:
            raise ValueError(f"event must be an event of this SimDevice, got {event!r}")
        return event

    def _draw(self, delay: Delay) -> float:
        if isinstance(delay, tuple):
            with self._rng_lock:
                return self._rng.uniform(*delay)
        return delay

    def _set_error(self, e: BaseException, stream: str) -> None:
        with self._cv:
            if self._error is None:
                self._error = DeviceError(f"work on stream {stream} failed: {e!r}")
                self._error.__cause__ = e

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    # -- Device ----------------------------------------------------------------------------
    def current_stream(self) -> SimStream:
        return self._compute

    def new_stream(self, name: str | None = None) -> SimStream:
        s = SimStream(self, name or f"stream{next(self._names)}")
        self._streams.append(s)
        return s

    def streams(self) -> list[SimStream]:
        """Every stream of this device, the compute stream first, in order of creation."""
        return list(self._streams)

    def new_event(self, label: str | None = None) -> SimEvent:
        return SimEvent(self, label or "event")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        s = self._own(stream, "stream")
        d, sv = check_copy_args(dst, src)
        delay = self._draw(self.copy_delay)

        def run() -> None:
            if delay:
                time.sleep(delay)  # the copy engine is busy: the bytes land late on purpose
            d.copy_(sv)

        s._put(run)

    def copy_batch(self, dsts, srcs, sizes, stream: Stream) -> None:
        """One batched copy, as `cudaMemcpyBatchAsync` takes it: `sizes[i]` bytes from CPU address
        `srcs[i]` to `dsts[i]` (int64 arrays of equal length), landing late as one copy. The
        caller keeps the memory alive until the stream is past it (an event recorded after)."""
        if not self.batch_copy:
            raise ValueError("copy_batch: this SimDevice was made without batch_copy=True")
        s = self._own(stream, "stream")
        d, r, n = (np.ascontiguousarray(a, dtype=np.int64) for a in (dsts, srcs, sizes))
        if not len(d) == len(r) == len(n) or (len(n) and int(n.min()) < 0):
            raise ValueError("copy_batch: dsts, srcs, sizes must be equally long, sizes >= 0")
        delay = self._draw(self.copy_delay)

        def run() -> None:
            if delay:
                time.sleep(delay)  # the copy engine is busy: the bytes land late on purpose
            for dst, src, size in zip(d.tolist(), r.tolist(), n.tolist(), strict=True):
                ctypes.memmove(dst, src, size)  # what the copy engine does with one descriptor

        s._put(run)

    def launch(self, fn: Callable[[], object], stream: Stream) -> None:
        s = self._own(stream, "stream")
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {fn!r}")
        delay = self._draw(self.launch_delay)

        def run() -> None:
            if delay:
                time.sleep(delay)
            fn()

        s._put(run)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(check_nbytes(nbytes), dtype=torch.uint8)

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        # CPU memory stands in for pinned memory: there is no driver to lock pages with.
        return torch.empty(check_nbytes(nbytes), dtype=torch.uint8)

    def free_pinned(self, buf: torch.Tensor) -> None:
        pass

    def new_flags(self, n: int, value: int = 0, label: str | None = None) -> SimFlags:
        check_nbytes(n, "n")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= FLAG_MASK:
            raise ValueError(f"value: expected an int in [0, 2**32), got {value!r}")
        return SimFlags(self, n, value, label or f"flags#{next(self._flag_names)}")

    def _own_flags(self, flags: Flags) -> SimFlags:
        if not isinstance(flags, SimFlags) or flags._dev is not self:
            raise ValueError(f"flags must be flags of this SimDevice, got {flags!r}")
        return flags

    def flag_write(self, flags: Flags, index: int, value: int, stream: Stream) -> None:
        f, s = self._own_flags(flags), self._own(stream, "stream")
        check_flag_op(f, index, value)
        s._put(lambda: self._flag_apply(f, (FlagOp(True, index, value),)))

    def flag_wait(self, flags: Flags, index: int, value: int, stream: Stream, *, geq: bool = False) -> None:
        f, s = self._own_flags(flags), self._own(stream, "stream")
        check_flag_op(f, index, value)
        s._put(lambda: self._flag_apply(f, (FlagOp(False, index, value, bool(geq)),)))

    def flag_batch(self, flags: Flags, ops) -> SimFlagBatch:
        f = self._own_flags(flags)
        return SimFlagBatch(f, check_flag_ops(f, ops))

    def flag_run(self, batch: FlagBatch, stream: Stream) -> None:
        if not isinstance(batch, SimFlagBatch) or batch.flags._dev is not self:
            raise ValueError(f"batch must be a flag batch of this SimDevice, got {batch!r}")
        s, f, ops = self._own(stream, "stream"), batch.flags, batch.ops  # the ops as of now
        s._put(lambda: self._flag_apply(f, ops))

    def _flag_apply(self, f: SimFlags, ops: tuple[FlagOp, ...]) -> None:
        """Run on a stream's worker: the ops in order; a wait holds the worker (and so every later
        item of its stream) until its word satisfies it or the device closes."""
        words = f._words
        with self._cv:
            for op in ops:
                if op.write:
                    words[op.index] = op.value
                    self._cv.notify_all()  # waits on this word re-check it
                elif op.geq:
                    self._cv.wait_for(lambda op=op: geq32(words[op.index], op.value) or self._closed)
                else:
                    self._cv.wait_for(lambda op=op: words[op.index] == op.value or self._closed)

    def synchronize(self) -> None:
        if self._closed:
            self._raise_error()
            return  # the workers are stopped: no work can still run
        for s in list(self._streams):
            s.synchronize()  # each stream's tail marker: all work submitted so far has run

    def close(self, timeout: float = 30.0) -> None:
        """Cancel the work not yet started, let each worker finish its current item, and join
        the workers (up to `timeout` s each; a warning names one still running). Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()  # release workers blocked in wait_event so they can exit
        _open.discard(self)
        for s in self._streams:
            s._stop()
        me = threading.current_thread()
        for s in self._streams:
            if s._thread is not me:  # close() from a launched fn: its own worker ends after it
                # A worker left running may be inside a torch op when the interpreter finalizes.
                s._thread.join(timeout=timeout)
                if s._thread.is_alive():
                    why = f"SimDevice.close: stream {s.name}'s worker still runs after {timeout} s"
                    warnings.warn(why, RuntimeWarning, stacklevel=2)


_open: weakref.WeakSet[SimDevice] = weakref.WeakSet()  # devices not closed yet


@atexit.register
def _close_open_devices() -> None:
    """At interpreter exit, close every SimDevice still open (see the module docstring)."""
    for dev in list(_open):
        dev.close()
