"""The serving integrations log the store's figures periodically at INFO (as LMCache logs its hit
rate): HF's `KVTier` after requests, the SGLang backend after SGLang moved pages; a line only
where there was traffic since the last, every KVTIER_STATS_LOG_S seconds."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

from test_sglang_backend import _backend, _disk, _fill, _indices  # noqa: E402

from kvtier.cli.demo import build_model, generate  # noqa: E402
from kvtier.integrations.hf import KVTier  # noqa: E402


def test_hf_kvtier_logs_the_hit_rate_and_the_tiers_after_requests(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("KVTIER_STATS_LOG_S", "1e-9")  # every request that follows traffic
    model = build_model("cpu", max_positions=1024)
    ids = torch.randint(
        1, model.config.vocab_size, (1, 2 * 256 + 9), generator=torch.Generator().manual_seed(3)
    )
    hf = caplog.at_level(logging.INFO, logger="kvtier.integrations.hf")
    with hf, KVTier.for_model(model, num_blocks=96, chunk_tokens=256) as kvt:
        for _ in range(3):  # cold (saves), warm (loads), and one more to log after the warm one
            cache = kvt.cache(ids)
            out, _ = generate(model, ids, 2, cache)
            cache.finish(out)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvtier: ")]
    assert lines, caplog.text
    last = lines[-1]
    assert "% of " in last and "tokens hit" in last and "host:" in last and "ms/chunk" in last, last
    assert "49.2% of 1,040 tokens hit" in last  # cold 0 of 520 asked (the last token runs), warm 512


def test_no_line_without_traffic_or_when_off(monkeypatch, caplog):
    monkeypatch.setenv("KVTIER_STATS_LOG_S", "0")
    model = build_model("cpu", max_positions=1024)
    ids = torch.randint(1, model.config.vocab_size, (1, 300))
    hf = caplog.at_level(logging.INFO, logger="kvtier.integrations.hf")
    with hf, KVTier.for_model(model, num_blocks=64, chunk_tokens=256) as kvt:
        for _ in range(2):
            kvt.cache(ids).finish(None)
    assert not [r for r in caplog.records if r.getMessage().startswith("kvtier: ")]


def test_sglang_backend_logs_pages_and_tiers(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("KVTIER_STATS_LOG_S", "1e-9")
    with caplog.at_level(logging.INFO, logger="kvtier.integrations.sglang"):
        be, pool = _backend([_disk(tmp_path)])
        _fill(pool, 1)
        keys = [f"k{i}" for i in range(4)]
        assert be.batch_set_v1(keys, _indices(pool, [0, 1, 2, 3])) == [True] * 4
        assert be.batch_get_v1(keys, _indices(pool, [4, 5, 6, 7])) == [True] * 4
        be.batch_exists(keys)  # the next call logs what the calls before it moved
        be.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvtier hicache: ")]
    assert lines and "4 pages got (100.0% of pages asked), 4 set" in lines[-1], caplog.text
    assert "disk: " in lines[-1] and "hits" in lines[-1] and "ms/chunk" in lines[-1]
