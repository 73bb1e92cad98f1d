"""CudaEvent's wrapper logic over a fake CUDA runtime, on the CPU: return codes, the cleared
"not ready" error, handle reuse, the default stream's device guard; TorchEvent's memory of
having been seen complete over a fake torch event. (The real runtime is exercised by
tests/test_device.py's "cuda" and "cuda-torch" devices on a GPU.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.device.cuda_events import NOT_READY, CudaEvent, EventHandles


class FakeRuntime:
    """The event calls of libcudart over Python state: an event is 'done' when its stream's
    work counter has passed the value it was recorded at."""

    def __init__(self):
        self.next_handle, self.device, self.last = 0x100, 0, 0
        self.recorded: dict[int, tuple[int, int]] = {}  # handle -> (stream, work at record)
        self.work: dict[int, int] = {}  # stream -> work enqueued
        self.done: dict[int, int] = {}  # stream -> work completed
        self.calls: list[tuple] = []
        self.fail: dict[str, int] = {}
        self.queries = 0
        self.during_query = None  # run once inside the next query, after its answer is known

    def _rc(self, name, rc=0):
        rc = self.fail.get(name, rc)
        if rc:
            self.last = rc
        return rc

    def api(self) -> SimpleNamespace:
        def create(ptr, flags):
            self.next_handle += 0x10
            ptr._obj.value = self.next_handle
            self.calls.append(("create", self.device))
            return self._rc("create")

        def record(h, stream):
            self.recorded[h] = (stream, self.work.get(stream, 0))
            self.calls.append(("record", h, stream, self.device))
            return self._rc("record")

        def query(h):
            self.queries += 1
            if h not in self.recorded:
                return self._rc("query")
            stream, at = self.recorded[h]
            rc = self._rc("query", 0 if self.done.get(stream, 0) >= at else NOT_READY)
            if self.during_query is not None:
                hook, self.during_query = self.during_query, None
                hook()
            return rc

        def wait(stream, h, flags):
            self.calls.append(("wait", stream, h, self.device))
            return self._rc("wait")

        def get_device(ptr):
            ptr._obj.value = self.device
            return 0

        def set_device(i):
            self.device = i
            self.calls.append(("set_device", i))
            return 0

        def last_error():
            rc, self.last = self.last, 0
            return rc

        return SimpleNamespace(
            create=create, record=record, query=query, wait=wait, get_device=get_device,
            set_device=set_device, last_error=last_error, sync=lambda h: self._rc("sync"),
            elapsed=lambda ms, a, b: self._rc("elapsed"), destroy=lambda h: 0,
        )  # fmt: skip


class FakeStream:
    def __init__(self, dev, handle):
        self.dev, self.handle = dev, handle
        self._dev = dev  # CudaEvent reads CudaStream's `_dev` (the default stream's device)


class FakeDevice:
    """What CudaEvent and CudaStream read of their device (CudaDevice's `_api`, `_handles`,
    `_event_cls`, `_own`, `index`), over the fake runtime; `handles` for the tests to read."""

    def __init__(self, rt: FakeRuntime, index: int = 1):
        self._api, self.index = rt.api(), index
        self.handles = self._handles = EventHandles(self._api, index)
        self._event_cls = CudaEvent

    def _own(self, stream, name):
        if not isinstance(stream, FakeStream) or stream.dev is not self:
            raise ValueError(f"{name} must be a stream of this CudaDevice, got {stream!r}")
        return stream


@pytest.fixture
def rt():
    return FakeRuntime()


def recorded(rt):
    """A device, its stream 0x7 with one piece of work, and an event recorded after that work."""
    dev = FakeDevice(rt)
    s = FakeStream(dev, 0x7)
    ev = CudaEvent(dev, "e")
    rt.work[0x7] = 1
    ev.record(s)
    return dev, s, ev


def test_query_follows_the_stream_and_clears_not_ready(rt):
    dev = FakeDevice(rt)
    s = FakeStream(dev, 0x7)
    ev = CudaEvent(dev, "e")
    assert ev.query() and ev.stream is None  # never recorded: complete
    rt.work[0x7] = 3
    ev.record(s)
    assert ev.stream is s
    assert not ev.query()
    assert rt.last == 0  # "not ready" was cleared: torch's next error check must not see it
    rt.done[0x7] = 3
    assert ev.query()


def test_an_event_seen_complete_is_not_asked_again_until_recorded(rt):
    dev, s, ev = recorded(rt)
    assert not ev.query() and not ev.known_complete
    rt.done[0x7] = 1
    assert ev.query() and ev.known_complete
    n, calls = rt.queries, len(rt.calls)
    rt.done[0x7] = 0  # a runtime asked now would say "not ready": shows it is not asked
    assert ev.query() and ev.synchronize() and rt.queries == n
    ev.wait_on(FakeStream(dev, 0x9))
    assert len(rt.calls) == calls  # waiting on completed work: no cudaStreamWaitEvent
    rt.work[0x7] = 2
    ev.record(s)  # a new record: not known any more
    assert not ev.known_complete and not ev.query() and rt.queries == n + 1
    ev.wait_on(FakeStream(dev, 0x9))
    assert rt.calls[-1] == ("wait", 0x9, ev.handle, 0)
    rt.done[0x7] = 2
    assert ev.synchronize() and ev.known_complete  # a wait that returned counts as seen
    ev.mark_recorded(s)  # recorded by the C helper: not known either
    assert not ev.known_complete


def test_a_record_racing_a_query_is_not_taken_as_complete(rt):
    """Another thread records the event while a query of the old record is in the runtime: the
    old record's "complete" must not mark the new one complete."""
    dev, s, ev = recorded(rt)
    rt.done[0x7] = 1  # the old record: complete

    def racing():
        rt.work[0x7] = 2
        ev.record(s)  # meanwhile, a new record of pending work

    rt.during_query = racing
    assert ev.query()  # true of the record it asked about
    assert not ev.known_complete and not ev.query()  # the new record is asked about: pending


def test_failed_calls_raise_naming_the_call_and_clear_the_error(rt):
    dev = FakeDevice(rt)
    ev = CudaEvent(dev, "e")
    rt.fail["record"] = 400
    with pytest.raises(RuntimeError, match="cudaEventRecord failed: cudaError 400"):
        ev.record(FakeStream(dev, 0x7))
    assert rt.last == 0 and ev.stream is None  # not recorded: the event stays complete
    rt.fail = {}
    ev.record(FakeStream(dev, 0x7))
    rt.fail = {"query": 700}
    with pytest.raises(RuntimeError, match="cudaEventQuery failed: cudaError 700"):
        ev.query()
    rt.fail = {"sync": 700}
    with pytest.raises(RuntimeError, match="cudaEventSynchronize"):
        ev.synchronize()
    with pytest.raises(ValueError, match="stream"):
        ev.record(object())


def test_handles_are_reused_once_their_event_dies(rt):
    dev = FakeDevice(rt)
    rt.work[0x7] = 1
    a2 = CudaEvent(dev, "a2")
    a2.record(FakeStream(dev, 0x7))  # pending when it dies
    ha = a2.handle
    del a2
    b = CudaEvent(dev, "b")
    assert b.handle == ha and dev.handles.created == 1  # reused, not created again
    assert b.query() and b.synchronize()  # unrecorded by b: complete, whatever the old record is
    n = len(rt.calls)
    b.wait_on(FakeStream(dev, 0x9))
    assert len(rt.calls) == n  # and nothing to wait for
    c = CudaEvent(dev, "c")
    assert c.handle != b.handle and dev.handles.created == 2  # a live event's handle is never shared


def test_creation_and_the_default_stream_run_on_the_events_device(rt):
    dev = FakeDevice(rt, index=1)  # the runtime's current device is 0
    ev = CudaEvent(dev, "e")
    assert ("create", 1) in rt.calls and rt.device == 0  # created on device 1, current one restored
    ev.record(FakeStream(dev, 0x7))
    assert rt.calls[-1] == ("record", ev.handle, 0x7, 0)  # a real stream carries its device: no switch
    ev.record(FakeStream(dev, 0))
    assert rt.calls[-2:] == [("record", ev.handle, 0, 1), ("set_device", 0)]  # legacy default: device 1's
    ev.wait_on(FakeStream(dev, 0))
    assert rt.calls[-2:] == [("wait", 0, ev.handle, 1), ("set_device", 0)]
    ev.wait_on(FakeStream(dev, 0x9))
    assert rt.calls[-1] == ("wait", 0x9, ev.handle, 0)


def test_synchronize_with_timeout_polls(rt):
    dev, s, ev = recorded(rt)
    assert ev.synchronize(timeout=0.01) is False  # never completes here
    rt.done[0x7] = 1
    assert ev.synchronize(timeout=0.01) is True


def test_cuda_streams_compare_by_device_and_handle():
    from kvtier.device.cuda import CudaStream

    class Raw:
        def __init__(self, device_index, cuda_stream):
            self.device_index, self.cuda_stream = device_index, cuda_stream

    dev = object()
    a, b = CudaStream(dev, Raw(0, 0x7), "a"), CudaStream(dev, Raw(0, 0x7), "b")
    assert a == b and hash(a) == hash(b)  # two wrappers of one stream
    assert a != CudaStream(dev, Raw(0, 0x9), "c")
    assert CudaStream(dev, Raw(0, 0), "d0") != CudaStream(dev, Raw(1, 0), "d1")  # handle 0 is per device
    assert a != object()


def test_choose_events_reads_the_argument_then_the_environment(monkeypatch):
    from kvtier.device import cuda_events

    monkeypatch.setattr(cuda_events, "event_api", lambda: (None, "no libcudart here"))
    monkeypatch.delenv("KVTIER_EVENTS", raising=False)
    assert cuda_events.choose_events() == (None, "torch")  # no runtime: torch's events
    with pytest.raises(RuntimeError, match="no libcudart here"):
        cuda_events.choose_events("raw")
    monkeypatch.setenv("KVTIER_EVENTS", "fast")
    with pytest.raises(ValueError, match="KVTIER_EVENTS.*'fast'"):
        cuda_events.choose_events()
    assert cuda_events.choose_events("torch") == (None, "torch")  # the argument wins
    api = object()
    monkeypatch.setattr(cuda_events, "event_api", lambda: (api, ""))
    monkeypatch.setenv("KVTIER_EVENTS", "")
    assert cuda_events.choose_events() == (api, "raw")


def test_torch_events_remember_being_seen_complete(monkeypatch):
    """TorchEvent (KVTIER_EVENTS=torch) as CudaEvent: once seen complete since its last record, a
    query, a wait or a stream's wait on it makes no call; a new record asks again."""
    import torch

    from kvtier.device.torch_events import TorchEvent

    class FakeTorchEvent:
        def __init__(self, enable_timing):
            self.done, self.queries, self.syncs = False, 0, 0

        def record(self, stream):
            self.done = False

        def query(self):
            self.queries += 1
            return self.done

        def synchronize(self):
            self.syncs += 1
            self.done = True

    monkeypatch.setattr(torch.cuda, "Event", FakeTorchEvent)
    waits = []
    stream = SimpleNamespace(raw=SimpleNamespace(wait_event=waits.append))
    ev = TorchEvent(SimpleNamespace(_own=lambda s, what: s), "e")
    assert ev.query() and ev.known_complete and ev.raw.queries == 0  # never recorded: no call
    ev.wait_on(stream)
    assert waits == []
    ev.record(stream)
    assert not ev.known_complete and not ev.query() and ev.raw.queries == 1
    ev.wait_on(stream)
    assert waits == [ev.raw]  # pending: the stream waits for it
    ev.raw.done = True
    assert ev.query() and ev.query() and ev.raw.queries == 2  # the second from memory
    ev.wait_on(stream)
    assert len(waits) == 1 and ev.known_complete
    ev.record(stream)  # a new record: not known complete any more
    assert not ev.known_complete
    assert ev.synchronize() and ev.synchronize() and ev.raw.syncs == 1
    assert ev.query() and ev.raw.queries == 2


def test_a_cuda_stream_waits_for_a_recorded_event_only(rt):
    """CudaStream.wait_event over CudaEvent (the engine's every wait): a never-recorded event asks
    nothing, a recorded one enqueues cudaStreamWaitEvent on this stream; another device's event or
    a foreign object is refused naming the argument."""
    from kvtier.device.cuda import CudaStream

    dev = FakeDevice(rt)
    stream = CudaStream(dev, SimpleNamespace(cuda_stream=0x9, device_index=1), "s")
    ev = CudaEvent(dev, "e")
    n = len(rt.calls)
    stream.wait_event(ev)
    assert len(rt.calls) == n  # never recorded: complete, no runtime call
    rt.work[0x7] = 1
    ev.record(FakeStream(dev, 0x7))
    stream.wait_event(ev)
    assert rt.calls[-1] == ("wait", 0x9, ev.handle, 0)
    other = FakeDevice(rt)
    with pytest.raises(ValueError, match="event must be an event of this CudaDevice"):
        stream.wait_event(CudaEvent(other, "x"))
    with pytest.raises(ValueError, match="event must be"):
        stream.wait_event(object())
