"""Two vLLM instances (each its own Scheduler and worker) sharing one Redis: B hits what A saved.
Only Redis holds it, so B's load is read in the background (the request waits out of the batch
while its workers read the chunks into the host and copy them), never in a step."""

from __future__ import annotations

import time

import pytest
from vllm_rig import _BLOCKS, Worker, drain, make_request, make_scheduler, run_step

from store_redis_fixtures import redis_server  # noqa: F401 - a fixture

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
pytestmark = [pytest.mark.redis, pytest.mark.vllm]
TOKENS = list(range(1, 101))  # 100 tokens: 3 full chunks of 32


def _instance(tmp_path, url: str):
    """One "vLLM server": the same model (config.json path: part of the keys) as the other."""
    extra = {"chunk_tokens": 32, "host_bytes": 1 << 22, "redis_url": url, "prefetch_timeout_s": 20.0}
    cfg, kcc, sched = make_scheduler(tmp_path, extra)
    return sched, Worker(cfg, kcc, 64)


def test_instance_b_hits_what_a_saved_through_redis(tmp_path, redis_server):  # noqa: F811
    sched_a, wa = _instance(tmp_path, redis_server.url)
    sched_b, wb = _instance(tmp_path, redis_server.url)
    reqs_a = {"a": make_request("a", TOKENS)}
    sched_a.add_request(reqs_a["a"])
    drain(sched_a, [wa], reqs_a)
    assert wa.conn.worker_side.store.flush(10)  # write-through: A's chunks reached Redis
    reqs_b: dict = {}
    run_step(sched_b, [wb], reqs_b)  # B's worker reports its key fields: its scheduler can ask Redis
    req = make_request("b", TOKENS)
    reqs_b["b"] = req
    sched_b.add_request(req)
    so, kv = run_step(sched_b, [wb], reqs_b)
    assert "b" not in so.num_scheduled_tokens  # it waits out of the batch while Redis is read
    (load,) = so.kv_connector_metadata.loads
    assert load.background and load.tiers == ("redis",) * 3 and load.budget_s is not None
    hits = 0
    for _ in range(2000):  # until its chunks were read, copied and reported received
        stats = kv.kv_connector_stats.data if kv.kv_connector_stats else {}
        hits += stats.get("hit_chunks_redis", 0)
        if "b" in so.num_scheduled_tokens:
            break
        so, kv = run_step(sched_b, [wb], reqs_b)
        time.sleep(0.002)  # the reader and the copies run on their own threads meanwhile
    assert so.num_scheduled_tokens["b"] == 4  # 96 tokens loaded from what A computed
    assert not kv.invalid_block_ids
    wb.check(req, _BLOCKS["b"], 100)
    assert hits == 3  # read from Redis into the host, then copied
    for w in (wa, wb):
        w.conn.shutdown()
    for s in (sched_a, sched_b):
        s.connector.shutdown()


def test_redis_down_is_a_miss_not_an_error(tmp_path, redis_server):  # noqa: F811
    sched_a, wa = _instance(tmp_path, redis_server.url)
    sched_b, wb = _instance(tmp_path, redis_server.url)
    reqs_a = {"a": make_request("a", TOKENS)}
    sched_a.add_request(reqs_a["a"])
    drain(sched_a, [wa], reqs_a)
    assert wa.conn.worker_side.store.flush(10)
    reqs_b: dict = {}
    run_step(sched_b, [wb], reqs_b)
    redis_server.kill()  # the shared tier is gone before B asks
    req = make_request("b", TOKENS)
    reqs_b["b"] = req
    sched_b.add_request(req)
    drain(sched_b, [wb], reqs_b)
    wb.check(req, _BLOCKS["b"], 100)  # computed by B itself, identical
    for w in (wa, wb):
        w.conn.shutdown()
