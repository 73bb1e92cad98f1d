"""The `sizes` suite on the CPU (--quick): GB/s over transfer size, a copy and kvtier's engine at
each size, every engine row checked bit for bit, against the run's host_memcpy ceiling."""

from __future__ import annotations

from kvtier.bench import Context
from kvtier.bench.runner import suites

MiB = 1 << 20


def test_quick_cpu_sweep_rows_each_size_each_path_correct():
    info = suites()["sizes"]
    assert info.needs_gpu is False
    ctx = Context("cpu", quick=True)
    ctx.suite = "sizes"
    rows = list(info.fn(ctx))
    want = [f"{what} {n} MiB" for n in (1, 4, 16, 64) for what in ("memcpy", "engine save", "engine load")]
    assert [r.case for r in rows] == want
    assert {r.ceiling for r in rows} == {"host_memcpy"} and all(r.gbps > 0 for r in rows)
    engine = [r for r in rows if r.case.startswith("engine")]
    assert all(r.correct is True for r in engine)
    assert [r.bytes for r in engine] == [n * MiB for n in (1, 1, 4, 4, 16, 16, 64, 64)]
    assert {r.params["block_size"] for r in engine} == {8, 16}  # 1 MiB of Llama-3-8B KV: 8 tokens
