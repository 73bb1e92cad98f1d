"""The Timer on the host clock, against the classic timing mistakes (CPU only; GPU: test_bench_gpu)."""

import queue
import threading
import time

import pytest

from kvtier.bench.timing import Timer


class FakeAsyncDevice:
    """Work is queued to a worker thread and the call returns at once, like a CUDA launch:
    submitted is not done. `synchronize()` waits until all submitted work has run."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._worker, daemon=True).start()

    def _worker(self):
        while True:
            seconds = self.q.get()
            time.sleep(seconds)
            self.q.task_done()

    def submit(self, seconds: float) -> None:
        self.q.put(seconds)

    def synchronize(self) -> None:
        self.q.join()


WORK = 0.02  # seconds of "device" work per call


def test_timing_without_sync_under_reports_and_the_timer_does_not():
    dev = FakeAsyncDevice()
    fn = lambda: dev.submit(WORK)

    # the classic mistake: a host clock around an asynchronous call measures the submission
    naive = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        naive.append(time.perf_counter() - t0)
    dev.synchronize()
    assert max(naive) < WORK / 4

    # the same mistake inside a timer that is not told how to wait
    unsynced = Timer("cpu", warmup=1, min_reps=5, budget_s=0.3).time(fn)
    dev.synchronize()
    assert unsynced.median_s < WORK / 4

    # the Timer with the device's synchronize measures the work itself
    t = Timer("cpu", sync=dev.synchronize, warmup=1, min_reps=5, budget_s=0.5).time(fn)
    assert WORK * 0.9 <= t.median_s <= WORK * 3
    assert t.count >= 5 and t.clock == "perf_counter"


def test_setup_work_is_not_billed_to_the_timed_run():
    dev = FakeAsyncDevice()
    setup = lambda: dev.submit(0.05)  # e.g. poisoning an output, still running when setup returns
    t = Timer("cpu", sync=dev.synchronize, warmup=0, min_reps=3, budget_s=0.1).time(
        lambda: dev.submit(0.005), setup=setup
    )
    assert t.max_ms < 40  # 5 ms of work, not 55


def test_warmup_keeps_one_time_costs_out():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.08 if len(calls) == 1 else 0.001)  # first call "compiles"

    cold = Timer("cpu", warmup=0, min_reps=3, budget_s=0.05).time(fn)
    assert cold.max_ms >= 75  # without warm-up the compile shows up in the figures
    calls.clear()
    warm = Timer("cpu", warmup=1, min_reps=3, budget_s=0.05).time(fn)
    assert warm.max_ms < 40


def test_stops_early_when_spread_is_small():
    t = Timer("cpu", warmup=0, min_reps=4, max_reps=1000, budget_s=10, rel_spread=10.0).time(lambda: None)
    assert t.count == 4


def test_stops_at_the_time_budget():
    t0 = time.perf_counter()
    t = Timer("cpu", warmup=0, min_reps=2, max_reps=10_000, budget_s=0.1, rel_spread=0.0).time(
        lambda: time.sleep(0.002)
    )
    assert time.perf_counter() - t0 < 1.0
    assert 2 <= t.count < 200


def test_stops_at_max_reps():
    t = Timer("cpu", warmup=0, min_reps=1, max_reps=7, budget_s=100, rel_spread=0.0).time(lambda: None)
    assert t.count <= 7


def test_host_l2_flush_runs_untimed():
    t = Timer("cpu", warmup=0, min_reps=2, budget_s=0.01).time(lambda: None, flush_l2=True)
    assert t.median_ms < 5  # the 128 MiB overwrite happens before the clock starts


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"warmup": -1}, "warmup"),
        ({"min_reps": 0}, "min_reps"),
        ({"min_reps": 5, "max_reps": 2}, "max_reps"),
        ({"budget_s": 0}, "budget_s"),
        ({"rel_spread": -1}, "rel_spread"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_bad_settings_name_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        Timer(**({"device": "cpu"} | kwargs))


def test_graph_needs_cuda_and_fn_must_be_callable():
    timer = Timer("cpu")
    with pytest.raises(ValueError, match="graph"):
        timer.time(lambda: None, graph=True)
    with pytest.raises(ValueError, match="fn"):
        timer.time(42)
