"""GPU-only checks of the measurement layer (skipped without CUDA)."""

import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _sleep_kernel():
    """~10-50 ms of GPU time that returns to the CPU at once."""
    return lambda: torch.cuda._sleep(50_000_000)  # clock cycles


def test_cuda_events_see_the_work_an_unsynced_host_clock_misses():
    from kvtier.bench.timing import Timer

    fn = _sleep_kernel()
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    naive_ms = (time.perf_counter() - t0) * 1e3  # the classic mistake: only the launch is timed
    torch.cuda.synchronize()
    t = Timer("cuda", warmup=1, min_reps=3, budget_s=0.5).time(fn)
    assert t.clock == "cuda_events"
    assert naive_ms < t.median_ms / 4


def test_graph_replay_cuts_launch_overhead():
    from kvtier.bench.probes import launch_us
    from kvtier.bench.timing import Timer

    us = launch_us(Timer("cuda", min_reps=3, budget_s=0.3))
    assert 0 < us["launch_graph_us"] < us["launch_eager_us"]


def test_flush_l2_runs_outside_the_timed_events():
    from kvtier.bench.timing import Timer

    x = torch.empty(1 << 20, device="cuda")
    t = Timer("cuda", min_reps=3, budget_s=0.2).time(lambda: x.zero_(), flush_l2=True)
    assert t.median_ms < 1.0  # a 4 MiB zero_, not the 2x L2 flush before it


def test_sm_copy_through_uva_is_bit_exact():
    from kvtier.bench.smcopy import sm_copy

    g = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8, device="cuda")
    h = torch.zeros(3 << 20, dtype=torch.uint8, pin_memory=True)
    sm_copy(h, g)
    torch.cuda.synchronize()
    assert torch.equal(h.cuda(), g)
    g2 = torch.empty_like(g)
    sm_copy(g2, h)
    assert torch.equal(g2, g)
    with pytest.raises(ValueError, match="pinned"):
        sm_copy(torch.empty(3 << 20, dtype=torch.uint8), g)


def test_quick_probe_on_gpu():
    from kvtier.bench.probe import run_probe

    rep = run_probe(quick=True)
    got = {f.name: f for f in rep.figures}
    for name in ("d2d_copy_gbps", "h2d_pinned_gbps", "d2h_pinned_gbps", "bidir_pinned_gbps", "bf16_tflops"):
        assert got[name].error is None and got[name].value > 0, got[name]
    assert rep.environment["topology"].get("pcie") or rep.environment["topology"].get("error")
    rep.ceilings()  # a valid ceilings file
