"""The two bug classes of per-layer "landed" flags, each shown three ways on SimDevice, as
`test_protocol_bugs.py` shows the slot and block ones:

- unprotected: the buggy sequence, sanitizer off -> the forward reads wrong bytes (copies land
  DELAY late, host steps take microseconds: the order is deterministic);
- sanitized: the same sequence, sanitizer on -> LifecycleError naming the flag, its state, the
  missing event;
- protocol: the correct sequence (sanitizer on, no complaint) -> the right bytes.

`Rig` does the steps `kvtier.engine.flags.LayerFlags` does (re-arm on the compute stream, loads
that store their progress per layer on the copy stream, the seal on the flag stream), with the
same tracker, and a switch to leave out the step the protocol needs.
"""

import pytest
import torch

from kvtier.device import FlagOp, SimDevice
from kvtier.engine.flags import ARMED, LANDED
from kvtier.lifecycle import FlagTracker, LifecycleError

DELAY = 0.15  # seconds each copy takes to land
BLOCK = 256  # bytes per GPU block (of one layer)
L = 2  # layers
B = 3  # the block the scenarios load


def pat(v):
    return torch.full((BLOCK,), v, dtype=torch.uint8)


class Rig:
    """A simulated cache of L layers x 8 blocks, a copy stream, a flag stream, flag words."""

    def __init__(self, sanitize):
        self.dev = SimDevice(copy_delay=DELAY)
        self.compute, self.copy = self.dev.current_stream(), self.dev.new_stream("copy")
        self.flag_stream = self.dev.new_stream("flag")
        self.kv = torch.zeros(L, 8, BLOCK, dtype=torch.uint8)
        self.words = self.dev.new_flags(2 * L, LANDED, label="rig")  # flags, then progress
        self.dev.flag_ops(self.words, [FlagOp(True, L + i, 0) for i in range(L)], self.flag_stream)
        self.tracker = FlagTracker("rig flags", L, sanitize=sanitize)
        self.seq, self.live, self.last = 0, 0, None
        self.armed = self.sealed = None

    def arm(self, ordered=True):
        waited = []
        if ordered and self.sealed is not None:
            # The re-arm must not precede the step before's flag writes: a late "landed" would
            # satisfy this step's waits.
            self.compute.wait_event(self.sealed)
            waited = [self.sealed]
        g = self.tracker.arm(self.compute, waited)
        self.dev.flag_ops(self.words, [FlagOp(True, i, ARMED) for i in range(L)], self.compute)
        self.armed = self.compute.record("armed")
        self.live, self.last, self.sealed = g, None, None
        return g

    def load(self, value, g):
        self.tracker.join(g)
        self.seq += 1
        if g == self.live and self.sealed is None:
            self.last = self.seq  # the seal waits for this load's layers
        self.copy.wait_event(self.armed)  # the copies follow the re-arm (the engine's load does too)
        events = []
        for layer in range(L):
            self.dev.copy(self.kv[layer, B], pat(value), self.copy)  # lands DELAY late
            self.dev.flag_write(self.words, L + layer, self.seq, self.copy)  # after the layer's copy
            events.append(self.copy.record(f"e_load:layer{layer}"))
        self.tracker.loaded(g, events)

    def seal(self, g):
        self.flag_stream.wait_event(self.armed)  # a flag is set only after the re-arm stored ARMED
        if self.last is None:
            ops = [FlagOp(True, i, LANDED) for i in range(L)]
        else:
            ops = [
                op
                for i in range(L)
                for op in (FlagOp(False, L + i, self.last, True), FlagOp(True, i, LANDED))
            ]
        self.dev.flag_ops(self.words, ops, self.flag_stream)
        self.sealed = self.flag_stream.record("sealed")
        self.tracker.seal(g, self.sealed)

    def read(self, layer):
        """The forward's read of the layer's block, behind the (graph's) wait on its flag."""
        out = torch.zeros(BLOCK, dtype=torch.uint8)
        self.dev.flag_wait(self.words, layer, LANDED, self.compute)  # attention after the layer landed
        self.dev.launch(lambda: out.copy_(self.kv[layer, B]), self.compute)
        return out


# Each scenario runs the buggy sequence when `buggy`, the protocol otherwise, and returns
# (bytes the forward read, bytes the protocol guarantees).


def rearm_before_landed(r, buggy):
    """Step 1 loads block B (its request went away: its forward never waited); step 2 loads B
    again. Re-armed before step 1's flags were set, step 1's late 'landed' satisfies step 2's wait."""
    g1 = r.arm()
    r.load(1, g1)
    r.seal(g1)
    g2 = r.arm(ordered=not buggy)
    r.load(2, g2)
    r.seal(g2)
    out = r.read(0)
    r.dev.synchronize()
    return out, pat(2)


def stale_generation(r, buggy):
    """Step 1's load landed and its flags were set; step 2's load joins step 1 (a stale handle,
    no re-arm): step 2's wait finds step 1's 'landed' and reads before step 2's copies landed."""
    g1 = r.arm()
    r.load(1, g1)
    r.seal(g1)
    r.dev.synchronize()
    g = g1 if buggy else r.arm()
    r.load(2, g)
    if not buggy:
        r.seal(g)
    out = r.read(0)
    r.dev.synchronize()
    return out, pat(2)


# scenario -> (flag, state, missing event label or None) the sanitizer must name
CASES = {
    rearm_before_landed: ("layer flag 0 of rig flags", "SEALED (step 1)", "e_load:layer0"),
    stale_generation: ("rig flags", "SEALED (step 1)", None),
}
ids = [f.__name__ for f in CASES]


@pytest.fixture
def rig(request):
    r = Rig(sanitize=request.param)
    yield r
    r.dev.close()  # releases a stream still held by a wait of an abandoned sequence


@pytest.mark.parametrize("rig", [False], indirect=True)
@pytest.mark.parametrize("scenario", CASES, ids=ids)
def test_unprotected_gives_wrong_bytes(rig, scenario):
    got, want = scenario(rig, buggy=True)
    assert not torch.equal(got, want)


@pytest.mark.parametrize("rig", [True], indirect=True)
@pytest.mark.parametrize("scenario", CASES, ids=ids)
def test_sanitizer_names_flag_state_and_event(rig, scenario):
    flag, state, event = CASES[scenario]
    with pytest.raises(LifecycleError) as err:
        scenario(rig, buggy=True)
    e = err.value
    assert e.buffer == flag and flag in str(e)
    assert e.state == state and state in str(e)
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
