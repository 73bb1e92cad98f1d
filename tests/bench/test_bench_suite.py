"""The suite interface: register, Context.row / ceiling / time."""

import pytest

from kvtier.bench import probes
from kvtier.bench.stats import summarize
from kvtier.bench.suite import SUITES, Context, register


def test_register_and_reject_duplicates_and_bad_names():
    @register("zz_test_suite", needs_gpu=False)
    def suite(ctx):
        """First line is the description."""
        return []

    try:
        assert SUITES["zz_test_suite"].description == "First line is the description."
        assert SUITES["zz_test_suite"].needs_gpu is False
        with pytest.raises(ValueError, match="already registered"):
            register("zz_test_suite")(lambda ctx: [])
    finally:
        SUITES.pop("zz_test_suite")
    with pytest.raises(ValueError, match="name"):
        register("Bad Name")


def test_ceiling_is_measured_once_per_run(monkeypatch):
    calls = []

    def fake(timer, nbytes):
        calls.append(nbytes)
        return 12.5

    monkeypatch.setitem(
        probes.CEILINGS, "host_memcpy", probes.CeilingDef(fake, "host_memcpy_gbps", "x", False)
    )
    ctx = Context("cpu", quick=True)
    assert ctx.ceiling("host_memcpy") == 12.5 and ctx.ceiling("host_memcpy") == 12.5
    assert len(calls) == 1 and ctx.ceilings == {"host_memcpy": 12.5}


def test_ceiling_names_are_checked():
    ctx = Context("cpu", quick=True)
    with pytest.raises(ValueError, match="unknown"):
        ctx.ceiling("pcie_magic")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ctx.ceiling("d2d_copy")


def test_row_computes_gbps_and_ratio_from_the_same_run_ceiling():
    ctx = Context("cpu", quick=True)
    ctx.ceilings["host_memcpy"] = 4.0
    ctx.suite = "demo"
    r = ctx.row("c", 8_000_000, summarize([1.0, 2.0, 4.0]), "host_memcpy", traffic_factor=2, dtype="x", bs=3)
    assert r.suite == "demo" and r.gbps == pytest.approx(4.0)  # 8e6 B in 2 ms
    assert r.ratio == pytest.approx(4.0 * 2 / 4.0) and r.ceiling_gbps == 4.0
    assert r.params["timing"]["count"] == 3 and r.params["timing"]["clock"] == "perf_counter"
    assert {k: v for k, v in r.params.items() if k != "timing"} == {
        "dtype": "x",
        "bs": 3,
        "traffic_factor": 2.0,
    }
    assert (r.median_ms, r.min_ms, r.max_ms) == (2.0, 1.0, 4.0)


@pytest.mark.parametrize(
    "args, kwargs, arg",
    [
        (("", 1), {}, "case"),
        (("c", 0), {}, "nbytes"),
        (("c", 1.5), {}, "nbytes"),
        (("c", 10), {"traffic_factor": 0}, "traffic_factor"),
    ],
)
def test_row_rejects_bad_input(args, kwargs, arg):
    ctx = Context("cpu", quick=True)
    ctx.ceilings["host_memcpy"] = 1.0
    with pytest.raises(ValueError, match=arg):
        ctx.row(*args, summarize([1.0]), "host_memcpy", **kwargs)
    with pytest.raises(ValueError, match="timing"):
        ctx.row("c", 10, 1.0, "host_memcpy")


def test_time_uses_the_timer_and_reports_progress():
    ctx = Context("cpu", quick=True)
    seen = []
    ctx.on_progress = seen.append
    t = ctx.time(lambda: None, name="noop")
    assert t.count >= 3 and seen == ["noop"]
