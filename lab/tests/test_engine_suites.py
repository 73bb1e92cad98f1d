"""The engine bench suites (bidir, save_beside_matmul, submit_overhead): registered, skip cleanly
without a GPU, and submit_overhead's quick dry pass runs on the simulator."""

import pytest

torch = pytest.importorskip("torch")

from kvtier.bench import Context, SkipSuite, registry  # noqa: E402
from lab.suites.interference import SaveLoop  # noqa: E402

SUITES = registry()

NAMES = ("bidir", "save_beside_matmul", "submit_overhead")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")


def test_registered():
    for name in NAMES:
        assert SUITES[name].needs_gpu and SUITES[name].description
        assert SUITES[name].fn.__module__ in (
            "lab.suites.bidir",
            "lab.suites.interference",
            "lab.suites.submit",
        )


@no_gpu
@pytest.mark.parametrize("name", NAMES)
def test_skip_without_gpu(name):
    with pytest.raises(SkipSuite, match="CUDA GPU"):
        list(SUITES[name].fn(Context("cpu", quick=False)))


@no_gpu
@pytest.mark.parametrize("name", ("bidir", "save_beside_matmul"))
def test_skip_without_gpu_quick(name):
    with pytest.raises(SkipSuite, match="CUDA GPU"):
        list(SUITES[name].fn(Context("cpu", quick=True)))


@no_gpu
def test_runner_skips_them_without_gpu():
    from kvtier.bench import plan

    run, skipped = plan(list(NAMES), on_gpu=False)
    assert run == [] and set(NAMES) <= set(skipped)


@no_gpu
def test_submit_overhead_dry_pass_on_sim():
    ctx = Context("cpu", quick=True)
    ctx.suite = "submit_overhead"
    rows = list(SUITES["submit_overhead"].fn(ctx))
    assert [r.case.split()[0] for r in rows] == ["save", "load"] * 3
    blocks = {r.params["blocks"] for r in rows}
    assert blocks == {256, 16, 1}  # block counts varying 256x
    for r in rows:
        assert r.ceiling == "host_memcpy" and r.gbps > 0
        p = r.params
        assert 0 < p["submit_us_min"] <= p["submit_us"] <= p["submit_us_max"]
        assert p["job_submit_us"] > 0 and p["flat_ratio"] >= 1 and p["flat_ratio_cold"] >= 1
        # P6's verdict reads the hot median; the figure after a GPU wait has a verdict of its own
        assert p["p6_row"] and p["p6_reads"] == "hot" and p["meets_target"] == (p["submit_hot_us"] <= 100.0)
        assert p["meets_target_cold"] == (p["submit_us"] <= 100.0)
        assert 0 < p["submit_hot_us_min"] <= p["submit_hot_us"] <= p["submit_hot_us_max"]
        assert p["engine_path"] in ("staged", "kernel")
        assert p["host_ref_hot_us"] > 0 and p["host_ref_after_wait_us"] > 0  # the host's yardstick
        assert p["submit_busy_us"] > 0 and p["busy_ms"] > 0 and isinstance(p["meets_target_busy"], bool)
        assert p["submit_hot_py_us"] > 0 and p["submit_hot_calls_us"] > 0  # the sim's event record
        assert p["submit_traced_us"] >= p["submit_hot_py_us"]  # the traced pass whole
        phases = p["submit_traced_phases_us"]  # each marked phase's median, the whole among them
        assert {"ids", "tracker_begin", "total"} <= set(phases)
        assert phases["total"] == pytest.approx(p["submit_traced_us"], abs=0.01)
        assert p["hot_sampling"] == "interleaved"


@no_gpu
def test_cases_that_do_not_fit_at_once_run_one_after_the_other(monkeypatch):
    """Where a second engine's pinned pool does not fit beside the first, the suite says so and
    takes the cases one at a time (rows in row order), leaving no engine open."""
    from lab.suites import submit

    real_init, real_close, alive = submit.Rig.__init__, submit.Rig.close, []

    def init(self, *args):
        if alive:
            raise RuntimeError("pinned memory: no room for a second pool (test)")
        real_init(self, *args)
        alive.append(self)

    def close(self):
        real_close(self)
        alive.remove(self)

    monkeypatch.setattr(submit.Rig, "__init__", init)
    monkeypatch.setattr(submit.Rig, "close", close)
    ctx = Context("cpu", quick=True)
    ctx.suite = "submit_overhead"
    rows = list(SUITES["submit_overhead"].fn(ctx))
    assert [r.case.split()[0] for r in rows] == ["save", "load"] * 3
    assert {r.params["blocks"] for r in rows} == {256, 16, 1}
    assert {r.params["hot_sampling"] for r in rows} == {"in row order"}
    assert [s["case"] for s in ctx.skipped] == ["submit hot samples interleaved"]
    assert "no room for a second pool" in ctx.skipped[0]["reason"] and alive == []


def test_hot_samples_interleave_the_cases_and_directions():
    """Each rep takes one hot pair of every case and direction, the first case rotating, a case's
    save and load pairs in turn (which first alternates); the warm-up pairs come first and are not
    samples."""
    from types import SimpleNamespace

    from lab.suites.submit import interleaved_hot

    order = []

    def rig(name):
        def call(direction):
            def submit(start):
                order.append(name + direction[0])
                return SimpleNamespace()

            return submit

        eng = SimpleNamespace(wait=lambda job: None)
        return SimpleNamespace(
            eng=eng, calls={d: call(d) for d in ("save", "load")}, hot={"save": [], "load": []}
        )

    rigs = [rig("a"), rig("b"), rig("c")]
    interleaved_hot(rigs, 4, warmup=1)
    assert order[:12] == ["as", "as", "al", "al", "bs", "bs", "bl", "bl", "cs", "cs", "cl", "cl"]  # warm-up
    pairs = order[12::2]
    assert pairs == order[13::2]  # every sample a pair: untimed submit, timed submit
    reps = [["as", "al", "bs", "bl", "cs", "cl"], ["bl", "bs", "cl", "cs", "al", "as"]]
    reps += [["cs", "cl", "as", "al", "bs", "bl"], ["al", "as", "bl", "bs", "cl", "cs"]]
    assert pairs == [p for rep in reps for p in rep]  # cases rotating, directions alternating
    assert [len(r.hot[d]) for r in rigs for d in ("save", "load")] == [4] * 6
    assert all(us > 0 for r in rigs for d in r.hot for us in r.hot[d])


def test_flat_ratio_reads_p6_rows_only():
    from types import SimpleNamespace

    from lab.suites.submit import flat_ratios

    def row(case, hot, cold, p6=True):
        return SimpleNamespace(case=case, params={"submit_hot_us": hot, "submit_us": cold, "p6_row": p6})

    rows = [row("save bs1", 80, 300), row("save bs16", 40, 100), row("save bs16 4GiB", 400, 900, False)]
    rows += [row("load bs1", 50, 200), row("load bs16", 50, 250)]
    flat_ratios(rows)
    assert [r.params.get("flat_ratio") for r in rows] == [2.0, 2.0, None, 1.0, 1.0]
    assert rows[0].params["flat_ratio_cold"] == 3.0 and rows[3].params["flat_ratio_cold"] == 1.25


def test_host_reference_checks_and_times():
    from lab.hostref import host_reference

    r = host_reference(64, wait_s=0.001, reps=2, gpu=False)
    assert r["ids"] == 64 and r["hot_us"] > 0 and r["after_sleep_us"] > 0 and r["after_gpu_wait_us"] is None
    for bad in ({"n_ids": 0}, {"n_ids": True}, {"wait_s": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            host_reference(**bad)


def test_summary_names_the_host_yardstick():
    from lab.summary import engine_figure

    p = {"submit_us": 412.0, "submit_hot_us": 130.0, "blocks": 512, "host_ref_hot_us": 4.3}
    p |= {"host_ref_after_wait_us": 167.0, "submit_busy_us": 301.0, "busy_ms": 3.0}
    assert engine_figure({"params": p}) == (
        "submit 412 us, 130 us hot, 301 us after 3 ms of host work for 512 blocks"
        " (host: 512-id check 4.3 / 167 us)"
    )
    p |= {"submit_hot_py_us": 71.0, "submit_hot_calls_us": 44.0}
    assert "130 us hot (71 Python + 44 runtime calls)" in engine_figure({"params": p})


def test_save_loop_keeps_jobs_queued_and_reraises():
    submitted, finished = [], []

    def submit():
        submitted.append(len(submitted))
        return submitted[-1]

    def finish(j):
        finished.append(j)
        return j

    with SaveLoop(submit, finish, depth=3) as loop:
        while len(finished) < 10:
            pass
    assert loop.events == finished == submitted  # every job finished, in order, none left queued

    def broken():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), SaveLoop(broken, finish):
        pass


def test_a_hold_keeps_the_hosts_submit_out_of_the_job_timing():
    """bidir's runs start after a hold of the timing stream: a slow host's submit (here 30 ms) is
    then not copy time, and `held` says the start was still pending once the jobs were in."""
    import time
    from types import SimpleNamespace

    from kvtier.device import SimDevice
    from lab.suites.engine_rig import time_jobs

    dev = SimDevice()
    side = dev.new_stream("copy")

    def submit(start):
        time.sleep(0.03)  # the host takes 30 ms to submit
        side.wait_event(start)  # the job starts no earlier than the timer's start
        dev.launch(lambda: time.sleep(0.005), side)  # 5 ms of "copy"
        return [SimpleNamespace(event=side.record("done"))]

    def finish(jobs):
        for j in jobs:
            j.event.synchronize()  # the next run starts from an idle device

    try:
        unheld = time_jobs(dev, submit, finish, 3, warmup=1)
        held: list[bool] = []
        t = time_jobs(dev, submit, finish, 3, warmup=1, hold_ms=150, held=held)
        short: list[bool] = []
        time_jobs(dev, submit, finish, 2, warmup=0, hold_ms=1, held=short)
    finally:
        dev.close()
    assert unheld.median_ms >= 30  # the host's submit counted
    assert 5 <= t.median_ms < 25 and held == [True, True, True]
    assert short == [False, False]  # a hold shorter than the submit: said so


def test_alternating_runs_take_turns_and_copies_move_the_bytes():
    """P4's verdict times the jobs and the plain bidirectional copies in turn: one run of each per
    round, the order reversed every other round, warm-up runs untimed; `Copies` moves both ways."""
    from types import SimpleNamespace

    from kvtier.device import SimDevice
    from lab.suites.bidir import Copies
    from lab.suites.engine_rig import time_alternating

    dev = SimDevice()
    order: list[str] = []
    side = dev.new_stream("copy")

    def job(name):
        def submit(start):
            order.append(name)
            side.wait_event(start)  # no earlier than the timer's start
            return [SimpleNamespace(event=side.record(name))]

        return submit

    def finish(jobs):
        for j in jobs:
            j.event.synchronize()  # the next run starts from an idle device

    copies = Copies(dev, 1 << 16)
    try:
        held: list[bool] = []
        runs = [(job("a"), finish, held), (job("b"), finish, None)]
        a, b = time_alternating(dev, runs, reps=3, warmup=1)
        copies.h_in.random_(0, 256)
        want_out = copies.g_out.clone()
        time_alternating(dev, [(copies, copies.finish, None)], reps=1, warmup=0)
    finally:
        copies.close()
        dev.close()
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]  # warm-up round, then 3 timed ones
    assert a.count == b.count == 3 and len(held) == 3
    assert torch.equal(copies.g_in, copies.h_in) and torch.equal(copies.h_out, want_out)
    assert want_out.float().std() > 0  # random bytes, not zeros


def test_copies_give_back_what_they_pinned_when_an_allocation_fails():
    from kvtier.device import SimDevice
    from lab.suites.bidir import Copies

    dev = SimDevice()
    freed = []
    dev.free_pinned = freed.append  # a spy: the buffers given back

    def short(nbytes):
        raise torch.OutOfMemoryError("device memory short")

    dev.empty = short
    try:
        with pytest.raises(torch.OutOfMemoryError):
            Copies(dev, 1 << 12)
    finally:
        dev.close()
    assert len(freed) == 2  # both pinned buffers, made before the failing device allocation
