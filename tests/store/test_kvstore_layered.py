"""KVStore.load on the kernel path (an engine with compute_beside=False, as the HF integration
builds): the chunks of a hit load layer-major through `engine.load_slots` (a job per chunk, the
layer events shared; their order is tested in test_engine_load_slots.py) — every byte right, pins
dropped once e_load completed — and a failing submission gives every fetched chunk back."""

import pytest

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.pool import PinnedPool
from kvtier.reference import random_cache
from kvtier.store import KVStore

from test_kvstore import BPC, BS, CT, DT, NB, D, H, L, Rig, toks


class LayeredRig(Rig):
    def __init__(self):  # Rig's, with the engine the HF integration makes
        self.dev = SimDevice(copy_delay=(0.0, 0.002), launch_delay=(0.0, 0.002), seed=9)
        self.kv = random_cache("vllm_flash", L, NB, BS, H, D, DT, seed=1)
        self.chunk_nbytes = self.kv.chunk_nbytes(BPC)
        self.pool = PinnedPool(self.dev, 16 * self.chunk_nbytes)
        config = EngineConfig(sanitize=True, compute_beside=False)
        self.eng = TransferEngine(self.dev, self.kv, self.pool, config)
        self.store = KVStore(self.eng, "m", chunk_tokens=CT)
        self.compute = self.dev.current_stream()


@pytest.fixture
def rig():
    r = LayeredRig()
    yield r
    r.close()


def test_a_hit_loads_layer_major_through_load_slots(rig):
    tokens = toks(11, 4 * CT)
    assert rig.store.save(tokens, range(8), after=rig.write(tokens, range(8))).wait(5)
    rig.poison(range(40, 48))
    lh = rig.store.load(tokens, range(40, 48))
    assert lh.tokens == 4 * CT and len(lh.jobs) == 4
    assert all(j.path == "kernel" and j.layer_events is lh.jobs[0].layer_events for j in lh.jobs)
    assert lh.wait(5) and rig.check(tokens, range(40, 48), 4)
    assert rig.store.stats()["host"]["pinned_bytes"] == 0  # every pin dropped once e_load completed


def test_a_path_given_to_load_overrides_the_engines(rig):
    """path="staged" (a load beside compute): one job per chunk on that path, exact; a bad path
    is refused, naming the argument, before anything is fetched."""
    tokens = toks(13, 3 * CT)
    assert rig.store.save(tokens, range(6), after=rig.write(tokens, range(6))).wait(5)
    with pytest.raises(ValueError, match="path"):
        rig.store.load(tokens, range(40, 46), path="dma")
    assert rig.store.stats()["host"]["pinned_bytes"] == 0
    rig.poison(range(40, 46))
    lh = rig.store.load(tokens, range(40, 46), path="staged")
    assert [j.path for j in lh.jobs] == ["staged"] * 3
    assert lh.wait(5) and rig.check(tokens, range(40, 46), 3)


def test_a_failing_submission_gives_every_fetched_chunk_back(rig, monkeypatch):
    tokens = toks(12, 3 * CT)
    assert rig.store.save(tokens, range(6), after=rig.write(tokens, range(6))).wait(5)

    def broken(*args, **kwargs):
        raise RuntimeError("submission failed")

    monkeypatch.setattr(rig.eng, "load_slots", broken)
    with pytest.raises(RuntimeError, match="submission failed"):
        rig.store.load(tokens, range(40, 46))
    assert rig.store.stats()["host"]["pinned_bytes"] == 0  # fetched, never submitted: unpinned
    monkeypatch.undo()
    lh = rig.store.load(tokens, range(40, 46))  # the chunks are still there, and loadable
    assert lh.tokens == 3 * CT and lh.wait(5) and rig.check(tokens, range(40, 46), 3)
