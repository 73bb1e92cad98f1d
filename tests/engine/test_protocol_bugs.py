"""The six bug classes of the lifecycle protocol, each shown three ways on SimDevice.

- unprotected: the buggy sequence, sanitizer off → wrong bytes (copies land DELAY late,
  the slow kernels take 2×DELAY, host steps take microseconds: the order is deterministic);
- sanitized: the same sequence, sanitizer on → LifecycleError naming buffer, state, event;
- protocol: the correct sequence (sanitizer on, no complaint) → the right bytes.

`Rig` does the save/load steps the TransferEngine will do, with the same trackers.
"""

import contextlib
import time

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.lifecycle import Access, BlockTracker, LifecycleError, SlotTracker, StaleSlotError
from kvtier.pool import PinnedPool, PoolExhausted

pytestmark = pytest.mark.usefixtures("slab")  # each test with the C and the Python bookkeeping

DELAY = 0.15  # seconds each copy takes to land
BLOCK = 256  # bytes per GPU block
B = 2  # the block the scenarios work on


def pat(v):
    return torch.full((BLOCK,), v, dtype=torch.uint8)


class Rig:
    """A simulated GPU KV cache of 8 blocks, a copy stream, a pool with room for one slot."""

    def __init__(self, sanitize):
        self.dev = SimDevice(copy_delay=DELAY)
        self.compute = self.dev.current_stream()
        self.copy = self.dev.new_stream("copy")
        self.kv = self.dev.empty(8 * BLOCK).view(8, BLOCK)
        self.kv.zero_()
        self.slots = SlotTracker(PinnedPool(self.dev, BLOCK), sanitize=sanitize)
        self.blocks = BlockTracker(sanitize=sanitize)

    def host_slot(self, value):
        """A slot whose bytes the CPU wrote (a disk read landing in the pool)."""
        slot = self.slots.alloc(BLOCK, timeout=0)
        slot.tensor.copy_(pat(value))
        self.slots.fill_host(slot)
        return slot

    def save(self, block, slot, wait=True):
        waits = self.blocks.waits_for(Access.SAVE, [block]) if wait else []
        for e in waits:
            self.copy.wait_event(e)  # the save must not read KV the compute is still writing
        self.dev.copy(slot.tensor, self.kv[block], self.copy)
        e_save = self.copy.record("e_save")
        self.blocks.begin_save([block], e_save, waited=waits)
        self.slots.begin_fill(slot, e_save)
        return e_save

    def load(self, slot, block, wait=True):
        waits = self.blocks.waits_for(Access.LOAD, [block]) if wait else []
        for e in waits:
            self.copy.wait_event(e)  # the load must not overwrite a block still read or written
        self.dev.copy(self.kv[block], slot.tensor, self.copy)
        e_load = self.copy.record("e_load")
        self.slots.begin_read(slot, e_load)
        self.blocks.begin_load([block], e_load, waited=waits)
        return e_load

    def compute_write(self, block, value, seconds):
        waits = self.blocks.waits_for(Access.WRITE, [block])
        for e in waits:
            self.compute.wait_event(e)  # new KV must not land on a block a copy still uses
        self.dev.launch(lambda: (time.sleep(seconds), self.kv[block].fill_(value)), self.compute)
        e = self.compute.record("e_compute")
        self.blocks.compute_write([block], e, waited=waits)

    def compute_read(self, block, out, seconds=0.0, wait=True):
        waits = self.blocks.waits_for(Access.READ, [block]) if wait else []
        for e in waits:
            self.compute.wait_event(e)  # attention must not read a block before its load lands
        self.dev.launch(lambda: (time.sleep(seconds), out.copy_(self.kv[block])), self.compute)
        e = self.compute.record("e_read")
        self.blocks.compute_read([block], e, waited=waits)


# Each scenario runs the buggy sequence when `buggy`, the protocol otherwise, and returns
# (bytes observed, bytes the protocol guarantees).


def host_buffer_released_after_submit(r, buggy):
    slot = r.host_slot(1)
    e_load = r.load(slot, B)
    if not buggy:
        e_load.synchronize()  # the copy has read the slot only once e_load completed
        r.slots.end_read(slot, e_load)
    r.slots.release(slot)  # buggy: right after submit, the H2D copy has not read it yet
    r.host_slot(9)  # the next job reuses the memory at once
    r.dev.synchronize()
    return r.kv[B].clone(), pat(1)


def compute_reads_before_load(r, buggy):
    slot = r.host_slot(1)
    r.load(slot, B)
    out = torch.zeros(BLOCK, dtype=torch.uint8)
    r.compute_read(B, out, wait=not buggy)
    r.dev.synchronize()
    return out, pat(1)


def save_skips_compute_event(r, buggy):
    r.compute_write(B, 7, seconds=2 * DELAY)  # a slow kernel writes the new KV
    slot = r.slots.alloc(BLOCK, timeout=0)
    r.save(B, slot, wait=not buggy)
    r.slots.wait_filled(slot)
    return slot.tensor.clone(), pat(7)


def load_overwrites_block_being_read(r, buggy):
    r.kv[B].fill_(5)  # KV another request is attending over
    out = torch.zeros(BLOCK, dtype=torch.uint8)
    r.compute_read(B, out, seconds=2 * DELAY)  # slow attention still reading block B
    slot = r.host_slot(1)
    r.load(slot, B, wait=not buggy)  # block B was handed to a new request
    r.dev.synchronize()
    return out, pat(5)


def slot_reused_after_timeout(r, buggy):
    r.kv[B].fill_(3)
    slot = r.slots.alloc(BLOCK, timeout=0)
    r.save(B, slot)
    assert not r.slots.wait_filled(slot, timeout=0.01)  # the job times out, the copy is in flight
    if buggy:
        r.slots.release(slot)  # the late copy will land in whoever gets the memory next
    else:
        r.slots.retire(slot)  # freed only once e_save has completed
    other = r.slots.alloc(BLOCK, timeout=5.0)  # back-pressure until the memory is really free
    other.tensor.copy_(pat(9))
    r.slots.fill_host(other)
    r.dev.synchronize()
    return other.tensor.clone(), pat(9)


def double_release(r, buggy):
    a = r.host_slot(1)
    r.slots.release(a)
    b = r.host_slot(2)  # same memory, new owner
    if buggy:
        r.slots.release(a)  # stale handle: frees b's memory
    with contextlib.suppress(PoolExhausted):  # with the protocol the pool is full: b holds it
        r.host_slot(3)
    return b.tensor.clone(), pat(2)


# scenario -> (buffer prefix, state, missing event label or None) the sanitizer must name
CASES = {
    host_buffer_released_after_submit: ("slot#", "READING", "e_load"),
    compute_reads_before_load: (f"gpu block {B}", "LOADING", "e_load"),
    save_skips_compute_event: (f"gpu block {B}", "WRITING", "e_compute"),
    load_overwrites_block_being_read: (f"gpu block {B}", "READING", "e_read"),
    slot_reused_after_timeout: ("slot#", "FILLING", "e_save"),
    double_release: ("slot#", "FREE", None),
}
ids = [f.__name__ for f in CASES]


@pytest.fixture
def rig(request):
    r = Rig(sanitize=request.param)
    yield r
    r.dev.synchronize()
    r.dev.close()


# safe without the sanitizer: a stale slot handle is refused by the pool itself
SAFE_BY_DEFAULT = {double_release}


@pytest.mark.parametrize("rig", [False], indirect=True)
@pytest.mark.parametrize("scenario", [c for c in CASES if c not in SAFE_BY_DEFAULT], ids=lambda f: f.__name__)
def test_unprotected_gives_wrong_bytes(rig, scenario):
    got, want = scenario(rig, buggy=True)
    assert not torch.equal(got, want)


@pytest.mark.parametrize("rig", [False], indirect=True)
@pytest.mark.parametrize("scenario", SAFE_BY_DEFAULT, ids=lambda f: f.__name__)
def test_refused_without_the_sanitizer(rig, scenario):
    with pytest.raises(StaleSlotError):
        scenario(rig, buggy=True)


@pytest.mark.parametrize("rig", [True], indirect=True)
@pytest.mark.parametrize("scenario", CASES, ids=ids)
def test_sanitizer_names_buffer_state_and_event(rig, scenario):
    buffer, state, event = CASES[scenario]
    with pytest.raises(LifecycleError) as err:
        scenario(rig, buggy=True)
    e = err.value
    assert e.buffer.startswith(buffer) and e.buffer in str(e)
    assert e.state.startswith(state) and state in str(e)
    if event is None:
        assert e.missing_event is None and "missing event: none" in str(e)
    else:
        assert e.missing_event.label == event and event in str(e)
        assert not e.missing_event.query()  # it really was still in flight


@pytest.mark.parametrize("rig", [True], indirect=True)
@pytest.mark.parametrize("scenario", CASES, ids=ids)
def test_protocol_gives_right_bytes(rig, scenario):
    got, want = scenario(rig, buggy=False)
    assert torch.equal(got, want)
