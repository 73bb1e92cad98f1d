"""The vllm suite's decode_beside rows on the CPU (SimDevice, the tiny shape): every mode's row,
its loads checked against the saved prefix, a background load for a running batch unless the
mode loads in the step."""

from __future__ import annotations

import pytest

from kvtier.bench.suite import Context
from kvtier.bench.suites.vllm import TINY
from kvtier.bench.suites.vllm_decode import MODES, decode_rows

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")


@pytest.mark.parametrize("order", ["LBHNC", "BLHNC"])
def test_decode_beside_rows_every_mode_exact(order):
    ctx = Context("cpu", quick=True)
    ctx.suite = "vllm"
    rows = list(decode_rows(ctx, order, TINY))
    assert [r.case for r in rows] == [f"decode_beside {m} {order} 4" for m in MODES]
    for r in rows:
        p = r.params
        assert r.correct, (r.case, p)
        assert p["transfers"] > 0 and p["p50_ratio"] > 0 and p["p99_ratio"] > 0
        assert p["submit_us_p99"] is not None and p["step_ms_nothing"] > 0
        assert p["background"] == (None if p["mode"] == "save" else p["mode"] != "load_in_step")
        assert p["load_errors"] == 0 and p["save_errors"] == 0
