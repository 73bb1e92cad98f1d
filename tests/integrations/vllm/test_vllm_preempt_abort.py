"""Preemption and aborts through vLLM's real Scheduler while kvtier's copies are in flight:
nothing is freed early (blocks being saved stay the request's, or later compute waits for the
save), nothing leaks (every pool slot returns), and the KV a later hit loads is exact."""

from __future__ import annotations

import time

import pytest
from vllm_rig import _BLOCKS, Worker, drain, free_blocks, make_request, make_scheduler, run_step

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = pytest.mark.vllm
A = list(range(1, 97))  # 96 tokens: 6 blocks, 3 full chunks of 32
B = list(range(501, 597))
SLOW = 0.05  # seconds per simulated copy: saves are still in flight during the next step


def _setup(tmp_path, num_blocks: int):
    from kvtier.device import SimDevice

    cfg, kcc, sched = make_scheduler(tmp_path, {"chunk_tokens": 32, "host_bytes": 1 << 22}, num_blocks)
    return sched, Worker(cfg, kcc, num_blocks, device=SimDevice(copy_delay=SLOW))


def _hit_is_exact(sched, w, reqs, rid: str, tokens: list[int]) -> None:
    """A new request for ``tokens`` and one more loads all 3 chunks from kvtier (vLLM's own cache
    forgotten) and every token's KV equals what the mock forward computes."""
    assert sched.reset_prefix_cache()
    req = make_request(rid, [*tokens, 7])
    reqs[rid] = req
    sched.add_request(req)
    so, kv = run_step(sched, [w], reqs)
    assert [len(r.ids) for r in so.kv_connector_metadata.loads] == [3]
    assert not kv.invalid_block_ids
    drain(sched, [w], reqs)
    w.check(req, _BLOCKS[rid], len(tokens) + 1)


def _no_leak(w) -> None:
    store = w.conn.worker_side.store
    store.evict()  # every chunk the host holds; none may still be pinned by a transfer
    st = store.engine.pool.stats()
    assert (st.used, st.slots, st.in_flight) == (0, 0, 0)
    w.conn.shutdown()


def test_preempted_while_saving_its_blocks_are_reused_only_after_the_copy(tmp_path):
    sched, w = _setup(tmp_path, num_blocks=13)  # 12 usable: a and b fill them exactly
    reqs = {"a": make_request("a", A, max_tokens=14), "b": make_request("b", B, max_tokens=3)}
    for r in reqs.values():
        sched.add_request(r)
    so, _ = run_step(sched, [w], reqs)  # both prefilled: 6 chunks being saved, slowly
    assert so.kv_connector_metadata.saves and free_blocks(sched) == 0
    so, _ = run_step(sched, [w], reqs)  # a needs a 7th block: b is preempted, a takes one of b's
    assert so.preempted_req_ids == {"b"}
    taken = _BLOCKS["a"][-1]
    for _ in range(10):  # a keeps writing that block well past the time b's saves take
        run_step(sched, [w], reqs)
        time.sleep(SLOW)
    assert taken in _BLOCKS["a"] and not reqs["a"].is_finished()
    drain(sched, [w], reqs)
    for rid, tokens in (("a2", A), ("b2", B)):  # b's chunks were read before a wrote its block
        _hit_is_exact(sched, w, reqs, rid, tokens)
    _no_leak(w)


def test_preempted_after_its_load_resumes_with_exact_kv(tmp_path):
    sched, w = _setup(tmp_path, num_blocks=13)
    reqs = {"a": make_request("a", A, max_tokens=1)}
    sched.add_request(reqs["a"])
    drain(sched, [w], reqs)  # a's chunks are held by kvtier
    assert sched.reset_prefix_cache()
    reqs["b"] = make_request("b", B, max_tokens=3)
    reqs["c"] = make_request("c", A, max_tokens=6)  # loads a's 2 chunks; running after b
    sched.add_request(reqs["b"])
    sched.add_request(reqs["c"])
    so, _ = run_step(sched, [w], reqs)
    assert [len(r.ids) for r in so.kv_connector_metadata.loads] == [2]
    preempted = checked = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        so, _ = run_step(sched, [w], reqs)  # b's decode needs a block: c (the last one) is preempted
        preempted |= "c" in (so.preempted_req_ids or ())
        c = reqs["c"]
        if preempted and "c" in so.num_scheduled_tokens and not c.is_finished():
            w.check(c, _BLOCKS["c"], c.num_computed_tokens)  # resumed (a hit or recomputed): exact
            checked = True
        if c.is_finished():
            break
        time.sleep(0.002)  # c resumes once b's blocks came back: after b's saves landed
    assert preempted and checked
    drain(sched, [w], reqs)
    _no_leak(w)


def test_abort_while_saving_holds_the_blocks_until_the_copies_completed(tmp_path):
    sched, w = _setup(tmp_path, num_blocks=9)  # 8 usable: b must wait for a's blocks
    reqs = {"a": make_request("a", A, max_tokens=5)}
    sched.add_request(reqs["a"])
    run_step(sched, [w], reqs)  # prefilled: 3 chunks being saved
    from vllm.v1.request import RequestStatus

    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    reqs["b"] = make_request("b", B)
    sched.add_request(reqs["b"])
    so, _ = run_step(sched, [w], reqs)  # the workers learn of the abort; the saves still run
    assert "b" not in so.num_scheduled_tokens  # a's blocks are still being read: not b's yet
    assert free_blocks(sched) < 8
    drain(sched, [w], reqs)  # then freed, and b computed into them
    w.check(reqs["b"], _BLOCKS["b"], len(B))
    _hit_is_exact(sched, w, reqs, "a2", A)  # a's chunks were read before b overwrote the blocks
    _no_leak(w)


def test_abort_while_loading_leaks_nothing(tmp_path):
    sched, w = _setup(tmp_path, num_blocks=17)
    reqs = {"a": make_request("a", A, max_tokens=1)}
    sched.add_request(reqs["a"])
    drain(sched, [w], reqs)
    assert sched.reset_prefix_cache()
    reqs["c"] = make_request("c", A, max_tokens=5)
    sched.add_request(reqs["c"])
    so, _ = run_step(sched, [w], reqs)  # c loads 2 chunks (slow copies), then computes
    assert [len(r.ids) for r in so.kv_connector_metadata.loads] == [2]
    from vllm.v1.request import RequestStatus

    sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    drain(sched, [w], reqs)
    _hit_is_exact(sched, w, reqs, "a2", A)
    _no_leak(w)
