"""The `vllm` suite's forward rows against references, on the CPU: the gather of a hit's prefix
from vLLM's per-layer views in every layout order, and a hit's first-token logits through the
connector's hooks equal to recomputing the prompt when the blocks hold the prompt's own KV."""

import pytest

from kvtier.layout import VLLM_ORDERS

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _ctx():
    from kvtier.bench.suite import Context

    ctx = Context("cpu", quick=True)
    ctx.suite = "vllm"
    return ctx


@pytest.mark.parametrize("order", VLLM_ORDERS)
def test_paged_prefix_reads_the_requests_blocks_in_token_order(order):
    from kvtier.bench.suites.vllm import TINY, Replay
    from kvtier.bench.suites.vllm_rows import PagedPrefix

    r = Replay(_ctx(), order, TINY, 128)
    try:
        r.cache.normal_()  # finite: torch.equal of NaNs is False
        prefix, n, d = PagedPrefix(r), r.blocks * TINY["N"], TINY["D"]
        assert prefix.hit_tokens == n
        for layer in range(TINY["L"]):
            k, v = prefix.gather(layer)
            assert k.shape == v.shape == (1, TINY["H"], n, d)
            want = torch.stack([r.cache[layer, r.dst[p // 16], :, p % 16] for p in range(n)], 1)  # [H, n, C]
            assert torch.equal(k[0], want[..., :d]) and torch.equal(v[0], want[..., d:])
    finally:
        r.close()


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "BLHNC", "BHLNC"])
def test_a_hit_through_the_hooks_gives_the_recomputed_logits(order):
    from kvtier.bench.suites.vllm import TINY, Replay
    from kvtier.bench.suites.vllm_rows import Forward, GraphedTail, PagedPrefix

    shape = TINY | {"dtype": torch.float32}  # fp32: the two forwards agree to rounding
    ctx = _ctx()
    fwd = Forward(ctx, shape)
    r = Replay(ctx, order, shape, 128)
    try:
        n, nb, h = r.blocks * shape["N"], r.blocks, shape["H"]
        ids = fwd.prompt(n + fwd.new)
        src = torch.tensor(r.src[:nb])
        for layer, (k, v) in enumerate(fwd.lean.prefill_kv(ids[:, :n])):  # the prompt's own KV
            pages = torch.cat([k, v], -1)[0].view(h, nb, shape["N"], -1).permute(1, 0, 2, 3)
            r.cache[layer][src] = pages  # [blocks, H, N, K||V], as vLLM's attention writes it
        r.step(r.meta(save=True))  # saved to the host tier from the source blocks
        r.settle_saves()
        r.poison()  # the hit's blocks: only the load can make them right
        tail = GraphedTail(fwd.lean, PagedPrefix(r), ids)
        logits, hit = fwd.hit(r, ids, tail, r.meta(load=True))
        want = fwd.lean.logits(ids)  # recompute: the whole prompt's prefill
        assert hit
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
        assert r.exact()
        r.poison()  # again, through the same static inputs: the second hit must load them too
        logits, hit = fwd.hit(r, ids, tail, r.meta(load=True))
        assert hit and r.exact()
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    finally:
        r.close()
