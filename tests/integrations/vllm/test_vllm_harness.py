"""The test harness itself (`vllm_harness.py`, `stand_in.py`): a hit through vLLM's Scheduler and
AsyncScheduler at TP 1 and 2 reads only true KV and samples a recompute's token, and the checker
does catch bad KV: a corrupted host chunk, and a load the forward does not wait for."""

from __future__ import annotations

import pytest
from vllm_harness import Engine

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = pytest.mark.vllm
A = list(range(1, 101))  # 3 full chunks of 32
EXTRA = {"chunk_tokens": 32, "host_bytes": 1 << 22}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_hit_reads_only_true_kv(tmp_path, async_scheduling, tp_size):
    e = Engine(tmp_path, EXTRA, tp_size=tp_size, async_scheduling=async_scheduling)
    try:
        e.add("a", A, max_tokens=3)
        e.settle()
        e.sched.reset_prefix_cache()
        e.add("b", A, max_tokens=3)
        e.settle()
        assert e.loads("b") == [3] and e.scheduled("b")[0] == 4  # 96 tokens loaded
        assert not e.invalid_blocks() and not e.violations()
        assert e.model.reads > 0
        assert e.outputs["a"] == e.outputs["b"] and e.outputs["b"][0] == e.first_token(A)
    finally:
        e.close()


def test_the_checker_sees_a_corrupted_chunk(tmp_path):
    e = Engine(tmp_path, EXTRA)
    try:
        e.add("a", A)
        e.settle()
        for entry in e.ranks[0].store.host.entries():
            entry.slot.tensor.view(-1)[:64] = 0  # the host's bytes, not what the forward wrote
        e.sched.reset_prefix_cache()
        e.add("b", A)
        e.settle()
        assert e.loads("b") == [3] and e.violations("b")
    finally:
        e.close()


def test_the_checker_sees_a_load_the_forward_did_not_wait_for(tmp_path):
    from kvtier.device import SimDevice

    e = Engine(tmp_path, EXTRA, device=lambda r: SimDevice(copy_delay=0.05, launch_delay=0.05))
    try:
        e.add("a", A)
        e.settle()
        e.sched.reset_prefix_cache()
        for rk in e.ranks:
            rk.ws.wait_layer = lambda name: None  # attention no longer waits for its layer
        e.add("b", A)
        e.settle()
        assert e.loads("b") == [3] and e.violations("b")
    finally:
        e.close()
