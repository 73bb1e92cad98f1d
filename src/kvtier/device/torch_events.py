"""`TorchEvent`: CudaDevice's events over `torch.cuda.Event`, where the raw ones of
`cuda_events.py` are not used (`CudaDevice(events="torch")`, env `KVTIER_EVENTS=torch`, or a
build where libcudart cannot be loaded). The same interface, and the same memory of having been
seen complete since the last record."""

from __future__ import annotations

import torch

from kvtier.device.base import Device, Event, Stream, check_timeout
from kvtier.device.cuda_events import _poll


class TorchEvent(Event):
    """The same event over `torch.cuda.Event` (timing enabled, as CudaEvent's), and as CudaEvent
    it remembers having been seen complete since its last record (then no call is made)."""

    def __init__(self, device: Device, label: str):
        self._dev, self.label, self._stream = device, label, None
        self.raw = torch.cuda.Event(enable_timing=True)
        self._gen, self._seen = 0, -1  # as CudaEvent's: records so far, and the count last seen done

    @property
    def stream(self) -> Stream | None:
        return self._stream

    @property
    def known_complete(self) -> bool:
        """Complete, as seen by an earlier query or wait (or never recorded): no call."""
        return self._stream is None or self._seen == self._gen

    def record(self, stream: Stream) -> None:
        s = self._dev._own(stream, "stream")
        self.raw.record(s.raw)
        self._stream = s
        self._gen += 1  # after torch took the record: a check racing it asks again

    def query(self) -> bool:
        gen = self._gen
        if self._stream is None or self._seen == gen:
            return True  # never recorded, or seen complete since its last record
        if self.raw.query():
            self._seen = gen  # the record current before the call has completed
            return True
        return False

    def synchronize(self, timeout: float | None = None) -> bool:
        if check_timeout(timeout) is None:
            gen = self._gen
            if self._stream is None or self._seen == gen:
                return True  # never recorded, or seen complete since its last record
            self.raw.synchronize()  # the host needs the work done, not merely submitted
            self._seen = gen
            return True
        return _poll(self, timeout)

    def wait_on(self, stream: Stream) -> None:
        if self._stream is None or self._seen == self._gen:
            return  # never recorded, or seen complete: the wait would be satisfied at once
        stream.raw.wait_event(self.raw)  # CUDA events order work across devices of one process

    def time_s(self) -> float:
        if self._stream is None or not self.raw.query():
            raise RuntimeError(f"event {self.label} has not completed; its time is not known yet")
        return self._dev._epoch.raw.elapsed_time(self.raw) / 1e3
