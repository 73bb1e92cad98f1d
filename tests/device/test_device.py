"""One behavioural suite for every device: SimDevice on the CPU, CudaDevice on a GPU.

Only tensor operations go inside `launch` (CUDA runs the Python of `fn` at submit time;
only the device work it submits is stream-ordered). Slow work is a sleep item on the
simulator and `torch.cuda._sleep` on a GPU.
"""

import time

import pytest
import torch

from kvtier.device import CudaDevice, DeviceError, SimDevice

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]


@pytest.fixture(params=["sim", pytest.param("cuda", marks=gpu), pytest.param("cuda-torch", marks=gpu)])
def dev(request):
    """SimDevice; CudaDevice with raw runtime events (the default) and with torch's events."""
    if request.param == "sim":
        d = SimDevice(copy_delay=(0.0, 0.002), seed=1)
    else:
        d = CudaDevice(events="torch" if request.param == "cuda-torch" else "raw")
    yield d
    d.close()


def slow(dev, stream, seconds):
    """Enqueue work that keeps `stream` busy for about `seconds`."""
    if isinstance(dev, SimDevice):
        dev.launch(lambda: time.sleep(seconds), stream)
    else:
        dev.launch(lambda: torch.cuda._sleep(int(seconds * 2e9)), stream)  # ~2 GHz clock


def host(dev, nbytes, fill=None):
    t = dev.alloc_pinned(nbytes)
    if fill is not None:
        t.copy_(fill)
    return t


def test_work_runs_in_submission_order(dev):
    s = dev.new_stream("s")
    x = dev.empty(8).view(torch.int64)
    slow(dev, s, 0.1)
    dev.launch(lambda: x.fill_(1), s)
    dev.launch(lambda: x.mul_(10), s)
    dev.launch(lambda: x.add_(3), s)
    s.synchronize()
    assert x.item() == 13


def test_copies_to_one_buffer_land_in_order(dev):
    s = dev.new_stream("s")
    n = 4099
    dst = dev.empty(n)
    for v in range(1, 6):
        dev.copy(dst, host(dev, n, torch.full((n,), v, dtype=torch.uint8)), s)
    s.synchronize()
    assert torch.all(dst.cpu() == 5)


def test_event_completes_only_after_preceding_work(dev):
    s = dev.new_stream("s")
    x = dev.empty(8).view(torch.int64)
    dev.launch(lambda: x.fill_(0), s)
    slow(dev, s, 0.3)
    dev.launch(lambda: x.fill_(42), s)
    ev = s.record()
    assert not ev.query()  # submitted is not completed
    assert ev.synchronize(timeout=0.01) is False
    assert ev.synchronize() is True
    assert ev.query()
    assert x.item() == 42


def test_unrecorded_event_counts_as_complete(dev):
    ev = dev.new_event()
    assert ev.query() and ev.synchronize(timeout=0.0)
    s = dev.new_stream("s")
    s.wait_event(ev)  # nothing to wait for
    assert s.record().synchronize(timeout=5.0)


def test_an_event_recorded_again_is_pending_again(dev):
    """Seen complete, then recorded behind slow work: queries and waits see the new record (raw
    events keep "seen complete" to skip runtime calls: it must end at the next record)."""
    s, b = dev.new_stream("s"), dev.new_stream("b")
    y = dev.empty(8).view(torch.int64)
    ev = dev.new_event("e")
    ev.record(s)
    assert ev.synchronize() and ev.query()
    assert ev.known_complete or type(ev).__name__ != "CudaEvent"  # raw events remember it
    slow(dev, s, 0.3)
    ev.record(s)
    assert not ev.known_complete and not ev.query()
    b.wait_event(ev)  # must be enqueued: the event is pending again
    dev.launch(lambda: y.fill_(5), b)
    eb = b.record()
    time.sleep(0.05)
    assert not eb.query()
    eb.synchronize()
    assert ev.query() and y.item() == 5


def test_wait_event_blocks_the_other_stream_not_the_host(dev):
    a, b = dev.new_stream("a"), dev.new_stream("b")
    y = dev.empty(8).view(torch.int64)
    dev.launch(lambda: y.fill_(0), b)
    b.synchronize()
    slow(dev, a, 0.3)
    ea = a.record()
    t0 = time.monotonic()
    b.wait_event(ea)
    assert time.monotonic() - t0 < 0.1  # the host did not block
    dev.launch(lambda: y.fill_(7), b)
    eb = b.record()
    time.sleep(0.05)
    assert not eb.query() and not ea.query()
    eb.synchronize()
    assert ea.query() and y.item() == 7
    assert eb.time_s() >= ea.time_s()


def test_copy_reads_its_source_when_the_stream_gets_there(dev):
    s = dev.new_stream("s")
    n = 1000
    src = host(dev, n, torch.full((n,), 1, dtype=torch.uint8))
    dst = dev.empty(n)
    slow(dev, s, 0.2)
    dev.copy(dst, src, s)
    src.fill_(9)  # the host changes the buffer after submit: the copy sees the new bytes
    s.synchronize()
    assert torch.all(dst.cpu() == 9)


@pytest.mark.parametrize("nbytes", [1, 7, 256, 4099, (1 << 20) + 3])
def test_round_trip_copies_are_exact(dev, nbytes):
    s = dev.new_stream("copy")
    g = torch.Generator().manual_seed(nbytes)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    src = host(dev, nbytes, data)
    back = host(dev, nbytes, torch.zeros(nbytes, dtype=torch.uint8))
    mid = dev.empty(nbytes)
    dev.copy(mid, src, s)
    dev.copy(back, mid, s)
    s.synchronize()
    assert torch.equal(back, data)


def test_copy_between_dtypes_moves_bytes(dev):
    s = dev.new_stream("s")
    src = host(dev, 16)
    src.view(torch.float32).copy_(torch.tensor([1.5, -2.0, 3.25, 0.0]))
    dst = dev.empty(16).view(torch.float32).view(2, 2)
    dev.copy(dst, src, s)
    s.synchronize()
    assert dst.cpu().flatten().tolist() == [1.5, -2.0, 3.25, 0.0]


def test_copy_rejects_bad_arguments(dev):
    s = dev.new_stream("s")
    with pytest.raises(ValueError, match="src"):
        dev.copy(dev.empty(8), host(dev, 4), s)
    with pytest.raises(ValueError, match="dst"):
        dev.copy(dev.empty(64).view(8, 8)[:, 0], host(dev, 8), s)
    with pytest.raises(ValueError, match="stream"):
        dev.copy(dev.empty(8), host(dev, 8), object())
    with pytest.raises(ValueError, match="fn"):
        dev.launch(42, s)


def test_alloc_pinned_is_exact_uint8(dev):
    t = dev.alloc_pinned(12345)
    assert t.shape == (12345,) and t.dtype == torch.uint8 and t.device.type == "cpu"
    if isinstance(dev, CudaDevice):
        assert t.is_pinned()
    dev.free_pinned(t)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="nbytes"):
            dev.alloc_pinned(bad)


def test_event_times_follow_the_stream(dev):
    s = dev.new_stream("s")
    e1 = s.record()
    slow(dev, s, 0.05)
    e2 = s.record()
    with pytest.raises(RuntimeError, match="not completed"):
        e2.time_s()
    e2.synchronize()
    assert e1.elapsed_ms(e2) > 0
    if isinstance(dev, SimDevice):
        assert e1.elapsed_ms(e2) >= 40


def test_device_synchronize_drains_every_stream(dev):
    streams = [dev.new_stream(f"s{i}") for i in range(3)]
    x = dev.empty(8 * 3).view(torch.int64)
    for i, s in enumerate(streams):
        slow(dev, s, 0.05)
        dev.launch(lambda i=i: x[i].fill_(i + 1), s)
    dev.synchronize()
    assert x.cpu().tolist() == [1, 2, 3]


# -- simulator only --------------------------------------------------------------------------
def test_sim_failed_work_surfaces_at_synchronize():
    with SimDevice() as d:
        s = d.new_stream("s")

        def boom():
            raise KeyError("kernel fault")

        d.launch(boom, s)
        with pytest.raises(DeviceError, match="kernel fault"):
            s.synchronize()


def test_sim_copy_delay_makes_data_late():
    with SimDevice(copy_delay=0.2) as d:
        s = d.new_stream("s")
        src = torch.full((64,), 3, dtype=torch.uint8)
        dst = torch.zeros(64, dtype=torch.uint8)
        d.copy(dst, src, s)
        time.sleep(0.05)
        assert torch.all(dst == 0)  # still in flight
        s.synchronize()
        assert torch.all(dst == 3)


def test_sim_batch_copy_lands_late_and_exact():
    """`copy_batch` (a SimDevice emulating cudaMemcpyBatchAsync): every (dst, src, size) moved,
    as one copy landing after copy_delay; refused on a SimDevice made without batch_copy."""
    with SimDevice(copy_delay=0.2, batch_copy=True) as d:
        s = d.new_stream("s")
        src = torch.arange(64, dtype=torch.uint8)
        dst = torch.zeros(64, dtype=torch.uint8)
        base_d, base_s = dst.data_ptr(), src.data_ptr()
        d.copy_batch([base_d + 40, base_d], [base_s, base_s + 8], [8, 16], s)
        time.sleep(0.05)
        assert torch.all(dst == 0)  # still in flight
        s.synchronize()
        want = torch.zeros(64, dtype=torch.uint8)
        want[40:48], want[0:16] = src[0:8], src[8:24]
        assert torch.equal(dst, want)
        with pytest.raises(ValueError, match="equally long"):
            d.copy_batch([base_d], [base_s, base_s], [1], s)
    with SimDevice() as d, pytest.raises(ValueError, match="batch_copy"):
        d.copy_batch([0], [0], [0], d.new_stream())
    with pytest.raises(ValueError, match="batch_copy"):
        SimDevice(batch_copy=1)


def test_events_reject_bad_timeouts_and_ends(dev):
    """On every device: a timeout that is not seconds >= 0, or an end that is not an event,
    raises ValueError naming it (the events' own checks, not an error from deep inside)."""
    s = dev.new_stream("t")
    a, b = s.record("a"), s.record("b")
    for bad in (-1, "1", float("nan"), True):
        with pytest.raises(ValueError, match="timeout"):
            a.synchronize(timeout=bad)
    assert a.synchronize(timeout=5.0) and b.synchronize()
    with pytest.raises(ValueError, match="end must be an Event"):
        a.elapsed_ms("b")
    assert a.elapsed_ms(b) >= 0


def test_sim_rejects_bad_delays_and_foreign_events():
    for bad in (-1, (0.2, 0.1), (1,), "x"):
        with pytest.raises(ValueError, match="copy_delay"):
            SimDevice(copy_delay=bad)
    with SimDevice() as a, SimDevice() as b, pytest.raises(ValueError, match="event"):
        a.new_stream().wait_event(b.new_stream().record())


def test_sim_close_releases_a_blocked_stream():
    d = SimDevice()
    a, b = d.new_stream("a"), d.new_stream("b")
    d.launch(lambda: time.sleep(0.5), a)
    gate = a.record("gate")
    b.wait_event(gate)
    time.sleep(0.05)
    t0 = time.monotonic()
    d.close()  # must not hang: the worker blocked in wait_event is released
    assert time.monotonic() - t0 < 2.0
    assert not b.worker_alive


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised without a GPU")
def test_cuda_device_without_gpu_fails_clearly():
    with pytest.raises(RuntimeError, match="SimDevice"):
        CudaDevice()


def test_compute_stream_events_order_other_streams(dev):
    """The compute stream (torch's default stream on CUDA: handle 0) records and waits too."""
    comp, s = dev.current_stream(), dev.new_stream("s")
    x = dev.empty(8).view(torch.int64)
    slow(dev, comp, 0.1)
    dev.launch(lambda: x.fill_(7), comp)
    s.wait_event(comp.record("written"))  # the read below must see the compute's write
    out = host(dev, 8).view(torch.int64)
    dev.copy(out, x, s)
    e = s.record()
    comp.wait_event(e)  # and compute's next write must not overtake that read
    dev.launch(lambda: x.fill_(9), comp)
    dev.synchronize()
    assert out.item() == 7 and x.cpu().item() == 9


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_raw_events_reuse_handles_and_leave_torch_no_error():
    from kvtier.device.cudart import runtime

    d = CudaDevice()
    try:
        assert d.events == "raw"
        s = d.new_stream("s")
        slow(d, s, 0.05)
        ev = s.record("late")
        assert not ev.query()  # cudaErrorNotReady ...
        assert runtime()[0].cudaGetLastError() == 0  # ... was cleared: torch will not see it
        y = torch.ones(4, device="cuda") + 1  # a launch torch checks
        torch.cuda.synchronize()
        assert ev.query() and y.sum().item() == 8
        for _ in range(100):  # a job's events die after it: their handles come back
            s.record().synchronize()
        assert d.events_created <= 4
    finally:
        d.close()
