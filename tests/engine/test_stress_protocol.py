"""Many concurrent save/load jobs on SimDevice with random delays; every byte is checked.

Each of 8 threads owns 8 blocks of a shared simulated KV cache and runs jobs through one
compute stream, one save stream and two load streams shared by all threads, and a pool
too small for everyone (back-pressure). A job:

1. compute writes fresh KV into 3 blocks;
2. saves them into a slot (the copy stream waits for the compute write);
3. compute overwrites the same blocks at once (it must wait for the save);
4. waits for the save with a random timeout — on timeout, half the jobs give up
   (`retire`) and the rest wait on;
5. checks the slot, loads it into 3 blocks on one or two load streams (refcount 1–2),
   lets compute read them back (waiting the loads), and checks the bytes read;
6. ends each read (or abandons it after a timeout) and lets go of the slot.

At the end every slot is free, nothing is in flight and no block access is pending.
"""

import random
import threading

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.lifecycle import Access, BlockTracker, SlotTracker
from kvtier.pool import PinnedPool

pytestmark = pytest.mark.usefixtures("slab")  # each test with the C and the Python bookkeeping

BLOCK = 1024
THREADS = 8
JOBS = 40
PER_JOB = 3


class World:
    def __init__(self, sanitize, seed):
        self.dev = SimDevice(copy_delay=(0.0, 0.002), launch_delay=(0.0, 0.001), seed=seed)
        self.compute = self.dev.current_stream()
        self.save_s = self.dev.new_stream("save")
        self.load_s = [self.dev.new_stream("load0"), self.dev.new_stream("load1")]
        self.kv = self.dev.empty(THREADS * 8 * BLOCK).view(-1, BLOCK)
        self.kv.zero_()
        self.pool = PinnedPool(
            self.dev, 4 * PER_JOB * BLOCK, alignment=512
        )  # 4 slots for 8 threads: back-pressure
        self.slots = SlotTracker(self.pool, sanitize=sanitize)
        self.blocks = BlockTracker(sanitize=sanitize)
        self.stats = {"checked_bytes": 0, "timeouts": 0, "aborted": 0, "shared_reads": 0}
        self.lock = threading.Lock()

    def count(self, key, n=1):
        with self.lock:
            self.stats[key] += n

    def wait_all(self, stream, events):
        for e in events:
            stream.wait_event(e)  # the access below must follow these (see MUST_FOLLOW)

    def compute_write(self, blocks, data):
        waits = self.blocks.waits_for(Access.WRITE, blocks)
        self.wait_all(self.compute, waits)
        idx = torch.tensor(blocks)
        self.dev.launch(lambda: self.kv.index_copy_(0, idx, data), self.compute)
        self.blocks.compute_write(blocks, self.compute.record("e_compute"), waited=waits)

    def save(self, blocks, slot):
        waits = self.blocks.waits_for(Access.SAVE, blocks)
        self.wait_all(self.save_s, waits)
        rows = slot.view(torch.uint8, (PER_JOB, BLOCK))
        for i, b in enumerate(blocks):
            self.dev.copy(rows[i], self.kv[b], self.save_s)
        e_save = self.save_s.record("e_save")
        self.blocks.begin_save(blocks, e_save, waited=waits)
        self.slots.begin_fill(slot, e_save)

    def load(self, slot, blocks, stream):
        waits = self.blocks.waits_for(Access.LOAD, blocks)
        self.wait_all(stream, waits)
        rows = slot.view(torch.uint8, (PER_JOB, BLOCK))
        for i, b in enumerate(blocks):
            self.dev.copy(self.kv[b], rows[i], stream)
        e_load = stream.record("e_load")
        self.slots.begin_read(slot, e_load)
        self.blocks.begin_load(blocks, e_load, waited=waits)
        return e_load

    def compute_read(self, blocks, out):
        waits = self.blocks.waits_for(Access.READ, blocks)
        self.wait_all(self.compute, waits)
        idx = torch.tensor(blocks)
        self.dev.launch(lambda: out.copy_(self.kv.index_select(0, idx)), self.compute)
        e_read = self.compute.record("e_read")
        self.blocks.compute_read(blocks, e_read, waited=waits)
        return e_read

    def job(self, tid, j, rng):
        region = range(tid * 8, tid * 8 + 8)
        g = torch.Generator().manual_seed(tid * 1000 + j)
        data = torch.randint(0, 256, (PER_JOB, BLOCK), dtype=torch.uint8, generator=g)
        src = rng.sample(region, PER_JOB)
        self.compute_write(src, data)
        slot = self.slots.alloc(PER_JOB * BLOCK, timeout=30.0)
        self.save(src, slot)
        self.compute_write(src, torch.full_like(data, 0xEE))  # must not reach the slot
        if not self.slots.wait_filled(slot, timeout=rng.choice([0.0, 0.0005, 0.05])):
            self.count("timeouts")
            if rng.random() < 0.5:
                self.count("aborted")
                self.slots.retire(slot)  # never release under DMA: freed once it lands
                return
            assert self.slots.wait_filled(slot)
        assert torch.equal(slot.view(torch.uint8, (PER_JOB, BLOCK)), data)
        readers = []
        for k in range(rng.choice([1, 2])):
            dst = rng.sample(region, PER_JOB)
            out = torch.empty_like(data)
            e_load = self.load(slot, dst, self.load_s[k])
            readers.append((e_load, self.compute_read(dst, out), out))
        self.count("shared_reads", len(readers) - 1)
        for e_load, _, _ in readers:
            if e_load.synchronize(timeout=rng.choice([0.0, None])):
                self.slots.end_read(slot, e_load)
            else:
                self.count("timeouts")
                self.slots.abandon_read(slot, e_load)  # dropped by poll once it completes
        self.slots.retire(slot)
        for _, e_read, out in readers:
            e_read.synchronize()  # `out` is valid only once the compute read completed
            assert torch.equal(out, data)
            self.count("checked_bytes", out.numel())


@pytest.mark.parametrize("sanitize", [True, False])
def test_many_concurrent_jobs_every_byte_right(sanitize):
    w = World(sanitize, seed=7)
    errors = []

    def run(tid):
        rng = random.Random(tid)
        try:
            for j in range(JOBS):
                w.job(tid, j, rng)
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        if errors:
            raise errors[0]
        assert not any(t.is_alive() for t in threads), "a job hung"
        w.dev.synchronize()
        w.slots.poll()
        st = w.pool.stats()
        assert st.used == 0 and st.in_flight == 0 and st.free == st.capacity
        assert w.slots.live() == {}
        assert w.blocks.pending() == 0
        w.pool.check_free_list()
        s = w.stats
        assert s["checked_bytes"] > THREADS * JOBS * PER_JOB * BLOCK // 3
        assert s["timeouts"] > 0 and s["aborted"] > 0 and s["shared_reads"] > 0
    finally:
        w.dev.close()
