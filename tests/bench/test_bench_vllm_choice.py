"""The `vllm` suite's choice rows on the CPU (`SimDevice`, the tiny Llama): per tier, each option
and the connector's choice through both halves of the connector, every loaded block checked bit
for bit; a stalled tier costs its loads their deadline and is then planned absent; decode steps
beside a read. The figures are the GPU's to judge: here the rows' shape and correctness."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _rows(monkeypatch, tiers: str, families=("choice", "beside_read")):
    from kvtier.bench.suite import Context
    from kvtier.bench.suites.vllm import TINY, Replay
    from kvtier.bench.suites.vllm_choice import choice_rows
    from kvtier.bench.suites.vllm_rows import Forward

    monkeypatch.setenv("KVTIER_VLLM_TIERS", tiers)
    ctx = Context("cpu", quick=True)
    ctx.suite = "vllm"
    fwd = Forward(ctx, TINY)
    rows = {row.case: row for row in choice_rows(ctx, fwd, Replay, "BLHNC", TINY, set(families))}
    return ctx, rows


def test_each_option_and_the_choice_of_a_slow_and_a_host_tier(monkeypatch):
    ctx, rows = _rows(monkeypatch, "host,slow")
    assert not ctx.skipped
    for tier in ("host", "slow"):
        label = f"{tier} 512 tokens"
        for kind in ("recompute", "load", "split"):
            assert f"option {kind} {label}" in rows
        choice = rows[f"choice {label}"]
        p = choice.params
        best = min(p["options_ms"].values())
        assert p["vs_best"] == pytest.approx(choice.median_ms / best)
        assert p["choice"] in ("load", "split", "recompute") and p["predicted_ms"] > 0
        assert choice.correct and rows[f"option load {label}"].correct  # loaded blocks bit-exact
        assert not rows[f"option load {label}"].params["cut"]
        assert 0 < rows[f"option split {label}"].params["split_chunks"] < p["chunks"]
    assert "step_beside_read host 512 tokens" not in rows  # the host has nothing to read
    beside = rows["step_beside_read slow 512 tokens"].params
    assert beside["steps_beside"] > 0 and beside["steps_alone"] > 0 and "slowdown_pct" in beside


def test_a_stalled_tier_is_cut_at_its_deadline_then_planned_absent(monkeypatch):
    ctx, rows = _rows(monkeypatch, "stalled", ("choice",))
    label = "stalled 512 tokens"
    load = rows[f"option load {label}"]
    assert load.params["cut"] and load.correct and load.median_ms >= 500  # half a second or more
    choice = rows[f"choice {label}"].params
    assert choice["absent"] == "stalled" and choice["choice"] == "recompute" and choice["best"] == "recompute"


def test_the_tiers_asked_are_checked_by_name():
    from kvtier.bench.suites.vllm import rows_asked
    from kvtier.bench.suites.vllm_choice import TIERS, tiers_asked

    assert tiers_asked(None) == TIERS and tiers_asked("Disk, slow") == ("disk", "slow")
    with pytest.raises(ValueError, match="KVTIER_VLLM_TIERS"):
        tiers_asked("tape")
    assert rows_asked("choice,beside_read") == {"choice", "beside_read"}


def test_a_run_starts_with_no_chunk_of_the_prefix_in_the_host_of_a_lower_tiers_cell(monkeypatch):
    """A recompute saves its chunks as the connector does; before the next run they are all out of
    the host (their pushes to the slow tier finished first: a push pins its entry), so the next
    load reads the tier's copy, the one the rows check against (on a GPU a recompute's KV is bf16
    apart from it). The writer thread is made to lag, as it may behind a GPU's copies."""
    import time
    from contextlib import ExitStack

    from kvtier.store.writer import Writer

    landed = Writer._landed

    def late(self, push):
        time.sleep(0.05)
        return landed(self, push)

    monkeypatch.setattr(Writer, "_landed", late)

    from kvtier.bench.suite import Context
    from kvtier.bench.suites.vllm import TINY, Replay
    from kvtier.bench.suites.vllm_choice import Cell
    from kvtier.bench.suites.vllm_rows import Forward

    ctx = Context("cpu", quick=True)
    ctx.suite = "vllm"
    fwd = Forward(ctx, TINY)
    with ExitStack() as stack:
        cell = Cell.make(ctx, fwd, Replay, "BLHNC", TINY, "slow", 512, stack)
        cell.recompute_once()
        cell.clean()
        store = cell.r.ws.store
        assert not any(store.host.contains(k) for k in store.keys(cell.names))
        assert cell.load_once(cell.hit_chunks)[1]["landed"] == cell.hit_chunks * cell.ct and cell.exact
