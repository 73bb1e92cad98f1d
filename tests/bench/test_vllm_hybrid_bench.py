"""The `vllm` suite's `hybrid` rows on the CPU: a hit on a tiny random Gemma 3 (five
sliding-window layers to one full) through the worker's hooks with one store per KV cache
group: each group loads what the hit reads, bit for bit, and the first token is the recompute's;
a hit whose chunks the host lost is not correct."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _ctx():
    from kvtier.bench.suite import Context

    ctx = Context("cpu", quick=True)
    ctx.suite = "vllm"
    return ctx


def test_a_hybrid_hit_row_is_correct_and_timed():
    from kvtier.bench.suites.vllm_hybrid import hybrid_rows

    (row,) = list(hybrid_rows(_ctx()))
    p = row.params
    assert row.case == "ttft_hit hybrid gemma3-tiny 256" and row.correct is True
    assert p["first_token_match"] is True
    assert p["speedup"] == pytest.approx(p["recompute_ms"] / p["hit_ms"])
    # One chunk of 16 blocks: the full layer loads all 16, each of the 5 window layers only the 4
    # blocks of its window of 64 tokens before the hit's end.
    assert p["loaded_mb_window"] / p["loaded_mb_full"] == pytest.approx(5 * 4 / 16)


def test_the_row_sees_a_window_the_host_lost():
    from kvtier.bench.suites.vllm_hybrid import HybridRig

    rig = HybridRig(_ctx(), "gemma3-tiny", 256, chunk_tokens=64)
    try:
        window = rig.ws.stores[0]
        assert window.fmt.tokens == 64  # a window of 64 tokens: 4 blocks, one chunk of 64
        window.host.evict(window.keys(rig.chunk_ids[-1:]))  # the unit the hit reads
        assert rig.row().correct is False
    finally:
        rig.close()


def test_the_vllm_suite_runs_the_hybrid_family_when_named():
    from kvtier.bench.suites.vllm import rows_asked

    assert "hybrid" in rows_asked(None, on_gpu=True) and "hybrid" not in rows_asked(None, on_gpu=False)
    assert rows_asked("hybrid", on_gpu=False) == {"hybrid"}


def test_a_state_model_hit_row_is_correct_and_its_state_is_what_the_token_reads(monkeypatch):
    from kvtier.bench.suites import vllm_hybrid_state
    from kvtier.bench.suites.vllm_hybrid_state import StateRig, state_rows

    (row,) = list(state_rows(_ctx()))
    p = row.params
    assert row.case == "ttft_hit hybrid qwen3next-tiny 256" and row.correct is True
    assert p["first_token_match"] is True and p["logits_match"] is True
    # One chunk of 16 blocks: the full layer loads all 16, the 3 state layers one state each.
    assert p["loaded_mb_state"] * 1e6 == 3 * p["state_bytes"]
    # A hit whose state layers start from anything but the loaded state computes other logits.
    monkeypatch.setattr(vllm_hybrid_state, "_unpack", lambda page, tensors: None)
    rig = StateRig(_ctx(), "qwen3next-tiny", 256)
    try:
        assert rig.row().params["logits_match"] is False
    finally:
        rig.close()


def test_the_state_row_sees_a_state_the_host_lost():
    from kvtier.bench.suites.vllm_hybrid_state import StateRig

    rig = StateRig(_ctx(), "qwen3next-tiny", 256)
    try:
        states = rig.ws.stores[1]
        states.host.evict(states.keys(rig.chunk_ids[-1:]))  # the state the hit reads
        assert rig.row().correct is False
    finally:
        rig.close()


def test_the_state_rig_reads_either_cache_layout_transformers_has_had():
    from types import SimpleNamespace

    from kvtier.bench.suites.vllm_hybrid import attention_kv
    from kvtier.bench.suites.vllm_hybrid_state import state_tensors

    k, v, conv, rec = (torch.full((1, 2), float(i)) for i in range(4))
    layered = SimpleNamespace(
        layers=[SimpleNamespace(keys=k, values=v), SimpleNamespace(conv={0: conv}, rec={0: rec})]
    )
    assert attention_kv(layered, 0) == (k, v) and state_tensors(layered, 1) == [conv, rec]
    listed = SimpleNamespace(
        key_cache=[k, None], value_cache=[v, None], conv_states=[None, conv], recurrent_states=[None, rec]
    )
    assert attention_kv(listed, 0) == (k, v) and state_tensors(listed, 1) == [conv, rec]
