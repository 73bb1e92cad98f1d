"""The `hybrid` row's graphed forward on CUDA: the next token's forward captured once at set-up
over the cache's K/V tensors, its logits over the prompt's KV an eager forward's, and
every hit's first token, read from blocks poisoned before the loads, the recompute's. Skipped
without a GPU; the eager forward's row runs on the CPU in test_vllm_hybrid_bench.py."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu


def test_the_hit_forward_is_one_graph_that_reads_what_the_hit_gathered():
    from kvtier.bench.suite import Context
    from kvtier.bench.suites.vllm_hybrid import HybridRig

    ctx = Context("cuda", quick=True)
    ctx.suite = "vllm"
    rig = HybridRig(ctx, "gemma3-tiny", 256)
    try:
        p = rig.row().params
        assert p["forward"] == "cuda graph", p.get("graph_error")
        assert p["graph_matches_eager"] is True and p["first_token_match"] is True
        assert rig.exact()
        # The graph reads the cache's K/V as the gathers leave them: other K/V, other logits.
        before = rig._forward().clone()
        for keys, _ in rig.kv:
            keys.mul_(-1)
        assert not torch.equal(rig._forward(), before)
    finally:
        rig.close()
