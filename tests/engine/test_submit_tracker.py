"""BlockTracker on numpy arrays (lifecycle/blocks.py): the same waits and sanitizer errors as the
set-based tracker it replaced (a reference kept here), every argument form it took before, its own
copy of the ids, ids past the scratch mask; and SlotTracker.poll visiting only waiting slots."""

import random

import numpy as np
import pytest
import torch

from kvtier.device import SimDevice
from kvtier.lifecycle import MUST_FOLLOW, WHY, Access, BlockTracker, LifecycleError, SlotTracker
from kvtier.lifecycle import blocks as blocks_mod
from kvtier.lifecycle.blocks import CheckedBlocks
from kvtier.pool import PinnedPool


class Ev:
    def __init__(self, stream, label):
        self.stream, self.label, self.done = stream, label, False

    def query(self):
        return self.done


class RefTracker:
    """The set-based tracker as it was: frozensets, isdisjoint, min of the intersection."""

    def __init__(self):
        self.pending = []

    def waits_for(self, kind, blocks, stream=None):
        s = frozenset(blocks)
        self.pending = [p for p in self.pending if not p[2].query()]
        hits = [p for p in self.pending if p[0] in MUST_FOLLOW[kind] and not s.isdisjoint(p[1])]
        return [p[2] for p in hits if stream is None or p[2].stream != stream]

    def register(self, kind, blocks, event, waited=()):
        s = frozenset(blocks)
        self.pending = [p for p in self.pending if not p[2].query()]
        for k, b, e in self.pending:
            if k not in MUST_FOLLOW[kind] or s.isdisjoint(b):
                continue
            if any(e is w for w in waited) or e.stream == event.stream or e.query():
                continue
            raise LifecycleError(kind.name.lower(), f"gpu block {min(s & b)}", k.value, e, WHY[(kind, k)])
        self.pending.append((kind, s, event))


@pytest.mark.parametrize("big", [False, True])
def test_same_waits_and_errors_as_the_set_tracker(big):
    rng = random.Random(1 if big else 0)
    base = blocks_mod.MASK_MAX if big else 0  # ids past the mask take the sort-based path
    new, ref = BlockTracker(sanitize=True), RefTracker()
    streams, events = ["compute", "save", "load", "other"], []
    for step in range(600):
        for e in events:
            if not e.done and rng.random() < 0.2:
                e.done = True
        kind = rng.choice(list(Access))
        stream = rng.choice(streams)
        blocks = [base + b for b in rng.sample(range(40), rng.randint(1, 6))]
        w_new = new.waits_for(kind, blocks, stream=stream)
        w_ref = ref.waits_for(kind, blocks, stream=stream)
        assert w_new == w_ref, step
        ev = Ev(stream, f"e{step}")
        events.append(ev)
        waited = w_ref if rng.random() < 0.7 else w_ref[: len(w_ref) // 2]
        errs = []
        for t in (new, ref):
            try:
                t.register(kind, blocks, ev, waited=waited)
                errs.append(None)
            except LifecycleError as e:
                errs.append(str(e))
        assert errs[0] == errs[1], step
        # The counts that let a call skip the list (no pending access of a kind it follows).
        st = new.debug_state()
        assert st["counts"] == {k: st["kinds"].count(k) for k in Access}, step
    assert new.pending() == len([p for p in ref.pending if not p[2].query()])


@pytest.mark.parametrize(
    "form",
    [
        lambda b: b,
        tuple,
        set,
        frozenset,
        lambda b: range(b[0], b[0] + 1),
        lambda b: torch.tensor(b),
        lambda b: torch.tensor(b, dtype=torch.int32),
        lambda b: np.array(b, dtype=np.uint32),
        lambda b: CheckedBlocks(np.array(b, dtype=np.int64), 100),
    ],
)
def test_every_argument_form(form):
    t = BlockTracker()
    e = Ev("load", "e_load")
    t.begin_load(form([3, 4]), e)
    assert t.waits_for(Access.READ, form([3, 4]), stream="compute") == [e]
    assert t.waits_for(Access.READ, [9], stream="compute") == []
    assert t.state(3) == "LOADING" and t.state(9) == "IDLE"


def test_the_tracker_keeps_its_own_copy():
    t = BlockTracker()
    e = Ev("save", "e_save")
    for mine in (np.array([1, 2]), torch.tensor([1, 2]), [1, 2]):
        t.begin_save(mine, e)
        mine[0] = 7  # the caller reuses its buffer
    assert t.waits_for(Access.WRITE, [1], stream="compute") == [e, e, e]
    assert t.waits_for(Access.WRITE, [7], stream="compute") == []


@pytest.mark.parametrize("bad", [[], [-1], [1, -3], ["a"], [1.5], torch.zeros(2), np.zeros((2, 2), np.int64)])
def test_bad_blocks_name_the_argument(bad):
    for sanitize in (True, False):
        with pytest.raises(ValueError, match="blocks"):
            BlockTracker(sanitize=sanitize).compute_write(bad, Ev("compute", "e"))


def test_error_names_the_lowest_shared_block():
    t = BlockTracker(sanitize=True)
    t.begin_load(np.array([9, 5, 7]), Ev("load", "e_load"))
    with pytest.raises(LifecycleError, match="gpu block 5 is LOADING; missing event: e_load"):
        t.compute_read([7, 5, 1], Ev("compute", "e_read"))


def test_slot_poll_visits_only_waiting_slots():
    dev = SimDevice()
    pool = PinnedPool(dev, 64 * 256)
    slots = SlotTracker(pool, sanitize=True)
    ready = [slots.alloc(256) for _ in range(20)]
    for s in ready:
        slots.fill_host(s)  # READY, held by their owner: nothing for poll to do
    retired = slots.alloc(256)
    e = dev.new_stream("copy").record()
    slots.begin_fill(retired, e)
    slots.retire(retired)
    assert slots.waiting() == [retired]
    e.synchronize()
    assert slots.poll() == 1 and not slots.waiting() and pool.stats().slots == 20
    for s in ready:
        slots.release(s)
    dev.close()
