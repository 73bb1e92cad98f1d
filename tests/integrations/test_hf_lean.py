"""LeanRunner (integrations/lean.py): kvtier's own first-token forward over a transformers model's
weights equals the model's own forward (fp32, Llama / Qwen2 / Mistral shapes), cold and with the
prefix loaded from kvtier's blocks — also when the loads land late into poisoned blocks."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier.device import SimDevice  # noqa: E402
from kvtier.integrations.hf import KVTier  # noqa: E402
from kvtier.integrations.lean import LeanRunner  # noqa: E402

from test_hf_cache import build, generate, llama, mistral, prompts, qwen2  # noqa: E402


def reference_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits[0, -1].float()


@pytest.mark.parametrize("arch", [llama, qwen2, mistral])
def test_lean_first_token_equals_the_model_cold_and_from_a_hit(arch):
    model = build(arch)
    lean = LeanRunner(model)
    a, b = prompts(model, n_prefix=100)
    tok, logits = lean.first_token(b)
    want = reference_logits(model, b)
    assert torch.allclose(logits, want, atol=1e-4, rtol=1e-4) and tok == int(want.argmax())
    dev = SimDevice(copy_delay=(0.0, 0.002), launch_delay=(0.0, 0.002), seed=7)
    with KVTier.for_model(model, device=dev, chunk_tokens=32, block_size=16, num_blocks=64,
                          engine_options=dict(sanitize=True)) as kvt:  # fmt: skip
        cold = kvt.cache(a)
        cold.finish(generate(model, a, cold)).wait(10)
        cache = kvt.cache(b)
        assert cache.hit_tokens == 96
        tok, logits = lean.first_token(b, cache)
        assert cache.arrived == list(range(model.config.num_hidden_layers))
        cache.finish(None)
    dev.close()
    assert torch.allclose(logits, want, atol=1e-4, rtol=1e-4) and tok == int(want.argmax())


@pytest.mark.parametrize("graphs", [False, True])
def test_lean_reads_each_layer_only_after_it_landed(graphs):
    model = build(llama)
    lean = LeanRunner(model, graphs=graphs)
    a, b = prompts(model, n_prefix=70)
    dev = SimDevice(launch_delay=0.0, seed=8)
    kvt = KVTier.for_model(model, device=dev, chunk_tokens=32, block_size=16, num_blocks=64)
    cold = kvt.cache(a)
    cold.finish(generate(model, a, cold)).wait(10)
    for x in kvt.kv.layers:
        x.fill_(float("nan"))  # what a read before the load landed would see
    dev.launch_delay = 0.1  # each layer of the load lands 0.1 s after the previous one
    cache = kvt.cache(b)
    dev.launch_delay = 0.0  # the reads themselves run at once: only the waits can hold them back
    tok, logits = lean.first_token(b, cache)
    cache.finish(None)
    kvt.close()
    dev.close()
    assert not logits.isnan().any()
    assert torch.allclose(logits, reference_logits(model, b), atol=1e-4, rtol=1e-4)


def test_lean_refuses_what_it_cannot_run():
    model = build(llama)
    with pytest.raises(ValueError, match="model"):
        LeanRunner(torch.nn.Linear(2, 2))
    lean = LeanRunner(model)
    with pytest.raises(ValueError, match="input_ids"):
        lean.first_token(torch.ones(2, 5, dtype=torch.long))

    class Full:
        hit_tokens = 5

    with pytest.raises(ValueError, match="at least one must run"):
        lean.first_token(torch.ones(1, 5, dtype=torch.long), Full())


def two_prompts(model, n_prefix=96, tail=21):
    """Two prompts of one shape whose prefixes differ (a graph replay must read the new ones)."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, model.config.vocab_size, (1, n_prefix + tail), generator=g) for _ in range(2)]


def test_lean_pieces_equal_the_eager_forward_hit_after_hit():
    """The graph path's steps (run without capture on a CPU device) read each hit's own blocks and
    tokens through the static inputs, and wait for each layer's load like the eager path."""
    model = build(llama)
    eager, pieces = LeanRunner(model), LeanRunner(model, graphs=True)
    dev = SimDevice(copy_delay=(0.0, 0.002), launch_delay=(0.0, 0.002), seed=9)
    with KVTier.for_model(model, device=dev, chunk_tokens=32, block_size=16, num_blocks=64,
                          engine_options=dict(sanitize=True)) as kvt:  # fmt: skip
        for p in two_prompts(model):
            cold = kvt.cache(p)
            cold.finish(generate(model, p[:, :-1], cold)).wait(10)
        got = []
        for p in two_prompts(model) * 2:  # the second pass reuses the pieces of the first
            want = eager.first_token(p, c := kvt.cache(p))[1]
            c.finish(None)
            for x in kvt.kv.layers:
                x.fill_(float("nan"))  # a read before the load landed would show
            c = kvt.cache(p)
            assert c.hit_tokens == 96
            got.append(pieces.first_token(p, c)[1])
            c.finish(None)
            assert torch.equal(got[-1], want)
            assert torch.allclose(got[-1], reference_logits(model, p), atol=1e-4, rtol=1e-4)
    dev.close()
    assert len(pieces.pieces) == 1 and pieces.captures == 0  # one shape; no capture on a CPU device
    assert not torch.equal(got[0], got[1])  # two prompts, two answers: the static inputs were rewritten


@pytest.mark.parametrize("graphs", [False, True])
def test_lean_split_equals_the_model_at_every_split_point(graphs):
    """split_first_token: [0, s) computed by the runner while [s, n) loads into poisoned blocks
    that land late; the tail over both gives the model's own logits, for s = 0, a middle chunk
    boundary and the whole hit (nothing loaded)."""
    model = build(llama)
    lean = LeanRunner(model, graphs=graphs)
    a, b = prompts(model, n_prefix=100)
    want = reference_logits(model, b)
    dev = SimDevice(copy_delay=(0.0, 0.002), launch_delay=0.0, seed=11)
    with KVTier.for_model(model, device=dev, chunk_tokens=32, block_size=16, num_blocks=64,
                          engine_options=dict(sanitize=True)) as kvt:  # fmt: skip
        cold = kvt.cache(a)
        cold.finish(generate(model, a, cold)).wait(10)
        for s in (0, 32, 64, 32, 96):
            for x in kvt.kv.layers:
                x.fill_(float("nan"))  # what a read before the load landed would see
            dev.launch_delay = 0.05  # each layer of the load lands 0.05 s after the previous one
            tok, logits, cache = lean.split_first_token(kvt, b, s)
            dev.launch_delay = 0.0
            assert (cache.front, cache.hit_tokens) == (s, 96 - s)
            cache.finish(None)
            assert not logits.isnan().any(), s
            assert torch.allclose(logits, want, atol=1e-4, rtol=1e-4) and tok == int(want.argmax()), s
    dev.close()
    if graphs:  # s = 0, 32, 64 each built its pieces once (32 twice); s = 96 loads nothing: eager
        assert len(lean.pieces) == 3


def test_lean_refuses_a_split_whose_front_the_model_computed():
    from kvtier.integrations.hf_split import split_cache

    model = build(llama)
    a, b = prompts(model, n_prefix=100)
    with KVTier.for_model(model, device=SimDevice(), chunk_tokens=32, block_size=16, num_blocks=64) as kvt:
        cold = kvt.cache(a)
        cold.finish(generate(model, a, cold)).wait(10)
        cache = split_cache(kvt, model, b, 32)
        with pytest.raises(ValueError, match="split_first_token"):
            LeanRunner(model).first_token(b, cache)
        cache.finish(None)
