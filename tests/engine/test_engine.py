"""TransferEngine on SimDevice: copies land late for real, so every wait the engine makes is
tested by data, with the sanitizer on (LifecycleError on any illegal move)."""

import time

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, Path, TransferEngine, choose_path
from kvtier.lifecycle import Access, LifecycleError, SlotState
from kvtier.pool import PinnedPool, PoolExhausted
from kvtier.reference import bits_equal, gather_ref, poison_blocks_, random_cache

L, NB, BS, H, D = 3, 12, 4, 2, 8


def rig(fmt="vllm_flash", dtype=torch.bfloat16, slots=4, n=3, path="auto", **delays):
    dev = SimDevice(**delays)
    kv = random_cache(fmt, L, NB, BS, H, D, dtype, seed=1)
    pool = PinnedPool(dev, slots * kv.chunk_nbytes(n))
    eng = TransferEngine(
        dev, kv, pool, EngineConfig(path=path, sanitize=True, staging_bytes=4 * kv.block_nbytes)
    )
    return dev, kv, pool, eng


def slow_fill(kv, blocks, value, seconds):
    """A compute "kernel" that writes `value` into every layer of `blocks` after `seconds`."""

    def run():
        time.sleep(seconds)
        for x in kv.layers:
            x[:, blocks] = value

    return run


@pytest.mark.parametrize("fmt", ["vllm_flash", "flashinfer_hnd", "mla", "cross_layer"])
@pytest.mark.parametrize("path", ["staged", "kernel"])
def test_round_trip_partial_last_block(fmt, path):
    dev, kv, pool, eng = rig(fmt, path=path, copy_delay=0.01, launch_delay=0.005)
    src, dst, ntok = [7, 1, 4], [0, 9, 3], 2 * BS + 3
    try:
        want = gather_ref(kv, src, ntok)
        others = [b for b in range(NB) if b not in dst]
        before_others, before_last = gather_ref(kv, others), gather_ref(kv, [dst[-1]])
        save = eng.save(src, after=None, num_tokens=ntok)
        assert save.path == path and save.nbytes == kv.chunk_nbytes(3) and save.submit_s > 0
        assert save.wait()
        assert eng.slots.state(save.slot) is SlotState.READY
        assert bits_equal(save.slot.view(kv.dtype, kv.chunk_shape(3)), want)
        load = eng.load(save.slot, dst, num_tokens=ntok)
        assert load.wait() and len(load.layer_events) == L
        assert bits_equal(gather_ref(kv, dst, ntok), want)
        assert bits_equal(gather_ref(kv, others), before_others)  # nothing else touched
        tail = 3 + kv.token_dim  # tokens past num_tokens in the last block are left alone
        after_last = gather_ref(kv, [dst[-1]])
        assert bits_equal(after_last.narrow(tail, 3, BS - 3), before_last.narrow(tail, 3, BS - 3))
        eng.release(save.slot)
        eng.close()
        assert pool.stats().used == 0
    finally:
        dev.close()


def test_fp8_kernel_save_staged_load_cross_path():
    dev, kv, pool, eng = rig("flashinfer_nhd", dtype=torch.float8_e4m3fn, launch_delay=0.002)
    try:
        want = gather_ref(kv, [2, 5])
        job = eng.save([2, 5], after=None, path="kernel")
        assert job.wait()
        load = eng.load(job.slot, [10, 11], path="staged")
        assert load.wait() and bits_equal(gather_ref(kv, [10, 11]), want)
    finally:
        dev.close()


def test_per_layer_events_complete_in_order_with_their_bytes():
    dev, kv, pool, eng = rig(path="kernel", launch_delay=0.06)
    try:
        save = eng.save([1, 2, 3], after=None)
        assert save.wait()
        want = save.slot.view(kv.dtype, kv.chunk_shape(3)).clone()
        poison_blocks_(kv, [6, 7, 8])  # the load must overwrite them
        load = eng.load(save.slot, [6, 7, 8], per_layer=True)
        assert load.layer_events[-1] is load.event
        assert len({id(e) for e in load.layer_events}) == L  # a real event per layer
        times = []
        for layer, ev in enumerate(load.layer_events):
            assert ev.synchronize(timeout=5)
            got = gather_ref(kv, [6, 7, 8])
            assert bits_equal(got[:, layer], want[:, layer])  # this layer has landed
            if layer + 1 < L:  # the next one (60 ms away) has not
                assert not bits_equal(got[:, layer + 1], want[:, layer + 1])
            times.append(ev.time_s())
        assert times == sorted(times)
        assert load.wait()
    finally:
        dev.close()


def test_wait_layer_orders_compute_after_that_layer():
    dev, kv, pool, eng = rig(path="kernel", launch_delay=0.03)
    compute = dev.current_stream()
    try:
        save = eng.save([0, 1], after=None)
        assert save.wait()
        want = save.slot.view(kv.dtype, kv.chunk_shape(2)).clone()
        load = eng.load(save.slot, [4, 5])
        out = {}
        load.wait_layer(1, compute)  # attention of layer 1 starts once layer 1 arrived
        dev.launch(lambda: out.setdefault("l1", gather_ref(kv, [4, 5])[:, 1].clone()), compute)
        compute.synchronize()
        assert bits_equal(out["l1"], want[:, 1])
        with pytest.raises(ValueError, match="layer"):
            load.wait_layer(L, compute)
    finally:
        dev.close()


@pytest.mark.parametrize("path", ["staged", "kernel"])
def test_save_waits_for_compute_event(path):
    dev, kv, pool, eng = rig(path=path, copy_delay=0.01)
    compute = dev.current_stream()
    try:
        # Without the wait (the bug): the save copies the KV before the slow kernel wrote it.
        dev.launch(slow_fill(kv, [2, 3], 1.0, 0.2), compute)
        compute.record("e_compute")
        stale = eng.save([2, 3], after=None)
        assert stale.wait()
        assert not bool((stale.slot.view(kv.dtype, kv.chunk_shape(2)) == 1.0).all())
        compute.synchronize()
        # With `after`: the copy stream waits for the compute event, the slot is right.
        dev.launch(slow_fill(kv, [2, 3], 2.0, 0.2), compute)
        job = eng.save([2, 3], after=compute.record("e_compute"))
        assert not job.done()
        assert job.wait()
        assert bool((job.slot.view(kv.dtype, kv.chunk_shape(2)) == 2.0).all())
        # Told through compute_write instead of `after`: the tracker makes the save wait too.
        dev.launch(slow_fill(kv, [2, 3], 3.0, 0.2), compute)
        eng.compute_write([2, 3], compute.record("e_write"), waited=[stale.event, job.event])
        job3 = eng.save([2, 3], after=None)
        assert job3.wait()
        assert bool((job3.slot.view(kv.dtype, kv.chunk_shape(2)) == 3.0).all())
    finally:
        dev.close()


@pytest.mark.parametrize("register", [True, False])
def test_load_waits_for_pending_compute_readers(register):
    dev, kv, pool, eng = rig(copy_delay=0.01)
    compute = dev.current_stream()
    try:
        for x in kv.layers:
            x[:, [5]] = 4.0  # KV another request still attends over
        save = eng.save([0], after=None)  # different data, to be loaded into block 5
        assert save.wait()
        out = {}

        def slow_read():
            time.sleep(0.2)
            out["kv"] = gather_ref(kv, [5])

        dev.launch(slow_read, compute)
        e_read = compute.record("e_read")
        if register:
            eng.compute_read([5], e_read)
        load = eng.load(save.slot, [5])
        assert load.wait()
        compute.synchronize()
        # Registered: the load waited for the reader. Not: it overwrote the block under it.
        assert bool((out["kv"] == 4.0).all()) is register
    finally:
        dev.close()


def test_wait_timeout_releases_nothing():
    dev, kv, pool, eng = rig(copy_delay=0.3)
    try:
        job = eng.save([1, 2, 3], after=None, path="staged")
        used = pool.stats().used
        assert not job.wait(timeout=0.01)
        assert eng.slots.state(job.slot) is SlotState.FILLING and pool.stats().used == used
        assert eng.poll() == 0
        eng.release(job.slot)  # the owner gives up: retired, freed only once e_save completed
        assert pool.stats().used == used and pool.stats().in_flight == used
        assert job.wait(timeout=5)
        eng.poll()
        assert pool.stats().used == 0
        # The same for a load: its slot stays READING until e_load completed.
        save = eng.save([1, 2, 3], after=None)
        assert save.wait()
        load = eng.load(save.slot, [4, 5, 6], path="staged")
        assert not load.wait(timeout=0.01)
        assert eng.slots.state(save.slot) is SlotState.READING
        eng.release(save.slot)
        assert pool.stats().used == used
        assert load.wait(timeout=5) and pool.stats().used == 0
    finally:
        dev.close()


def test_pool_back_pressure():
    dev, kv, pool, eng = rig(slots=2, copy_delay=0.2)
    try:
        a = eng.save([0, 1, 2], after=None)
        eng.save([3, 4, 5], after=None)
        with pytest.raises(PoolExhausted):
            eng.save([6, 7, 8], after=None, timeout=0.05)
        eng.release(a.slot)  # still in flight: the room comes back when its copy has landed
        t0 = time.monotonic()
        c = eng.save([6, 7, 8], after=None, timeout=5)
        assert a.event.query() and time.monotonic() - t0 > 0.05
        assert c.wait()
    finally:
        dev.close()


def test_poll_settles_completed_jobs():
    dev, kv, pool, eng = rig(copy_delay=0.02)
    try:
        jobs = [eng.save([i], after=None) for i in range(3)]
        assert eng.poll() in range(0, 4)
        for j in jobs:
            j.event.synchronize()
        eng.poll()
        assert all(eng.slots.state(j.slot) is SlotState.READY for j in jobs)
        assert eng.poll() == 0 and all(j.done() for j in jobs)
    finally:
        dev.close()


def test_sanitizer_catches_illegal_moves():
    dev, kv, pool, eng = rig(copy_delay=0.2)
    compute = dev.current_stream()
    try:
        job = eng.save([0, 1, 2], after=None)
        with pytest.raises(LifecycleError, match="FILLING"):
            eng.load(job.slot, [3, 4, 5])  # the save has not landed
        with pytest.raises(LifecycleError, match="release|FILLING"):
            eng.slots.release(job.slot)  # freeing a slot under DMA
        assert job.wait()
        load = eng.load(job.slot, [6, 7, 8])
        with pytest.raises(LifecycleError, match="LOADING"):  # reading a block before its load
            eng.compute_read([6], compute.record("e_read"))
        load.wait_on(compute)
        eng.compute_read([6], compute.record("e_read"))  # ordered now: accepted
        assert load.wait()
    finally:
        dev.close()


def test_bad_arguments():
    dev, kv, pool, eng = rig()
    try:
        with pytest.raises(ValueError, match="out of range"):
            eng.save([NB], after=None)
        with pytest.raises(ValueError, match="num_tokens"):
            eng.save([1, 2], after=None, num_tokens=2 * BS + 1)
        with pytest.raises(ValueError, match="batch"):
            eng.save([1], after=None, path="batch")
        with pytest.raises(ValueError, match="path"):
            eng.save([1], after=None, path="dma")
        job = eng.save([1, 2], after=None)
        assert job.wait()
        with pytest.raises(ValueError, match="duplicate"):
            eng.load(job.slot, [3, 3])
        with pytest.raises(ValueError, match="slot"):
            eng.load(job.slot, [3])
        assert pool.stats().slots == 1  # failed calls left nothing allocated
    finally:
        dev.close()


def test_wrong_types_raise_errors_naming_the_argument():
    """Not a TypeError or AttributeError from deep inside: a ValueError naming what was wrong,
    raised before anything is submitted or allocated."""
    dev, kv, pool, eng = rig()
    other_dev, _, _, other = rig()
    try:
        job = eng.save([1, 2], after=None)
        assert job.wait()
        bad = [
            ("timeout", lambda: eng.save([3], after=None, timeout="1")),
            ("timeout", lambda: eng.save([3], after=None, timeout=float("nan"))),
            ("num_tokens: expected an int", lambda: eng.save([3], after=None, num_tokens=3.0)),
            ("slot: expected a Slot", lambda: eng.load("slot", [3, 4])),
            ("slot: expected a Slot", lambda: eng.load(None, [3, 4])),
            ("per_layer", lambda: eng.load(job.slot, [3, 4], per_layer="yes")),
            ("per_layer", lambda: eng.load(job.slot, [3, 4], per_layer=1)),
            ("job: expected", lambda: eng.wait("job")),
            ("job: expected", lambda: other.wait(job)),  # a job of another engine
            ("timeout", lambda: eng.wait(job, timeout=-1)),
            ("timeout", lambda: job.event.synchronize(timeout=True)),
            ("slot: expected a Slot", lambda: eng.release("slot")),
            ("event: expected", lambda: eng.compute_read([1], "event")),
            ("event: expected", lambda: eng.compute_write([1], other_dev.new_event())),  # another device's
            ("timeout", lambda: pool.alloc(64, timeout=-0.5)),
        ]
        for what, call in bad:
            with pytest.raises(ValueError, match=what):
                call()
        assert pool.stats().slots == 1  # only the save's slot: no failed call allocated one
        assert eng.blocks.waits_for(Access.LOAD, [1]) == []  # the failed compute_read registered nothing
        eng.release(job.slot)
    finally:
        eng.close()
        other.close()
        dev.close()
        other_dev.close()


def test_auto_path_rule():
    small = 32 << 10
    assert choose_path("save", run_nbytes=small) is Path.STAGED
    assert choose_path("load", run_nbytes=small, per_layer=True, compute_beside=True) is Path.STAGED
    assert choose_path("load", run_nbytes=small, per_layer=True, compute_beside=False) is Path.KERNEL
    assert choose_path("load", run_nbytes=small, per_layer=False, compute_beside=False) is Path.STAGED
    assert choose_path("save", run_nbytes=small, batch_ok=True) is Path.STAGED  # never for short runs
    assert choose_path("save", run_nbytes=8 << 20, batch_ok=True) is Path.BATCH


def test_auto_path_decided_once_per_direction_and_overridable():
    dev, kv, pool, eng = rig()
    try:
        calls = []
        real = eng.mover.check_path
        eng.mover.check_path = lambda p: (calls.append(p), real(p))[1]
        assert eng.load_path(per_layer=True) is eng.load_path(per_layer=True) is Path.STAGED
        assert eng.load_path() is Path.STAGED
        assert len(calls) == 2  # (load, per_layer) and (load, not per_layer): once each
        save = eng.save([0, 1, 2], after=None, path="kernel")  # a job's path= still wins
        assert save.path == "kernel" and save.wait()
        with pytest.raises(ValueError, match="path"):
            eng.save([3, 4, 5], after=None, path="sideways")
        eng.release(save.slot)
    finally:
        eng.close()
        pool.close()
        dev.close()


def test_a_failed_save_lets_what_it_enqueued_land_before_its_slot_is_reused():
    """A mover that enqueued work into the slot and then raised: the engine waits for that work
    before the slot goes back to the pool, so the next owner's bytes (here a host write, as the
    disk tier makes) are not overwritten by the failed job's late copy."""
    dev, kv, pool, eng = rig(slots=1)
    try:

        def broken(path, ids, slot, stream, done=None):
            dev.launch(lambda: (time.sleep(0.05), slot.tensor.fill_(0xEE)), stream)  # a late copy
            raise RuntimeError("boom")

        eng.mover.save = broken
        with pytest.raises(RuntimeError, match="boom"):
            eng.save([0, 1, 2], after=None)
        assert pool.stats().slots == 0  # released: nothing of the job is in flight any more
        slot = eng.slots.alloc(kv.chunk_nbytes(3))  # the same bytes (one slot in the pool)
        slot.tensor.fill_(0x11)
        eng.slots.fill_host(slot)
        time.sleep(0.1)  # a copy still queued would have landed by now
        assert bool((slot.tensor == 0x11).all())
        eng.slots.release(slot)
    finally:
        eng.close()
        dev.close()


def test_a_failed_load_lets_what_it_enqueued_land_before_it_raises():
    """A load whose mover enqueued part of its copies and raised: when the error reaches the
    caller nothing of the job is still in flight (no late write into the blocks, no read of the
    slot the caller may now release)."""
    dev, kv, pool, eng = rig()
    try:
        job = eng.save([0, 1, 2], after=None)
        eng.wait(job)  # the load's source is complete
        landed = []

        def broken(path, ids, slot, stream, per_layer, label, done=None, mark=None):
            dev.launch(lambda: (time.sleep(0.05), landed.append(True)), stream)  # a late copy
            raise RuntimeError("boom")

        eng.mover.load = broken
        with pytest.raises(RuntimeError, match="boom"):
            eng.load(job.slot, [3, 4, 5])
        assert landed == [True]
        eng.release(job.slot)
        assert pool.stats().slots == 0
    finally:
        eng.close()
        dev.close()


def test_a_failed_save_whose_copies_cannot_be_waited_for_keeps_its_slot():
    """Where even the wait fails (a lost device), the slot stays out of the pool: a leak, never a
    reuse under a copy that may still write it."""
    dev, kv, pool, eng = rig(slots=1)
    try:

        def broken(*args, **kw):
            raise RuntimeError("boom")

        def lost():
            raise RuntimeError("device lost")

        eng.mover.save = broken
        eng.save_stream.synchronize = lost
        lost_warning = pytest.warns(UserWarning, match="could not be waited for")
        with lost_warning, pytest.raises(RuntimeError, match="boom"):
            eng.save([0, 1, 2], after=None)
        assert pool.stats().slots == 1 and pool.try_alloc(kv.chunk_nbytes(3)) is None
        del eng.save_stream.synchronize
    finally:
        eng.close()
        dev.close()
