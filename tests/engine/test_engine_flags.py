"""An engine's per-layer "landed" flags (`engine.layer_flags()`) on SimDevice, copies landing late:
what a compute stream reads after `flags.wait(layer)` is the loaded data, on every load path and
with several loads in one step; a step without loads finds the flags set; a load that fails after
the re-arm never leaves a wait blocked; the sanitizer refuses a stale step's handle.

Reads are queued on the compute stream behind the waits (`dev.launch`), as attention is: what
they see is what the device order guarantees, not what the host happened to see.
"""

import threading

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.engine.flags import ARMED, LANDED, Writer
from kvtier.lifecycle import LifecycleError
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, poison_blocks_, random_cache

L, NB, BS, H, D = 4, 24, 4, 2, 8
WAIT_S = 10.0


def rig(path="kernel", sanitize=True, **delays):
    dev = SimDevice(**delays)
    kv = random_cache("vllm_flash", L, NB, BS, H, D, torch.bfloat16, seed=3)
    pool = PinnedPool(dev, 16 * kv.chunk_nbytes(3))
    eng = TransferEngine(dev, kv, pool, EngineConfig(path=path, sanitize=sanitize, compute_beside=False))
    return dev, kv, pool, eng


def saved(eng, groups):
    jobs = [eng.save(g, after=None) for g in groups]
    assert all(j.wait() for j in jobs)
    return [j.slot for j in jobs]


def read_after_waits(dev, kv, flags, blocks, step=None):
    """Per layer, on the compute stream: wait for the layer's flag, then read the layer of `blocks`
    (as attention would). Returns the reads (filled once the compute stream ran) and its end event."""
    compute, out = dev.current_stream(), [None] * L
    for layer in range(L):
        (step or flags).wait(layer, compute)

        def read(layer=layer):
            out[layer] = gather_ref(kv, blocks)[:, layer].clone()

        dev.launch(read, compute)
    return out, compute.record("reads")


def same(out, want):
    return all(bits_equal(out[layer], want[:, layer]) for layer in range(L))


def test_a_step_without_loads_finds_every_flag_set():
    dev, kv, pool, eng = rig()
    try:
        flags = eng.layer_flags()
        assert flags is eng.layer_flags()  # made once, at start
        assert flags.words.read() == [LANDED] * L + [0] * L
        _, done = read_after_waits(dev, kv, flags, [0])
        assert done.synchronize(WAIT_S)  # no arm: the waits pass at once
        eng.close()
    finally:
        dev.close()


@pytest.mark.parametrize("path", ["kernel", "staged"])
@pytest.mark.parametrize("api", ["load", "load_slots"])
def test_reads_after_the_waits_see_the_loaded_blocks(path, api):
    dev, kv, pool, eng = rig(path)
    src, dst = [[1, 2, 3], [4, 5]], [10, 11, 12, 13, 14]
    try:
        flags = eng.layer_flags()
        slots = saved(eng, src)
        want = gather_ref(kv, [b for g in src for b in g])
        poison_blocks_(kv, dst)
        dev.copy_delay, dev.launch_delay = 0.05, 0.05  # every copy and scatter lands late
        with flags.arm(dev.current_stream()) as step:
            if api == "load":
                jobs = [eng.load(slots[0], dst[:3], flags=step), eng.load(slots[1], dst[3:], flags=step)]
            else:
                jobs = eng.load_slots(slots, dst, flags=step)
        out, done = read_after_waits(dev, kv, flags, dst)
        assert done.synchronize(WAIT_S)
        assert same(out, want)
        assert all(j.wait(WAIT_S) for j in jobs)
        assert flags.words.read()[:L] == [LANDED] * L
        eng.close()
    finally:
        dev.close()


def test_a_flag_waits_for_the_layer_of_every_load_of_the_step():
    """Two requests' loads in one step: flag l is set only once the second landed its layer l,
    although the first load (earlier on the load stream) landed all of it."""
    dev, kv, pool, eng = rig("kernel")
    gate = threading.Event()
    try:
        flags = eng.layer_flags()
        a_slot, b_slot = saved(eng, [[1, 2], [3, 4]])
        want = gather_ref(kv, [1, 2, 3, 4])
        poison_blocks_(kv, [10, 11, 12, 13])
        with flags.arm(dev.current_stream()) as step:
            a = eng.load(a_slot, [10, 11], flags=step)
            dev.launch(gate.wait, eng.load_stream)  # the second request's copies are held back
            b = eng.load(b_slot, [12, 13], flags=step)
        out, done = read_after_waits(dev, kv, flags, [10, 11, 12, 13])
        assert a.wait(WAIT_S)  # the first request landed every layer
        assert not done.query() and not b.event.query()
        assert out[0] is None  # no read ran: flag 0 waits for the second request's layer 0
        gate.set()
        assert done.synchronize(WAIT_S)
        assert same(out, want)
        eng.close()
    finally:
        gate.set()
        dev.close()


def test_reads_without_the_waits_see_stale_blocks():
    """The same step with the forward not waiting on the flags reads the blocks before they land
    (the hazard the waits remove)."""
    dev, kv, pool, eng = rig("kernel")
    try:
        flags = eng.layer_flags()
        (slot,) = saved(eng, [[1, 2, 3]])
        want = gather_ref(kv, [1, 2, 3])
        poison_blocks_(kv, [10, 11, 12])
        dev.launch_delay = 0.1
        with flags.arm(dev.current_stream()) as step:
            job = eng.load(slot, [10, 11, 12], flags=step)
        out = gather_ref(kv, [10, 11, 12])  # read now, no wait
        assert not same([out[:, layer] for layer in range(L)], want)
        assert job.wait(WAIT_S)
        eng.close()
    finally:
        dev.close()


def test_steps_re_arm_and_replay_the_same_waits():
    """Step after step, the same waits (constants) guard each step's loads; steps without loads
    pass them at once."""
    dev, kv, pool, eng = rig("kernel")
    try:
        flags = eng.layer_flags()
        slots = saved(eng, [[1, 2], [3, 4], [5, 6]])
        dev.launch_delay = 0.02
        for i, slot in enumerate(slots):
            dst = [10 + 2 * i, 11 + 2 * i]
            want = gather_ref(kv, [1 + 2 * i, 2 + 2 * i])
            poison_blocks_(kv, dst)
            with flags.arm(dev.current_stream()) as step:
                eng.load(slot, dst, flags=step)
            assert step.generation == i + 1
            out, done = read_after_waits(dev, kv, flags, dst)
            assert done.synchronize(WAIT_S) and same(out, want)
            _, idle = read_after_waits(dev, kv, flags, dst)  # a step without loads
            assert idle.synchronize(WAIT_S)
        eng.close()
    finally:
        dev.close()


def test_a_re_arm_follows_the_step_before_even_when_no_forward_waited_for_it():
    """Step 1 loads blocks whose request then went away (no wait on its flags); step 2 loads the
    same blocks. Step 1's late 'landed' must not satisfy step 2's waits (`tests/engine/
    test_flag_bugs.py` shows the bug without the ordering)."""
    dev, kv, pool, eng = rig("kernel")
    try:
        flags = eng.layer_flags()
        one, two = saved(eng, [[1, 2], [3, 4]])
        want = gather_ref(kv, [3, 4])
        dev.launch_delay = 0.1
        with flags.arm(dev.current_stream()) as first:
            eng.load(one, [10, 11], flags=first)
        with flags.arm(dev.current_stream()) as second:
            eng.load(two, [10, 11], flags=second)
        out, done = read_after_waits(dev, kv, flags, [10, 11])
        assert done.synchronize(WAIT_S) and same(out, want)
        eng.close()
    finally:
        dev.close()


def test_a_step_whose_loads_all_missed_sets_its_flags_at_the_seal():
    dev, kv, pool, eng = rig()
    try:
        flags = eng.layer_flags()
        with flags.arm(dev.current_stream()) as step:
            pass  # every request missed: nothing joined
        assert step.last is None
        _, done = read_after_waits(dev, kv, flags, [0])
        assert done.synchronize(WAIT_S)
        eng.close()
    finally:
        dev.close()


def _break_after_layer(eng, monkeypatch, layer):
    """The mover fails in the middle of a per-layer load, after layer `layer` was enqueued."""
    real = eng.mover.load

    def broken(path, ids, slot, stream, per_layer, label, done=None, mark=None):
        def failing(i):
            mark(i)
            if i == layer:
                raise RuntimeError("injected submit failure")

        return real(path, ids, slot, stream, per_layer, label, done, failing)

    monkeypatch.setattr(eng.mover, "load", broken)


@pytest.mark.parametrize("first", [True, False], ids=["only-load", "after-a-good-load"])
def test_a_failed_load_never_leaves_the_waits_blocked(monkeypatch, first):
    dev, kv, pool, eng = rig("kernel")
    try:
        flags = eng.layer_flags()
        good, bad = saved(eng, [[1, 2], [3, 4]])
        dev.launch_delay = 0.02
        with pytest.raises(RuntimeError, match="injected"), flags.arm(dev.current_stream()) as step:
            if not first:
                eng.load(good, [10, 11], flags=step)
            _break_after_layer(eng, monkeypatch, 1)
            eng.load(bad, [12, 13], flags=step)
        assert step.sealed is not None  # the `with` sealed it on the way out
        _, done = read_after_waits(dev, kv, flags, [10])
        assert done.synchronize(WAIT_S)  # every flag was set: the forward runs (its blocks: failed)
        eng.close()
    finally:
        dev.close()


def test_without_its_progress_a_failed_load_would_block_the_waits(monkeypatch):
    """The same failure with the failed load's progress left unset: the waits never pass (the
    deadlock `Writer.fail` prevents), until the device is closed."""
    dev, kv, pool, eng = rig("kernel")
    try:
        flags = eng.layer_flags()
        (bad,) = saved(eng, [[3, 4]])
        monkeypatch.setattr(Writer, "fail", lambda self, quiesced: None)
        with pytest.raises(RuntimeError, match="injected"), flags.arm(dev.current_stream()) as step:
            _break_after_layer(eng, monkeypatch, 1)
            eng.load(bad, [12, 13], flags=step)
        _, done = read_after_waits(dev, kv, flags, [12])
        assert not done.synchronize(0.5)  # flag 2 waits for a layer that will never be loaded
    finally:
        dev.close()  # releases the blocked streams


def test_close_seals_a_step_left_armed():
    dev, kv, pool, eng = rig()
    try:
        flags = eng.layer_flags()
        (slot,) = saved(eng, [[1, 2]])
        step = flags.arm(dev.current_stream())
        eng.load(slot, [10, 11], flags=step)
        _, done = read_after_waits(dev, kv, flags, [10, 11])
        eng.close()  # never sealed by the caller: close seals it
        assert step.sealed is not None and done.synchronize(WAIT_S)
    finally:
        dev.close()


def test_arming_seals_the_step_before_and_follows_it():
    dev, kv, pool, eng = rig()
    try:
        flags = eng.layer_flags()
        (slot,) = saved(eng, [[1, 2]])
        first = flags.arm(dev.current_stream())
        eng.load(slot, [10, 11], flags=first)
        second = flags.arm(dev.current_stream())  # the caller forgot to seal the first
        assert first.sealed is not None and flags.live is second
        second.seal()
        _, done = read_after_waits(dev, kv, flags, [10, 11])
        assert done.synchronize(WAIT_S)
        assert flags.words.read()[:L] == [LANDED] * L and ARMED != LANDED
        eng.close()
    finally:
        dev.close()


@pytest.mark.parametrize("sanitize", [True, False])
def test_a_stale_step_is_refused(sanitize):
    """A load through a sealed step's handle would land after that step's waits passed: refused,
    sanitizer or not (`test_flag_bugs.py` shows the wrong bytes it would give). A wait through it
    is the sanitizer's to catch."""
    dev, kv, pool, eng = rig(sanitize=sanitize)
    try:
        flags = eng.layer_flags()
        (slot,) = saved(eng, [[1, 2]])
        with flags.arm(dev.current_stream()) as old:
            pass
        with pytest.raises(LifecycleError) as err:
            eng.load(slot, [10, 11], flags=old)  # sealed: no wait would cover this load
        assert err.value.state == "SEALED (step 1)" and err.value.buffer == "kvtier-flags"
        with flags.arm(dev.current_stream()) as new:
            eng.load(slot, [10, 11], flags=new)
        with pytest.raises(LifecycleError) as err:
            eng.load(slot, [12, 13], flags=old)
        assert err.value.state.endswith("(step 2)")  # step 1 is not the live step any more
        if sanitize:
            with pytest.raises(LifecycleError) as err:
                old.wait(0)  # a wait through step 1's handle while step 2 is live
            assert err.value.buffer == "layer flag 0 of kvtier-flags" and "step 2" in err.value.state
        else:
            old.wait(0)  # the same words: it waits for the live step's flag
        eng.close()
    finally:
        dev.close()


def test_bad_flags_arguments_name_themselves():
    dev, kv, pool, eng = rig()
    other_dev, other_kv, other_pool, other = rig()
    try:
        flags = eng.layer_flags()
        (slot,) = saved(eng, [[1, 2]])
        with flags.arm(dev.current_stream()):
            pass
        with pytest.raises(ValueError, match="flags"):
            eng.load(slot, [10, 11], flags="step")
        with (
            other.layer_flags().arm(other_dev.current_stream()) as foreign,
            pytest.raises(ValueError, match="flags"),
        ):
            eng.load(slot, [10, 11], flags=foreign)
        with pytest.raises(ValueError, match="layer"):
            flags.wait(L)
        eng.close()
        other.close()
    finally:
        dev.close()
        other_dev.close()
