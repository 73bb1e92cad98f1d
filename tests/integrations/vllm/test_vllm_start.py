"""The connector at vLLM's start, under vLLM's real Scheduler: a Redis that does not answer is a
warning from the scheduler side and from each worker (its password masked), then misses; bad
settings refuse the connector, the error naming the setting as typed."""

from __future__ import annotations

import logging
import threading

import pytest
from vllm_rig import Worker, drain, make_request, make_scheduler

from kvtier.device import SimDevice

from store_redis_fixtures import free_port

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
pytestmark = pytest.mark.vllm
TOKENS = list(range(1, 101))  # 100 tokens: 3 full chunks of 32


def _start_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "at start" in r.getMessage()
    ]


def test_a_redis_that_does_not_answer_is_a_warning_at_start(tmp_path, caplog):
    port = free_port()  # nothing listens there
    masked = f"redis://:***@127.0.0.1:{port}/0"
    extra = {"chunk_tokens": 32, "host_bytes": "4MiB", "redis_url": f"redis://:hunter2@127.0.0.1:{port}/0"}
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        cfg, kcc, sched = make_scheduler(tmp_path, extra)  # the scheduler side's RedisTier
    (warning,) = _start_warnings(caplog)
    assert masked in warning and "ConnectionError" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        worker = Worker(cfg, kcc, 64)  # the worker's tiers, made when vLLM registers its caches
    (warning,) = _start_warnings(caplog)
    assert masked in warning
    assert "hunter2" not in caplog.text
    reqs = {"a": make_request("a", TOKENS)}  # served without the tier: every chunk a miss
    sched.add_request(reqs["a"])
    drain(sched, [worker], reqs)
    (redis,) = worker.conn.worker_side.store.tiers
    assert redis.stats()["errors_skipped"] > 0  # misses at once: the breaker opened at start
    worker.conn.shutdown()
    sched.connector.shutdown()


@pytest.mark.parametrize(
    "extra, names",
    [
        ({"kvtier": {"host_bytes": "4MiB"}, "hostbytes": 1}, ["'hostbytes'", "'kvtier' block"]),
        ({"redis_url": "redis://:hunter2@cache:port/0"}, ["['redis_url']", "redis://:***@cache:port/0"]),
        ({"engine_path": "fast"}, ["['engine_path']", "'fast'"]),
        ({"host_bytes": "4G"}, ["['host_bytes']='4G'", "GiB"]),
    ],
)
def test_bad_settings_refuse_the_connector_naming_them(tmp_path, extra, names):
    with pytest.raises(ValueError) as err:
        make_scheduler(tmp_path, extra)
    for name in names:
        assert name in str(err.value)
    assert "hunter2" not in str(err.value)


def test_host_bytes_below_three_chunks_refuses_the_worker_before_it_allocates(tmp_path):
    chunk = 2 * 2 * 32 * 2 * 16 * 4  # 2 layers, K and V, 32 tokens, 2 heads x 16, the rig's fp32: 16 KiB
    cfg, kcc, sched = make_scheduler(tmp_path, {"chunk_tokens": 32, "host_bytes": "32KiB"})
    dev = SimDevice()  # the rig's device, made before: what the worker starts is what is counted
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match=rf"\['host_bytes'\]=32768 is too small for chunks of {chunk} bytes"):
        Worker(cfg, kcc, 64, device=dev)
    assert set(threading.enumerate()) == before  # no pool, engine or store thread
    dev.close()
    sched.connector.shutdown()
