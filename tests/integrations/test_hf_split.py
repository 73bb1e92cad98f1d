"""A split prefix hit in transformers' generate: [0, s) recomputed while [s, n) loads; greedy tokens
equal DynamicCache's for s = 0, a middle chunk boundary and n, from the host and from disk
(SimDevice, copies land late, sanitizer on; random weights, no download)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier.device import SimDevice  # noqa: E402
from kvtier.integrations.hf import KVTier, cache_kwarg  # noqa: E402
from kvtier.integrations.hf_split import plan_request, split_cache  # noqa: E402
from kvtier.planner import READ_SOURCE  # noqa: E402

from test_hf_cache import build, generate, llama, prompts, qwen2, run, tier_for  # noqa: E402


def split_run(kvt, model, ids, s):
    ref = generate(model, ids)
    cache = split_cache(kvt, model, ids, s)
    out = generate(model, ids, cache)
    handle = cache.finish(out)
    if handle is not None:
        assert handle.wait_durable(10)
    assert torch.equal(out, ref), (
        f"split {s}: front {cache.front}, loaded {cache.hit_tokens} {cache.hit_tiers}"
    )
    return cache


@pytest.mark.parametrize("kind", ["host", "disk"])
@pytest.mark.parametrize("s", [0, 32, 64])
def test_split_tokens_identical_to_dynamic_cache(kind, s, tmp_path):
    model = build(llama)
    dev = SimDevice(copy_delay=(0.0, 0.002), launch_delay=(0.0, 0.002), seed=3)
    opts = dict(engine_options=dict(sanitize=True), chunk_tokens=32, block_size=8, num_blocks=64)
    with KVTier.for_model(model, device=dev, tiers=tier_for(kind, tmp_path), **opts) as kvt:
        a, b = prompts(model)  # 80 shared tokens: a hit of 2 chunks of 32
        run(kvt, model, a)
        if kind != "host":
            kvt.store.evict()  # the loaded chunks must come from the disk
        cache = split_run(kvt, model, b, s)
        assert cache.front == s and cache.hit_tokens == 64 - s
        assert cache.hit_tiers == (kind,) * ((64 - s) // 32)
        assert cache.arrived == (list(range(3)) if s < 64 else [])
    dev.close()


def test_split_with_other_head_counts_and_the_front_saved_again(tmp_path):
    """Qwen2 shapes; the host is emptied before finish: the recomputed front chunks are saved
    from the request's own KV, and a later request loads all three chunks exactly."""
    model = build(qwen2)
    dev = SimDevice(copy_delay=(0.0, 0.002), seed=7)
    with KVTier.for_model(model, device=dev, chunk_tokens=32, block_size=16, num_blocks=64) as kvt:
        a, b = prompts(model)
        run(kvt, model, a)
        ref = generate(model, b)
        cache = split_cache(kvt, model, b, 32)
        out = generate(model, b, cache)
        assert torch.equal(out, ref)
        full = transformers.DynamicCache()
        with torch.no_grad():
            model(b, **{cache_kwarg(model): full}, use_cache=True)  # one forward over the whole prompt
        for mine, theirs in zip(cache.layers, full.layers, strict=True):  # same KV, up to rounding
            torch.testing.assert_close(mine.keys[..., : b.shape[1], :], theirs.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mine.values[..., : b.shape[1], :], theirs.values, rtol=1e-5, atol=1e-5)
        kvt.store.evict()  # chunk 0 (recomputed here) is gone from the store
        assert cache.finish(out) is not None
        _, again = run(kvt, model, b)
        assert again.hit_tokens == 96 and again.hit_tiers == ("host",) * 3
    dev.close()


def test_the_front_is_computed_while_the_rest_is_still_loading():
    """The load stream held behind a gate, NaN-poisoned blocks: when split_cache returns, the
    forward over [0, s) is done and the load is not; once the gate opens, the tokens match (every
    read waited)."""
    import threading

    model = build(llama)
    dev = SimDevice(seed=5)
    kvt = KVTier.for_model(model, device=dev, chunk_tokens=32, num_blocks=64)
    a, b = prompts(model)
    run(kvt, model, a)
    for x in kvt.kv.layers:
        x.fill_(float("nan"))  # what a read before the load landed would see
    gate = threading.Event()
    dev.launch(lambda: gate.wait(60), kvt.engine.load_stream)  # the load's copies queue behind it
    try:
        cache = split_cache(kvt, model, b, 32)
        assert cache.layers[0].keys.shape[-2] == 32  # [0, 32) computed ...
        assert not cache.load.done()  # ... while [32, 64) is still in flight
    finally:
        gate.set()
    assert torch.equal(generate(model, b, cache), generate(model, b))
    cache.finish(None)
    kvt.close()
    dev.close()


def test_bad_split_and_a_split_beyond_the_hit():
    model = build(llama)
    dev = SimDevice()
    with KVTier.for_model(model, device=dev, chunk_tokens=32, num_blocks=64) as kvt:
        a, b = prompts(model)
        run(kvt, model, a)
        with pytest.raises(ValueError, match="split_tokens"):
            split_cache(kvt, model, b, 40)
        cache = split_run(kvt, model, b, 320)  # capped at the 64-token hit: all recomputed
        assert cache.front == 64 and cache.hit_tokens == 0 and cache.load is None
    dev.close()


def test_plan_request_reads_the_hit_and_its_split_runs_exactly(tmp_path):
    model = build(llama)
    dev = SimDevice(copy_delay=(0.0, 0.002), seed=9)
    with KVTier.for_model(model, device=dev, tiers=tier_for("disk", tmp_path), chunk_tokens=32) as kvt:
        a, b = prompts(model)
        run(kvt, model, a)
        kvt.store.evict()  # the hit now lives on disk only
        slow = plan_request(kvt, model, b, "h200", link="pcie3")
        assert slow.matched_tokens == 64 and slow.new_tokens == b.shape[1] - 64 and slow.chunk_tokens == 32
        assert slow.path.tier == "disk"
        assert slow.kv_bytes_per_token == 3 * 2 * 2 * 16 * 2  # layers, K+V, KV heads, head_dim, bf16
        assert slow.choice in ("load", "recompute", "split") and slow.split_tokens % 32 == 0
        assert slow.path.hops[0].source != READ_SOURCE  # nothing read from the disk yet
        cache = split_run(kvt, model, b, slow.split_tokens)
        assert cache.front == slow.split_tokens
        kvt.store.evict()
        if cache.hit_tokens:  # the split read chunks from the disk: later plans use that rate
            again = plan_request(kvt, model, b, "h200", link="pcie3")
            assert again.path.hops[0].source == READ_SOURCE
            assert again.path.hops[0].gbps == kvt.store.read_rate.fit("disk")[0]
        run(kvt, model, b)  # a load from the disk, whatever the split was
        kvt.store.evict()
        measured = plan_request(kvt, model, b, "h200", link="pcie3")
        assert measured.path.hops[0].source == READ_SOURCE
        assert plan_request(kvt, model, b, "h200", link="pcie3", read_gbps=3.0).path.hops[0].gbps == 3.0
    dev.close()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_the_split_load_is_staged_and_queued_before_the_front(kind, tmp_path):
    """Beside the front's compute the copies take the staged path (no SM held), and a host hit's
    are queued on the calling thread before the front starts: no reader thread competes with the
    front's launches. A disk hit is read on a thread while the front computes."""
    import threading

    model = build(llama)
    dev = SimDevice(copy_delay=(0.0, 0.002), seed=11)
    with KVTier.for_model(model, device=dev, tiers=tier_for(kind, tmp_path), chunk_tokens=32) as kvt:
        a, b = prompts(model)
        run(kvt, model, a)
        if kind != "host":
            kvt.store.evict()
        seen, before = {}, kvt.store.stats()["store"]["loads"]
        front_started = threading.Event()
        store_load = kvt.store.load

        def load(*args, **kwargs):
            seen["thread"] = threading.current_thread().name
            seen["after_front"] = front_started.is_set()
            if seen["thread"] != threading.main_thread().name:
                # The read overlaps the front: it can start only once the front runs (no timing luck).
                seen["overlapped"] = front_started.wait(timeout=30)
            return store_load(*args, **kwargs)

        def front(ids):
            front_started.set()
            seen["queued"] = kvt.store.stats()["store"]["loads"]
            return [(torch.zeros(1, 1, 0, 1),) * 2]  # never read: only the load is checked

        kvt.store.load = load
        cache = split_cache(kvt, model, b, 32, front=front)
        assert [j.path for j in cache.load.jobs] == ["staged"]
        if kind == "host":
            assert seen["thread"] == threading.main_thread().name and not seen["after_front"]
            assert seen["queued"] == before + 1  # the load was submitted before the front ran
        else:
            assert seen["thread"] == "kvtier-split-load" and seen["overlapped"]
        cache.finish(None)
    dev.close()
