"""The pinned ids buffers of one staged-graph exec (engine/ids.py `IdsBuffers`): a buffer is
written again only once the event recorded after the launch that read it has completed; the
exec's own buffer is reused while free (no node update), another is taken while it is read.
Fake events complete when the test says so; `synchronize` is the host waiting for it."""

import random

import pytest

from kvtier.engine.ids import IdsBuffers


class FakeEvent:
    def __init__(self, done=False):
        self.done, self.waits = done, 0

    def query(self):
        return self.done

    def synchronize(self):
        self.waits += 1
        self.done = True  # the host blocked until the launch ran


def bufs(max_depth=4):
    made = []

    def make_buffer():
        made.append(object())
        return made[-1]

    return IdsBuffers(make_buffer, max_depth=max_depth), made


def launch(b, movable=True):
    """One replay: take, use with a new pending event; (buffer, its event)."""
    k = b.take(movable)
    ev = FakeEvent()
    b.use(k, ev)
    return b.buffers[k], ev


def test_the_execs_buffer_is_reused_while_its_launches_complete():
    b, made = bufs()
    for _ in range(5):
        buf, ev = launch(b)
        assert buf is made[0]
        ev.done = True  # the launch ran
    assert len(b) == 1 and b.moved == 0 and b.grown == 0 and b.waited == 0


def test_a_buffer_still_read_is_never_handed_out():
    b, made = bufs(max_depth=3)
    busy = []
    for _ in range(3):  # three launches queued, none completed
        buf, ev = launch(b)
        assert all(buf is not x for x, _e in busy)  # not one a queued launch still reads
        busy.append((buf, ev))
    assert len(b) == 3 and b.grown == 2 and b.moved == 2 and b.waited == 0
    # All three queued and no room to grow: the host waits for a launch that is not the newest.
    buf, _ev = launch(b)
    waited = [e for x, e in busy if x is buf]
    assert b.waited == 1 and waited[0].waits == 1 and buf is not busy[-1][0]


def test_a_free_buffer_is_preferred_to_a_new_one():
    b, made = bufs(max_depth=8)
    _buf0, e0 = launch(b)
    buf1, e1 = launch(b)  # the first still queued: a second buffer
    assert buf1 is made[1]
    e0.done = True  # the first ran, the second has not
    buf2, _e2 = launch(b)
    assert buf2 is made[0] and len(b) == 2


def test_an_exec_that_cannot_move_waits_for_its_one_buffer():
    b, made = bufs()
    _buf, ev = launch(b, movable=False)
    buf, _ev = launch(b, movable=False)
    assert buf is made[0] and len(b) == 1 and b.waited == 1 and ev.waits == 1


def test_an_unrecorded_guard_reads_as_free():
    b, made = bufs()
    k = b.take()
    b.use(k, FakeEvent(done=True))  # the job's event, not recorded (the submit failed later)
    assert b.take() == k


def test_max_depth_checked():
    with pytest.raises(ValueError, match="max_depth"):
        IdsBuffers(object, max_depth=0)


def test_randomized_reuse_only_after_completion():
    rng = random.Random(0)
    b, _made = bufs(max_depth=6)
    reader, events = {}, []  # buffer id -> event of the launch that last read it
    for _ in range(500):
        for ev in events:
            if not ev.done and rng.random() < 0.3:
                ev.done = True  # launches complete in any order
        k = b.take(movable=rng.random() < 0.9)
        buf = b.buffers[k]
        prev = reader.get(id(buf))
        assert prev is None or prev.query(), "a buffer was handed out while a launch may still read it"
        ev = FakeEvent()
        b.use(k, ev)
        assert b.buffers[b.cur] is buf  # what the node reads from now on
        events.append(ev)
        reader[id(buf)] = ev
    assert len(b) <= 6
