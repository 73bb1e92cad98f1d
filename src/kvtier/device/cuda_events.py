"""Events of CudaDevice: raw cudaEvent_t handles driven through ctypes (default), or torch's.

A job records one event and waits on a few. Through torch each of those calls builds a Python
object, takes a device guard and runs its own checks; the same runtime call through ctypes costs
the host several times less (measured: docs/performance.md). `CudaEvent` holds a handle of
its device's `EventHandles` and gives it back when the object dies (a handle is reused only by a
later record, which CUDA allows at any time: waits already enqueued keep the old record).

`TorchEvent` (`torch_events.py`) is the same interface over `torch.cuda.Event`:
`CudaDevice(events="torch")`, env `KVTIER_EVENTS=torch`, or where libcudart cannot be loaded.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from ctypes import CFUNCTYPE, POINTER, byref, c_float, c_int, c_uint, c_void_p
from types import SimpleNamespace

from kvtier.device.base import Device, Event, Stream, check_timeout

NOT_READY = 600  # cudaErrorNotReady: the recorded work has not completed (not a failure)
_TIMING = 0  # cudaEventDefault: timing on, so a trace can place every event on a timeline


@functools.cache
def event_api() -> tuple[SimpleNamespace | None, str]:
    """(the runtime's event calls as ctypes functions, why not usable or '')."""
    from kvtier.device.cudart import runtime

    lib, _ver, why = runtime()
    if lib is None:
        return None, why

    def fn(name, *args):
        return CFUNCTYPE(c_int, *args)((name, lib))  # own prototypes: ints pass as pointers

    try:
        api = SimpleNamespace(
            create=fn("cudaEventCreateWithFlags", POINTER(c_void_p), c_uint),
            record=fn("cudaEventRecord", c_void_p, c_void_p),
            query=fn("cudaEventQuery", c_void_p),
            sync=fn("cudaEventSynchronize", c_void_p),
            elapsed=fn("cudaEventElapsedTime", POINTER(c_float), c_void_p, c_void_p),
            destroy=fn("cudaEventDestroy", c_void_p),
            wait=fn("cudaStreamWaitEvent", c_void_p, c_void_p, c_uint),
            get_device=fn("cudaGetDevice", POINTER(c_int)),
            set_device=fn("cudaSetDevice", c_int),
            last_error=fn("cudaGetLastError"),
        )
    except AttributeError as e:
        return None, f"the CUDA runtime lacks an event call: {e}"
    return api, ""


def choose_events(events: str | None = None) -> tuple[SimpleNamespace | None, str]:
    """(the runtime's event calls or None, "raw" or "torch") for CudaDevice's `events`: None reads
    env KVTIER_EVENTS, else "raw" where libcudart loads. Raises naming a bad value, and when "raw"
    was asked for but the runtime cannot be loaded."""
    events = events if events is not None else os.environ.get("KVTIER_EVENTS", "").strip() or None
    if events not in (None, "raw", "torch"):
        raise ValueError(f"events (or env KVTIER_EVENTS) must be 'raw', 'torch' or None, got {events!r}")
    api, why = event_api() if events != "torch" else (None, "")
    if events == "raw" and api is None:
        raise RuntimeError(f"events='raw' needs the CUDA runtime through ctypes: {why}")
    return api, "raw" if api is not None else "torch"


def cuda_error(api: SimpleNamespace, what: str, rc: int) -> RuntimeError:
    """The error to raise for a failed call, after clearing the runtime's last error (so that
    torch's next check does not report it against an unrelated launch)."""
    api.last_error()
    from kvtier.device.cudart import runtime

    lib = runtime()[0]
    name = lib.cudaGetErrorString(rc).decode() if lib is not None else "?"
    return RuntimeError(f"{what} failed: cudaError {rc} ({name})")


class OnDevice:
    """The runtime's current device set to `index` for a block (only switched when it differs)."""

    def __init__(self, api: SimpleNamespace, index: int):
        self._api, self._index, self._prev = api, index, None

    def __enter__(self) -> None:
        cur = c_int(-1)
        if self._api.get_device(byref(cur)) == 0 and cur.value != self._index:
            self._prev = cur.value
            self._api.set_device(self._index)

    def __exit__(self, *exc: object) -> None:
        if self._prev is not None:
            self._api.set_device(self._prev)
            self._prev = None


class EventHandles:
    """A free list of cudaEvent_t handles of one device: `take` reuses or creates, `give` returns."""

    def __init__(self, api: SimpleNamespace, index: int):
        self._api, self._index = api, index
        self._free: list[int] = []
        self.created = 0

    def take(self) -> int:
        try:
            return self._free.pop()
        except IndexError:
            pass
        h = c_void_p(0)
        with OnDevice(self._api, self._index):  # an event belongs to the device current at creation
            rc = self._api.create(byref(h), _TIMING)
        if rc != 0 or not h.value:
            raise cuda_error(self._api, "cudaEventCreateWithFlags", rc)
        self.created += 1
        return h.value

    def give(self, h: int) -> None:
        self._free.append(h)  # no one holds it: its next record re-arms it for a new owner

    def close(self) -> None:
        """Destroy the free handles (those still held are given back when their events die)."""
        while self._free:
            self._api.destroy(self._free.pop())


class CudaEvent(Event):
    """An event of `device` over a raw cudaEvent_t (see the module doc)."""

    # `stream`: a plain slot, not the base class's property (read on every submit: no Python call);
    # read it, never assign it (record / mark_recorded do).
    __slots__ = ("_dev", "_gen", "_seen", "handle", "label", "stream")

    def __init__(self, device: Device, label: str):
        self._dev, self.label, self.stream = device, label, None
        # The cudaEvent_t: read it (a caller recording it in a call of its own, `mark_recorded`),
        # never assign it. A plain attribute: the C helper's replay reads it on every submit.
        try:  # a free handle, popped inline (the usual case: a call fewer); else `take` makes one
            self.handle = device._handles._free.pop()  # one atomic pop: safe beside other threads
        except IndexError:
            self.handle = device._handles.take()
        # Records so far, and the count at which a query or wait last saw the event complete: while
        # they are equal it is complete (work it recorded stays done) and no runtime call is made.
        # A record bumps _gen only after the runtime took it, and a check stores the _gen it read
        # before asking the runtime: a record racing a check leaves them unequal (asks again).
        self._gen, self._seen = 0, -1

    def __del__(self) -> None:
        h, self.handle = getattr(self, "handle", 0), 0
        if h:
            with contextlib.suppress(Exception):  # interpreter shutdown: the handle dies with the process
                self._dev._handles.give(h)

    def mark_recorded(self, stream: Stream) -> None:
        """The caller has just recorded `handle` on `stream` (the C helper, `engine/fast.py`)."""
        self.stream = stream
        self._gen += 1  # a new record: not known complete any more

    @property
    def known_complete(self) -> bool:
        """Complete, as seen by an earlier query or wait (or never recorded): no runtime call."""
        return self.stream is None or self._seen == self._gen

    def record(self, stream: Stream) -> None:
        s = self._dev._own(stream, "stream")
        api = self._dev._api
        if s.handle:
            rc = api.record(self.handle, s.handle)
        else:  # the legacy default stream (handle 0) is the current device's: make it ours
            with OnDevice(api, self._dev.index):
                rc = api.record(self.handle, 0)
        if rc != 0:
            raise cuda_error(api, "cudaEventRecord", rc)
        self.stream = s
        self._gen += 1  # after the runtime took the record: a check racing it asks again

    def query(self) -> bool:
        if self.stream is None:
            return True  # never recorded by this event (its handle may hold an old owner's record)
        gen = self._gen
        if self._seen == gen:
            return True  # seen complete since its last record: done work stays done
        rc = self._dev._api.query(self.handle)
        if rc == 0:
            self._seen = gen  # the record current before the call has completed
            return True
        if rc == NOT_READY:
            self._dev._api.last_error()  # "not ready" is no failure: torch must not see it later
            return False
        raise cuda_error(self._dev._api, "cudaEventQuery", rc)

    def synchronize(self, timeout: float | None = None) -> bool:
        check_timeout(timeout)
        if self.stream is None:
            return True  # never recorded: complete by definition
        if timeout is None:
            gen = self._gen
            if self._seen == gen:
                return True  # seen complete since its last record
            rc = self._dev._api.sync(self.handle)  # the host needs the work done (ctypes drops the GIL)
            if rc != 0:
                raise cuda_error(self._dev._api, "cudaEventSynchronize", rc)
            self._seen = gen
            return True
        return _poll(self, timeout)

    def wait_on(self, stream: Stream) -> None:
        """Later work on `stream` waits for this event (the stream may be of another device)."""
        api = self._dev._api
        if self.stream is None or self._seen == self._gen:
            return  # never recorded, or seen complete: the wait would be satisfied at once
        if stream.handle:
            rc = api.wait(stream.handle, self.handle, 0)
        else:  # the legacy default stream of the stream's own device
            with OnDevice(api, stream._dev.index):
                rc = api.wait(0, self.handle, 0)
        if rc != 0:
            raise cuda_error(api, "cudaStreamWaitEvent", rc)

    def time_s(self) -> float:
        if self.stream is None or not self.query():
            raise RuntimeError(f"event {self.label} has not completed; its time is not known yet")
        ms = c_float(0.0)
        rc = self._dev._api.elapsed(byref(ms), self._dev._epoch.handle, self.handle)
        if rc != 0:
            raise cuda_error(self._dev._api, "cudaEventElapsedTime", rc)
        return ms.value / 1e3


def _poll(event: Event, timeout: float) -> bool:
    """CUDA has no timed wait on an event: poll with a growing sleep (us to 1 ms)."""
    deadline = time.monotonic() + timeout
    nap = 20e-6
    while not event.query():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(nap, left))
        nap = min(nap * 2, 1e-3)
    return True
