"""The baselines (peers' ways of moving KV): registered, the CPU one bit-exact, a wrong gather
caught; on a GPU, the rebuilt vLLM swap_blocks against torch and every baseline in a quick run."""

import pytest

torch = pytest.importorskip("torch")

from kvtier.bench import Context, registry  # noqa: E402

SUITES = registry()
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_baselines_are_registered():
    assert {"baseline_gather", "baseline_gather_d2h", "baseline_swap_blocks", "baseline_host_gather"} <= set(
        SUITES
    )
    assert SUITES["baseline_host_gather"].needs_gpu is False and SUITES["baseline_gather"].needs_gpu


def test_host_gather_baseline_runs_on_cpu_and_is_bit_exact():
    ctx = Context("cpu", quick=True)
    ctx.suite = "baseline_host_gather"
    rows = list(SUITES["baseline_host_gather"].fn(ctx))
    assert [r.params["block_size"] for r in rows] == [4, 16]
    assert all(r.correct is True and r.gbps > 0 and r.ceiling == "host_memcpy" for r in rows)
    assert "host_memcpy" in ctx.ceilings


def test_workload_check_catches_a_wrong_gather():
    from lab.suites.baseline import GPU_QUICK, Workload, index_select_all

    w = Workload(GPU_QUICK, torch.device("cpu"))
    views, ids, out = w.blocks(16)
    index_select_all(views, ids, out)
    assert w.matches(out, views, ids)
    out.view(torch.int16)[1, 0, 3, 5, 2, 7] ^= 1  # one bit of one element wrong
    assert not w.matches(out, views, ids)
    with pytest.raises(ValueError, match="bs"):
        w.blocks(3)


@pytest.mark.gpu
@gpu
def test_native_swap_blocks_matches_torch():
    from lab.native import NativeBuildError, SwapPlan

    src = torch.randint(-1000, 1000, (64, 16, 8), dtype=torch.int16, device="cuda")
    dst = torch.zeros(10, 16, 8, dtype=torch.int16, pin_memory=True)
    ids = torch.randperm(64)[:10]
    try:
        plan = SwapPlan([(src, dst)], torch.stack([ids, torch.arange(10)], 1))
    except NativeBuildError as e:
        pytest.skip(str(e))
    plan()
    torch.cuda.synchronize()
    assert torch.equal(dst, src[ids.cuda()].cpu())
    with pytest.raises(ValueError, match="out of range"):
        SwapPlan([(src, dst)], torch.tensor([[64, 0]]))


@pytest.mark.gpu
@gpu
def test_quick_bench_on_gpu_runs_every_baseline_bit_exact(tmp_path):
    from kvtier.bench import result, run_bench

    run = run_bench(quick=True, out_dir=tmp_path, progress=False)
    result.validate(run.doc)
    st = run.doc["suites"]
    assert st["baseline_gather"]["status"] == "ran" and st["baseline_gather_d2h"]["status"] == "ran"
    assert st["baseline_swap_blocks"]["status"] in ("ran", "skipped")
    assert not run.incorrect and all(r["correct"] is not False for r in run.doc["rows"])
    assert set(run.doc["environment"]["ceilings"]) >= {"d2d_copy", "h2d_pinned", "d2h_pinned", "bidir_pinned"}
    assert run.plot is not None and run.plot.exists()
