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
- `ev.synchronize()` / `stream.synchronize()` block the host;
- `flag_write(flags, i, v, stream)` stores v into word i of a `Flags` array when the stream
  reaches it, after everything submitted to that stream before it; `flag_wait(flags, i, v,
  stream)` makes later work on `stream` wait until word i holds v (or, with `geq`, until
  int32(word - v) >= 0: a comparison that ignores wraparound); `flag_ops` enqueues several
  of them as one operation, in order. These are CUDA's stream memory operations
  (cuStreamWriteValue32, cuStreamWaitValue32, cuStreamBatchMemOp): unlike an event wait, a
  flag wait names a fixed address and value, so a CUDA graph can hold it and replay it in
  every step.

Memory is torch tensors: "GPU memory" is whatever `Device.empty` returns (CUDA tensors, or
CPU tensors on the simulator), host memory is the uint8 tensor `alloc_pinned` returns.
"""

from __future__ import annotations

import abc
import numbers
from collections.abc import Callable, Sequence
from typing import NamedTuple

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


FLAG_MASK = 0xFFFFFFFF  # a flag word is 32 bits; values are taken modulo 2**32


class FlagOp(NamedTuple):
    """One stream memory operation on word `index` of a `Flags` array (an entry of a batch).

    write=True stores `value`; write=False waits until the word equals `value`, or with `geq`
    until int32(word - value) >= 0 (CUDA's cyclic comparison: a counter that wraps still compares).
    """

    write: bool
    index: int
    value: int
    geq: bool = False


class Flags(abc.ABC):
    """`n` 32-bit words in device memory that streams write and wait on (`Device.flag_*`).

    Made once (`Device.new_flags`), at start; the device reads and writes them, the host only
    through `read()` (which first waits for the device to be idle: a diagnostic, not a protocol).
    """

    label: str
    n: int

    @abc.abstractmethod
    def read(self) -> list[int]:
        """The words' values now, after every stream of the device went idle."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label} [{self.n}]>"


class FlagBatch(abc.ABC):
    """`ops` on one `Flags` array, prepared once (`Device.flag_batch`) and enqueued as often as
    needed (`Device.flag_run`): a protocol that runs the same batch every step pays no per-op
    host work for it. `set_values` changes some ops' values in place; a batch already enqueued
    keeps the values it was enqueued with (the device takes a copy, as CUDA does)."""

    flags: Flags
    ops: tuple[FlagOp, ...]

    @abc.abstractmethod
    def set_values(self, positions: range, value: int) -> None:
        """The ops at `positions` (a range of indices into `ops`) get `value` from now on."""

    def __len__(self) -> int:
        return len(self.ops)

    def _check_set(self, positions: range, value: int) -> None:
        n = len(self)
        ok = isinstance(positions, range) and (
            not positions or 0 <= min(positions[0], positions[-1]) <= max(positions[0], positions[-1]) < n
        )
        if not ok:
            raise ValueError(f"positions: expected a range of op indices in [0, {n}), got {positions!r}")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= FLAG_MASK:
            raise ValueError(f"value: expected an int in [0, 2**32), got {value!r}")


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

    @abc.abstractmethod
    def new_flags(self, n: int, value: int = 0, label: str | None = None) -> Flags:
        """`n` flag words in device memory, each holding `value` (made at start, never per step)."""

    @abc.abstractmethod
    def flag_write(self, flags: Flags, index: int, value: int, stream: Stream) -> None:
        """Enqueue on `stream`: word `index` := `value`, once everything before it on `stream` ran
        (its writes visible first)."""

    def flag_writer(self, flags: Flags, stream: Stream) -> Callable[[int, int], None]:
        """`write(index, value)`: `flag_write(flags, index, value, stream)` with `flags` and `stream`
        checked once, here: for a loop that writes a word per layer (a device may make it cheaper)."""
        return lambda index, value: self.flag_write(flags, index, value, stream)

    @abc.abstractmethod
    def flag_wait(self, flags: Flags, index: int, value: int, stream: Stream, *, geq: bool = False) -> None:
        """Later work on `stream` waits until word `index` equals `value` (`geq`: int32(word - value)
        >= 0); the host does not block. Under CUDA-graph capture this becomes a graph node."""

    @abc.abstractmethod
    def flag_batch(self, flags: Flags, ops: Sequence[FlagOp]) -> FlagBatch:
        """`ops` on `flags`, checked and prepared for `flag_run` (made once, run many times)."""

    @abc.abstractmethod
    def flag_run(self, batch: FlagBatch, stream: Stream) -> None:
        """Enqueue `batch`'s ops on `stream`, in order (a wait holds back the ops after it)."""

    def flag_ops(self, flags: Flags, ops: Sequence[FlagOp], stream: Stream) -> None:
        """Enqueue `ops` on `stream` in order: `flag_run(flag_batch(flags, ops), stream)`."""
        self.flag_run(self.flag_batch(flags, ops), stream)

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


def check_flag_op(flags: Flags, index: int, value: int, name: str = "index") -> None:
    """`index` names a word of `flags` and `value` fits in 32 bits (ValueError naming which not)."""
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < flags.n:
        raise ValueError(f"{name}: expected a word of {flags.label}, in [0, {flags.n}), got {index!r}")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= FLAG_MASK:
        raise ValueError(f"value: expected an int in [0, 2**32), got {value!r}")


def check_flag_ops(flags: Flags, ops: Sequence[FlagOp]) -> list[FlagOp]:
    """`ops` as a non-empty list of FlagOps on words of `flags` (ValueError naming the bad one)."""
    got = list(ops) if isinstance(ops, list | tuple) else None
    if not got:
        raise ValueError(f"ops: expected a non-empty list of FlagOp, got {ops!r}")
    for j, op in enumerate(got):
        if not isinstance(op, FlagOp):
            raise ValueError(f"ops[{j}]: expected a FlagOp, got {op!r}")
        check_flag_op(flags, op.index, op.value, f"ops[{j}].index")
    return got


def geq32(word: int, value: int) -> bool:
    """CUDA's CU_STREAM_WAIT_VALUE_GEQ: int32(word - value) >= 0."""
    return ((word - value) & FLAG_MASK) < 0x80000000


def check_nbytes(nbytes: int, name: str = "nbytes") -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"{name} must be a positive int, got {nbytes!r}")
    return nbytes
