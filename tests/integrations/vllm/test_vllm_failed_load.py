"""A load that fails in the middle of a request while the forward runs past it, through vLLM's
real Scheduler and AsyncScheduler, with TP 1 and 2: no chunk computed from the failed blocks is
ever stored (a later hit reads only true KV), and the chunks vLLM recomputes are saved (a later
request with the prefix hits all of them)."""

from __future__ import annotations

import pytest
from vllm_harness import Engine

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = pytest.mark.vllm
A = list(range(1, 101))  # 3 full chunks of 32 (6 blocks): the prefix kvtier holds
B = A + list(range(1001, 1101))  # 200 tokens: 6 chunks; the forward runs 3 chunks past the hit
EXTRA = {"chunk_tokens": 32, "host_bytes": 1 << 22}


def _keys(e, rank: int, tokens: list[int], chunks: list[int]) -> list[bytes]:
    """Rank ``rank``'s store keys of chunks ``chunks`` of ``tokens`` (ids from vLLM's hashes)."""
    from vllm_utils import create_request

    req = create_request("__keys__", tokens)
    ids = [bytes(req.block_hashes[2 * c + 1]) for c in chunks]  # 2 blocks a chunk: its last hash
    return e.ranks[rank].store.keys(ids)


def _lose_in_flight(e, rank: int, chunk: int):
    """Before the next step that loads, rank ``rank``'s host loses chunk ``chunk`` of A: the
    scheduler granted it, the worker no longer has it (an eviction racing the grant)."""

    def hook(so):
        if so.kv_connector_metadata.loads and e.before_execute is hook:
            store = e.ranks[rank].store
            store.host.evict(_keys(e, rank, A, [chunk]))
            e.before_execute = None

    e.before_execute = hook


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("tp_size,failing_rank", [(1, 0), (2, 1)], ids=["tp1", "tp2-rank1"])
def test_chunks_computed_past_a_failed_load_are_never_stored(
    tmp_path, async_scheduling, tp_size, failing_rank
):
    e = Engine(tmp_path, EXTRA, tp_size=tp_size, async_scheduling=async_scheduling)
    try:
        e.add("a", A)
        e.settle()  # A's 3 chunks held by every rank, and reported
        e.sched.reset_prefix_cache()  # vLLM's own cache forgets: only kvtier can hit
        _lose_in_flight(e, failing_rank, 2)
        e.add("b", B, max_tokens=3)
        e.settle()
        assert e.loads("b") == [3]  # granted 3 chunks; the third failed on one rank
        assert e.invalid_blocks()  # reported: vLLM recomputed from the failed block on
        if not async_scheduling:  # vLLM 0.33's AsyncScheduler keeps the output of the step already in
            # flight past a failed load (vllm-project/vllm#49250): its token is vLLM's, not kvtier's
            assert e.outputs["b"][0] == e.first_token(B)  # vLLM's recompute gave the true token

        e.sched.reset_prefix_cache()
        e.add("a2", A)  # A again: its third chunk is stored whatever became of b's recompute
        e.settle()
        e.sched.reset_prefix_cache()
        e.add("c", B, max_tokens=2)  # every chunk of B from kvtier: none may hold garbage
        e.settle()
        assert not e.violations("c"), e.violations("c")
        assert e.loads("c") == [6], e.loads("c")  # every chunk, the recomputed ones included
        assert e.outputs["c"][0] == e.first_token(B)
    finally:
        e.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failed_hit_is_saved_once_recomputed(tmp_path, async_scheduling):
    e = Engine(tmp_path, EXTRA, async_scheduling=async_scheduling)
    try:
        e.add("a", A)
        e.settle()
        e.sched.reset_prefix_cache()
        _lose_in_flight(e, 0, 1)  # chunks 1 and 2 are recomputed by vLLM
        e.add("b", A)
        e.settle()
        assert e.loads("b") == [3] and e.invalid_blocks()
        e.sched.reset_prefix_cache()
        e.add("d", A)  # the same prefix again: every chunk was saved after the recompute
        e.settle()
        assert e.loads("d") == [3], e.loads("d")
        assert not e.violations("d") and e.outputs["d"][0] == e.first_token(A)
    finally:
        e.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_request_that_ends_in_its_load_step_still_saves_its_chunks(tmp_path, async_scheduling, tp_size):
    e = Engine(tmp_path, EXTRA, tp_size=tp_size, async_scheduling=async_scheduling)
    try:
        e.add("a", A)
        e.settle()
        e.sched.reset_prefix_cache()
        e.add("b", B, max_tokens=1)  # loads 3 chunks, computes 3 more, and is done in that step
        e.settle()
        assert e.loads("b") == [3] and e.outputs["b"] == [e.first_token(B)]
        e.sched.reset_prefix_cache()
        e.add("c", B)
        e.settle()
        assert e.loads("c") == [6], e.loads("c")
        assert not e.violations(), e.violations()
    finally:
        e.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fail", [False, True], ids=["loaded", "failed"])
def test_a_prompt_prefilled_over_several_steps_after_its_load_saves_every_chunk(
    tmp_path, async_scheduling, fail
):
    e = Engine(tmp_path, EXTRA, async_scheduling=async_scheduling, max_num_batched_tokens=48)
    try:
        e.add("a", A)
        e.settle()
        e.sched.reset_prefix_cache()
        if fail:
            _lose_in_flight(e, 0, 1)
        e.add("b", B)  # 104 tokens past the hit: three steps of at most 48
        e.settle()
        assert e.loads("b") == [3] and len(e.scheduled("b")) > 2 and bool(e.invalid_blocks()) == fail
        e.sched.reset_prefix_cache()
        e.add("c", B)
        e.settle()
        assert e.loads("c") == [6], e.loads("c")
        assert not e.violations("c"), e.violations("c")
    finally:
        e.close()
