"""Hybrid models through vLLM 0.33's real Scheduler, with the KVCacheConfigs vLLM builds from the
models' own config.json (gpt-oss-20b: full + sliding window 128; Gemma 3 4B: full + six sliding
groups of 1024; DeepSeek-V3.2: MLA and its DSA indexer in one group): each group keeps and loads
what a hit needs, a hit only where every group holds, a failed load of any group recomputes the
request, preemption and window blocks vLLM hands out again read only true KV. A model with state
groups (Qwen3-Next): `test_vllm_hybrid_state.py`."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from hybrid_harness import HybridEngine, _views  # noqa: E402
from hybrid_models import hybrid_kv_cache_config, hybrid_vllm_config  # noqa: E402

from store_redis_fixtures import redis_server  # noqa: E402, F401 - a fixture

pytestmark = pytest.mark.vllm
HOST = {"host_bytes": 1 << 28}
ARGS = {
    "gpt-oss-20b": dict(num_blocks=300),
    "gemma-3-4b": dict(num_blocks=700, max_model_len=1536, batched=1536),
    "deepseek-v3.2": dict(num_blocks=300),
}


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(i * 7919 + seed * 104729) % 997 + 1 for i in range(n)]


def _groups(tmp_path, name):
    from kvtier.integrations.vllm.groups import groups_of

    cfg = hybrid_vllm_config(tmp_path, name, {}, **({"max_model_len": 1536} if "gemma" in name else {}))
    kcc, *_ = hybrid_kv_cache_config(cfg, 700 if "gemma" in name else 300)
    return groups_of(kcc)


@pytest.mark.parametrize(
    "name,want",
    [
        ("gpt-oss-20b", [("window", 128)] + [("full", None)]),
        ("gemma-3-4b", [("window", 1024)] * 6 + [("full", None)]),
        ("deepseek-v3.2", [("full", None)] * 2),
    ],
)
def test_groups_as_vllm_builds_them(tmp_path, name, want):
    groups, refused = _groups(tmp_path, name)
    assert refused is None and [(g.kind, g.window) for g in groups] == want
    assert len({g.label for g in groups}) == len(groups)  # every group's keys its own
    if name == "deepseek-v3.2":  # one block table, the latent and the indexer keys apart
        assert {g.index for g in groups} == {0} and "INDEXER" in groups[1].label
        assert all(len(g.layers) == 61 for g in groups)


@pytest.mark.parametrize(
    "name,ct,want",
    [
        # a window of 128 is 8 blocks: the last half of a 16-block chunk, the whole unit of 4
        ("gpt-oss-20b", 256, [(0, 1, 128), (1, 2, 256)]),
        ("gpt-oss-20b", 64, [(0, 2, 64), (1, 9, 64)]),
        ("gemma-3-4b", 256, [(g, 4, 256) for g in range(6)] + [(6, 5, 256)]),
        ("deepseek-v3.2", 64, [(0, 9, 64), (1, 9, 64)]),
    ],
    ids=["gpt-oss-ct256", "gpt-oss-ct64", "gemma-3", "deepseek-v3.2"],
)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_hybrid_hit_loads_each_group_what_it_reads(tmp_path, name, ct, want, async_scheduling):
    """want: per group (group, chunks loaded, tokens a stored chunk of that group covers)."""
    a = _prompt(1300 if "gemma" in name else 600)
    e = HybridEngine(
        tmp_path, name, {"chunk_tokens": ct, **HOST}, async_scheduling=async_scheduling, **ARGS[name]
    )
    try:
        e.add("a", a, max_tokens=3)
        e.settle()
        e.sched.reset_prefix_cache()  # vLLM's own cache forgets: only kvtier can hit
        e.add("b", a, max_tokens=3)
        e.settle()
        ws = e.ranks[0].ws
        assert [(g, n, ws.stores[g].fmt.tokens) for g, n in e.run_loads("b")] == want
        hit = max(n for _, n, _ in want) * ct
        assert e.scheduled("b")[0] == len(a) - hit  # vLLM computed only past the hit
        assert not e.violations() and e.model.reads > 0
        assert e.outputs["b"] == e.outputs["a"] and e.outputs["b"][0] == e.first_token(a)
    finally:
        e.close()


def test_the_choice_plans_a_hybrid_load_at_the_bytes_each_group_reads(tmp_path):
    a = _prompt(600)
    e = HybridEngine(tmp_path, "gpt-oss-20b", {"chunk_tokens": 256, **HOST}, **ARGS["gpt-oss-20b"])
    try:
        e.add("a", a, max_tokens=3)
        e.settle()
        stores = e.ranks[0].ws.stores
        # A hit of 2 chunks: the window group (128 tokens) reads one unit of 8 blocks, the full
        # group both chunks: not two chunks of every group.
        want = stores[0].fmt.nbytes + 2 * stores[1].fmt.nbytes
        load_bytes = e.sched.connector.scheduler_side.chooser.load_bytes
        assert load_bytes(0, 2) == want < 2 * (stores[0].fmt.nbytes + stores[1].fmt.nbytes)
        assert load_bytes(256, 2) == stores[0].fmt.nbytes + stores[1].fmt.nbytes  # past vLLM's own
    finally:
        e.close()


def test_load_async_never_is_said_not_to_hold_for_a_hybrid_model(tmp_path, caplog):
    from kvtier.integrations.vllm.groups import GroupPlan
    from kvtier.integrations.vllm.scheduler import SchedulerSide
    from kvtier.integrations.vllm.settings import VllmSettings

    groups, _ = _groups(tmp_path, "gpt-oss-20b")
    for mode, said in (("never", True), ("auto", False)):
        caplog.clear()
        s = VllmSettings(chunk_tokens=256, load_async=mode)
        SchedulerSide(s, 16, 16, 1, plan=GroupPlan(groups, 256))
        assert ('load_async "never" does not hold' in caplog.text) is said


def test_a_hit_ends_where_every_group_holds_its_window(tmp_path):
    a = _prompt(300)  # 4 chunks of 64 (the fifth holds the last token)
    e = HybridEngine(tmp_path, "gpt-oss-20b", {"chunk_tokens": 64, **HOST}, **ARGS["gpt-oss-20b"])
    try:
        e.add("a", a)
        e.settle()
        window = e.ranks[0].ws.stores[0]
        assert window.host.evict(window.keys([_chunk_id(a, 3)])) == 1  # the window's last unit
        e.settle()  # the scheduler hears of it
        e.sched.reset_prefix_cache()
        e.add("b", a)
        e.settle()
        # A hit of 4 chunks needs the window of chunks 2 and 3; of 3, chunks 1 and 2: held.
        assert e.run_loads("b") == [(0, 2), (1, 3)] and e.scheduled("b")[0] == 300 - 192
        assert not e.violations() and e.outputs["b"][0] == e.first_token(a)
    finally:
        e.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name,group", [("gpt-oss-20b", 0), ("gpt-oss-20b", 1), ("deepseek-v3.2", 1)])
def test_a_failed_load_of_any_group_recomputes_the_request(tmp_path, name, group, async_scheduling):
    a = _prompt(300)
    e = HybridEngine(
        tmp_path, name, {"chunk_tokens": 64, **HOST}, async_scheduling=async_scheduling, **ARGS[name]
    )
    try:
        e.add("a", a)
        e.settle()
        e.sched.reset_prefix_cache()
        store = e.ranks[0].ws.stores[group]

        def lose(so):  # the grant races an eviction of one group's chunk
            if so.kv_connector_metadata.loads and e.before_execute is lose:
                store.host.evict(store.keys([_chunk_id(a, 3)]))
                e.before_execute = None

        e.before_execute = lose
        e.add("b", a, max_tokens=3)
        e.settle()
        assert e.failed_receipts() == {"b"} and not e.invalid_blocks()  # vLLM refuses blocks here
        # vLLM dropped the whole load and asked again: the hit now ends before the lost chunk.
        first, again = e.run_loads("b")[:-2], e.run_loads("b")[-2:]
        assert max(n for _, n in first) == 4 and max(n for _, n in again) == 3
        assert e.scheduled("b")[0] == len(a) - 3 * 64
        assert not e.violations() and e.outputs["b"][0] == e.first_token(a)
        e.sched.reset_prefix_cache()
        e.add("c", a)
        e.settle()  # what b recomputed was saved: c hits all of it
        assert max(n for _, n in e.run_loads("c")) == 4 and not e.violations()
    finally:
        e.close()


def test_preempted_hybrid_requests_read_only_true_kv(tmp_path):
    e = HybridEngine(tmp_path, "gpt-oss-20b", {"chunk_tokens": 64, **HOST}, num_blocks=300, batched=256)
    try:
        give_back = _shrink(e, 48)
        for i in range(3):
            e.add(f"r{i}", _prompt(200, seed=i), max_tokens=120)
        e.settle(timeout_s=120)
        assert any(so.preempted_req_ids for so, _ in e.history)
        assert not e.violations() and len(e.finished) == 3
        give_back()
        assert e.sched.reset_prefix_cache()
        e.add("again", _prompt(200, seed=1), max_tokens=2)
        e.settle()
        assert e.run_loads("again") and not e.violations()
        assert e.outputs["again"][0] == e.first_token(_prompt(200, seed=1))
    finally:
        e.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_window_blocks_handed_out_again_wait_for_their_saves(tmp_path, async_scheduling):
    """vLLM frees a window's blocks while its request runs and hands them to another: the step
    that does waits for the saves still reading them (the copies land late here)."""
    from kvtier.device import SimDevice

    dev = SimDevice(copy_delay=0.3)
    e = HybridEngine(
        tmp_path,
        "gpt-oss-20b",
        {"chunk_tokens": 64, **HOST},
        num_blocks=300,
        batched=256,
        device=lambda r: dev,
        async_scheduling=async_scheduling,
    )
    try:
        give_back = _shrink(e, 90)  # a's freed window blocks come back to it at once
        a = _prompt(600)
        e.add("a", a, max_tokens=2)  # prefilled 256 tokens a step: the window moves 16 blocks
        e.settle(timeout_s=120)
        assert _handed_again(e, "a")  # while a prefilled, to a itself
        give_back()
        assert e.sched.reset_prefix_cache()
        b = a[:150]  # a hit of 2 chunks reads the window of chunks 0 and 1, freed after step 1
        e.add("b", b, max_tokens=2)
        e.settle(timeout_s=120)
        assert e.run_loads("b") == [(0, 2), (1, 2)] and not e.violations()
        assert e.outputs["b"][0] == e.first_token(b)
    finally:
        e.close()


def _chunk_id(tokens: list[int], chunk: int, per_chunk: int = 4) -> bytes:
    """The id of chunk ``chunk`` of ``tokens`` (64-token chunks of 16-token blocks)."""
    from vllm_utils import create_request

    req = create_request("__ids__", tokens)
    return bytes(req.block_hashes[(chunk + 1) * per_chunk - 1])


def _shrink(e, free: int):
    """vLLM's pool left with ``free`` free blocks; returns a call that gives the rest back."""
    pool = e.sched.kv_cache_manager.block_pool
    taken = pool.get_new_blocks(pool.get_num_free_blocks() - free)
    return lambda: pool.free_blocks(taken)


def _handed_again(e, rid: str) -> set[int]:
    """Window-group blocks of request ``rid`` that vLLM handed out again in a later step."""
    seen, again = set(), set()
    for so, _ in e.history:
        again |= so.kv_connector_metadata.fresh & seen
        for new in so.scheduled_new_reqs:
            seen |= set(new.block_ids[0]) if new.req_id == rid else set()
        cr = so.scheduled_cached_reqs
        for r, nb in zip(cr.req_ids, cr.new_block_ids, strict=True):
            seen |= set(nb[0]) if r == rid and nb else set()
    return again


def test_each_group_is_checked_against_its_strides(tmp_path):
    """Each group's views are read as the order vLLM resolved; views in another order are
    refused at registration, naming kv_caches and the orders their strides fit."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.integrations.vllm import KVTierConnector

    cfg = hybrid_vllm_config(tmp_path, "gpt-oss-20b", HOST)
    kcc, *_ = hybrid_kv_cache_config(cfg, 300)
    views = _views(kcc)  # LBHNC, as kcc's tensors place them
    kcc.kv_cache_layout = "BLHNC"
    conn = KVTierConnector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        with pytest.raises(ValueError, match=r"kv_caches: strides .* not order='BLHNC'; they fit .*LBHNC"):
            conn.register_kv_caches(views)
    finally:
        conn.shutdown()


@pytest.mark.redis
def test_another_instance_hits_a_hybrid_prefix_through_redis(tmp_path, redis_server):  # noqa: F811
    """Instance B asks Redis for every group's chunks A wrote there, and loads them (read in
    the background, each group's through its own store)."""
    extra = {"chunk_tokens": 64, **HOST, "redis_url": redis_server.url, "prefetch_timeout_s": 20.0}
    a = _prompt(300)
    ea = HybridEngine(tmp_path, "gpt-oss-20b", extra, num_blocks=300)
    eb = HybridEngine(tmp_path, "gpt-oss-20b", extra, num_blocks=300)
    try:
        ea.add("a", a)
        ea.settle()
        assert all(st.flush(10) for st in ea.ranks[0].ws.stores)  # write-through: in Redis
        eb.settle()  # B's worker reports its key fields: its scheduler can ask Redis
        eb.add("b", a)
        eb.settle()
        assert eb.run_loads("b") == [(0, 2), (1, 4)] and eb.counts().get("hit_chunks_redis", 0) == 6
        assert not eb.violations() and eb.outputs["b"][0] == eb.first_token(a)
    finally:
        ea.close()
        eb.close()


@pytest.mark.parametrize("name", ["gpt-oss-20b", "deepseek-v3.2"])
def test_at_tp2_a_hit_needs_every_rank_and_one_rank_failing_takes_it_back(tmp_path, name):
    a = _prompt(300)
    e = HybridEngine(tmp_path, name, {"chunk_tokens": 64, **HOST}, tp_size=2, **ARGS[name])
    try:
        e.add("a", a)
        e.settle()
        e.sched.reset_prefix_cache()
        e.add("b", a, max_tokens=3)
        e.settle()
        assert max(n for _, n in e.run_loads("b")) == 4 and e.scheduled("b")[0] == 300 - 256
        assert not e.violations() and e.outputs["b"][0] == e.first_token(a)
        store = e.ranks[1].ws.stores[1]  # rank 1's full-attention group (DeepSeek: its indexer)

        def lose(so):  # the grant races an eviction on one rank only
            if so.kv_connector_metadata.loads and e.before_execute is lose:
                store.host.evict(store.keys([_chunk_id(a, 3)]))
                e.before_execute = None

        e.sched.reset_prefix_cache()
        e.before_execute = lose
        e.add("c", a, max_tokens=3)
        e.settle()
        assert e.failed_receipts() == {"c"} and max(n for _, n in e.run_loads("c")[-2:]) == 3
        assert not e.violations() and e.outputs["c"][0] == e.first_token(a)
    finally:
        e.close()


@pytest.mark.parametrize("name", ["gpt-oss-20b", "deepseek-v3.2"])
def test_after_a_restart_every_group_is_hit_on_the_disk(tmp_path, name):
    extra = {"chunk_tokens": 64, **HOST, "disk_path": str(tmp_path / "disk")}
    a = _prompt(300)
    e = HybridEngine(tmp_path, name, extra, **ARGS[name])
    try:
        e.add("a", a)
        e.settle()  # write-through: every group's chunks are on the disk
    finally:
        e.close()
    e = HybridEngine(tmp_path, name, extra, **ARGS[name])  # a new server: empty hosts, the same disk
    try:
        e.add("b", a, max_tokens=3)
        e.settle()
        assert max(n for _, n in e.run_loads("b")) == 4 and not e.failed_receipts()
        assert not e.violations() and e.outputs["b"][0] == e.first_token(a)
    finally:
        e.close()


@pytest.mark.parametrize("name", ["gpt-oss-20b", "deepseek-v3.2"])
def test_a_host_smaller_than_the_working_set_is_granted_only_what_every_group_holds(tmp_path, name):
    probe = HybridEngine(tmp_path / "probe", name, {"chunk_tokens": 64, **HOST}, **ARGS[name])
    chunk = sum(st.fmt.nbytes for st in probe.ranks[0].ws.stores)  # one chunk's units, every group
    probe.close()
    e = HybridEngine(tmp_path, name, {"chunk_tokens": 64, "host_bytes": 6 * chunk}, **ARGS[name])
    try:
        prompts = [_prompt(300, seed=s) for s in range(4)]
        for i, p in enumerate(prompts):  # 16 chunks through a host of 6: the first ones evicted
            e.add(f"a{i}", p)
            e.settle()
        for i, p in reversed(list(enumerate(prompts))):
            e.sched.reset_prefix_cache()
            e.add(f"b{i}", p, max_tokens=2)
            e.settle()
            assert not e.violations() and e.outputs[f"b{i}"][0] == e.first_token(p)
        assert max(n for _, n in e.run_loads("b3")) == 4  # the last saved: held whole
        assert e.run_loads("b0") == [] and not e.failed_receipts()  # evicted: never granted
    finally:
        e.close()
