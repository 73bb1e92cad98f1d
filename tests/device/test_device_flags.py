"""Flags: words that streams write and wait on (CUDA's stream memory operations), on every device.

The waits are shown without timing: work queued behind a wait on a word nobody wrote yet cannot
have run, whatever the machine's speed; it runs once another stream writes the word.
"""

import time

import pytest
import torch

from kvtier.device import CudaDevice, FlagOp, SimDevice

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
WAIT_S = 10.0  # generous: a wait that should pass passes at once


@pytest.fixture(params=["sim", pytest.param("cuda", marks=gpu)])
def dev(request):
    d = SimDevice(copy_delay=0.0, seed=1) if request.param == "sim" else CudaDevice()
    yield d
    d.close()


def slow(dev, stream, seconds):
    if isinstance(dev, SimDevice):
        dev.launch(lambda: time.sleep(seconds), stream)
    else:
        dev.launch(lambda: torch.cuda._sleep(int(seconds * 2e9)), stream)


def test_new_flags_hold_their_value(dev):
    f = dev.new_flags(5, 7, label="f")
    assert f.n == 5 and f.label == "f" and f.read() == [7] * 5
    assert dev.new_flags(2, 0xFFFFFFFF).read() == [0xFFFFFFFF] * 2


def test_a_wait_holds_the_stream_until_another_stream_writes(dev):
    f = dev.new_flags(2, 0)
    waiter, writer = dev.new_stream("waiter"), dev.new_stream("writer")
    dev.flag_wait(f, 1, 3, waiter)
    after = waiter.record("after")
    time.sleep(0.05)
    assert not after.query()  # nothing wrote word 1 yet: the work behind the wait cannot have run
    dev.flag_write(f, 1, 2, writer)  # not the value waited for
    writer.synchronize()
    assert not after.query()
    dev.flag_write(f, 1, 3, writer)
    assert after.synchronize(WAIT_S)
    assert f.read() == [0, 3]


def test_a_write_follows_the_earlier_work_of_its_stream(dev):
    f = dev.new_flags(1, 0)
    writer, waiter = dev.new_stream("writer"), dev.new_stream("waiter")
    slow(dev, writer, 0.2)
    before = writer.record("before")  # completes when the slow work is done
    dev.flag_write(f, 0, 1, writer)
    dev.flag_wait(f, 0, 1, waiter)
    after = waiter.record("after")
    assert after.synchronize(WAIT_S)
    assert before.query()  # the waiter passed only once the write ran, after the slow work


@pytest.mark.parametrize("on", ["side", "compute"])
def test_a_writer_writes_as_flag_write_does(dev, on):
    f = dev.new_flags(3, 0)
    s = dev.new_stream("s") if on == "side" else dev.current_stream()  # CUDA: a stream, the default one
    write = dev.flag_writer(f, s)
    slow(dev, s, 0.1)
    write(1, 5)
    write(2, 6)
    s.synchronize()
    assert f.read() == [0, 5, 6]


def test_geq_is_cyclic(dev):
    f = dev.new_flags(1, 0xFFFFFFFE)
    waiter, writer = dev.new_stream("waiter"), dev.new_stream("writer")
    dev.flag_wait(f, 0, 2, waiter, geq=True)  # 2 is "ahead" of 0xFFFFFFFE by 4: not yet
    after = waiter.record()
    dev.flag_write(f, 0, 0xFFFFFFFF, writer)
    dev.flag_write(f, 0, 1, writer)  # wrapped, still behind 2
    writer.synchronize()
    assert not after.query()
    dev.flag_write(f, 0, 3, writer)  # past 2
    assert after.synchronize(WAIT_S)


def test_a_batch_runs_in_order_and_its_wait_holds_the_ops_after_it(dev):
    f = dev.new_flags(3, 0)
    a, b, c = dev.new_stream("a"), dev.new_stream("b"), dev.new_stream("c")
    dev.flag_ops(f, [FlagOp(False, 0, 1), FlagOp(True, 1, 7), FlagOp(True, 2, 9)], a)
    dev.flag_wait(f, 1, 7, c)  # only the batch writes word 1, after its wait on word 0
    after = c.record()
    time.sleep(0.05)
    assert not after.query()
    dev.flag_write(f, 0, 1, b)
    assert after.synchronize(WAIT_S)
    assert f.read() == [1, 7, 9]


def test_a_prepared_batch_keeps_the_values_it_was_enqueued_with(dev):
    f = dev.new_flags(2, 0)
    s = dev.new_stream("s")
    batch = dev.flag_batch(f, [FlagOp(True, 0, 5), FlagOp(True, 1, 6)])
    assert len(batch) == 2 and batch.ops == (FlagOp(True, 0, 5), FlagOp(True, 1, 6))
    slow(dev, s, 0.1)
    dev.flag_run(batch, s)
    batch.set_values(range(0, 2), 8)  # after the enqueue: the queued run keeps 5 and 6
    s.synchronize()
    assert f.read() == [5, 6]
    dev.flag_run(batch, s)
    assert f.read() == [8, 8] and batch.ops == (FlagOp(True, 0, 8), FlagOp(True, 1, 8))


def test_bad_arguments_name_themselves(dev):
    f = dev.new_flags(2)
    s = dev.current_stream()
    with pytest.raises(ValueError, match="index"):
        dev.flag_write(f, 2, 1, s)
    with pytest.raises(ValueError, match="value"):
        dev.flag_wait(f, 0, 1 << 32, s)
    with pytest.raises(ValueError, match="value"):
        dev.flag_write(f, 0, -1, s)
    with pytest.raises(ValueError, match=r"ops\[1\]"):
        dev.flag_ops(f, [FlagOp(True, 0, 1), FlagOp(True, 5, 1)], s)
    with pytest.raises(ValueError, match="ops"):
        dev.flag_ops(f, [], s)
    with pytest.raises(ValueError, match="positions"):
        dev.flag_batch(f, [FlagOp(True, 0, 1)]).set_values(range(0, 2), 1)
    with pytest.raises(ValueError, match="n"):
        dev.new_flags(0)
    other = SimDevice()
    try:
        with pytest.raises(ValueError, match="flags"):
            dev.flag_write(other.new_flags(1), 0, 1, s)
        with pytest.raises(ValueError, match="stream"):
            dev.flag_write(f, 0, 1, other.current_stream())
    finally:
        other.close()


def test_close_releases_a_stream_blocked_on_a_flag():
    d = SimDevice()
    f = d.new_flags(1, 0)
    s = d.new_stream("s")
    d.flag_wait(f, 0, 1, s)  # never written
    d.close()  # returns: the blocked worker is released
    assert not s.worker_alive


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_a_cuda_graph_holds_the_wait_and_replays_it_every_time():
    d = CudaDevice()
    try:
        f = d.new_flags(1, 1)
        x = torch.zeros(1, device="cuda")
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x.add_(1)  # warm-up on a side stream, as torch asks
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            d.flag_wait(f, 0, 1, d.wrap_stream(torch.cuda.current_stream()))  # a batch-memop node
            x.add_(1)
        torch.cuda.synchronize()
        x.zero_()
        g.replay()  # the word holds 1: the replay runs through
        torch.cuda.synchronize()
        assert x.item() == 1
        writer = d.new_stream("writer")
        d.flag_write(f, 0, 0, writer)  # re-armed
        writer.synchronize()
        g.replay()  # the same graph: now held at its wait
        done = d.current_stream().record()
        time.sleep(0.05)
        assert not done.query()  # (no .item() here: it would wait on the held stream)
        d.flag_write(f, 0, 1, writer)
        assert done.synchronize(WAIT_S)
        assert x.item() == 2
    finally:
        d.close()
