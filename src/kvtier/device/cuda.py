"""CudaDevice: the device interface over torch.cuda streams, CUDA events and pinned memory.

Importable anywhere; constructing it without a GPU raises a clear error. Events are raw
cudaEvent_t handles driven through ctypes by default (`cuda_events.py`: a few us less per call
than torch's), torch's with `events="torch"`.

Pinned memory. torch's `pin_memory=True` goes through its caching host allocator, which
rounds every request up to a power of two (a 5 GiB slab would lock 8 GiB). The default
here (`pin="register"`) allocates ordinary pageable memory, touches it, and page-locks it
with `cudaHostRegister` — exactly `nbytes`, no rounding (buffers of 2 MiB and more).
`pin="torch"` uses torch's allocator instead; registration that fails falls back to it
with a warning.

Flags (`new_flags`, `flag_write`, `flag_wait`, `flag_batch` / `flag_run`): words of device
memory and the driver's stream memory operations on them (`cuda_flags.py`: why device memory,
which CUDA versions, what a graph holds).
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable

import torch

from kvtier.device import cuda_flags
from kvtier.device.base import (
    FLAG_MASK,
    Device,
    Event,
    FlagBatch,
    Flags,
    Stream,
    check_copy_args,
    check_flag_op,
    check_flag_ops,
    check_nbytes,
)
from kvtier.device.cuda_events import CudaEvent, EventHandles, choose_events
from kvtier.device.cudart import clear_last_error
from kvtier.device.torch_events import TorchEvent

__all__ = ["CudaDevice", "CudaEvent", "CudaStream", "TorchEvent"]

_CUDA_HOST_REGISTER_PORTABLE = 1  # the registration is visible to every CUDA context
_REGISTER_MIN = 2 << 20


class CudaStream(Stream):
    def __init__(self, device: CudaDevice, raw: torch.cuda.Stream, name: str):
        self._dev = device
        self.raw = raw
        self.handle = raw.cuda_stream  # the cudaStream_t, for raw runtime calls (0: legacy default)
        self.index = raw.device_index  # its device; both plain ints, read without a torch call
        self._key = (self.index, self.handle)  # what identifies the stream (0 is per device)
        self.name = name
        self._seq = itertools.count(1)

    def record(self, label: str | None = None) -> Event:
        ev = self._dev._event_cls(self._dev, label or f"{self.name}#{next(self._seq)}")
        ev.record(self)
        return ev

    def wait_event(self, event: Event) -> None:
        if type(event) is not self._dev._event_cls or event._dev is not self._dev:
            raise ValueError(f"event must be an event of this CudaDevice, got {event!r}")
        if event.stream is None:
            return  # never recorded: complete by definition
        event.wait_on(self)  # later work here must not start on data the event guards

    def synchronize(self) -> None:
        self.raw.synchronize()  # returning from a submit proves nothing; this does

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CudaStream) and other._key == self._key  # ints: no torch call

    def __hash__(self) -> int:
        return hash(self._key)


class CudaDevice(Device):
    """The real device: torch.cuda streams, CUDA events (raw handles), host memory page-locked once.

    Args:
        index: CUDA device ordinal.
        pin: "register" (exact-size cudaHostRegister, default) or "torch" (pin_memory=True).
        events: "raw" (cudaEvent_t handles through ctypes, `cuda_events.py`), "torch"
            (torch.cuda.Event), or None: env KVTIER_EVENTS, else "raw" where libcudart loads.
    """

    def __init__(self, index: int = 0, pin: str = "register", events: str | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaDevice needs a CUDA GPU but torch.cuda.is_available() is False; "
                "use kvtier.device.SimDevice to run on the CPU"
            )
        if not isinstance(index, int) or not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"index must be in [0, {torch.cuda.device_count()}), got {index!r}")
        if pin not in ("register", "torch"):
            raise ValueError(f"pin must be 'register' or 'torch', got {pin!r}")
        self._api, self.events = choose_events(events)
        self._event_cls = CudaEvent if self._api is not None else TorchEvent
        self._handles = EventHandles(self._api, index) if self._api is not None else None
        self.index = index
        self.name = f"cuda:{index}"
        self.pin = pin
        self._torch_device = torch.device("cuda", index)
        self._registered: dict[int, torch.Tensor] = {}  # data_ptr -> buffer kept alive while locked
        # A device dropped without close() must not leave its pages registered: freed memory that
        # malloc hands out again would then fail cudaHostRegister ("already registered").
        weakref.finalize(self, _unregister_all, self._registered)
        self._names = itertools.count()
        self._flag_names = itertools.count()
        self._compute = CudaStream(self, torch.cuda.current_stream(self._torch_device), "compute")
        self._epoch = self._event_cls(self, "epoch")
        self._epoch.record(self._compute)  # time zero of every event's time_s()

    @property
    def events_created(self) -> int:
        """cudaEvent_t handles created so far (0 with torch's events): a dead event's is reused."""
        return 0 if self._handles is None else self._handles.created

    def _own(self, stream: Stream, name: str) -> CudaStream:
        if not isinstance(stream, CudaStream) or stream._dev is not self:
            raise ValueError(f"{name} must be a stream of this CudaDevice, got {stream!r}")
        return stream

    def current_stream(self) -> CudaStream:
        return self._compute

    def new_stream(self, name: str | None = None) -> CudaStream:
        raw = torch.cuda.Stream(device=self._torch_device)
        return CudaStream(self, raw, name or f"stream{next(self._names)}")

    def new_event(self, label: str | None = None) -> Event:
        return self._event_cls(self, label or "event")

    def wrap_stream(self, raw: torch.cuda.Stream, name: str | None = None) -> CudaStream:
        """A torch stream of this device as a CudaStream, e.g. the stream a CUDA graph is being
        captured on (`torch.cuda.current_stream()` inside `torch.cuda.graph`)."""
        if not isinstance(raw, torch.cuda.Stream) or raw.device_index != self.index:
            raise ValueError(f"raw must be a torch.cuda.Stream of {self.name}, got {raw!r}")
        return CudaStream(self, raw, name or f"stream{next(self._names)}")

    def _check_side(self, t: torch.Tensor, name: str) -> None:
        if t.is_cuda:
            if t.device != self._torch_device:
                raise ValueError(f"{name} is on {t.device}, expected {self._torch_device}")
        elif not t.is_pinned():
            # A pageable host buffer makes the copy synchronous and staged: no overlap.
            raise ValueError(f"{name} is pageable host memory; stream copies need pinned memory")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        s = self._own(stream, "stream")
        d, sv = check_copy_args(dst, src)
        if not (dst.is_cuda or src.is_cuda):
            raise ValueError("dst and src are both host tensors; a stream copy needs one side on the GPU")
        self._check_side(dst, "dst")
        self._check_side(src, "src")
        with torch.cuda.stream(s.raw):
            d.copy_(sv, non_blocking=True)
        for t in (dst, src):
            if t.is_cuda:
                # Keeps torch's caching allocator from handing this memory to someone else
                # while the copy stream may still be using it.
                t.record_stream(s.raw)

    def launch(self, fn: Callable[[], object], stream: Stream) -> None:
        s = self._own(stream, "stream")
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {fn!r}")
        with torch.cuda.stream(s.raw):
            fn()

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(check_nbytes(nbytes), dtype=torch.uint8, device=self._torch_device)

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        check_nbytes(nbytes)
        # Small buffers share pages with other allocations, and a page registers only once;
        # below 2 MiB the power-of-two rounding of torch's allocator costs little anyway.
        if self.pin == "register" and nbytes >= _REGISTER_MIN:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            buf.zero_()  # first touch: the pages exist (on the caller's NUMA node) before locking
            err = int(
                torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE)
            )
            if err == 0:
                self._registered[buf.data_ptr()] = buf
                return buf
            clear_last_error()  # the handled failure must not surface at torch's next CUDA call
            warnings.warn(
                f"cudaHostRegister of {nbytes} bytes failed (cudaError {err}); "
                "falling back to torch pin_memory, which rounds up to a power of two",
                RuntimeWarning,
                stacklevel=2,
            )
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def free_pinned(self, buf: torch.Tensor) -> None:
        if self._registered.pop(buf.data_ptr(), None) is not None:
            # Callers free only after their copies completed (the pool is closed last).
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._torch_device)

    def _memops(self):
        api, why = cuda_flags.memop_api()
        if api is None:
            raise RuntimeError(f"flags need CUDA's stream memory operations: {why}")
        return api

    def new_flags(self, n: int, value: int = 0, label: str | None = None) -> cuda_flags.CudaFlags:
        check_nbytes(n, "n")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= FLAG_MASK:
            raise ValueError(f"value: expected an int in [0, 2**32), got {value!r}")
        self._memops()  # refused here, at start, where the driver cannot do it
        return cuda_flags.CudaFlags(self, n, value, label or f"flags#{next(self._flag_names)}")

    def _own_flags(self, flags: Flags) -> cuda_flags.CudaFlags:
        if not isinstance(flags, cuda_flags.CudaFlags) or flags._dev is not self:
            raise ValueError(f"flags must be flags of this CudaDevice, got {flags!r}")
        return flags

    def flag_write(self, flags: Flags, index: int, value: int, stream: Stream) -> None:
        f, s = self._own_flags(flags), self._own(stream, "stream")
        check_flag_op(f, index, value)
        cuda_flags.write(self._memops(), self, f, index, value, s)

    def flag_writer(self, flags: Flags, stream: Stream):
        f, s = self._own_flags(flags), self._own(stream, "stream")
        return cuda_flags.writer(self._memops(), self, f, s)

    def flag_wait(self, flags: Flags, index: int, value: int, stream: Stream, *, geq: bool = False) -> None:
        f, s = self._own_flags(flags), self._own(stream, "stream")
        check_flag_op(f, index, value)
        cuda_flags.wait(self._memops(), self, f, index, value, s, bool(geq))

    def flag_batch(self, flags: Flags, ops) -> cuda_flags.CudaFlagBatch:
        f = self._own_flags(flags)
        return cuda_flags.CudaFlagBatch(f, check_flag_ops(f, ops))

    def flag_run(self, batch: FlagBatch, stream: Stream) -> None:
        if not isinstance(batch, cuda_flags.CudaFlagBatch) or batch.flags._dev is not self:
            raise ValueError(f"batch must be a flag batch of this CudaDevice, got {batch!r}")
        cuda_flags.run(self._memops(), self, batch, self._own(stream, "stream"))

    def close(self) -> None:
        # No copy may still read or write a buffer we are about to unlock.
        self.synchronize()
        _unregister_all(self._registered)
        if self._handles is not None:
            self._handles.close()  # the free ones; events still alive give theirs back later


def _unregister_all(registered: dict[int, torch.Tensor]) -> None:
    for ptr in list(registered):
        torch.cuda.cudart().cudaHostUnregister(ptr)
    registered.clear()
