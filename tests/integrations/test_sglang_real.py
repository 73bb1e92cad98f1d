"""kvtier's HiCache backend inside SGLang's own classes: built by SGLang's dynamic backend
factory from a real ``HiCacheStorageConfig``, over SGLang's ``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost`` made on the CPU, and wrapped in SGLang's failure injector.
Skipped where SGLang is not installed (``pip install kvtier[sglang]``)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed (pip install kvtier[sglang])")


def _import_pools():
    """SGLang's host pools. Their import chain reaches model configs that import torchvision at
    module level; no CPU torchvision matches this torch, so a stub stands in for the import only
    (transformers has already decided torchvision is absent) and is removed again."""
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached before the stub exists: transformers keeps "absent"
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    added = [n for n in names if n not in sys.modules]
    for name in added:
        mod = types.ModuleType(name)
        mod.__path__, mod.__spec__ = [], importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.InterpolationMode = type("InterpolationMode", (), {})
        sys.modules[name] = mod
    try:
        from sglang.srt.mem_cache.device_pool_info import (
            KVBufferLayout,
            KVBuffers,
            MHABufferInfo,
            MLABufferInfo,
        )
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    except ImportError as exc:
        pytest.skip(f"SGLang's host pools do not import here: {exc}")
    finally:
        for name in added:
            sys.modules.pop(name, None)
    return KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo, MHATokenToKVPoolHost, MLATokenToKVPoolHost


(KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo, MHAHost, MLAHost) = _import_pools()
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageFailureInjector,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

pytestmark = pytest.mark.sglang

L, HEADS, DIM, PAGE, TOKENS = 3, 2, 64, 16, 256


def _mha_pool(layout: str):
    k = tuple(torch.zeros(TOKENS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(L))
    v = tuple(torch.zeros(TOKENS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(L))
    ptrs = lambda xs: torch.tensor([x.data_ptr() for x in xs], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PAGE,
        head_num=HEADS,
        head_dim=DIM,
        v_head_dim=DIM,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MHAHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=TOKENS,
        start_layer=0,
        end_layer=L,
    )


def _mla_pool(layout: str):
    rank, rope = 64, 16
    bufs = tuple(torch.zeros(TOKENS, 1, rank + rope, dtype=torch.bfloat16) for _ in range(L))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(L)),
        device_layer_num=L,
        page_size=PAGE,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
        kv_cache_dim=rank + rope,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MLAHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=TOKENS,
        start_layer=0,
        end_layer=L,
        target_layer_num=L,
    )


def _config(tmp_path, *, tp_rank=0, tp_size=1, mla=False, layout="page_first"):
    extra = {
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KVTierHiCache",
        "interface_v1": 1,
        "tiers": ["disk"],
        "disk_path": str(tmp_path / "kv"),
        "gather_below_bytes": 4096,
    }
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=layout == "page_first",
        model_name="org/model",
        extra_config=extra,
    )


def _attach(cfg, pool, tiers=None):
    """As SGLang's cache controller attaches a backend: the factory, then the host pool."""
    if tiers is None:
        be = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    else:  # ranks of one process share the disk tier (one DiskTier per directory)
        from kvtier.integrations.sglang import KVTierHiCache

        be = KVTierHiCache(cfg, {}, tiers=tiers)
    be.register_mem_pool_host(pool)
    return be


def _pages(pool, indices: torch.Tensor) -> list[torch.Tensor]:
    """Each page's bytes, from SGLang's own ``get_data_page``."""
    return [pool.get_data_page(int(i), flat=True).view(torch.int16).clone() for i in indices[::PAGE]]


def _cycle(be, pool, keys: list[str]) -> bool:
    """exists -> set_v1 -> get_v1 into fresh, poisoned pages; every page bit for bit."""
    src = pool.alloc(len(keys) * PAGE)
    pool.kv_buffer.view(torch.int16).random_()
    want = _pages(pool, src)
    assert be.batch_exists(keys) == 0
    assert be.batch_set_v1(keys, src) == [True] * len(keys)
    assert be.batch_exists(keys) == len(keys)
    dst = pool.alloc(len(keys) * PAGE)
    pool.kv_buffer.view(torch.int16).fill_(0x5A5A)
    assert be.batch_get_v1(keys, dst) == [True] * len(keys)
    return all(torch.equal(g, w) for g, w in zip(_pages(pool, dst), want, strict=True))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mha_pool_through_sglang_factory(tmp_path, layout):
    pool = _mha_pool(layout)
    be = _attach(_config(tmp_path, layout=layout), pool)
    assert isinstance(be, HiCacheStorage)
    assert _cycle(be, pool, [f"{layout}-{i}" for i in range(4)])
    m = be.get_stats()
    assert type(m).__name__ == "StorageMetrics" and m.backup_pgs == [4] and m.prefetch_pgs == [4]
    be.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mla_pool_single_writer(tmp_path, layout):
    from kvtier.store.disk import DiskTier

    disk = DiskTier(tmp_path / "shared", 1 << 30, fsync=False)
    pool0, pool1 = _mla_pool(layout), _mla_pool(layout)
    w = _attach(_config(tmp_path, tp_rank=0, tp_size=2, mla=True, layout=layout), pool0, [disk])
    r = _attach(_config(tmp_path, tp_rank=1, tp_size=2, mla=True, layout=layout), pool1, [disk])
    assert _cycle(w, pool0, ["a", "b"])
    assert r.batch_exists(["a", "b"]) == 2  # the latent is shared by the TP ranks
    assert r.batch_set_v1(["c"], pool1.alloc(PAGE)) == [True] and r.batch_exists(["c"]) == 0  # not the writer
    w.close()


def test_tp_ranks_kept_apart(tmp_path):
    from kvtier.store.disk import DiskTier

    disk = DiskTier(tmp_path / "shared", 1 << 30, fsync=False)
    pools = [_mha_pool("page_first"), _mha_pool("page_first")]
    ranks = [_attach(_config(tmp_path, tp_rank=r, tp_size=2), pools[r], [disk]) for r in (0, 1)]
    assert _cycle(ranks[0], pools[0], ["x", "y"])
    assert ranks[1].batch_exists(["x", "y"]) == 0
    assert _cycle(ranks[1], pools[1], ["x", "y"])
    ranks[0].close()


def test_under_sglang_failure_injector(tmp_path):
    pool = _mha_pool("page_first")
    inner = _attach(_config(tmp_path), pool)
    be = HiCacheStorageFailureInjector(inner, 0.0, 0.5)
    pool.kv_buffer.view(torch.int16).random_()
    for r in range(20):
        keys = [f"inj{r}-{i}" for i in range(3)]
        src, dst = pool.alloc(3 * PAGE), pool.alloc(3 * PAGE)
        assert src is not None and dst is not None
        set_ok = be.batch_set_v1(keys, src)
        hits = be.batch_exists(keys)
        got = be.batch_get_v1(keys, dst)
        assert len(set_ok) == len(got) == 3 and 0 <= hits <= 3
        pool.free(src)
        pool.free(dst)
    assert inner.stats()["pages_set_ok"] > 0
    be.close()
