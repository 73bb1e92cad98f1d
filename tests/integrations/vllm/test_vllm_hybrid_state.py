"""A model with Mamba / linear-attention state through vLLM 0.33's real Scheduler: Qwen3-Next (36
gated delta net layers in three state groups beside 12 full-attention layers), Nemotron-H 8B's
shape (24 Mamba2 layers in six state groups beside 4 attention layers) and Jamba v0.1 (28 Mamba1
layers in seven beside 4), with the KVCacheConfig vLLM builds from the config.json after the
platform grew the attention block to the state page (1056, 1040 and 144 tokens a block, one
block a chunk): a state group keeps the state
at each chunk's end that vLLM hands off, a hit needs the state at exactly its end, the state
loaded is the state saved, bit for bit, and the stand-in's state layers read it; a failed load of
the state recomputes the request, preemption reads only true state, and TP 2 keeps each rank's
share (those on Qwen3-Next)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

import torch  # noqa: E402
from hybrid_harness import POISON, HybridEngine, _views  # noqa: E402
from hybrid_models import hybrid_kv_cache_config, hybrid_vllm_config  # noqa: E402

from store_redis_fixtures import redis_server  # noqa: E402, F401 - a fixture

pytestmark = pytest.mark.vllm
NAME = "qwen3-next"
BS = 1056  # the attention block vLLM grows to hold a gated delta net layer's state
HOST = {"host_bytes": 1 << 30}
ARGS = dict(num_blocks=24, max_model_len=8192, batched=BS)  # prefilled one block a step
STATES = (0, 1, 2)  # vLLM's state groups of Qwen3-Next; group 3 is full attention
# Per model: the attention block vLLM grows to a state page, its state groups, its full group,
# the engine's arguments. Nemotron-H (8B's shape): 24 Mamba2 layers in six state groups beside 4
# attention layers. Jamba v0.1: 28 Mamba1 layers in seven beside 4 (small states: 144-token
# blocks, more of them for vLLM's max_model_len).
SHAPES = {
    NAME: (BS, STATES, 3, {}),
    "nemotron-h": (1040, tuple(range(6)), 6, {}),
    "jamba": (144, tuple(range(7)), 7, {"num_blocks": 80}),
}


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(i * 7919 + seed * 104729) % 997 + 1 for i in range(n)]


def _engine(tmp_path, extra=None, name: str = NAME, **kw) -> HybridEngine:
    bs, *_, args = SHAPES[name]
    return HybridEngine(tmp_path, name, {**HOST, **(extra or {})}, **{**ARGS, "batched": bs, **args, **kw})


def _chunk_id(tokens: list[int], chunk: int, bs: int = BS) -> bytes:
    """Chunk ``chunk``'s id (one block a chunk, vLLM's hash block the same)."""
    from vllm_utils import create_request

    return bytes(create_request("__ids__", tokens, hash_block_size=bs).block_hashes[chunk])


def _computed(e: HybridEngine, rid: str) -> int:
    """Tokens vLLM computed for ``rid`` over every step (its prompt past the hit, then one a step)."""
    return sum(e.scheduled(rid))


def _pages(e: HybridEngine, rid: str, group: int, col: int, rank: int = 0) -> torch.Tensor:
    """Every layer's state bytes in block ``col`` of ``rid``'s table of ``group`` on ``rank``."""
    views, block = e.ranks[rank].views, e.blocks[rid][group][col]
    return torch.stack(
        [views[n][block, 0, 0].view(torch.uint8) for n in e.kcc.kv_cache_groups[group].layer_names]
    )


def test_state_groups_as_vllm_builds_them(tmp_path):
    from kvtier.integrations.vllm.groups import groups_of

    cfg = hybrid_vllm_config(tmp_path, NAME, HOST, max_model_len=8192)
    kcc, *_ = hybrid_kv_cache_config(cfg, 24)
    groups, refused = groups_of(kcc)
    assert refused is None and [g.kind for g in groups] == ["state"] * 3 + ["full"]
    assert all(g.block_size == BS and len(g.layers) == 12 for g in groups)
    state = 3 * 8192 * 2 + 32 * 128 * 128 * 4  # conv (bf16) and SSM (fp32) state of one layer
    assert [g.state_bytes for g in groups] == [state] * 3 + [None]
    assert len({g.label for g in groups}) == 4 and all(":gdn_attn" in g.label for g in groups[:3])


# Mamba2 (Nemotron-H): conv state over x, B and C (8192 + 2 * 8 * 128 channels, 3 taps, bf16),
# SSM state (128 heads x 64 x 128, fp32). Mamba1 (Jamba): conv state (8192 channels, 3 taps,
# bf16), SSM state (8192 x 16, fp32).
@pytest.mark.parametrize(
    "name,state,kind",
    [
        ("nemotron-h", 3 * (8192 + 2 * 8 * 128) * 2 + 128 * 64 * 128 * 4, "mamba2"),
        ("jamba", 8192 * 3 * 2 + 8192 * 16 * 4, "mamba1"),
    ],
)
def test_mamba_state_groups_as_vllm_builds_them(tmp_path, name, state, kind):
    from kvtier.integrations.vllm.groups import groups_of

    bs, states, _, args = SHAPES[name]
    cfg = hybrid_vllm_config(tmp_path, name, HOST, max_model_len=8192)
    kcc, *_ = hybrid_kv_cache_config(cfg, args.get("num_blocks", 24))
    groups, refused = groups_of(kcc)
    assert refused is None and [g.kind for g in groups] == ["state"] * len(states) + ["full"]
    assert all(g.block_size == bs and len(g.layers) == 4 for g in groups)
    assert [g.state_bytes for g in groups] == [state] * len(states) + [None]
    assert len({g.label for g in groups}) == len(groups)
    assert all(f":{kind}" in g.label for g in groups[: len(states)])


def test_a_state_model_without_prefix_caching_leaves_the_connector_idle(tmp_path, caplog):
    """Without prefix caching vLLM keeps no state at a block boundary (mamba_cache_mode
    "none"): the connector stays idle and says which setting serves the model."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm_utils import create_request

    from kvtier.integrations.vllm.groups import groups_of

    cfg = hybrid_vllm_config(tmp_path, NAME, HOST, max_model_len=8192, prefix_caching=False)
    kcc, sched_kcc, bs, hbs = hybrid_kv_cache_config(cfg, 24)
    groups, refused = groups_of(kcc)
    assert groups == [] and "mamba_cache_mode='none'" in refused and "--enable-prefix-caching" in refused
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.vllm.connector"):
        s = Scheduler(cfg, sched_kcc, StructuredOutputManager(cfg), block_size=bs, hash_block_size=hbs)
    assert s.connector.idle
    assert [r.message for r in caplog.records if "idle" in r.message] == [
        f"kvtier: the connector stays idle for this model: {refused}"
    ]
    s.add_request(create_request("a", _prompt(100)))
    meta = s.schedule().kv_connector_metadata
    assert not meta.loads and not meta.saves


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", [NAME, "nemotron-h", "jamba"])
def test_a_hit_loads_the_state_at_its_end_bit_for_bit(tmp_path, name, async_scheduling):
    bs, states, full, _ = SHAPES[name]
    a = _prompt(3 * bs + 44)  # 3 whole chunks before the last token
    e = _engine(tmp_path, name=name, async_scheduling=async_scheduling)
    try:
        e.add("a", a, max_tokens=3)
        e.settle(timeout_s=300)
        # vLLM keeps (and hands off) the state only at the prompt's last block boundary by default
        saved = [r for so, _ in e.history for r in so.kv_connector_metadata.saves if r.group in states]
        assert [(r.group, r.ids) for r in saved] == [(g, [_chunk_id(a, 2, bs)]) for g in states]
        at_a = {g: _pages(e, "a", g, 2) for g in states}  # the state after 3 chunks, as a computed it
        for g in states:
            for n in e.kcc.kv_cache_groups[g].layer_names:
                e.ranks[0].views[n][e.blocks["a"][g][2]].view(torch.uint8).fill_(
                    POISON
                )  # only a load restores it
        e.sched.reset_prefix_cache()  # vLLM's own cache forgets: only kvtier can hit
        e.add("b", a, max_tokens=3)
        e.settle(timeout_s=300)
        # one state per state group, 3 chunks of KV
        assert e.run_loads("b") == [(g, 1) for g in states] + [(full, 3)]
        assert e.scheduled("b")[0] == len(a) - 3 * bs  # vLLM computed only past the hit
        for g in states:
            assert torch.equal(_pages(e, "b", g, 2), at_a[g])  # loaded where vLLM reads it, bit for bit
        assert not e.violations() and e.model.reads > 0  # b's state layers read it as true
        assert e.outputs["b"] == e.outputs["a"] and e.outputs["b"][0] == e.first_token(a)
    finally:
        e.close()


def test_a_hit_needs_the_state_at_exactly_its_end(tmp_path):
    """Every chunk's KV is held, but a state only where vLLM kept one: a prompt sharing a's
    first chunks is a miss until a state at its end is saved (vLLM's retention interval)."""
    a = _prompt(3500)
    c = a[:2200] + _prompt(1300, seed=3)  # shares chunks 0 and 1 with a
    e = _engine(tmp_path)
    try:
        e.add("a", a)
        e.settle(timeout_s=300)
        e.sched.reset_prefix_cache()
        e.add("c", c)
        e.settle(timeout_s=300)
        assert e.run_loads("c") == []  # the full group holds 2 chunks of c, no state group does
        assert not e.violations() and e.outputs["c"][0] == e.first_token(c)
    finally:
        e.close()
    e = _engine(tmp_path / "every-block", retention_interval=BS)  # vLLM keeps a state per block
    try:
        e.add("a", a)
        e.settle(timeout_s=300)
        e.sched.reset_prefix_cache()
        e.add("c", c)
        e.settle(timeout_s=300)
        assert (
            e.run_loads("c") == [(0, 1), (1, 1), (2, 1), (3, 2)] and _computed(e, "c") == len(c) - 2 * BS + 1
        )
        assert not e.violations() and e.outputs["c"][0] == e.first_token(c)
    finally:
        e.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("group", [1, 3], ids=["state", "full"])
def test_a_failed_load_of_the_state_recomputes_the_request(tmp_path, group, async_scheduling):
    a = _prompt(3500)
    e = _engine(tmp_path, retention_interval=BS, async_scheduling=async_scheduling)
    try:
        e.add("a", a)
        e.settle(timeout_s=300)  # a state at every chunk's end
        e.sched.reset_prefix_cache()
        store = e.ranks[0].ws.stores[group]

        def lose(so):  # the grant races an eviction of one group's last chunk
            if so.kv_connector_metadata.loads and e.before_execute is lose:
                assert store.host.evict(store.keys([_chunk_id(a, 2)])) == 1
                e.before_execute = None

        e.before_execute = lose
        e.add("b", a, max_tokens=3)
        e.settle(timeout_s=300)
        assert e.failed_receipts() == {"b"} and not e.invalid_blocks()
        # vLLM dropped the whole load and asked again: the hit ends at the state before the lost one
        assert e.run_loads("b") == [(0, 1), (1, 1), (2, 1), (3, 3), (0, 1), (1, 1), (2, 1), (3, 2)]
        assert _computed(e, "b") == len(a) - 2 * BS + 2
        assert not e.violations() and e.outputs["b"][0] == e.first_token(a)
        e.sched.reset_prefix_cache()
        e.add("c", a)
        e.settle(timeout_s=300)  # what b recomputed was saved, and only true state: c hits all of it
        assert max(n for _, n in e.run_loads("c")) == 3 and _computed(e, "c") == len(a) - 3 * BS + 1
        assert not e.violations() and e.outputs["c"][0] == e.first_token(a)
    finally:
        e.close()


def test_preempted_state_requests_read_only_true_state(tmp_path):
    e = _engine(tmp_path, num_blocks=40, batched=3 * BS)  # two requests prefill in a step
    try:
        pool = e.sched.kv_cache_manager.block_pool
        taken = pool.get_new_blocks(pool.get_num_free_blocks() - 14)  # short of two requests' blocks
        for i in range(3):
            e.add(f"r{i}", _prompt(2500, seed=i), max_tokens=2)
        e.settle(timeout_s=600)
        assert any(so.preempted_req_ids for so, _ in e.history)
        assert not e.violations() and len(e.finished) == 3
        pool.free_blocks(taken)
        assert e.sched.reset_prefix_cache()
        e.add("again", _prompt(2500, seed=1), max_tokens=2)
        e.settle(timeout_s=300)
        assert e.run_loads("again") == [(0, 1), (1, 1), (2, 1), (3, 2)] and not e.violations()
        assert e.outputs["again"][0] == e.first_token(_prompt(2500, seed=1))
    finally:
        e.close()


def test_at_tp2_a_hit_needs_every_ranks_state_and_one_rank_failing_takes_it_back(tmp_path):
    a = _prompt(3500)
    e = _engine(tmp_path, tp_size=2)
    try:
        e.add("a", a)
        e.settle(timeout_s=300)
        halves = [e.ranks[r].ws.stores[0].fmt.nbytes for r in range(2)]
        assert halves[0] == halves[1] == 12 * (3 * 4096 * 2 + 16 * 128 * 128 * 4)  # each rank its share
        e.sched.reset_prefix_cache()
        e.add("b", a, max_tokens=3)
        e.settle(timeout_s=300)
        assert e.run_loads("b") == [(0, 1), (1, 1), (2, 1), (3, 3)] and e.scheduled("b")[0] == len(a) - 3 * BS
        assert not e.violations() and e.outputs["b"][0] == e.first_token(a)
        store = e.ranks[1].ws.stores[2]  # rank 1's third state group

        def lose(so):  # the grant races an eviction on one rank only
            if so.kv_connector_metadata.loads and e.before_execute is lose:
                assert store.host.evict(store.keys([_chunk_id(a, 2)])) == 1
                e.before_execute = None

        e.sched.reset_prefix_cache()
        e.before_execute = lose
        e.add("c", a, max_tokens=3)
        e.settle(timeout_s=300)
        assert e.failed_receipts() == {"c"} and e.run_loads("c")[4:] == []  # no state before: a miss
        assert _computed(e, "c") == len(a) + 2 and not e.violations()
        assert e.outputs["c"][0] == e.first_token(a)
    finally:
        e.close()


def test_state_views_are_checked_against_their_strides_and_width(tmp_path):
    """The state groups' views are read as the order vLLM resolved and as wide as the layer's
    packed state; views in another order or of another width are refused at registration."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.integrations.vllm import KVTierConnector

    cfg = hybrid_vllm_config(tmp_path, NAME, HOST, max_model_len=8192)
    kcc, *_ = hybrid_kv_cache_config(cfg, 24)
    views = _views(kcc)  # LBHNC, as kcc's tensors place them
    kcc.kv_cache_layout = "BLHNC"
    conn = KVTierConnector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        with pytest.raises(ValueError, match=r"kv_caches: strides .* not order='BLHNC'; they fit .*LBHNC"):
            conn.register_kv_caches(views)
    finally:
        conn.shutdown()
    kcc.kv_cache_layout = "LBHNC"
    narrow = {n: v[..., :-64] if "linear_attn" in n else v for n, v in views.items()}
    conn = KVTierConnector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        with pytest.raises(ValueError, match=r"kv_caches: group 0's state views .* 2146304 bytes of state"):
            conn.register_kv_caches(narrow)
    finally:
        conn.shutdown()


def test_after_a_restart_the_states_are_hit_on_the_disk(tmp_path):
    """A new server over the same disk: empty hosts, every group's chunks (the states too) read
    back from the disk in the background, the stand-in's state layers reading them as true."""
    extra = {"disk_path": str(tmp_path / "disk")}
    a = _prompt(3500)
    e = _engine(tmp_path, extra)
    try:
        e.add("a", a)
        e.settle(timeout_s=300)  # write-through: the states and the KV are on the disk
    finally:
        e.close()
    e = _engine(tmp_path, extra)  # a new server: empty hosts, the same disk
    try:
        e.add("b", a, max_tokens=3)
        e.settle(timeout_s=300)
        assert e.run_loads("b") == [(0, 1), (1, 1), (2, 1), (3, 3)] and not e.failed_receipts()
        assert e.scheduled("b")[0] == len(a) - 3 * BS  # vLLM computed only past the hit
        assert not e.violations() and e.model.reads > 0 and e.outputs["b"][0] == e.first_token(a)
    finally:
        e.close()


@pytest.mark.redis
def test_another_instance_hits_the_states_through_redis(tmp_path, redis_server):  # noqa: F811
    """Instance B asks Redis for every group's chunks A wrote there, the states too, and its
    state layers read the states it loads as true."""
    extra = {"redis_url": redis_server.url, "prefetch_timeout_s": 20.0}
    a = _prompt(3500)
    ea, eb = _engine(tmp_path, extra), _engine(tmp_path, extra)
    try:
        ea.add("a", a)
        ea.settle(timeout_s=300)
        assert all(st.flush(10) for st in ea.ranks[0].ws.stores)  # write-through: in Redis
        eb.settle()  # B's worker reports its key fields: its scheduler can ask Redis
        eb.add("b", a, max_tokens=3)
        eb.settle(timeout_s=300)
        assert eb.run_loads("b") == [(0, 1), (1, 1), (2, 1), (3, 3)] and not eb.failed_receipts()
        assert eb.counts().get("hit_chunks_redis", 0) == 6  # three states, three chunks of KV
        assert eb.scheduled("b")[0] == len(a) - 3 * BS  # vLLM computed only past the hit
        assert not eb.violations() and eb.model.reads > 0 and eb.outputs["b"][0] == eb.first_token(a)
    finally:
        ea.close()
        eb.close()
