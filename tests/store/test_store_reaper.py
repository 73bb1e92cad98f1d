"""The store's Reaper applies a job only once its event completed, queries each event once per
pass, and stops querying a stream past its first incomplete event."""

from kvtier.store.reaper import Reaper


class Event:
    def __init__(self, stream, done=False):
        self.stream, self.is_done, self.queries = stream, done, 0

    def query(self):
        self.queries += 1
        return self.is_done


class Job:
    def __init__(self, event):
        self.event, self.settled = event, 0

    def done(self):
        self.settled += 1
        return self.event.is_done


def reaper():
    applied = []
    r = Reaper(lambda job, entry, kind: applied.append((job, entry, kind)), lambda **_: None)
    r.close()  # no background thread: the test drives every pass
    return r, applied


def test_jobs_sharing_an_event_cost_one_query_and_apply_together():
    r, applied = reaper()
    ev = Event("load")
    jobs = [Job(ev) for _ in range(128)]  # one load_slots call: a job per chunk, one e_load
    for i, j in enumerate(jobs):
        r.track(j, i, "load")
    assert r.reap() == 0 and ev.queries == 1 and not applied  # in flight: nothing applied
    ev.is_done = True
    assert r.reap() == 128 and ev.queries == 2
    assert [e for _, e, _ in applied] == list(range(128)) and all(j.settled == 1 for j in jobs)
    assert r.reap() == 0 and len(r) == 0  # applied once


def test_a_stream_is_not_queried_past_its_first_incomplete_event():
    r, applied = reaper()
    a1, a2, b1 = Event("save", done=True), Event("save"), Event("load", done=True)
    a3 = Event("save", done=True)  # later on the same stream: cannot have completed before a2
    for j in (Job(a1), Job(a2), Job(b1), Job(a3)):
        r.track(j, None, "save")
    assert r.reap() == 2  # a1 and b1
    assert a3.queries == 0 and {applied[0][0].event, applied[1][0].event} == {a1, b1}
    a2.is_done = True
    assert r.reap() == 2 and len(r) == 0  # a2, then a3 in the same pass


def test_the_thread_queries_an_incomplete_job_once_per_slice():
    """While the oldest job's copies run, the thread wakes once a slice (each wake-up takes the
    GIL from the caller's forward), not in a tight poll; once the event completed it applies it."""
    import time

    applied = []
    r = Reaper(lambda job, entry, kind: applied.append(job), lambda **_: None, slice_s=0.01)
    try:
        ev = Event("s")
        r.track(Job(ev), None, "load")
        time.sleep(0.2)
        assert 5 <= ev.queries <= 30  # ~20 slices of 10 ms; a poll from 20 us would be hundreds
        ev.is_done = True
        deadline = time.monotonic() + 2
        while not applied and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(applied) == 1
    finally:
        r.close()
