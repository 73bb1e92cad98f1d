"""TransferEngine.load_slots on SimDevice (copies land late, sanitizer on): several slots into a
request's blocks layer-major, bit for bit; layer l of every slot has landed when layer l's event
completes while later layers are still in flight; slots stay READING until e_load completed;
bad arguments and slots without data are refused before anything is submitted."""

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.lifecycle import LifecycleError, SlotState
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, poison_blocks_, random_cache

L, NB, BS, H, D = 4, 24, 4, 2, 8


def rig(fmt="vllm_flash", **delays):
    dev = SimDevice(**delays)
    kv = random_cache(fmt, L, NB, BS, H, D, torch.bfloat16, seed=2)
    pool = PinnedPool(dev, 8 * kv.chunk_nbytes(3))
    eng = TransferEngine(dev, kv, pool, EngineConfig(sanitize=True, compute_beside=False))
    return dev, kv, pool, eng


def saved(eng, groups, ntok=None):
    """One READY slot per group of blocks (the last group may be partial: ntok)."""
    jobs = [
        eng.save(g, after=None, num_tokens=ntok if i == len(groups) - 1 else None)
        for i, g in enumerate(groups)
    ]
    assert all(j.wait() for j in jobs)
    return [j.slot for j in jobs]


@pytest.mark.parametrize("fmt", ["vllm_flash", "flashinfer_hnd", "mla", "cross_layer"])
def test_load_slots_round_trip_partial_last_block(fmt):
    dev, kv, pool, eng = rig(fmt, launch_delay=0.002)
    groups, dst = [[7, 1, 4], [2], [9, 3]], [0, 11, 5, 13, 20, 21]
    ntok = 4 * BS + (BS + 3)  # the last slot: 2 blocks, the second holding 3 tokens
    src = [b for g in groups for b in g]
    try:
        want = gather_ref(kv, src, ntok)
        slots = saved(eng, groups, ntok=BS + 3)
        others = [b for b in range(NB) if b not in dst]
        before = gather_ref(kv, others)
        poison_blocks_(kv, dst)  # a block the load missed keeps poison bits
        jobs = eng.load_slots(slots, dst, num_tokens=ntok)
        assert len(jobs) == 3 and all(j.path == "kernel" for j in jobs)
        assert all(j.layer_events is jobs[0].layer_events and j.event is jobs[0].event for j in jobs)
        assert all(j.wait() for j in jobs)
        assert bits_equal(gather_ref(kv, dst, ntok), want)
        assert bits_equal(gather_ref(kv, others), before)
        for s in slots:
            assert eng.slots.state(s) is SlotState.READY  # the read ended with e_load
            eng.release(s)
        eng.close()
        assert pool.stats().used == 0
    finally:
        dev.close()


def test_layer_events_are_layer_major_across_slots():
    dev, kv, pool, eng = rig(launch_delay=0.0)
    groups, dst = [[1, 2, 3], [4, 5, 6], [7, 8, 9]], list(range(12, 21))
    try:
        slots = saved(eng, groups)
        want = gather_ref(kv, [b for g in groups for b in g])
        dev.launch_delay = 0.15  # each layer's launch lands 0.15 s after the previous one
        jobs = eng.load_slots(slots, dst)
        first = jobs[0].layer_events[0]
        assert first.synchronize(5)
        # Layer 0 of every slot has landed; the last layer has not.
        assert bits_equal(gather_ref(kv, dst)[:, 0], want[:, 0])
        assert not jobs[-1].event.query()
        assert eng.slots.state(slots[0]) is SlotState.READING  # in flight: not released, not READY
        assert all(j.wait(5) for j in jobs)
        assert bits_equal(gather_ref(kv, dst), want)
        eng.close()
    finally:
        dev.launch_delay = 0.0
        dev.close()


def test_load_slots_refuses_bad_arguments_and_unfilled_slots():
    dev, kv, pool, eng = rig(copy_delay=0.3)
    try:
        ready = saved(eng, [[1, 2, 3]])
        with pytest.raises(ValueError, match="slots"):
            eng.load_slots([], [])
        with pytest.raises(ValueError, match="twice"):
            eng.load_slots([ready[0], ready[0]], list(range(10, 16)))
        with pytest.raises(ValueError, match="block_ids: 2 ids"):
            eng.load_slots(ready, [10, 11])
        with pytest.raises(ValueError, match="duplicate"):
            eng.load_slots(ready, [10, 10, 11])
        filling = eng.save([4, 5, 6], after=None, path="staged")  # lands 0.3 s later
        with pytest.raises(LifecycleError, match="no complete data"):
            eng.load_slots([ready[0], filling.slot], list(range(10, 16)))
        assert eng.slots.state(ready[0]) is SlotState.READY  # nothing was submitted
        assert filling.wait(5)
        eng.close()
    finally:
        dev.close()


def test_a_failed_load_slots_lets_what_it_enqueued_land_before_it_raises():
    """As a single load: when the mover's error reaches the caller, nothing it enqueued is in
    flight any more (the slots may be released right away)."""
    import time

    dev, kv, pool, eng = rig()
    try:
        slots = saved(eng, [[1, 2], [3]])
        landed = []

        def broken(ids, counts, slots, stream, label, mark=None):
            dev.launch(lambda: (time.sleep(0.05), landed.append(True)), stream)  # a late layer
            raise RuntimeError("boom")

        eng.mover.load_slots = broken
        with pytest.raises(RuntimeError, match="boom"):
            eng.load_slots(slots, [5, 6, 7])
        assert landed == [True]
        for s in slots:
            assert eng.slots.state(s) is SlotState.READY  # no read was begun
            eng.release(s)
        assert pool.stats().used == 0
    finally:
        eng.close()
        dev.close()
