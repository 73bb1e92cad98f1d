"""FlagTracker: the steps of a flag array (LANDED -> ARMED -> SEALED -> LANDED), the legal and
illegal moves, with events held pending by a gate until the test opens it."""

import threading

import pytest

from kvtier.device import SimDevice
from kvtier.lifecycle import FlagState, FlagTracker, LifecycleError


@pytest.fixture
def dev():
    d = SimDevice()
    gates = []

    def pending(name="s"):
        """An event that completes only when its gate opens: (event, open)."""
        gate = threading.Event()
        gates.append(gate)
        s = d.new_stream(name)
        d.launch(gate.wait, s)
        ev = s.record(name)
        return ev, lambda: (gate.set(), ev.synchronize())

    d.pending = pending
    yield d
    for g in gates:
        g.set()
    d.close()


def test_a_step_moves_through_its_states(dev):
    t = FlagTracker("f", 2, sanitize=True)
    assert t.state() is FlagState.LANDED and t.generation == 0
    g = t.arm("compute")
    assert g == 1 and t.state() is FlagState.ARMED
    t.join(g)
    layers = [dev.pending("layer0")[0], dev.pending("layer1")[0]]
    t.loaded(g, layers)
    sealed, land = dev.pending("sealed")
    t.seal(g, sealed)
    assert t.state() is FlagState.SEALED
    land()
    assert t.state() is FlagState.LANDED
    assert t.arm("compute") == 2  # the step before landed: no wait needed


def test_re_arming_before_the_flags_were_set_names_the_first_layer_still_landing(dev):
    t = FlagTracker("f", 3, sanitize=True)
    g = t.arm("compute")
    done = dev.new_stream("done").record("done")
    done.synchronize()
    layer1, _ = dev.pending("e:layer1")
    sealed, _ = dev.pending("sealed")
    t.loaded(g, [done, layer1, layer1])
    t.seal(g, sealed)
    with pytest.raises(LifecycleError) as err:
        t.arm("compute")
    e = err.value
    assert (e.action, e.buffer, e.state) == ("arm", "layer flag 1 of f", "SEALED (step 1)")
    assert e.missing_event is layer1
    assert t.generation == 1  # refused: nothing changed


def test_re_arming_after_the_copies_but_before_the_seal_names_the_seal(dev):
    t = FlagTracker("f", 1, sanitize=True)
    g = t.arm("compute")
    sealed, _ = dev.pending("sealed")
    t.seal(g, sealed)  # no load: only the seal's write is pending
    with pytest.raises(LifecycleError) as err:
        t.arm("compute")
    assert err.value.buffer == "layer flag 0 of f" and err.value.missing_event is sealed


def test_a_stream_ordered_after_the_seal_may_re_arm_at_once(dev):
    t = FlagTracker("f", 1, sanitize=True)
    g = t.arm("compute")
    sealed, _ = dev.pending("sealed")
    t.seal(g, sealed)
    assert t.arm("compute", waited=[sealed]) == 2
    g3_sealed, _ = dev.pending("sealed3")
    t.seal(2, g3_sealed)
    assert t.arm(g3_sealed.stream) == 3  # the seal's own stream is ordered after it


def test_re_arming_a_step_never_sealed_is_refused(dev):
    t = FlagTracker("f", 1, sanitize=True)
    t.arm("compute")
    with pytest.raises(LifecycleError) as err:
        t.arm("compute")
    assert err.value.state == "ARMED (step 1)" and err.value.missing_event is None


def test_a_load_joins_only_the_live_step_before_its_seal(dev):
    t = FlagTracker("f", 1, sanitize=True)
    with pytest.raises(LifecycleError) as err:
        t.join(1)  # nothing armed yet
    assert err.value.state == "LANDED"
    g1 = t.arm("compute")
    t.join(g1)
    done = dev.new_stream("d").record()
    done.synchronize()
    t.seal(g1, done)
    with pytest.raises(LifecycleError) as err:
        t.join(g1)
    assert (err.value.action, err.value.buffer, err.value.state) == ("load", "f", "SEALED (step 1)")
    g2 = t.arm("compute")
    with pytest.raises(LifecycleError) as err:
        t.join(g1)
    assert err.value.state == "ARMED (step 2)"
    t.join(g2)
    assert t.stale_error(g1).state == "ARMED (step 2)"


def test_a_wait_through_a_stale_step_is_refused(dev):
    t = FlagTracker("f", 2, sanitize=True)
    g1 = t.arm("compute")
    t.check_wait(g1, 1)
    sealed, land = dev.pending("sealed")
    t.seal(g1, sealed)
    land()
    t.check_wait(g1, 1)  # still the live step: its flags are these
    t.arm("compute")
    with pytest.raises(LifecycleError) as err:
        t.check_wait(g1, 1)
    assert err.value.buffer == "layer flag 1 of f" and err.value.state == "ARMED (step 2)"


def test_without_the_sanitizer_every_move_is_applied(dev):
    t = FlagTracker("f", 1, sanitize=False)
    g = t.arm("compute")
    t.arm("compute")  # never sealed: allowed
    t.join(g)  # stale: allowed
    t.check_wait(g, 0)
    assert t.generation == 2
