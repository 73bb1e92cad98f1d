"""A stale handle never moves wrong KV, sanitizer or not (issue #32, class 1).

A save's slot is released and its bytes go to the next save; a load, a load_slots or a release
through the old handle must then be refused by name (`StaleSlotError`) before anything is
submitted: the caller's blocks keep their KV and the new owner keeps its slot. SimDevice makes
the copies land late, so a load that went ahead would be seen in the blocks."""

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.lifecycle import StaleSlotError
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, random_cache

L, NB, BS, H, D = 2, 16, 4, 2, 8
N = 2  # blocks per save


@pytest.fixture(params=[False, True], ids=["sanitizer-off", "sanitizer-on"])
def reused(request):
    """(engine, kv, old slot, new save job): the old slot's bytes now hold the new save's KV."""
    dev = SimDevice(copy_delay=0.01)
    kv = random_cache("vllm_flash", L, NB, BS, H, D, torch.bfloat16, seed=3)
    pool = PinnedPool(dev, kv.chunk_nbytes(N))  # room for one slot: the next save reuses its bytes
    config = EngineConfig(sanitize=request.param, staging_bytes=4 * kv.block_nbytes)
    eng = TransferEngine(dev, kv, pool, config)
    first = eng.save([0, 1], after=None)
    assert first.wait()
    eng.release(first.slot)
    second = eng.save([2, 3], after=None, timeout=5.0)
    assert second.wait()
    assert (second.slot.chunk, second.slot.offset) == (first.slot.chunk, first.slot.offset)
    yield eng, kv, first.slot, second
    eng.close()
    dev.close()


def test_a_load_from_a_stale_slot_is_refused(reused):
    eng, kv, old, new = reused
    dst = [8, 9]
    before = gather_ref(kv, dst)
    with pytest.raises(
        StaleSlotError, match=rf"slot#{old.id}.*generation {old.id}.*live generation {new.slot.id}"
    ):
        eng.load(old, dst)
    eng.device.synchronize()  # anything submitted would have landed by now
    assert bits_equal(gather_ref(kv, dst), before)  # the other request's KV was not written


def test_load_slots_refuses_a_stale_slot(reused):
    eng, kv, old, _ = reused
    dst = [10, 11]
    before = gather_ref(kv, dst)
    with pytest.raises(StaleSlotError, match=rf"slot#{old.id}"):
        eng.load_slots([old], dst)
    eng.device.synchronize()
    assert bits_equal(gather_ref(kv, dst), before)


def test_a_release_of_a_stale_slot_is_refused_and_the_owner_keeps_its_slot(reused):
    eng, kv, old, new = reused
    with pytest.raises(StaleSlotError, match=rf"slot#{old.id}"):
        eng.release(old)
    eng.poll()
    assert eng.pool.stats().slots == 1  # the new owner's slot is still allocated
    load = eng.load(new.slot, [12, 13])  # and still loads its own KV
    assert load.wait()
    assert bits_equal(gather_ref(kv, [12, 13]), gather_ref(kv, [2, 3]))
