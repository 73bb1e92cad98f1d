"""The connector's counters on vLLM's stats path: the worker's `get_kv_connector_stats`, the
scheduler's `build_kv_connector_stats` (aggregate / reduce), and `build_prom_metrics` through
vLLM's own `KVConnectorProm`, with a hit and an error counted."""

from __future__ import annotations

import pytest
from vllm_rig import _BLOCKS, Worker, drain, make_request, make_scheduler, run_step

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = pytest.mark.vllm
TOKENS = list(range(1, 101))  # 100 tokens: 3 full chunks of 32


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    """kvtier's Prometheus metrics through vLLM's own `KVConnectorProm`, made once: they register
    in the process's one registry, as in vLLM."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    cfg, _, _ = make_scheduler(tmp_path_factory.mktemp("prom"), {"chunk_tokens": 32, "host_bytes": 1 << 22})
    return KVConnectorProm(cfg, ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]})


def test_hits_misses_and_errors_reach_vllms_stats_and_prometheus(tmp_path, prom):
    from prometheus_client import REGISTRY

    from kvtier.integrations.vllm import KVTierConnector

    cfg, kcc, sched = make_scheduler(tmp_path, {"chunk_tokens": 32, "host_bytes": 1 << 22})
    w = Worker(cfg, kcc, 64)
    reqs = {"a": make_request("a", TOKENS)}
    sched.add_request(reqs["a"])
    drain(sched, [w], reqs)
    store = w.conn.worker_side.store
    ids = [bytes(h) for h in reqs["a"].block_hashes[1::2]][:3]
    assert store.evict(ids[2:]) == 1  # the host loses the third chunk the scheduler thinks it holds
    sched.reset_prefix_cache()
    reqs["b"] = make_request("b", TOKENS)
    sched.add_request(reqs["b"])
    _, kv = run_step(sched, [w], reqs)
    assert kv.invalid_block_ids == set(_BLOCKS["b"][4:6])  # recomputed by vLLM
    first = kv.kv_connector_stats
    assert first.data["hit_chunks_host"] == 2 and first.data["miss_chunks"] == 1
    drain(sched, [w], reqs)
    w.check(reqs["b"], _BLOCKS["b"], 100)

    rest = store.engine.pool.stats().free  # now make c's saves fail: no room in the pool
    hog = store.engine.pool.alloc(rest - 1024)  # nearly every byte taken: the next save has no room
    sched.reset_prefix_cache()
    reqs["c"] = make_request("c", [t + 1000 for t in TOKENS])
    sched.add_request(reqs["c"])
    outs = []
    for _ in range(3):
        outs.append(run_step(sched, [w], reqs)[1].kv_connector_stats)
    store.engine.pool.free(hog)
    drain(sched, [w], reqs)

    agg = KVTierConnector.build_kv_connector_stats({})
    for s in [first, *outs]:
        if s is not None:
            agg = agg.aggregate(s)
    red, data = agg.reduce(), dict(agg.data)  # reduce(): vLLM's log line; data: what Prometheus gets
    assert red["hit_chunks_host"] == 2 and red["miss_chunks"] == 1 and red["save_errors"] >= 3
    assert red["hit_rate_pct"] == round(100 * 2 / 3, 1) and list(red)[0] == "hit_rate_pct"
    assert red["loads"] >= 1 and red["load_MB"] > 0 and red["load_gbps"] > 0 and red["load_ms_mean"] > 0
    assert "load_bytes" not in red and "load_busy_s" not in red  # raw sums stay in data, not in the line
    assert not agg.is_empty()
    agg.reset()
    assert agg.is_empty()

    prom.observe(data, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    got = REGISTRY.get_sample_value
    assert got("vllm:kvtier_hit_chunks_total", {**labels, "tier": "host"}) == 2
    assert got("vllm:kvtier_miss_chunks_total", labels) == 1
    assert got("vllm:kvtier_errors_total", {**labels, "op": "save"}) == red["save_errors"]
    assert got("vllm:kvtier_bytes_total", {**labels, "op": "load"}) == data["load_bytes"]
    w.conn.shutdown()


def test_each_requests_choice_and_first_token_reach_vllms_log_line_and_prometheus(prom):
    from prometheus_client import REGISTRY

    from kvtier.integrations.vllm import KVTierConnector

    worker = KVTierConnector.build_kv_connector_stats({"hit_chunks_disk": 8, "deadline_cuts": 1})
    first = KVTierConnector.build_kv_connector_stats(
        {"first_tokens": [["load", "disk", 40.0, 52.0], ["recompute", "host", 900.0, 880.0]]}
    )
    later = KVTierConnector.build_kv_connector_stats({"first_tokens": [["load", "host", 20.0, 30.0]]})
    agg = worker.aggregate(first).aggregate(later)  # as vLLM sums the workers' and the scheduler's
    red = agg.reduce()
    assert red["choice_load"] == 2 and red["choice_recompute"] == 1 and red["deadline_cuts"] == 1
    assert red["first_token_ms_planned_load"] == 30.0 and red["first_token_ms_load"] == 41.0
    assert red["first_token_ms_recompute"] == 880.0
    assert "first_tokens" not in red  # the per-request list stays in data, for Prometheus

    prom.observe(dict(agg.data), 1)
    labels = {"model_name": "tiny", "engine": "1"}
    got = REGISTRY.get_sample_value
    assert got("vllm:kvtier_choices_total", {**labels, "choice": "load", "tier": "disk"}) == 1
    assert got("vllm:kvtier_choices_total", {**labels, "choice": "load", "tier": "host"}) == 1
    measured = {**labels, "choice": "load", "kind": "measured"}
    assert got("vllm:kvtier_first_token_seconds_count", measured) == 2
    assert got("vllm:kvtier_first_token_seconds_sum", measured) == pytest.approx(0.082)
    planned = {**labels, "choice": "recompute", "kind": "planned"}
    assert got("vllm:kvtier_first_token_seconds_sum", planned) == pytest.approx(0.9)
    assert got("vllm:kvtier_deadline_cuts_total", labels) == 1
