"""TransferEngine.save_slots / load_slots over several slots in one submission, on every path, on
SimDevice (copies land late, sanitizer on). The batch path runs on a `SimDevice(batch_copy=True)`:
the very copies `fastpath/batch.py` computes for cudaMemcpyBatchAsync, one batched copy per call,
run by memmove. Round trips are bit for bit on poisoned outputs over vLLM 0.33's six orders (MLA
too); a stale slot is refused; a failure in the middle of a submission gives every slot back."""

import pytest
import torch
from test_batch_merge import ORDERS, SHAPES, make

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.lifecycle import SlotState, StaleSlotError
from kvtier.pool import PinnedPool, PoolExhausted
from kvtier.reference import bits_equal, gather_ref, poison_blocks_, random_cache

PATHS = ["batch", "staged", "kernel"]


class Counted:
    """Counts the batched copies a SimDevice is handed (each one cudaMemcpyBatchAsync on CUDA)."""

    def __init__(self, dev):
        self.calls, real = 0, dev.copy_batch

        def copy_batch(*args):
            self.calls += 1
            return real(*args)

        dev.copy_batch = copy_batch


def rig(kv, slots=8, nbytes=None, **delays):
    dev = SimDevice(batch_copy=True, **delays)
    pool = PinnedPool(dev, slots * (nbytes or kv.chunk_nbytes(3)))
    eng = TransferEngine(dev, kv, pool, EngineConfig(sanitize=True, staging_bytes=4 * kv.block_nbytes))
    return dev, pool, eng


def finish(eng, pool, slots=()):
    """Give the slots back and close the engine: every pool byte is free then."""
    for s in slots:
        eng.release(s)
    eng.close()
    assert pool.stats().used == 0


def round_trip(kv, eng, path, src_groups, dst, ntok):
    """save_slots of `src_groups` (the last may be partial: ntok tokens in all) into poisoned
    slots, each slot checked against the reference; load_slots of them into poisoned `dst`,
    checked, and every other block untouched. Returns the slots (READY)."""
    src = [b for g in src_groups for b in g]
    counts = [len(g) for g in src_groups]
    want = gather_ref(kv, src, ntok)  # zeros past num_tokens
    saves = eng.save_slots(src, counts, after=None, num_tokens=ntok, path=path)
    assert len(saves) == len(counts) and all(j.event is saves[0].event and j.path == path for j in saves)
    assert all(j.wait(5) for j in saves)
    at = 0
    for j, c in zip(saves, counts, strict=True):
        assert eng.slots.state(j.slot) is SlotState.READY and list(j.ids) == src[at : at + c]
        assert bits_equal(j.slot.view(kv.dtype, kv.chunk_shape(c)).to(want.device), want[at : at + c])
        at += c
    poison_blocks_(kv, dst)  # a block the load missed keeps poison bits
    keep = [b for b in range(kv.num_blocks) if b not in dst]
    before, last_before = gather_ref(kv, keep), gather_ref(kv, dst[-1:])
    if kv.device.type == "cuda":
        torch.cuda.synchronize()  # the poison and the snapshots (compute stream) land before the load writes
    slots = [j.slot for j in saves]
    loads = eng.load_slots(slots, dst, num_tokens=ntok, path=path)
    assert len(loads) == len(slots) and all(j.event is loads[0].event and j.path == path for j in loads)
    if path != "kernel":  # one event for the whole job: every layer's is e_load
        assert all(e is loads[0].event for e in loads[0].layer_events)
    assert all(j.wait(5) for j in loads)
    assert bits_equal(gather_ref(kv, dst, ntok), want)
    assert bits_equal(gather_ref(kv, keep), before)  # no other block written
    if ntok is not None:  # tokens past num_tokens in the last block stay as they were (poison)
        valid, tail = ntok - (len(dst) - 1) * kv.block_size, 3 + kv.token_dim
        n, last = kv.block_size - valid, gather_ref(kv, dst[-1:])
        assert bits_equal(last.narrow(tail, valid, n), last_before.narrow(tail, valid, n))
    return slots


@pytest.mark.parametrize("mla", [False, True], ids=["kv", "mla"])
@pytest.mark.parametrize("shape", ["l3_h2_bs4", "l5_h3_bs3"])
@pytest.mark.parametrize("order", ORDERS)
def test_batch_round_trip_in_every_vllm_order(order, shape, mla):
    kv = make(order, SHAPES[shape], torch.bfloat16, mla=mla, seed=3)
    dev, pool, eng = rig(kv, copy_delay=(0.0, 0.003), seed=4)
    counted = Counted(dev)
    N = kv.block_size
    try:
        # consecutive ids (B-first blocks join, across slots too where the slots are adjacent)
        slots = round_trip(kv, eng, "batch", [[2, 3], [4], [5, 6, 7]], [10, 11, 12, 13, 14, 15], None)
        assert counted.calls == 2  # one batched copy for the save of three slots, one for the load
        for s in slots:
            eng.release(s)
        # spread ids, the last block partial
        slots = round_trip(kv, eng, "batch", [[9], [1, 16]], [0, 18, 5], 2 * N + 1)
        assert counted.calls == 4
        finish(eng, pool, slots)
    finally:
        dev.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", ["vllm_flash", "flashinfer_hnd", "mla", "cross_layer"])
def test_every_path_round_trips_several_slots(fmt, path):
    kv = random_cache(fmt, 3, 24, 4, 2, 8, torch.bfloat16, seed=2)
    dev, pool, eng = rig(kv, copy_delay=0.002, launch_delay=(0.0, 0.002))
    try:
        slots = round_trip(kv, eng, path, [[7, 1, 4], [2], [9, 3]], [0, 11, 5, 13, 20, 21], 5 * 4 + 3)
        finish(eng, pool, slots)
    finally:
        dev.close()


def test_a_chunk_saved_on_one_path_loads_on_any():
    kv = random_cache("vllm_flash", 3, 24, 4, 2, 8, torch.bfloat16, seed=6)
    dev, pool, eng = rig(kv, copy_delay=0.002)
    try:
        groups = [[1, 2], [3, 4], [5, 6]]
        want = gather_ref(kv, [b for g in groups for b in g])
        for save_path in PATHS:
            saves = eng.save_slots([b for g in groups for b in g], [2, 2, 2], after=None, path=save_path)
            assert all(j.wait(5) for j in saves)
            for load_path in PATHS:
                dst = [10, 12, 14, 16, 18, 20]
                poison_blocks_(kv, dst)
                loads = eng.load_slots([j.slot for j in saves], dst, path=load_path)
                assert all(j.wait(5) for j in loads)
                assert bits_equal(gather_ref(kv, dst), want), (save_path, load_path)
            for j in saves:
                eng.release(j.slot)
        eng.close()
        assert pool.stats().used == 0
    finally:
        dev.close()


def test_load_slots_refuses_a_stale_slot_on_the_batch_path():
    kv = random_cache("vllm_flash", 2, 16, 4, 2, 8, torch.bfloat16, seed=3)
    dev, pool, eng = rig(kv, slots=1, nbytes=kv.chunk_nbytes(2), copy_delay=0.01)
    try:
        old = eng.save_slots([0, 1], [2], after=None, path="batch")[0]
        assert old.wait(5)
        eng.release(old.slot)
        new = eng.save_slots([2, 3], [2], after=None, path="batch", timeout=5.0)[0]  # the old slot's bytes
        assert new.wait(5)
        before = gather_ref(kv, [8, 9])
        with pytest.raises(StaleSlotError, match=rf"slot#{old.slot.id}"):
            eng.load_slots([old.slot], [8, 9], path="batch")
        dev.synchronize()  # anything submitted would have landed by now
        assert bits_equal(gather_ref(kv, [8, 9]), before)
        eng.release(new.slot)
        eng.close()
    finally:
        dev.close()


def test_refused_arguments_submit_nothing():
    kv = random_cache("vllm_flash", 2, 16, 4, 2, 8, torch.bfloat16, seed=3)
    dev, pool, eng = rig(kv)
    try:
        for counts in ([], [0, 2], [2, "1"], 3):
            with pytest.raises(ValueError, match="counts"):
                eng.save_slots([1, 2], counts, after=None)
        with pytest.raises(ValueError, match="block_ids: 3 ids"):
            eng.save_slots([1, 2, 3], [2, 2], after=None)
        assert pool.stats().slots == 0  # nothing allocated
        saves = eng.save_slots([1, 2, 3, 4], [2, 2], after=None, path="batch")
        assert all(j.wait(5) for j in saves)
        slots = [j.slot for j in saves]
        with pytest.raises(ValueError, match="duplicate"):
            eng.load_slots(slots, [5, 5, 6, 7], path="batch")
        with pytest.raises(ValueError, match="block_ids: 3 ids"):
            eng.load_slots(slots, [5, 6, 7], path="batch")
        assert all(eng.slots.state(s) is SlotState.READY for s in slots)  # no read was begun
        no_batch = SimDevice()
        try:
            pool2 = PinnedPool(no_batch, kv.chunk_nbytes(2))
            eng2 = TransferEngine(no_batch, kv, pool2, EngineConfig())
            with pytest.raises(ValueError, match="batch"):
                eng2.save_slots([1, 2], [2], after=None, path="batch")  # no copy engine emulated
            assert pool2.stats().slots == 0
            eng2.close()
        finally:
            no_batch.close()
        finish(eng, pool, slots)
    finally:
        dev.close()


def test_save_slots_saves_what_the_pool_has_room_for():
    kv = random_cache("vllm_flash", 2, 16, 4, 2, 8, torch.bfloat16, seed=3)
    dev, pool, eng = rig(kv, slots=2, nbytes=kv.chunk_nbytes(2))
    try:
        ids = [1, 2, 3, 4, 5, 6]
        want = gather_ref(kv, ids[:4])
        saves = eng.save_slots(ids, [2, 2, 2], after=None, num_tokens=5 * 4 + 1, path="batch")
        assert len(saves) == 2  # the third chunk had no room: not saved, nothing held for it
        assert all(j.wait(5) for j in saves)
        got = torch.cat([j.slot.view(kv.dtype, kv.chunk_shape(2)) for j in saves])
        assert bits_equal(got, want)  # whole blocks: the partial last one was not in the part saved
        with pytest.raises(PoolExhausted):
            eng.save_slots([7, 8], [2], after=None)  # not even one slot: nothing submitted
        finish(eng, pool, [j.slot for j in saves])
    finally:
        dev.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_failed_save_slots_gives_every_slot_back(path):
    """The mover fails after it enqueued part of the job: the error reaches the caller only once
    what it enqueued has landed, and every slot goes back to the pool (no leaked slot)."""
    import time

    kv = random_cache("vllm_flash", 2, 16, 4, 2, 8, torch.bfloat16, seed=3)
    dev, pool, eng = rig(kv)
    landed = []
    real = eng.mover.save_slots

    def broken(p, ids, counts, slots, stream):
        real(p, ids, counts, slots, stream)  # every slot's copies enqueued
        dev.launch(lambda: (time.sleep(0.05), landed.append(True)), stream)  # a late one
        raise RuntimeError("boom")

    eng.mover.save_slots = broken
    try:
        with pytest.raises(RuntimeError, match="boom"):
            eng.save_slots([1, 2, 3, 4, 5, 6], [2, 2, 2], after=None, path=path)
        assert landed == [True]
        assert pool.stats().slots == 0 and pool.stats().used == 0  # every slot back
        assert eng.blocks.pending() == 0  # no save registered on the blocks
        del eng.mover.save_slots
        saves = eng.save_slots([1, 2, 3, 4, 5, 6], [2, 2, 2], after=None, path=path)  # works again
        assert all(j.wait(5) for j in saves)
        finish(eng, pool, [j.slot for j in saves])
    finally:
        dev.close()


@pytest.mark.parametrize("path", ["batch", "staged"])
def test_a_failed_load_slots_begins_no_read(path):
    import time

    kv = random_cache("vllm_flash", 2, 16, 4, 2, 8, torch.bfloat16, seed=3)
    dev, pool, eng = rig(kv)
    try:
        saves = eng.save_slots([1, 2, 3, 4], [2, 2], after=None, path=path)
        assert all(j.wait(5) for j in saves)
        slots, landed = [j.slot for j in saves], []

        def broken(p, ids, counts, slots, stream, label):
            dev.launch(lambda: (time.sleep(0.05), landed.append(True)), stream)  # a late copy
            raise RuntimeError("boom")

        eng.mover.load_slots_whole = broken
        with pytest.raises(RuntimeError, match="boom"):
            eng.load_slots(slots, [8, 9, 10, 11], path=path)
        assert landed == [True]  # what it enqueued landed before the error reached the caller
        for s in slots:
            assert eng.slots.state(s) is SlotState.READY  # no read was begun
            eng.release(s)
        assert pool.stats().used == 0
        eng.close()
    finally:
        dev.close()


def test_batch_loads_follow_pending_accesses_of_their_blocks():
    """A load_slots into blocks a save still reads waits for that save (vLLM #47282's order): the
    save copies the old KV out before the load overwrites it, though the save lands late."""
    kv = random_cache("vllm_flash", 2, 16, 4, 2, 8, torch.bfloat16, seed=3)
    dev, pool, eng = rig(kv)
    try:
        first = eng.save_slots([1, 2, 3, 4], [2, 2], after=None, path="batch")
        assert all(j.wait(5) for j in first)
        old = gather_ref(kv, [8, 9])
        dev.copy_delay = 0.1  # the next save lands late
        save = eng.save_slots([8, 9], [2], after=None, path="batch")[0]
        dev.copy_delay = 0.0
        loads = eng.load_slots([j.slot for j in first], [8, 9, 10, 11], path="batch")
        assert all(j.wait(5) for j in loads) and save.wait(5)
        assert bits_equal(save.slot.view(kv.dtype, kv.chunk_shape(2)), old)  # read before overwritten
        for j in [*first, save]:
            eng.release(j.slot)
        eng.close()
    finally:
        dev.close()
