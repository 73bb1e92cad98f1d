"""kvtier's HiCache backend inside SGLang's own classes: built by SGLang's dynamic backend
factory from a real ``HiCacheStorageConfig``, over SGLang's ``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost`` made on the CPU, and wrapped in SGLang's failure injector.
Skipped where SGLang is not installed (``pip install kvtier[sglang]``)."""

from __future__ import annotations

import importlib.machinery
import sys
import threading
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

from store_redis_fixtures import redis_server  # noqa: E402, F401  (a fixture)

pytestmark = pytest.mark.sglang

L, HEADS, DIM, PAGE, TOKENS = 3, 2, 64, 16, 256


def _mha_pool(layout: str, dtype=torch.bfloat16):
    """dtype: the device pool's ``store_dtype`` (uint8 for an fp8 KV cache), as SGLang's
    ``MHATokenToKVPool._mha_buffer_info`` passes it."""
    k = tuple(torch.zeros(TOKENS, HEADS, DIM, dtype=dtype) for _ in range(L))
    v = tuple(torch.zeros(TOKENS, HEADS, DIM, dtype=dtype) for _ in range(L))
    ptrs = lambda xs: torch.tensor([x.data_ptr() for x in xs], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PAGE,
        head_num=HEADS,
        head_dim=DIM,
        v_head_dim=DIM,
        dtype=dtype,
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


def _config(tmp_path, *, tp_rank=0, tp_size=1, mla=False, layout="page_first", **settings):
    extra = {
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KVTierHiCache",
        "interface_v1": 1,
        "tiers": ["disk"],
        "disk_path": str(tmp_path / "kv"),
        "gather_below_bytes": 4096,
    } | settings
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
    return [pool.get_data_page(int(i), flat=True).view(torch.uint8).clone() for i in indices[::PAGE]]


def _cycle(be, pool, keys: list[str]) -> bool:
    """exists -> set_v1 -> get_v1 into fresh, poisoned pages; every page bit for bit."""
    src = pool.alloc(len(keys) * PAGE)
    pool.kv_buffer.view(torch.uint8).random_()
    want = _pages(pool, src)
    assert be.batch_exists(keys) == 0
    assert be.batch_set_v1(keys, src) == [True] * len(keys)
    assert be.batch_exists(keys) == len(keys)
    dst = pool.alloc(len(keys) * PAGE)
    pool.kv_buffer.view(torch.uint8).fill_(0x5A)
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
    pool.kv_buffer.view(torch.uint8).random_()
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


# -- SGLang's HiCacheController: its backup thread is what writes pages in a server --------------


class _DevicePool:
    """What ``HiCacheController`` reads of the device KV pool when only its storage (L3) runs."""

    device, layer_num = "cpu", L

    def register_layer_transfer_counter(self, counter) -> None:
        self.counter = counter


class _Allocator:
    def __init__(self) -> None:
        self.kv = _DevicePool()

    def get_kvcache(self):
        return self.kv


def _controller(cfg, pool):
    """SGLang's ``HiCacheController`` over ``pool``, its backend made by the dynamic factory from
    ``cfg``'s extra_config and its storage threads started (one rank: no process group)."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.runtime_context import get_parallel

    ranks = dict(
        tp_rank=cfg.tp_rank, tp_size=cfg.tp_size, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    )
    with get_parallel().override(**ranks):  # what a server publishes before it builds the controller
        return HiCacheController(
            _Allocator(),
            pool,
            PAGE,
            None,
            threading.Event(),
            storage_backend="dynamic",
            model_name=cfg.model_name,
            storage_backend_extra_config=dict(cfg.extra_config),
            enable_storage_metrics=True,
        )


def _backup(controller, keys: list[str], indices) -> int:
    """``keys``' pages at ``indices`` through the controller's backup thread; tokens it stored."""
    controller.write_storage(indices, list(range(len(indices))), hash_value=keys)
    return controller.ack_backup_queue.get(timeout=60).completed_tokens  # bounded: a dead thread fails


# -- the KV dtype the model runs: SGLang keeps fp8_e4m3 and fp8_e5m2 pools alike as uint8 ----------


def _serving(monkeypatch, kv_cache_dtype: str) -> None:
    """This process as an SGLang server's scheduler holds it: ``--kv-cache-dtype`` published in
    its runtime context's model namespace (what SGLang's own model runner reads)."""
    from sglang.srt import runtime_context

    bag = types.SimpleNamespace(kv_cache_dtype=kv_cache_dtype)
    monkeypatch.setattr(runtime_context, "get_model", lambda: bag)


def _fp8_server(tmp_path, monkeypatch, kv_cache_dtype: str):
    """A server with an fp8 KV cache: SGLang's host pool of uint8 (the device pool's
    ``store_dtype``), its backend made by the factory over the disk tier at ``tmp_path``."""
    _serving(monkeypatch, kv_cache_dtype)
    pool = _mha_pool("page_first", torch.uint8)
    return _attach(_config(tmp_path), pool), pool


def test_fp8_formats_never_load_each_others_pages(tmp_path, monkeypatch):
    keys = ["f0", "f1", "f2"]
    _serving(monkeypatch, "fp8_e4m3")
    pool = _mha_pool("page_first", torch.uint8)
    e4m3 = _controller(_config(tmp_path), pool)  # a server: its backup thread writes the pages
    src = pool.alloc(3 * PAGE)
    pool.kv_buffer.view(torch.uint8).random_()
    want = _pages(pool, src)
    assert _backup(e4m3, keys, src) == 3 * PAGE
    e4m3.detach_storage_backend()

    e5m2, pool = _fp8_server(tmp_path, monkeypatch, "fp8_e5m2")  # the same tiers, the other format
    assert e5m2.batch_exists(keys) == 0
    assert e5m2.batch_get_v1(keys, pool.alloc(3 * PAGE)) == [False] * 3
    e5m2.close()

    again, pool = _fp8_server(tmp_path, monkeypatch, "fp8_e4m3")
    assert again.batch_exists(keys) == 3
    dst = pool.alloc(3 * PAGE)
    pool.kv_buffer.view(torch.uint8).fill_(0x5A)
    assert again.batch_get_v1(keys, dst) == [True] * 3
    assert all(torch.equal(g, w) for g, w in zip(_pages(pool, dst), want, strict=True))
    again.close()


def test_fp8_format_unknown_is_refused_at_start(tmp_path, monkeypatch):
    pool = _mha_pool("page_first", torch.uint8)
    be = StorageBackendFactory.create_backend("dynamic", _config(tmp_path), pool)
    with pytest.raises(ValueError, match=r"extra_config\['kv_cache_dtype'\]"):
        be.register_mem_pool_host(pool)  # outside a server: SGLang's --kv-cache-dtype is not readable
    be.close()  # as SGLang's controller closes a backend whose attach failed
    # the setting names it there; it must agree with SGLang's own where both are known
    keys = ["s0"]
    a = _attach(_config(tmp_path, kv_cache_dtype="fp8_e5m2"), pool)
    assert a.batch_set_v1(keys, pool.alloc(PAGE)) == [True]
    a.close()
    _serving(monkeypatch, "fp8_e5m2")
    b = _attach(_config(tmp_path), _mha_pool("page_first", torch.uint8))
    assert b.batch_exists(keys) == 1  # the setting and SGLang's value name the same format
    b.close()
    be = StorageBackendFactory.create_backend("dynamic", _config(tmp_path, kv_cache_dtype="fp8_e4m3"), pool)
    with pytest.raises(ValueError, match="fp8_e5m2"):
        be.register_mem_pool_host(pool)
    be.close()


def test_a_pool_of_the_models_dtype_keys_by_it(tmp_path, monkeypatch):
    _serving(monkeypatch, "auto")
    a = _attach(_config(tmp_path), _mha_pool("page_first", torch.bfloat16))
    b = _attach(_config(tmp_path / "fp16"), _mha_pool("page_first", torch.float16))
    assert a._ns != b._ns and "bfloat16" in a._ns and "float16" in b._ns
    a.close()
    b.close()


# -- a page is atomic: two servers backing up the same page into one Redis ---------------------------


class _WritesBetweenPieces:
    """A server's Redis tier that writes a page's first piece (K), then runs ``between`` (another
    server backing up the same page), then the rest (V): two backups of one page interleaved."""

    def __init__(self, tier, between) -> None:
        self.tier, self.between, self.name = tier, between, tier.name

    def put_many(self, items):
        first = self.tier.put_many(items[:1])
        self.between()
        return first + self.tier.put_many(items[1:])

    def __getattr__(self, name):
        return getattr(self.tier, name)


def _redis_config(tmp_path, url: str):
    return _config(tmp_path, tiers=["redis"], redis_url=url, redis_timeout_s=5.0)


def _redis_server(tmp_path, url: str):
    """A server backing up into the Redis at ``url``: its controller, and its pool of random pages."""
    pool = _mha_pool("page_first")
    pool.kv_buffer.view(torch.uint8).random_()
    return _controller(_redis_config(tmp_path, url), pool), pool


@pytest.mark.redis
@pytest.mark.parametrize("keyed", [False, True])
def test_a_page_of_two_interleaved_writers_is_a_miss(tmp_path, redis_server, keyed, monkeypatch):  # noqa: F811
    from kvtier.store.auth import ENV

    if keyed:  # every server's backend seals its pieces (the keys from the environment)
        monkeypatch.setenv(ENV, "0123456789abcdef0123456789abcdef")
    else:
        monkeypatch.delenv(ENV, raising=False)
    a, pa = _redis_server(tmp_path, redis_server.url)
    b, pb = _redis_server(tmp_path, redis_server.url)
    pr = _mha_pool("page_first")
    reader = _attach(_redis_config(tmp_path, redis_server.url), pr)
    assert not reader.shape.gathered and len(reader.shape.sizes) == 2  # K and V of a page: a chunk each
    src_a, src_b = pa.alloc(PAGE), pb.alloc(PAGE)
    want_a, want_b = _pages(pa, src_a)[0], _pages(pb, src_b)[0]
    assert not torch.equal(want_a, want_b)  # the same page key, other bytes (another GPU's numerics)
    backend = a.storage_backend
    direct = backend.tiers[0]
    assert (direct.auth is not None) == keyed and (reader.tiers[0].auth is not None) == keyed
    backend.tiers[0] = _WritesBetweenPieces(direct, lambda: _backup(b, ["page"], src_b))
    _backup(a, ["page"], src_a)  # A's K first, then B's whole backup of the page, then A's V
    backend.tiers[0] = direct

    dst = pr.alloc(PAGE)
    pr.kv_buffer.view(torch.uint8).fill_(0x5A)
    got = reader.batch_get_v1(["page"], dst)
    page = _pages(pr, dst)[0]
    assert not (got == [True] and not torch.equal(page, want_a) and not torch.equal(page, want_b)), (
        "a page mixed from two writes was loaded as a hit"
    )
    assert got == [False] and reader.stats()["redis_pages_mixed"] == 1
    # dropped: the next backup stores it whole, and it loads whole
    assert reader.batch_exists(["page"]) == 0
    assert _backup(a, ["page"], src_a) == PAGE
    assert reader.batch_get_v1(["page"], dst) == [True] and torch.equal(_pages(pr, dst)[0], want_a)
    for c in (a, b):
        c.detach_storage_backend()
    reader.close()


@pytest.mark.redis
def test_concurrent_backups_load_whole_or_miss(tmp_path, redis_server):  # noqa: F811
    servers = [_redis_server(tmp_path, redis_server.url) for _ in range(2)]
    pr = _mha_pool("page_first")
    reader = _attach(_redis_config(tmp_path, redis_server.url), pr)
    n = 7  # pages a backup (a pool holds 15)
    srcs = [pool.alloc(n * PAGE) for _, pool in servers]
    wants = [_pages(pool, src) for (_, pool), src in zip(servers, srcs, strict=True)]
    dst = pr.alloc(n * PAGE)
    for r in range(16):
        keys = [f"r{r}p{i}" for i in range(n)]
        for (c, _), src in zip(servers, srcs, strict=True):  # both backup threads write the same pages
            c.write_storage(src, list(range(n * PAGE)), hash_value=keys)
        for c, _ in servers:
            c.ack_backup_queue.get(timeout=60)  # both backups done before the read that judges them
        pr.kv_buffer.view(torch.uint8).fill_(0x5A)
        got = reader.batch_get_v1(keys, dst)
        for i, (ok, page) in enumerate(zip(got, _pages(pr, dst), strict=True)):
            whole = any(torch.equal(page, w[i]) for w in wants)
            assert not ok or whole, f"round {r}: page {i} was loaded mixed from two writes"
    for c, _ in servers:
        c.detach_storage_backend()
    reader.close()


def test_a_redis_that_does_not_answer_is_a_warning_at_start(tmp_path, caplog):
    import logging

    from store_redis_fixtures import free_port

    port = free_port()  # nothing listens there
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    pool = _mha_pool("page_first")
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        be = _attach(_config(tmp_path, tiers=["disk", "redis"], redis_url=url), pool)
    warnings = [r.getMessage() for r in caplog.records if "at start" in r.getMessage()]
    assert len(warnings) == 1 and f"redis://:***@127.0.0.1:{port}/0" in warnings[0]
    assert "hunter2" not in caplog.text
    src = pool.alloc(2 * PAGE)
    assert be.batch_set_v1(["w0", "w1"], src) == [True, True]  # the disk tier holds them
    assert be.batch_exists(["w0", "w1"]) == 2
    assert be.stats()["tiers"]["redis"]["write_skipping"] == 1  # Redis: a miss at once, no timeout paid
    be.close()


@pytest.mark.parametrize(
    "served, want",
    [
        ("fp8_e4m3", "float8_e4m3fn"),
        (
            "auto",
            "float8_e4m3fn",
        ),  # a uint8 pool under "auto": an fp8 checkpoint's KV, which SGLang runs in e4m3
        ("fp8_e5m2", "float8_e5m2"),
        ("mxfp8", "uint8:mxfp8"),
    ],
)
def test_the_kv_dtype_of_a_uint8_pool_is_what_the_server_runs(monkeypatch, served, want):
    from kvtier.integrations.sglang_dtype import kv_dtype

    _serving(monkeypatch, served)
    assert kv_dtype(types.SimpleNamespace(dtype=torch.uint8)) == want
    assert kv_dtype(types.SimpleNamespace(dtype=torch.bfloat16)) == "bfloat16"  # stored as run
