"""The device interface: streams, events, asynchronous copies and pinned allocation.

Everything kvtier does on a GPU goes through this small surface, so that the same protocol
code runs on `CudaDevice` (the real thing) and on `SimDevice` (CPU worker threads whose
copies land late on purpose). The semantics follow CUDA's:

- work submitted to one stream runs in submission order; a call returning means the work
  is *submitted*, not *done*;
- `ev = stream.record()` completes when the stream reaches it, i.e. after all work
  submitted to that stream before it; an event never recorded counts as complete
  (cudaEventQuery returns success for it);
- `stream.wait_event(ev)` makes all *later* work on `stream` wait until `ev` completes,
  without blocking the host;
- `ev.synchronize()` / `stream.synchronize()` block the host.

Memory is torch tensors: "GPU memory" is whatever `Device.empty` returns (CUDA tensors, or
CPU tensors on the simulator), host memory is the uint8 tensor `alloc_pinned` returns.
"""

from __future__ import annotations

import abc
import numbers
from collections.abc import Callable

import torch


class DeviceError(RuntimeError):
    """Work that ran on a stream failed; raised at the next synchronize (sticky, like CUDA)."""


class Event(abc.ABC):
    """A marker in a stream; completes when the stream has executed everything before it."""

    label: str  # for messages and traces, e.g. "copy#12"

    @property
    @abc.abstractmethod
    def stream(self) -> Stream | None:
        """The stream of the latest record, or None when never recorded."""

    @abc.abstractmethod
    def record(self, stream: Stream) -> None:
        """(Re)arm the event at the current tail of `stream`."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True when the recorded work has completed (or the event was never recorded)."""

    @abc.abstractmethod
    def synchronize(self, timeout: float | None = None) -> bool:
        """Block the host until complete; with `timeout` (seconds) return False on expiry."""

    @property
    def known_complete(self) -> bool:
        """Complete without asking the device: never recorded (here), or seen complete by a query
        or wait since the last record (CudaEvent). False means "not known", not "pending"."""
        return self.stream is None

    @abc.abstractmethod
    def time_s(self) -> float:
        """Seconds from the device's epoch to the moment the stream reached this event.

        Only valid once the event has completed; used to draw timelines.
        """

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to `end`, both completed."""
        if not isinstance(end, Event):
            raise ValueError(f"end must be an Event, got {end!r}")
        return (end.time_s() - self.time_s()) * 1e3

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label}>"


class Stream(abc.ABC):
    """An in-order queue of device work."""

    name: str

    @abc.abstractmethod
    def record(self, label: str | None = None) -> Event:
        """A new event recorded at the current tail of this stream."""

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits until `event` completes; the host does not block."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until everything submitted to this stream has run."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class Device(abc.ABC):
    """Streams, events, copies and memory of one accelerator (or its simulation)."""

    name: str  # "sim" or "cuda:0"

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The compute stream: where the serving engine's model runs."""

    @abc.abstractmethod
    def new_stream(self, name: str | None = None) -> Stream:
        """A new stream, e.g. for copies that must overlap compute."""

    @abc.abstractmethod
    def new_event(self, label: str | None = None) -> Event:
        """An unrecorded event (counts as complete until recorded)."""

    @abc.abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        """Enqueue a byte copy `src` → `dst` on `stream`.

        Both tensors contiguous with equal `nbytes` (any dtypes; bytes are copied as is).
        The bytes of `src` are read when the stream reaches the copy, not at this call:
        `src` must stay untouched and `dst` unread until an event recorded after it completes.
        """

    @abc.abstractmethod
    def launch(self, fn: Callable[[], object], stream: Stream) -> None:
        """Enqueue arbitrary device work (a kernel, a torch op) on `stream`.

        CUDA runs `fn()` now under `torch.cuda.stream(stream)`, so only the device work it
        submits is stream-ordered; the simulator runs all of `fn` when the stream reaches it.
        Portable code therefore puts only tensor operations in `fn`.
        """

    @abc.abstractmethod
    def empty(self, nbytes: int) -> torch.Tensor:
        """Uninitialised device memory: a 1-D uint8 tensor of `nbytes`."""

    @abc.abstractmethod
    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        """Page-locked host memory: a 1-D uint8 CPU tensor of exactly `nbytes`.

        Meant to be called a few times at start-up (the pool's slab), never per request.
        """

    @abc.abstractmethod
    def free_pinned(self, buf: torch.Tensor) -> None:
        """Give back a buffer from `alloc_pinned` (unregisters it on CUDA)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until every stream of this device is idle."""

    def close(self) -> None:  # noqa: B027 - optional hook: not every device holds resources
        """Release threads and registrations; the device is unusable afterwards."""

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_copy_args(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a byte copy and return flat uint8 views of (dst, src)."""
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    dst_n = dst.numel() * dst.element_size()
    src_n = src.numel() * src.element_size()
    if dst_n != src_n:
        raise ValueError(f"dst has {dst_n} bytes but src has {src_n}; a copy moves equal byte counts")
    return dst.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8)


def check_timeout(timeout: float | None, name: str = "timeout") -> float | None:
    """None (no limit) or a number of seconds >= 0; anything else raises ValueError naming it."""
    if timeout is None:
        return None
    t = type(timeout)
    if (t is float or t is int) and timeout >= 0:  # the usual values, without the ABC check below
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:  # NaN too
        raise ValueError(f"{name} must be seconds >= 0 or None, got {timeout!r}")
    return timeout


def check_nbytes(nbytes: int, name: str = "nbytes") -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"{name} must be a positive int, got {nbytes!r}")
    return nbytes
