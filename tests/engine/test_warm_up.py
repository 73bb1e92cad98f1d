"""warm_up: every copy path used once at start, the blocks left as they were, every slot back."""

from __future__ import annotations

import torch

from kvtier.device import SimDevice
from kvtier.engine import TransferEngine, warm_up
from kvtier.pool import PinnedPool
from kvtier.reference import random_cache


def test_warm_up_uses_every_path_and_leaves_the_cache_as_it_was(monkeypatch):
    calls: list[tuple] = []
    for name in ("save_slots", "load", "load_slots"):
        real = getattr(TransferEngine, name)

        def spy(self, *a, _real=real, _name=name, **k):
            calls.append((_name, k.get("path"), k.get("per_layer", True), k.get("stream")))
            return _real(self, *a, **k)

        monkeypatch.setattr(TransferEngine, name, spy)
    dev = SimDevice()
    kv = random_cache("vllm_flash", 2, 16, 4, 2, 16, torch.float16)
    before = [t.clone() for t in kv.layers]
    eng = TransferEngine(dev, kv, PinnedPool(dev, 16 * kv.chunk_nbytes(4)))
    lanes = [dev.new_stream("a"), dev.new_stream("b")]
    try:
        assert warm_up(eng, range(16), 4, lanes)
        assert [c[3] for c in calls if c[0] == "save_slots"] == lanes  # each save stream once
        for path in {eng.load_path(per_layer=True).value, eng.load_path(per_layer=False).value}:
            assert ("load", path, True, None) in calls and ("load", path, False, None) in calls
            assert ("load_slots", path, True, None) in calls
        same = [
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for a, b in zip(kv.layers, before, strict=True)
        ]
        assert all(same)  # bit for bit (random bits hold NaNs, which equal nothing)
        assert eng.pool.stats().used == 0  # every slot given back
    finally:
        eng.close()
        dev.close()


def test_a_failing_path_is_a_warning_not_a_failed_start(monkeypatch, caplog):
    dev = SimDevice()
    kv = random_cache("vllm_flash", 2, 16, 4, 2, 16, torch.float16)
    eng = TransferEngine(dev, kv, PinnedPool(dev, 16 * kv.chunk_nbytes(4)))

    def broken(self, *a, **k):
        raise RuntimeError("no such path here")

    monkeypatch.setattr(TransferEngine, "load_slots", broken)
    try:
        assert not warm_up(eng, range(16), 4)
        assert "warm-up at start failed" in caplog.text
        assert eng.pool.stats().used == 0  # the saved slots went back all the same
    finally:
        eng.close()
        dev.close()


def test_warm_up_also_runs_the_paths_its_caller_names(monkeypatch):
    calls: list[tuple] = []
    real = TransferEngine.load

    def spy(self, *a, **k):
        calls.append((k.get("path"), k.get("per_layer", True)))
        return real(self, *a, **k)

    monkeypatch.setattr(TransferEngine, "load", spy)
    dev = SimDevice()
    kv = random_cache("vllm_flash", 2, 16, 4, 2, 16, torch.float16)
    eng = TransferEngine(dev, kv, PinnedPool(dev, 16 * kv.chunk_nbytes(4)))
    try:
        own = {eng.load_path(per_layer=True).value, eng.load_path(per_layer=False).value}
        named = next(p for p in ("kernel", "staged", "batch") if p not in own)  # one it would not take
        assert warm_up(eng, range(16), 4, load_paths=(named, None))
        assert (named, True) in calls and (named, False) in calls  # a layer-wise load's first use
    finally:
        eng.close()
        dev.close()
