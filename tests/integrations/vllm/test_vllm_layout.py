"""The KV cache layout the connector asks vLLM 0.33 for (`kv_layout`), through vLLM's own
resolution (`resolve_kv_cache_layout`, the engine core's) and attention backend classes, on the CPU."""

from __future__ import annotations

import pytest
from vllm_rig import make_scheduler

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = pytest.mark.vllm


def _cfg(tmp_path, **extra):
    cfg, kcc, _ = make_scheduler(tmp_path, {"chunk_tokens": 32, "host_bytes": 1 << 22, **extra})
    return cfg, kcc


def _resolve(cfg, backends) -> str:
    """What vLLM's engine core resolves with these backends on every worker (the connector asked)."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    names = [x.name for x in get_supported_kv_cache_layouts(backends)]
    return resolve_kv_cache_layout(cfg, [names]).name


@pytest.fixture
def flash_attention(monkeypatch):
    """The backend selection of a CUDA GPU below SM 10 (FlashAttention first in
    vllm/platforms/cuda.py `_get_backend_priorities`, which imports CUDA ops: not here), which the
    CPU platform cannot make: vLLM's own helper answers with the real FlashAttention class."""
    from vllm.distributed.kv_transfer.kv_connector import utils
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    assert FlashAttentionBackend.supported_kv_cache_layouts() is None  # any order
    monkeypatch.setattr(utils, "get_current_attn_backends", lambda cfg, names=None: [FlashAttentionBackend])
    return [FlashAttentionBackend]


def test_auto_asks_flash_attention_for_blhnc_and_the_worker_gets_it(tmp_path, flash_attention):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.integrations.vllm import KVTierConnector

    cfg, kcc = _cfg(tmp_path)
    assert KVTierConnector.get_required_kvcache_layout(cfg) == "BLHNC"
    assert _resolve(cfg, flash_attention) == "BLHNC"
    worker = KVTierConnector(cfg, KVConnectorRole.WORKER, kcc)
    assert worker.worker_side.order == "BLHNC"  # the order its caches are read in
    worker.shutdown()


def test_any_leaves_vllms_default(tmp_path, flash_attention):
    from kvtier.integrations.vllm import KVTierConnector

    cfg, _ = _cfg(tmp_path, kv_layout="any")
    assert KVTierConnector.get_required_kvcache_layout(cfg) is None
    assert _resolve(cfg, flash_attention) == "LBNHC"  # vLLM's first preference when no backend declares


def test_auto_asks_nothing_of_a_backend_without_blhnc(tmp_path):
    """The CPU platform's attention takes LBHNC only: "auto" asks for nothing, vLLM picks LBHNC."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    from kvtier.integrations.vllm import KVTierConnector

    cfg, _ = _cfg(tmp_path)
    backends = get_current_attn_backends(cfg)
    assert [b.supported_kv_cache_layouts() for b in backends] == [(_layout("LBHNC"),)]
    assert KVTierConnector.get_required_kvcache_layout(cfg) is None
    assert _resolve(cfg, backends) == "LBHNC"


def test_an_order_asked_for_is_dropped_where_a_backend_refuses_it(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    from kvtier.integrations.vllm import KVTierConnector

    cfg, _ = _cfg(tmp_path, kv_layout="BLNHC")
    assert KVTierConnector.get_required_kvcache_layout(cfg) == "BLNHC"
    assert _resolve(cfg, get_current_attn_backends(cfg)) == "LBHNC"  # vLLM warns and keeps its own


def test_auto_asks_nothing_when_the_backends_cannot_be_found(tmp_path, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector import utils

    from kvtier.integrations.vllm import KVTierConnector

    def fail(cfg, names=None):
        raise RuntimeError("no platform")

    monkeypatch.setattr(utils, "get_current_attn_backends", fail)
    cfg, _ = _cfg(tmp_path)
    assert KVTierConnector.get_required_kvcache_layout(cfg) is None


def test_kv_layout_names_are_vllms_and_kvtiers():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvtier import layout
    from kvtier.integrations.vllm.settings import KV_LAYOUTS, VLLM_ORDERS, VllmSettings

    assert VLLM_ORDERS == layout.VLLM_ORDERS
    assert set(VLLM_ORDERS) == {m.name for m in KVCacheLayout}
    assert VllmSettings().kv_layout == "auto"
    for name in KV_LAYOUTS:
        assert VllmSettings.from_extra({"kv_layout": name}).kv_layout == name
    for bad in ("NHD", "blhnc", None, 3):
        with pytest.raises(ValueError, match="kv_layout"):
            VllmSettings.from_extra({"kv_layout": bad})


def _layout(name: str):
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return KVCacheLayout[name]
