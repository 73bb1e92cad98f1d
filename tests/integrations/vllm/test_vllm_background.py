"""The step's thread pays microseconds (issue #40), through vLLM's real Scheduler and AsyncScheduler:

- a hit that arrives while other requests run is loaded in the background (vLLM's asynchronous
  load): the request waits out of the batch, the running requests' steps never wait for its
  copies, and its KV is exact once it is scheduled; a failed one is recomputed from the failed
  block; an abort while it loads leaks nothing;
- saves and background loads are handed to the saver and loader threads: the step's thread never
  runs the store's per-chunk work for them; a preemption still waits for a save handed over but
  not yet submitted;
- every copy path's first use happens when the worker registers its caches, and leaves the cache
  as it was.
"""

from __future__ import annotations

import threading
import time

import pytest
from vllm_harness import Engine

from kvtier.device import SimDevice

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = pytest.mark.vllm
A = list(range(1, 101))  # 3 full chunks of 32: the prefix kvtier holds
B = A + list(range(1001, 1041))  # A's chunks, then tokens of its own
LONG = list(range(2001, 2061))  # a request that keeps decoding beside the hit (finished by the test)
EXTRA = {"chunk_tokens": 32, "host_bytes": 1 << 22}
DELAY = 0.2  # seconds per simulated copy: a load of 3 chunks outlasts many steps
STUCK_S = 30.0  # how long a held load stream stays held (released early by the test)


def _warm(e, long_tokens: int = 2000) -> None:
    """A's chunks held and reported; vLLM's own cache forgotten; LONG running (decoding)."""
    e.add("a", A)
    e.settle()
    e.sched.reset_prefix_cache()  # only kvtier can hit
    e.add("long", LONG, max_tokens=long_tokens)
    for _ in range(3):
        e.step()
    assert "long" in e.sched.requests and e.sched.running


def _until_done(e, rid: str) -> None:
    """Steps until ``rid`` delivered its first token; then LONG is aborted (it decoded beside enough)
    and the engine settles."""
    from vllm.v1.request import RequestStatus

    deadline = time.monotonic() + 60
    while rid not in e.outputs:
        e.step()
        assert time.monotonic() < deadline, e.pending()
        time.sleep(0.001)  # copies land on the SimDevices' threads meanwhile
    e.sched.finish_requests("long", RequestStatus.FINISHED_ABORTED)
    e.settle()


def _load_runs(e, rid: str) -> list:
    return [
        (i, r)
        for i, (so, _) in enumerate(e.history)
        for r in so.kv_connector_metadata.loads
        if r.req_id == rid
    ]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("tp_size", [1, 2], ids=["tp1", "tp2"])
def test_a_hit_beside_running_requests_loads_in_the_background(tmp_path, async_scheduling, tp_size):
    e = Engine(tmp_path, EXTRA, tp_size=tp_size, async_scheduling=async_scheduling)
    gate = threading.Event()
    try:
        _warm(e)
        for rk in e.ranks:  # every load's copies queue behind the gate: b's cannot land before it opens
            rk.dev.launch(lambda: gate.wait(STUCK_S), rk.store.engine.load_stream)
        e.add("b", B, max_tokens=3)
        steps = []  # (wall seconds, scheduled request ids) of each step while b's copies are held
        while len(steps) < 8:
            t0 = time.monotonic()
            so = e.step()
            steps.append((time.monotonic() - t0, set(so.num_scheduled_tokens) if so else set()))
        runs = _load_runs(e, "b")
        assert [len(r.ids) for _, r in runs] == [3] and runs[0][1].background
        assert "b" not in e.sched.running and "b" not in e.outputs  # it waits out of the batch
        assert all("long" in ids for _, ids in steps[2:])  # the batch went on meanwhile ...
        slowest = max(dt for dt, _ in steps)
        assert slowest < STUCK_S / 3, f"a step took {slowest:.1f} s: it waited for b's held copies"
        gate.set()  # ... and b is scheduled once its copies landed
        _until_done(e, "b")
        assert not e.violations(), e.violations()
        assert e.outputs["b"][0] == e.first_token(B)
        assert e.counts().get("hit_chunks_host") == 3 * tp_size
    finally:
        gate.set()
        e.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_background_load_that_fails_is_recomputed_and_saved(tmp_path, async_scheduling):
    from vllm_utils import create_request

    e = Engine(tmp_path, EXTRA, async_scheduling=async_scheduling)
    try:
        _warm(e)
        store = e.ranks[0].store
        lost = store.keys([bytes(create_request("k", A).block_hashes[3])])  # chunk 1 of A

        def lose(so):
            if any(r.req_id == "b" for r in so.kv_connector_metadata.loads):
                store.host.evict(lost)  # granted, then gone before the loader reads it
                e.before_execute = None

        e.before_execute = lose
        e.add("b", B, max_tokens=2)
        _until_done(e, "b")
        runs = _load_runs(e, "b")
        assert runs and runs[0][1].background
        assert e.invalid_blocks()  # reported no later than its receipt: vLLM recomputed from there
        assert not e.violations("b") and e.outputs["b"][0] == e.first_token(B)
        e.sched.reset_prefix_cache()
        e.add("c", B, max_tokens=2)  # b's recompute saved the chunks that failed
        e.settle()
        assert sum(len(r.ids) for _, r in _load_runs(e, "c")) == 4 and not e.violations("c")
    finally:
        e.close()


def test_an_abort_while_a_background_load_runs_leaks_nothing(tmp_path):
    from vllm.v1.request import RequestStatus

    dev = SimDevice(copy_delay=DELAY)
    e = Engine(tmp_path, EXTRA, device=lambda r: dev)
    try:
        _warm(e)
        e.add("b", B, max_tokens=3)
        while not _load_runs(e, "b"):
            e.step()
        e.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)  # its copies are still landing
        e.sched.finish_requests("long", RequestStatus.FINISHED_ABORTED)
        e.settle()
        assert "b" not in e.sched.requests
        pool = e.ranks[0].store.engine.pool
        e.ranks[0].store.evict()  # every chunk: none may still be pinned by a transfer
        assert (pool.stats().used, pool.stats().in_flight) == (0, 0)
    finally:
        e.close()


@pytest.mark.parametrize("mode,background", [("never", False), ("always", True), ("auto", False)])
def test_load_async_chooses_the_step_or_the_background(tmp_path, mode, background):
    e = Engine(tmp_path, EXTRA | {"load_async": mode})
    try:
        e.add("a", A)
        e.settle()
        e.sched.reset_prefix_cache()
        e.add("b", B, max_tokens=2)  # nothing else runs: "auto" loads in the step, layer by layer
        e.settle()
        runs = _load_runs(e, "b")
        assert [r.background for _, r in runs] == [background]
        assert not e.violations() and e.outputs["b"][0] == e.first_token(B)
    finally:
        e.close()


def test_the_steps_thread_hands_saves_and_background_loads_over(tmp_path, monkeypatch):
    from kvtier.integrations.vllm.hash_store import HashKeyedStore

    seen: dict[str, set[str]] = {"save": set(), "load": set()}
    save, load = HashKeyedStore.save, HashKeyedStore.load

    def saving(self, *a, **k):
        seen["save"].add(threading.current_thread().name)
        return save(self, *a, **k)

    def loading(self, *a, **k):
        seen["load"].add(threading.current_thread().name)
        return load(self, *a, **k)

    monkeypatch.setattr(HashKeyedStore, "save", saving)
    monkeypatch.setattr(HashKeyedStore, "load", loading)
    e = Engine(tmp_path, EXTRA | {"load_async": "always"})
    try:
        e.add("a", A)
        e.settle()
        e.sched.reset_prefix_cache()
        e.add("b", B, max_tokens=2)
        e.settle()
        assert seen["save"] == {"kvtier-saver-tp0"} and seen["load"] == {"kvtier-loader-tp0"}
        assert not e.violations() and e.outputs["b"][0] == e.first_token(B)
    finally:
        e.close()


def test_a_preemption_waits_for_a_save_not_yet_submitted(tmp_path, monkeypatch):
    from kvtier.integrations.vllm.hash_store import HashKeyedStore

    save = HashKeyedStore.save

    def slow(self, tokens, *a, **k):  # the saver thread is behind: b's save is submitted late
        time.sleep(0.3)
        return save(self, tokens, *a, **k)

    monkeypatch.setattr(HashKeyedStore, "save", slow)
    b2 = list(range(501, 597))
    e = Engine(tmp_path, EXTRA, num_blocks=13)  # 12 usable: a and b fill them exactly
    try:
        e.add("a", list(range(1, 97)), max_tokens=14)
        e.add("b", b2, max_tokens=3)
        preempted = False
        for _ in range(6):  # a's decode needs a 7th block: b is preempted, its blocks go to a
            so = e.step()
            preempted |= "b" in (so.preempted_req_ids or ())
            if preempted:
                break
        assert preempted
        e.settle()
        assert not e.violations()
        e.sched.reset_prefix_cache()
        e.add("b2", b2 + [7])  # b's chunks were read before a wrote its blocks
        e.settle()
        assert sum(len(r.ids) for _, r in _load_runs(e, "b2")) == 3 and not e.violations("b2")
    finally:
        e.close()


def test_every_paths_first_use_is_at_register_and_leaves_the_cache_as_it_was(tmp_path, monkeypatch):
    import torch

    from kvtier.engine import TransferEngine
    from kvtier.integrations.vllm.worker import SAVE_LANES

    calls: list[tuple] = []
    for name in ("save_slots", "load", "load_slots"):
        real = getattr(TransferEngine, name)

        def spy(self, *a, _real=real, _name=name, **k):
            calls.append((_name, k.get("path"), k.get("per_layer", True)))
            return _real(self, *a, **k)

        monkeypatch.setattr(TransferEngine, name, spy)
    e = Engine(tmp_path, EXTRA)
    try:
        rk = e.ranks[0]
        assert calls.count(("save_slots", None, True)) == SAVE_LANES  # each save lane once
        eng = rk.store.engine
        own = {eng.load_path(per_layer=True).value, eng.load_path(per_layer=False).value}
        for path in own | {rk.ws.load_path()}:  # and the layer-major path a load in the step names
            assert ("load", path, True) in calls and ("load", path, False) in calls
            assert ("load_slots", path, True) in calls
        assert eng.pool.stats().used == 0  # the warm-up's slots went back
        assert torch.all(rk.cache == -1.0)  # POISON: the blocks hold what they held
    finally:
        e.close()


@pytest.mark.parametrize("interval", [0.0005, 0])
def test_the_worker_lowers_pythons_switch_interval_at_start(tmp_path, interval):
    import sys

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)  # Python's default
        e = Engine(tmp_path, EXTRA | {"gil_switch_interval_s": interval})
        try:
            assert sys.getswitchinterval() == pytest.approx(interval or 0.005)
        finally:
            e.close()
    finally:
        sys.setswitchinterval(before)


def test_a_bad_switch_interval_is_refused_by_name():
    from kvtier.integrations.vllm.settings import VllmSettings

    with pytest.raises(ValueError, match=r"\['gil_switch_interval_s'\]"):
        VllmSettings.from_extra({"gil_switch_interval_s": -1})
