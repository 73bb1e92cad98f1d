"""kvtier's vLLM connector against vLLM 0.33's real Scheduler, whole requests, CPU tensors."""

from __future__ import annotations

import pytest
from vllm_rig import _BLOCKS, Worker, drain, make_request, make_scheduler, run_step

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = pytest.mark.vllm
TOKENS = list(range(1, 101))  # 100 tokens: 3 full chunks of 32


def _finish(sched, workers, reqs):
    drain(sched, workers, reqs)  # the saves completed and were reported: vLLM freed the blocks


def _second_request(sched, workers, reqs, rid="b"):
    sched.reset_prefix_cache()  # the local prefix cache forgets: only kvtier can hit
    req = make_request(rid, TOKENS)
    reqs[rid] = req
    sched.add_request(req)
    so, kv = run_step(sched, workers, reqs)
    return req, so, kv


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_hit_loads_exactly_the_saved_kv(tmp_path, order):
    cfg, kcc, sched = make_scheduler(tmp_path, {"chunk_tokens": 32, "host_bytes": 1 << 22})
    w = Worker(cfg, kcc, 64, order=order)
    reqs = {"a": make_request("a", TOKENS)}
    sched.add_request(reqs["a"])
    _finish(sched, [w], reqs)
    req, so, kv = _second_request(sched, [w], reqs)
    assert so.num_scheduled_tokens["b"] == 4  # 96 loaded, the rest computed
    assert [len(r.ids) for r in so.kv_connector_metadata.loads] == [3]
    assert not kv.invalid_block_ids
    w.check(req, _BLOCKS["b"], 100)
    assert kv.kv_connector_stats.data["hit_chunks_host"] == 3
    w.conn.shutdown()


def test_miss_loads_nothing(tmp_path):
    cfg, kcc, sched = make_scheduler(tmp_path, {"chunk_tokens": 32, "host_bytes": 1 << 22})
    w = Worker(cfg, kcc, 64)
    reqs = {}
    req, so, kv = _second_request(sched, [w], reqs)
    assert so.num_scheduled_tokens["b"] == 100 and not so.kv_connector_metadata.loads
    assert not kv.invalid_block_ids
    w.check(req, _BLOCKS["b"], 100)
    w.conn.shutdown()


def test_lost_chunks_are_recomputed(tmp_path):
    cfg, kcc, sched = make_scheduler(tmp_path, {"chunk_tokens": 32, "host_bytes": 1 << 22})
    w = Worker(cfg, kcc, 64)
    reqs = {"a": make_request("a", TOKENS)}
    sched.add_request(reqs["a"])
    _finish(sched, [w], reqs)
    w.conn.worker_side.store.evict()  # the host loses every chunk the scheduler thinks it holds
    req, so, kv = _second_request(sched, [w], reqs)
    assert kv.invalid_block_ids == set(_BLOCKS["b"][:6])  # reported: vLLM recomputes them
    _finish(sched, [w], reqs)
    w.check(req, _BLOCKS["b"], 100)  # recomputed, identical
    w.conn.shutdown()


def test_tp_ranks_keep_their_own_chunks(tmp_path):
    from kvtier.store.throttle import MemoryTier

    shared = MemoryTier(1 << 24)
    cfg, kcc, sched = make_scheduler(tmp_path, {"chunk_tokens": 32, "host_bytes": 1 << 22})
    w0 = Worker(cfg, kcc, 64, tiers=[shared], tp_rank=0, tp_size=2)
    reqs = {"a": make_request("a", TOKENS)}
    sched.add_request(reqs["a"])
    _finish(sched, [w0], reqs)
    w0.conn.worker_side.store.flush(5)
    ids = [bytes(h) for h in reqs["a"].block_hashes[1::2]][:3]
    keys0 = w0.conn.worker_side.store.keys(ids)
    assert all(shared.contains(k) for k in keys0)
    w1 = Worker(cfg, kcc, 64, tiers=[shared], tp_rank=1, tp_size=2)
    assert w1.conn.worker_side.store.lookup(ids).tokens == 0  # rank 1 never sees rank 0's KV
    for w in (w0, w1):
        w.conn.shutdown()
