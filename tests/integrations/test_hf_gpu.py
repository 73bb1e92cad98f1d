"""KVTierCache on a CUDA GPU (CudaDevice, sanitizer on): greedy tokens equal DynamicCache's cold
and with a prefix hit from the host and from disk, and with a split (front recomputed while the
back loads). The paged cache is poisoned (NaN) before each warm request, so KV that did not land
would show. Skipped without CUDA; the CPU versions are test_hf_cache.py and test_hf_split.py."""

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier.integrations.hf import KVTier  # noqa: E402
from kvtier.store.disk import DiskTier  # noqa: E402

from test_hf_cache import generate, llama, mistral, prompts, qwen2  # noqa: E402

pytestmark = pytest.mark.gpu


def build(arch):
    cfg, cls = arch()
    torch.manual_seed(0)
    return cls(cfg).eval().to("cuda")  # fp32: greedy ties are not decided by rounding


def poison(kvt) -> None:
    for x in kvt.kv.layers:
        x.fill_(float("nan"))  # what attention would read if a block had not landed


@pytest.mark.parametrize("arch", [llama, qwen2, mistral])
@pytest.mark.parametrize("kind", ["host", "disk"])
def test_gpu_tokens_identical_cold_and_warm(arch, kind, tmp_path):
    model = build(arch)
    tiers = [DiskTier(tmp_path / "disk", 64 << 20)] if kind == "disk" else []
    opts = dict(engine_options=dict(sanitize=True), chunk_tokens=32, block_size=16, num_blocks=64)
    a, b = (x.cuda() for x in prompts(model, n_prefix=100))
    with KVTier.for_model(model, tiers=tiers, **opts) as kvt:
        cold = kvt.cache(a)
        out = generate(model, a, cold)
        assert cold.hit_tokens == 0 and torch.equal(out, generate(model, a))
        assert cold.finish(out).wait_durable(30)
        if kind != "host":
            kvt.store.evict()  # the hit must come from the lower tier
        poison(kvt)
        torch.cuda.synchronize()
        warm = kvt.cache(b)
        out = generate(model, b, warm)
        assert warm.hit_tokens == 96 and warm.hit_tiers == (kind,) * 3
        assert warm.arrived == list(range(model.config.num_hidden_layers))
        assert torch.equal(out, generate(model, b))
        warm.finish(out)
    for t in tiers:
        t.close()


@pytest.mark.parametrize("split", [32, 64])
def test_gpu_split_tokens_identical(split):
    from kvtier.integrations.hf_split import split_cache

    model = build(llama)
    a, b = (x.cuda() for x in prompts(model, n_prefix=100))
    with KVTier.for_model(model, chunk_tokens=32, block_size=8, num_blocks=64,
                          engine_options=dict(sanitize=True)) as kvt:  # fmt: skip
        cold = kvt.cache(a)
        cold.finish(generate(model, a, cold)).wait(30)
        poison(kvt)
        cache = split_cache(kvt, model, b, split)
        out = generate(model, b, cache)
        assert cache.front == split and cache.front + cache.hit_tokens == 96
        assert torch.equal(out, generate(model, b))
        cache.finish(out)


@pytest.mark.parametrize("arch", [llama, qwen2])
def test_gpu_lean_first_token_equals_the_model_cold_and_from_a_poisoned_hit(arch):
    from kvtier.integrations.lean import LeanRunner

    model = build(arch)
    lean = LeanRunner(model)
    a, b = (x.cuda() for x in prompts(model, n_prefix=100))
    with torch.no_grad():
        want = model(b).logits[0, -1].float()
    tok, logits = lean.first_token(b)
    assert torch.allclose(logits, want, atol=1e-3, rtol=1e-3) and tok == int(want.argmax())
    with KVTier.for_model(model, chunk_tokens=32, block_size=16, num_blocks=64,
                          engine_options=dict(sanitize=True)) as kvt:  # fmt: skip
        cold = kvt.cache(a)
        cold.finish(generate(model, a, cold)).wait(30)
        poison(kvt)
        torch.cuda.synchronize()
        cache = kvt.cache(b)
        tok, logits = lean.first_token(b, cache)
        assert cache.hit_tokens == 96
        cache.finish(None)
    assert torch.allclose(logits, want, atol=1e-3, rtol=1e-3) and tok == int(want.argmax())


def lean_runners(arch):
    """(model, an eager and a graphed LeanRunner over it, two prompts of one shape on the GPU)."""
    from kvtier.integrations.lean import LeanRunner

    from test_hf_lean import two_prompts

    model = build(arch)
    return model, LeanRunner(model, graphs=False), LeanRunner(model), [p.cuda() for p in two_prompts(model)]


@contextlib.contextmanager
def saved(model, prompts):
    """A KVTier (sanitizer on) holding each prompt's prefix, saved by a cold request."""
    with KVTier.for_model(model, chunk_tokens=32, block_size=16, num_blocks=64,
                          engine_options=dict(sanitize=True)) as kvt:  # fmt: skip
        for p in prompts:
            cold = kvt.cache(p)
            cold.finish(generate(model, p[:, :-1], cold)).wait(30)
        yield kvt


@pytest.mark.parametrize("arch", [llama, qwen2])
def test_gpu_lean_graphs_replay_equals_the_eager_forward_hit_after_hit(arch):
    """Hits replayed through captured CUDA graphs read each hit's own blocks and tokens (two
    prompts of one shape, blocks poisoned before each hit) and equal the eager forward bit for bit."""
    model, eager, graphed, ps = lean_runners(arch)
    with saved(model, ps) as kvt:
        got = []
        for p in ps * 3:  # the first hit captures, the next five replay
            want = eager.first_token(p, c := kvt.cache(p))[1]
            c.finish(None)
            poison(kvt)
            c = kvt.cache(p)
            got.append(graphed.first_token(p, c)[1])
            c.finish(None)
            assert c.hit_tokens == 96 and torch.equal(got[-1], want)
            with torch.no_grad():
                ref = model(p).logits[0, -1].float()
            assert torch.allclose(got[-1], ref, atol=1e-3, rtol=1e-3)
    assert graphed.captures == 1 and graphed.pieces and not torch.equal(got[0], got[1])
    assert eager.gqa_flash == graphed.gqa_flash  # both took the same attention kernel


def test_gpu_lean_gqa_flash_equals_the_expanded_heads():
    """Flash attention over grouped K/V heads with the bottom-right causal diagonal (no mask, no
    repeat) gives the attention of the expanded heads with the boolean mask."""
    from kvtier.integrations.lean import LeanRunner

    lean = LeanRunner(build(llama))
    torch.manual_seed(3)
    for m, n in ((1, 70), (13, 109), (64, 4160)):
        q = torch.randn(1, 8, m, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 2, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        mask = lean.tail_mask(n - m, m, "cuda")
        lean.gqa_flash = None
        fast = lean.attend(q, k, v, mask, 0.125)
        assert lean.gqa_flash, "flash over grouped heads is not available in this torch"
        lean.gqa_flash = False
        slow = lean.attend(q, k, v, mask, 0.125)
        assert torch.allclose(fast.float(), slow.float(), atol=2e-2, rtol=2e-2), (m, n)


@pytest.mark.parametrize("arch", [llama, qwen2])
def test_gpu_lean_split_equals_the_model_eager_and_replayed(arch):
    """split_first_token on CUDA: [0, s) computed while [s, n) loads into poisoned blocks; the
    replayed graphs (front copied in per hit) equal the eager forward bit for bit, both the model."""
    from kvtier.integrations.lean import LeanRunner

    model = build(arch)
    eager, graphed = LeanRunner(model, graphs=False), LeanRunner(model)
    a, b = (x.cuda() for x in prompts(model, n_prefix=100))
    with torch.no_grad():
        want = model(b).logits[0, -1].float()
    with KVTier.for_model(model, chunk_tokens=32, block_size=16, num_blocks=64,
                          engine_options=dict(sanitize=True)) as kvt:  # fmt: skip
        cold = kvt.cache(a)
        cold.finish(generate(model, a, cold)).wait(30)
        for s in (32, 64, 32, 64):
            poison(kvt)
            _, ref, c = eager.split_first_token(kvt, b, s)
            c.finish(None)
            poison(kvt)
            tok, got, c = graphed.split_first_token(kvt, b, s)
            assert (c.front, c.hit_tokens) == (s, 96 - s)
            c.finish(None)
            assert torch.equal(got, ref), s
            assert torch.allclose(got, want, atol=1e-3, rtol=1e-3) and tok == int(want.argmax()), s
    # per split point: the tail's pieces and the front's graph, each captured once
    assert len(graphed.pieces) == 2 and set(graphed.fronts) == {32, 64} and graphed.captures == 4


@pytest.mark.parametrize("arch", [llama, qwen2])
def test_gpu_lean_split_with_a_graphed_front_equals_the_eager_split(arch):
    """A split's front replayed from its CUDA graph (two prompts of one shape, in turn) gives the
    eager split's logits bit for bit, the loaded blocks poisoned before each hit."""
    model, eager, graphed, ps = lean_runners(arch)
    with saved(model, ps) as kvt:
        got = []
        for p in ps * 3:  # the first split captures the front (and the tail), the next five replay
            _, want, c = eager.split_first_token(kvt, p, 32)
            c.finish(None)
            poison(kvt)
            _, logits, c = graphed.split_first_token(kvt, p, 32)
            c.finish(None)
            assert (c.front, c.hit_tokens) == (32, 64) and torch.equal(logits, want)
            got.append(logits)
    assert set(graphed.fronts) == {32} and not torch.equal(got[0], got[1])
