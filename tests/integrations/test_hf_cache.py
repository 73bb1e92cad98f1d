"""KVTierCache in transformers' generate: greedy tokens equal DynamicCache's, cold and with a
prefix hit from the host, disk and Redis; layer i is read only after it landed (SimDevice,
copies land late, sanitizer on). Models: random weights from a config, no download."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier.device import SimDevice  # noqa: E402
from kvtier.integrations.hf import KVTier, cache_kwarg  # noqa: E402
from kvtier.store.disk import DiskTier  # noqa: E402
from kvtier.store.redis_tier import RedisTier  # noqa: E402

from store_redis_fixtures import needs_redis, redis_server  # noqa: E402, F401  (a fixture)

NEW = 6  # tokens generated per request


def llama():
    cfg = transformers.LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    return cfg, transformers.LlamaForCausalLM


def qwen2():  # other head counts and an odd head_dim (120 / 6 = 20), q/k/v biases
    cfg = transformers.Qwen2Config(
        vocab_size=320, hidden_size=120, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512,
    )  # fmt: skip
    return cfg, transformers.Qwen2ForCausalLM


def mistral():  # no sliding window: every layer is full attention
    cfg = transformers.MistralConfig(
        vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        sliding_window=None,
    )  # fmt: skip
    return cfg, transformers.MistralForCausalLM


def build(arch):
    cfg, cls = arch()
    torch.manual_seed(0)
    return cls(cfg).eval()


def generate(model, ids, cache=None):
    extra = {} if cache is None else {cache_kwarg(model): cache}
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **extra)


def prompts(model, n_prefix=80, tails=(13, 29)):
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prefix = torch.randint(1, vocab, (1, n_prefix), generator=g)
    return [torch.cat([prefix, torch.randint(1, vocab, (1, t), generator=g)], 1) for t in tails]


def tier_for(kind, tmp_path, url=None):
    if kind == "host":
        return []
    if kind == "disk":
        return [DiskTier(tmp_path / "disk", 64 << 20)]
    return [RedisTier(url=url)]


def run(kvt, model, ids):
    """One request through kvtier; returns (tokens, cache) after checking against DynamicCache."""
    ref = generate(model, ids)  # transformers' own DynamicCache
    cache = kvt.cache(ids)
    out = generate(model, ids, cache)
    handle = cache.finish(out)
    if handle is not None:
        assert handle.wait_durable(10)  # write-through: the chunks reached the lower tiers
    assert torch.equal(out, ref), f"hit {cache.hit_tokens} from {cache.hit_tiers}"
    return out, cache


def check_hits(model, kvt, kind):
    a, b = prompts(model)
    _, cold = run(kvt, model, a)
    assert cold.hit_tokens == 0
    if kind != "host":
        kvt.store.evict()  # the hit must come from the lower tier, not the host
    _, warm = run(kvt, model, b)
    assert warm.hit_tokens == 64 and warm.hit_tiers == (kind,) * 2  # 80 shared tokens: 2 chunks of 32
    assert sorted(warm.arrived) == warm.arrived == list(range(model.config.num_hidden_layers))


@pytest.mark.parametrize("arch", [llama, qwen2, mistral])
@pytest.mark.parametrize("kind", ["host", "disk"])
def test_tokens_identical_to_dynamic_cache_cold_and_warm(arch, kind, tmp_path):
    model = build(arch)
    dev = SimDevice(copy_delay=(0.0, 0.002), launch_delay=(0.0, 0.002), seed=3)
    bs = 8 if arch is llama else 16
    opts = dict(engine_options=dict(sanitize=True), chunk_tokens=32, block_size=bs, num_blocks=64)
    with KVTier.for_model(model, device=dev, tiers=tier_for(kind, tmp_path), **opts) as kvt:
        check_hits(model, kvt, kind)
    dev.close()


@needs_redis
@pytest.mark.redis
def test_tokens_identical_with_a_redis_hit(redis_server, tmp_path):  # noqa: F811
    model = build(llama)
    dev = SimDevice(copy_delay=(0.0, 0.002), seed=4)
    tiers = tier_for("redis", tmp_path, redis_server.url)
    with KVTier.for_model(model, device=dev, tiers=tiers, chunk_tokens=32, num_blocks=64) as kvt:
        check_hits(model, kvt, "redis")
    dev.close()


def test_whole_prompt_cached_still_runs_one_token_and_repeats_exactly(tmp_path):
    model = build(llama)
    dev = SimDevice()
    ids = prompts(model, n_prefix=64, tails=(0,))[0]  # exactly two chunks
    with KVTier.for_model(model, device=dev, chunk_tokens=32, num_blocks=64) as kvt:
        run(kvt, model, ids)
        _, again = run(kvt, model, ids)
        assert again.hit_tokens == 32  # the last prompt token is never taken from the store
    dev.close()


def _loaded_layer_order(model, wait: bool):
    """A warm request whose loads land late (0.2 s per layer) into poisoned blocks; reads run at once.
    Returns, per read of layer i: (did layer i of every chunk land, had the last layer landed)."""
    dev = SimDevice(launch_delay=0.0, seed=5)
    kvt = KVTier.for_model(model, device=dev, chunk_tokens=32, num_blocks=64)
    a, b = prompts(model, n_prefix=40)  # one shared chunk: layer events of a single load job
    run(kvt, model, a)
    for x in kvt.kv.layers:
        x.fill_(float("nan"))  # what a read before the load landed would see
    dev.launch_delay = 0.2  # each layer of the load lands 0.2 s after the one before
    cache = kvt.cache(b)
    seen = []
    real_launch = dev.launch

    def spy(fn, stream):  # the gather of layer i runs on the compute stream: look at the events then
        jobs = cache.load.jobs
        i = len(seen)

        def wrapped():
            seen.append((all(j.layer_events[i].query() for j in jobs), jobs[-1].layer_events[-1].query()))
            fn()

        slow, dev.launch_delay = dev.launch_delay, 0.0  # the read itself is not delayed
        real_launch(wrapped, stream)
        dev.launch_delay = slow

    dev.launch = spy
    if not wait:
        cache.load.wait_layer = lambda layer, stream: None  # the bug: attention does not wait
    out = generate(model, b, cache)
    dev.launch, dev.launch_delay = real_launch, 0.0
    cache.finish(None)
    kvt.close()
    dev.close()
    return seen, out, cache


def test_layer_i_is_read_only_after_it_landed_while_later_layers_are_in_flight():
    model = build(llama)
    seen, out, cache = _loaded_layer_order(model, wait=True)
    assert cache.hit_tokens == 32 and cache.arrived == [0, 1, 2]
    assert [ready for ready, _ in seen] == [True, True, True]  # every read after its layer's event
    assert seen[0][1] is False  # pipelined: layer 0 was read while the last layer was still loading
    assert torch.equal(out, generate(model, prompts(model, n_prefix=40)[1]))


def test_without_the_layer_wait_attention_reads_bytes_that_have_not_landed():
    model = build(llama)
    seen, _, cache = _loaded_layer_order(model, wait=False)
    assert not all(ready for ready, _ in seen)  # read before the copy landed: NaN KV
    assert any(lay.keys[:, :, :32].isnan().any() for lay in cache.layers)


def test_kvtier_demo_cli_runs_cold_warm_and_disk_and_says_tokens_match(tmp_path):
    from click.testing import CliRunner

    from kvtier.cli import cli
    from kvtier.cli import demo as _  # noqa: F401  (registers the command)

    png = tmp_path / "ttft.png"
    args = ["demo", "--prefix", "256", "--requests", "3", "--new-tokens", "3", "--plot", str(png)]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert "tokens identical to a run without kvtier: yes" in r.output
    assert "host emptied" in r.output and " disk " in r.output and " host " in r.output
    assert png.stat().st_size > 0


def test_a_sliding_window_model_is_refused():
    cfg = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=16,
    )  # fmt: skip
    dev = SimDevice()
    with pytest.raises(ValueError, match="full-attention"):
        KVTier.for_model(transformers.MistralForCausalLM(cfg), device=dev)
    dev.close()
