"""The `vllm` suite's full-graph rows (`vllm_graphs.py`) on the CPU: the code path the GPU runs,
with SimDevice's late copies standing in for the load stream and the steps run eagerly instead of
replayed. The hit through the flags gives the recompute's logits, and reads poisoned blocks
without the waits; the rows come out with their params, correct."""

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _setup(order="LBHNC"):
    from kvtier.bench.suite import Context
    from kvtier.bench.suites.vllm import TINY, Replay
    from kvtier.bench.suites.vllm_rows import Forward

    ctx = Context("cpu", quick=True)
    ctx.suite = "vllm"
    shape = TINY | {"dtype": torch.float32}
    fwd = Forward(ctx, shape)
    return ctx, fwd, Replay(ctx, order, shape, 128)


def _saved_prompt(fwd, r):
    from kvtier.bench.suites.vllm_graphs import pick_prompt, write_prompt_kv

    n = r.blocks * r.kv.block_size
    ids, token, gap = pick_prompt(fwd, n)
    write_prompt_kv(r, fwd.lean, ids)
    r.step(r.meta(save=True))
    r.settle_saves()
    return ids, token


@pytest.mark.parametrize("waits", ["inline", "branch", None])
def test_a_hit_through_the_flags_reads_only_landed_blocks(waits):
    from kvtier.bench.suites.vllm_graphs import FlagHit, FullGraph
    from kvtier.bench.suites.vllm_rows import PagedPrefix

    ctx, fwd, r = _setup()
    try:
        ids, _ = _saved_prompt(fwd, r)
        want = fwd.lean.logits(ids)
        r.poison()  # only the load can make the blocks right
        r.dev.launch_delay = 0.05  # each layer's scatter lands late
        full = FullGraph(fwd.lean, PagedPrefix(r), ids, r.ws.store.engine.layer_flags(), waits=waits)
        hit = FlagHit(r, full)
        logits, all_hit = hit(ids, r.meta(load=True))
        r.sync()
        assert all_hit and r.exact() and hit.settle()
        if waits:
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
        else:  # the layers ran on the poisoned blocks before the loads landed
            assert not torch.allclose(logits, want, atol=1e-4, rtol=1e-4, equal_nan=False)
    finally:
        r.close()


@pytest.mark.parametrize("order", ["LBHNC", "BLHNC"])
def test_full_graph_rows_come_out_correct(order):
    from kvtier.bench.suites.vllm_graphs import full_graph_rows

    ctx, fwd, r = _setup(order)
    try:
        n = r.blocks * r.kv.block_size
        list(fwd.recompute_rows(n))  # the suite's ttft_recompute row comes first
        label, params = f"{order} {n} tokens", {"order": order}
        rows = list(full_graph_rows(ctx, fwd, r, label, params, first=True))
        assert [x.case for x in rows] == [f"ttft_hit_full_graph {label}", f"decode_full_graph {order}"]
        hit, decode = rows
        p = hit.params
        assert hit.correct is True
        assert p["token_full_graph"] == p["token_piecewise"] == p["token_recompute"] and p["tokens_stable"]
        assert p["vs_piecewise"] == pytest.approx(p["full_graph_ms"] / p["piecewise_ms"])
        assert p["prefill_margin_std"] > 0 and p["recompute_ms"] > 0
        q = decode.params
        assert q["waits"] == r.kv.num_layers and math.isfinite(q["slowdown_pct"])
        assert math.isfinite(q["slowdown_pct_branch"]) and q["branch_waits_ms"] > 0
        assert q["with_waits_ms"] > 0 and q["without_waits_ms"] > 0
        flags = r.ws.store.engine.layer_flags()
        assert flags.live.generation == fwd.warmup + fwd.reps  # one armed step per full-graph hit
    finally:
        r.close()


def test_other_orders_get_no_full_graph_rows():
    from kvtier.bench.suites.vllm_graphs import full_graph_rows

    ctx, fwd, r = _setup("LHBNC")
    try:
        assert list(full_graph_rows(ctx, fwd, r, "x", {}, first=True)) == []
    finally:
        r.close()
