"""The pinned ids ring of the staged graphs (engine/ids.py `HostRing`): a buffer is written again
only once the event recorded after the copy that read it has completed. Fake events: each records
into a log, completes when the test says so; `synchronize` is the host waiting for it."""

import random

import pytest

from kvtier.engine.fastpath.ring import HostRing


class FakeEvent:
    def __init__(self, log):
        self.log, self.done, self.waits = log, True, 0

    def record(self, stream):
        self.done = False  # like cudaEventRecord: pending until the stream reaches it
        self.log.append(("record", self, stream))

    def query(self):
        return self.done

    def synchronize(self):
        self.waits += 1
        self.done = True  # the host blocked until the copy ran


def ring(depth=2, max_depth=4):
    log, made = [], []

    def make_buffer():
        made.append(object())
        return made[-1]

    return HostRing(make_buffer, lambda: FakeEvent(log), depth=depth, max_depth=max_depth), log, made


def test_round_robin_when_every_copy_completed():
    r, log, made = ring(depth=3)
    seen = []
    for _ in range(7):
        i = r.take()
        seen.append(r.buffers[i])
        r.arm(i, "s")
        log[-1][1].done = True  # the copy ran
    assert seen == [made[0], made[1], made[2]] * 2 + [made[0]]
    assert len(r) == 3 and r.grown == 0 and r.waited == 0


def test_a_buffer_still_read_is_never_handed_out():
    r, log, made = ring(depth=2, max_depth=4)
    busy = []
    for _ in range(4):  # four copies in flight, none completed
        i = r.take()
        assert all(r.buffers[i] is not b for b in busy)  # not one a queued copy still reads
        busy.append(r.buffers[i])
        r.arm(i, "s")
    assert len(r) == 4 and r.grown == 2 and r.waited == 0
    # All four in flight, the ring is full: the host waits for the oldest copy, then reuses it.
    i = r.take()
    assert r.buffers[i] is busy[0] and r.waited == 1
    ev = log[0][1]
    assert ev.waits == 1 and ev.done


def test_oldest_completed_buffer_is_reused_first():
    r, log, made = ring(depth=2, max_depth=8)
    a = r.take()
    r.arm(a, "s")
    b = r.take()
    r.arm(b, "s")
    log[0][1].done = True  # the first copy ran, the second has not
    i = r.take()
    assert r.buffers[i] is made[0] and len(r) == 2


def test_randomized_reuse_only_after_completion():
    rng = random.Random(0)
    r, log, _made = ring(depth=2, max_depth=6)
    reader = {}  # buffer id -> event of the copy reading it
    for _ in range(500):
        for ev in {e for _k, e, _s in log}:
            if not ev.done and rng.random() < 0.3:
                ev.done = True  # copies complete in any order
        i = r.take()
        buf = r.buffers[i]
        prev = reader.get(id(buf))
        assert prev is None or prev.query(), "a buffer was handed out while a copy may still read it"
        r.arm(i, "s")
        reader[id(buf)] = log[-1][1]
    assert len(r) <= 6


def test_a_failed_copy_leaves_the_buffer_free():
    r, log, made = ring(depth=2)
    i = r.take()  # ... the copy was never enqueued (error): no arm
    j = r.take()
    assert i == j and not log


@pytest.mark.parametrize("depth, max_depth", [(0, 4), (5, 4)])
def test_depth_checked(depth, max_depth):
    with pytest.raises(ValueError, match="depth"):
        HostRing(object, object, depth=depth, max_depth=max_depth)


def test_a_buffer_guarded_by_the_jobs_event():
    r, log, made = ring(depth=2, max_depth=4)
    job = FakeEvent([])
    i = r.take()
    r.arm_with(i, job)  # the caller records the job's event after the copy
    job.record("s")
    assert not log  # the ring recorded nothing of its own
    j = r.take()
    r.arm_with(j, FakeEvent([]))  # never recorded (the submit failed after the copy): reads as free
    k = r.take()
    assert r.buffers[k] is not made[0]  # the job is still pending: its buffer is not handed out
    job.done = True
    r.arm(k, "s")
    log[-1][1].done = True
    assert r.buffers[r.take()] is made[0]  # the job completed: its buffer comes back


def test_randomized_mix_of_own_and_job_events():
    rng = random.Random(1)
    r, log, _made = ring(depth=2, max_depth=8)
    events, reader = [], {}
    for _ in range(500):
        for ev in events:
            if not ev.done and rng.random() < 0.3:
                ev.done = True  # copies and jobs complete in any order
        i = r.take()
        buf = r.buffers[i]
        prev = reader.get(id(buf))
        assert prev is None or prev.query(), "a buffer was handed out while a copy may still read it"
        if rng.random() < 0.5:
            r.arm(i, "s")
            ev = log[-1][1]
        else:
            ev = FakeEvent([])
            r.arm_with(i, ev)
            ev.record("s")
        events.append(ev)
        reader[id(buf)] = ev
    assert len(r) <= 8
