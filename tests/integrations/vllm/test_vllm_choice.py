"""The vLLM connector decides per request, and a slow tier never stalls the engine (issue #41),
through vLLM's real Scheduler with the stand-in model that checks every read (`vllm_harness.py`):

- a hit only the disk holds loads in the background (reported received through get_finished),
  never in a step, even with nothing else running;
- a tier slower than planned: the plan's deadline cuts its read, and the request is scheduled
  then with the chunks that landed, vLLM recomputing the rest;
- a tier measured slower than the prefill is not read: the host's chunks load, vLLM prefills the
  rest (a split);
- a stalled or dead tier costs a recompute, never a stall; it is planned as absent until it
  answers again;
- host hits loaded in the step teach the plan what such a load costs beyond its overlap.

The disk's reads go through a `Gate` (fast, slow, stalled or failing). With ``choice: "auto"`` the
stand-in's steps take PER_TOKEN per token scheduled, so a prefill costs what a model's does.
"""

from __future__ import annotations

import threading
import time

import pytest
from vllm_harness import Engine, _computed_of
from vllm_utils import create_request

from kvtier.store.disk import DiskTier

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = pytest.mark.vllm
CT, CHUNKS = 32, 8
PREFIX = list(range(1, CHUNKS * CT + 21))  # 8 chunks of 32, and 20 tokens of its own
LONG = list(range(5001, 5061))  # a request decoding beside
PER_TOKEN = 0.004  # s per token of a step: recomputing PREFIX takes about 1.1 s
SLOW = 0.3  # s per chunk read from a slow disk: all of PREFIX's 2.4 s
TIMEOUT = 2.0  # s a read of a dead disk takes to fail (a server that does not answer: a timeout)


class Gate:
    """What the disk's reads do: pass (after ``delay`` s each), wait until opened (stalled), or
    fail at a timeout (dead)."""

    def __init__(self, monkeypatch) -> None:
        self.delay, self.dead, self.open = 0.0, False, threading.Event()
        self.open.set()
        real = DiskTier._get

        def get(tier, key, dest):
            if self.dead:
                time.sleep(TIMEOUT)
                raise TimeoutError("the disk does not answer")
            self.open.wait(30)  # stalled: no answer (30 s: a run that waits for it still ends)
            time.sleep(self.delay)
            return real(tier, key, dest)

        monkeypatch.setattr(DiskTier, "_get", get)

    def fail(self, how: str) -> None:
        if how == "stalled":
            self.open.clear()
        else:
            self.dead = True

    def heal(self) -> None:
        self.dead = False
        self.open.set()


def _engine(tmp_path, extra: dict, **kw) -> Engine:
    base = {"chunk_tokens": CT, "host_bytes": 1 << 22, "disk_path": str(tmp_path / "disk")}
    return Engine(tmp_path, base | extra, **kw)


def _host_forgets(e, ids=None) -> None:
    """The host drops the chunks ``ids`` (every chunk: None), vLLM's own cache forgets, and the
    workers report it: the scheduler's index has those chunks on the disk alone."""
    for rk in e.ranks:
        rk.store.evict(ids)
    e.sched.reset_prefix_cache()
    e.settle()


def _chunk_ids(tokens: list[int]) -> list[bytes]:
    hashes = create_request("ids", tokens).block_hashes  # 16-token blocks: a chunk's id is its 2nd
    return [bytes(hashes[2 * i + 1]) for i in range(len(tokens) // CT)]


def _load_runs(e, rid: str) -> list:
    loads = [(i, so.kv_connector_metadata.loads) for i, (so, _) in enumerate(e.history)]
    return [(i, r) for i, runs in loads for r in runs if r.req_id == rid]


def _first_scheduled(e, rid: str) -> tuple[int, int]:
    """(history index, tokens vLLM held for ``rid``) of the first step that computed it."""
    i = next(i for i, (so, _) in enumerate(e.history) if rid in so.num_scheduled_tokens)
    return i, _computed_of(e.history[i][0], rid)


def _firsts(e) -> list:
    """Per request with a hit, [choice, tier, planned ms, measured ms], as vLLM's loggers got them."""
    return e.logged.get("first_tokens", [])


def test_a_hit_only_the_disk_holds_loads_in_the_background_reported_through_get_finished(tmp_path):
    e = _engine(tmp_path, {})
    try:
        e.add("a", PREFIX)
        e.settle()  # write-through: the chunks are on the disk
        _host_forgets(e)
        e.add("b", PREFIX)  # nothing else runs: a hit the host held would load in the step
        e.settle()
        ((sent, run),) = _load_runs(e, "b")
        assert run.background and run.tiers == ("disk",) * CHUNKS
        assert "b" not in e.history[sent][0].num_scheduled_tokens  # it waited out of the batch
        received = [i for i, (_, kv) in enumerate(e.history) if kv and "b" in (kv.finished_recving or ())]
        first, held = _first_scheduled(e, "b")
        assert received and sent <= received[0] < first  # get_finished said so, then vLLM scheduled it
        assert held == CHUNKS * CT and e.counts().get("hit_chunks_disk") == CHUNKS
        assert not e.violations() and e.outputs["b"][0] == e.first_token(PREFIX)
    finally:
        e.close()


def test_a_slow_tier_is_cut_at_the_plans_deadline_and_the_request_goes_on_with_what_landed(
    tmp_path, monkeypatch
):
    gate = Gate(monkeypatch)
    e = _engine(tmp_path, {"choice": "auto"}, step_s_per_token=PER_TOKEN)
    try:
        e.add("a", PREFIX)
        e.settle()
        _host_forgets(e)
        e.add("b1", PREFIX)  # the disk answers at once: loading beats recomputing, and is measured
        e.settle()
        assert [len(r.ids) for _, r in _load_runs(e, "b1")] == [CHUNKS]
        _host_forgets(e)
        gate.delay = SLOW  # now the disk needs 2.4 s for what recomputing does in about 1.1 s
        t0 = time.monotonic()
        e.add("b2", PREFIX)
        while not any("b2" in so.num_scheduled_tokens for so, _ in e.history):
            e.step()
            assert time.monotonic() - t0 < 10, e.pending()
            time.sleep(0.001)
        waited = time.monotonic() - t0
        _, held = _first_scheduled(e, "b2")
        assert 0 < held < CHUNKS * CT and held % CT == 0  # the chunks that landed by the deadline
        assert waited < CHUNKS * SLOW  # scheduled before the whole read could have landed (a loaded box
        # slows the steps the deadline is planned from: the cut itself is what `held` shows)
        ((_, run),) = _load_runs(e, "b2")
        assert len(run.ids) == CHUNKS and run.budget_s < CHUNKS * SLOW  # planned: the whole hit, in time
        e.settle()
        assert e.counts().get("deadline_cuts") == 1 and e.invalid_blocks()  # the rest: recomputed
        assert not e.violations() and e.outputs["b2"][0] == e.first_token(PREFIX)
        kinds = [(f[0], f[1]) for f in _firsts(e)]
        assert kinds == [("load", "disk"), ("load", "disk")]
        assert all(f[2] is not None and f[3] > 0 for f in _firsts(e))  # planned and measured
        # Cut in the middle of a chunk that was coming, only slowly: the disk stays planned with,
        # at the rate it now delivers (a stalled read is what plans a tier absent).
        assert e.sched.connector.scheduler_side.absent == set()
    finally:
        e.close()


def test_a_tier_measured_slower_than_the_prefill_is_not_read(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    gate.delay = SLOW
    e = _engine(tmp_path, {"choice": "auto"}, step_s_per_token=PER_TOKEN)
    side = e.sched.connector.scheduler_side
    try:
        e.add("a", PREFIX)
        e.settle()
        _host_forgets(e)
        e.add("b1", PREFIX)  # planned at the datasheet's disk rate; its deadline cuts the read
        e.settle()
        _, landed = _first_scheduled(e, "b1")
        assert 0 < landed < CHUNKS * CT
        _host_forgets(e, _chunk_ids(PREFIX)[landed // CT :])  # b1's recompute saved them: dropped again
        t0 = time.monotonic()
        while side.absent:  # a read cut mid-chunk: the disk is absent until its probe answers
            e.settle()
            assert time.monotonic() - t0 < 10
            time.sleep(0.05)
        e.sched.reset_prefix_cache()
        # The host holds the chunks that landed, the disk all of them, at the rate it showed: the
        # host's chunks load, vLLM prefills the rest.
        e.add("b2", PREFIX)
        e.settle()
        ((_, run),) = _load_runs(e, "b2")
        assert len(run.ids) == landed // CT and set(run.tiers) == {"host"}
        assert _first_scheduled(e, "b2")[1] == landed
        assert [f[0] for f in _firsts(e)] == ["load", "split"]
        assert not e.violations() and e.outputs["b2"][0] == e.first_token(PREFIX)
    finally:
        e.close()


@pytest.mark.parametrize("failure", ["stalled", "dead"])
def test_a_stalled_or_dead_tier_costs_a_recompute_never_a_stall(tmp_path, monkeypatch, failure):
    from vllm.v1.request import RequestStatus

    gate = Gate(monkeypatch)
    e = _engine(tmp_path, {"prefetch_timeout_s": 0.5})
    try:
        e.add("a", PREFIX)
        e.settle()
        _host_forgets(e)
        e.add("long", LONG, max_tokens=2000)
        for _ in range(3):
            e.step()
        gate.fail(failure)
        e.add("b", PREFIX)
        steps, t0 = [], time.monotonic()
        while "b" not in e.outputs:
            t = time.monotonic()
            e.step()
            steps.append(time.monotonic() - t)
            assert time.monotonic() - t0 < 10, e.pending()
            time.sleep(0.001)
        waited = time.monotonic() - t0
        assert max(steps) < 0.25, max(steps)  # no step waited for the tier; the batch went on
        assert waited < TIMEOUT - 0.5, waited  # its deadline (0.5 s), then the recompute: no read's end
        assert e.invalid_blocks()  # what did not land was reported: vLLM recomputed it
        assert not e.violations("b") and e.outputs["b"][0] == e.first_token(PREFIX)
        e.sched.finish_requests("long", RequestStatus.FINISHED_ABORTED)
        _host_forgets(e)  # b's recompute saved its chunks: the host drops them again
        e.add("c", PREFIX)  # planned without the disk: recomputed, nothing asked of it
        e.settle()
        assert _load_runs(e, "c") == [] and e.outputs["c"][0] == e.first_token(PREFIX)
        side = e.sched.connector.scheduler_side
        assert side.absent == {"disk"}
        gate.heal()
        t0 = time.monotonic()
        while side.absent:  # the disk answers its probe again: planned with it again
            e.settle()
            assert time.monotonic() - t0 < 10
            time.sleep(0.05)
        _host_forgets(e)
        e.add("d", PREFIX)
        e.settle()
        assert [len(r.ids) for _, r in _load_runs(e, "d")] == [CHUNKS]
        assert not e.violations("d") and e.outputs["d"][0] == e.first_token(PREFIX)
    finally:
        gate.heal()
        e.close()


def test_host_hits_loaded_in_the_step_teach_the_plan_what_such_a_load_costs(tmp_path):
    e = _engine(tmp_path, {"choice": "auto"}, step_s_per_token=PER_TOKEN)
    steps = e.sched.connector.scheduler_side.chooser.steps
    try:
        e.add("a", PREFIX)
        e.settle()
        for rid in ("b1", "b2"):  # planned with nothing learned: in the step
            e.sched.reset_prefix_cache()  # vLLM's own cache forgets: the host's chunks are the hit
            e.add(rid, PREFIX)
            e.settle()
            ((_, run),) = _load_runs(e, rid)
            assert not run.background  # nothing else runs: in the step, layer by layer
        firsts = _firsts(e)  # [choice, tier, planned ms, measured ms] per hit
        assert [f[:2] for f in firsts] == [["load", "host"]] * 2
        # b1's is the process's first: a first use, not learned from; b2's is what such a load
        # costs beyond the plan's overlap (a later hit is planned with it: in the step or not).
        assert steps._extra and len(steps._extra) == 1
        assert steps.in_step_extra_ms() == pytest.approx(max(0.0, firsts[1][3] - firsts[1][2]))
        assert not e.violations() and e.outputs["b2"][0] == e.first_token(PREFIX)
    finally:
        e.close()
