"""The state machines of pool slots and GPU blocks, legal and illegal moves, the sanitizer.

Events are made controllable with a gate: the stream blocks on a threading.Event, so an
event recorded after it stays incomplete until the test opens the gate.
"""

import threading

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.lifecycle import (
    MUST_FOLLOW,
    Access,
    BlockTracker,
    LifecycleError,
    SlotState,
    SlotTracker,
    sanitize_enabled,
)
from kvtier.pool import PinnedPool

pytestmark = pytest.mark.usefixtures("slab")  # each test with the C and the Python bookkeeping


@pytest.fixture
def dev():
    d = SimDevice()
    gates = []

    def pending_event(name="s"):
        """An event that completes only when its gate is opened: returns (event, open)."""
        gate = threading.Event()
        gates.append(gate)
        s = d.new_stream(name)
        d.launch(gate.wait, s)
        ev = s.record()
        return ev, lambda: (gate.set(), ev.synchronize())

    d.pending_event = pending_event
    yield d
    for g in gates:
        g.set()
    d.close()


@pytest.fixture
def slots(dev):
    return SlotTracker(PinnedPool(dev, 64 * 1024), sanitize=True)


def done_event(dev):
    s = dev.new_stream("done")
    ev = s.record()
    ev.synchronize()
    return ev


def put_in(dev, slots, state):
    """A slot in `state`, with its events still pending."""
    slot = slots.alloc(1000)
    if state in (SlotState.READY, SlotState.READING):
        slots.fill_host(slot)
    if state is SlotState.FILLING:
        slots.begin_fill(slot, dev.pending_event()[0])
    if state is SlotState.READING:
        slots.begin_read(slot, dev.pending_event()[0])
    if state is SlotState.FREE:
        slots.release(slot)
    assert slots.state(slot) is state
    return slot


ACTIONS = ["begin_fill", "fill_host", "fill_done", "begin_read", "end_read", "release", "retire"]
# With every event of the slot still pending: which actions are legal from which state.
LEGAL = {
    SlotState.ALLOCATED: {"begin_fill", "fill_host", "release", "retire"},
    SlotState.FILLING: {"retire"},
    SlotState.READY: {"begin_read", "release", "retire"},
    SlotState.READING: {"begin_read", "retire"},
    SlotState.FREE: set(),
}


def apply(dev, slots, slot, action):
    if action in ("begin_fill", "begin_read"):
        getattr(slots, action)(slot, done_event(dev))
    elif action == "end_read":
        slots.end_read(slot, done_event(dev))  # an event no read registered
    else:
        getattr(slots, action)(slot)


@pytest.mark.parametrize("state", list(LEGAL))
@pytest.mark.parametrize("action", ACTIONS)
def test_slot_transition_table(dev, slots, state, action):
    slot = put_in(dev, slots, state)
    if action in LEGAL[state]:
        apply(dev, slots, slot, action)
    else:
        with pytest.raises(LifecycleError) as err:
            apply(dev, slots, slot, action)
        e = err.value
        assert e.buffer == slot.name and slot.name in str(e)
        assert e.state.startswith(state.value) and state.value in str(e)
        assert "missing event" in str(e)
        if state in (SlotState.FILLING, SlotState.READING) and action not in ("end_read",):
            assert e.missing_event is not None and e.missing_event.label in str(e)


def test_full_slot_cycle_and_in_flight_accounting(dev, slots):
    pool = slots.pool
    slot = slots.alloc(1000)
    e_save, land = dev.pending_event()
    slots.begin_fill(slot, e_save)
    assert pool.stats().in_flight == 1024
    with pytest.raises(LifecycleError, match="FILLING.*" + e_save.label):
        slots.fill_done(slot)  # READY only once e_save completed
    land()
    slots.fill_done(slot)
    assert slots.state(slot) is SlotState.READY and pool.stats().in_flight == 0
    (e1, open1), (e2, open2) = dev.pending_event(), dev.pending_event()
    slots.begin_read(slot, e1)
    slots.begin_read(slot, e2)  # refcount 2
    assert pool.stats().in_flight == 1024
    with pytest.raises(LifecycleError, match="READING.*" + e1.label):
        slots.end_read(slot, e1)  # never on a timeout or when the call returns
    open1()
    slots.end_read(slot, e1)
    assert slots.state(slot) is SlotState.READING
    open2()
    slots.end_read(slot, e2)
    with pytest.raises(LifecycleError, match="ended twice"):
        slots.end_read(slot, e2)
    assert slots.state(slot) is SlotState.READY and pool.stats().in_flight == 0
    slots.release(slot)
    assert slots.state(slot) is SlotState.FREE and pool.stats().used == 0


def test_wait_filled_times_out_without_moving(dev, slots):
    slot = slots.alloc(100)
    e_save, land = dev.pending_event()
    slots.begin_fill(slot, e_save)
    assert slots.wait_filled(slot, timeout=0.02) is False
    assert slots.state(slot) is SlotState.FILLING
    land()
    assert slots.wait_filled(slot, timeout=1.0) is True
    assert slots.state(slot) is SlotState.READY


def test_retire_frees_once_the_copy_lands(dev, slots):
    pool = slots.pool
    slot = slots.alloc(1000)
    e_save, land = dev.pending_event()
    slots.begin_fill(slot, e_save)
    slots.retire(slot)
    assert slots.poll() == 0 and pool.stats().used == 1024  # still under DMA: kept
    with pytest.raises(LifecycleError, match="retired"):
        slots.retire(slot)
    land()
    assert slots.poll() == 1 and pool.stats().used == 0
    assert slots.state(slot) is SlotState.FREE


def test_retire_waits_for_every_reader(dev, slots):
    slot = put_in(dev, slots, SlotState.READY)
    (e1, open1), (e2, open2) = dev.pending_event(), dev.pending_event()
    slots.begin_read(slot, e1)
    slots.begin_read(slot, e2)
    slots.retire(slot)
    open1()
    slots.end_read(slot, e1)  # a reader still ends its own read
    assert slots.state(slot) is SlotState.READING
    open2()
    slots.end_read(slot, e2)  # the last read frees the retired slot
    assert slots.state(slot) is SlotState.FREE and slots.pool.stats().used == 0


def test_abandoned_read_is_dropped_when_complete(dev, slots):
    slot = put_in(dev, slots, SlotState.READY)
    e, land = dev.pending_event()
    slots.begin_read(slot, e)
    slots.abandon_read(slot, e)  # the job timed out; the copy is still in flight
    assert slots.poll() == 0 and slots.state(slot) is SlotState.READING
    land()
    slots.poll()
    assert slots.state(slot) is SlotState.READY


def test_alloc_back_pressure_harvests_retired_slots(dev):
    slots = SlotTracker(PinnedPool(dev, 1024), sanitize=True)
    slot = slots.alloc(1024)
    e_save, land = dev.pending_event()
    slots.begin_fill(slot, e_save)
    slots.retire(slot)
    threading.Timer(0.1, land).start()
    again = slots.alloc(1024, timeout=5.0)  # waits until the late copy lands, then reuses
    assert e_save.query() and slots.state(again) is SlotState.ALLOCATED


def test_sanitizer_off_applies_moves_as_asked(dev):
    slots = SlotTracker(PinnedPool(dev, 4096), sanitize=False)
    slot = slots.alloc(100)
    slots.begin_fill(slot, dev.pending_event()[0])
    slots.release(slot)  # illegal, but not checked: the bug tests rely on this
    assert slots.pool.stats().used == 0


def test_sanitize_switch(monkeypatch):
    monkeypatch.delenv("KVTIER_SANITIZE", raising=False)
    assert not sanitize_enabled()
    monkeypatch.setenv("KVTIER_SANITIZE", "1")
    assert sanitize_enabled() and not sanitize_enabled(False)
    assert BlockTracker().sanitize
    monkeypatch.setenv("KVTIER_SANITIZE", "0")
    assert not sanitize_enabled() and sanitize_enabled(True)


# -- GPU blocks ------------------------------------------------------------------------------
@pytest.mark.parametrize("new", list(Access))
@pytest.mark.parametrize("old", list(Access))
def test_block_conflict_table(dev, new, old):
    blocks = BlockTracker(sanitize=True)
    e_old, open_old = dev.pending_event("old")
    blocks.register(old, [3, 4], e_old)
    e_new = dev.new_stream("new").record()
    e_new.synchronize()
    expect = blocks.waits_for(new, [4, 9])
    assert expect == ([e_old] if old in MUST_FOLLOW[new] else [])
    if old in MUST_FOLLOW[new]:
        with pytest.raises(LifecycleError) as err:
            blocks.register(new, [4, 9], e_new)
        msg = str(err.value)
        assert "gpu block 4" in msg and old.value in msg and e_old.label in msg
        blocks.register(new, [4, 9], e_new, waited=expect)  # the declared wait makes it legal
    else:
        blocks.register(new, [4, 9], e_new)
    blocks.register(new, [5], e_new)  # disjoint blocks never conflict
    open_old()
    assert blocks.waits_for(new, [4]) == []


def test_block_state_and_same_stream_order(dev):
    blocks = BlockTracker(sanitize=True)
    e_load, land = dev.pending_event("copy")
    blocks.begin_load([1, 2], e_load)
    assert blocks.state(1) == "LOADING" and blocks.state(7) == "IDLE"
    # Work on the load's own stream is ordered after it without a wait.
    blocks.compute_read([1], e_load.stream.record())
    assert blocks.waits_for(Access.READ, [1], stream=e_load.stream) == []
    land()
    e_load.stream.synchronize()
    assert blocks.state(1) == "IDLE" and blocks.pending() == 0


def test_completed_candidates_are_queried_once_then_dropped(dev):
    blocks = BlockTracker(sanitize=True)
    e_load, land = dev.pending_event("copy")
    blocks.begin_load([1, 2], e_load)
    blocks.compute_write([7], done_event(dev))  # completed already, but no prune has run yet
    assert blocks.waits_for(Access.SAVE, [1, 7]) == [e_load]  # only the load still orders a save
    land()
    queries = []
    real = e_load.query
    e_load.query = lambda: queries.append(1) or real()
    assert blocks.waits_for(Access.SAVE, [1]) == []
    assert blocks.waits_for(Access.SAVE, [1]) == []
    assert len(queries) == 1  # found complete once, then gone from the pending list


def test_blocks_accept_tensors_and_reject_bad_input(dev):
    blocks = BlockTracker(sanitize=True)
    blocks.compute_write(torch.tensor([1, 2, 3]), done_event(dev))
    with pytest.raises(ValueError, match="blocks"):
        blocks.compute_write([], done_event(dev))
    with pytest.raises(ValueError, match="blocks"):
        blocks.compute_write([-1], done_event(dev))
    with pytest.raises(ValueError, match="kind"):
        blocks.waits_for("LOAD", [1])
