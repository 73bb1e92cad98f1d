"""kvtier's HiCache backend under SGLang's hybrid models: the host pool groups SGLang's own
assembler builds on the CPU (full attention + sliding window, full attention + Mamba state, MLA
+ DSA indexer), SGLang's ``HybridCacheController`` backing pages up and prefetching them (its
``*_v2`` calls), kvtier's disk and Redis tiers below. Skipped where SGLang is not installed."""

from __future__ import annotations

import threading
import types

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed (pip install kvtier[sglang])")

from test_sglang_real import _import_pools  # noqa: E402  (SGLang's pools import chain, stubbed)

_import_pools()
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.configs.mamba_utils import (  # noqa: E402
    Mamba2CacheParams,
    Mamba2StateDType,
    Mamba2StateShape,
)
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.host_pool_config import prepare_host_pool_config  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
from sglang.srt.mem_cache.memory_pool import (  # noqa: E402
    DSATokenToKVPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.srt.mem_cache.ple_state_pool import ShortConvPool  # noqa: E402
from sglang.srt.mem_cache.pool_host import HostPoolGroup, common  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from store_redis_fixtures import free_port  # noqa: E402

pytestmark = pytest.mark.sglang

PAGE, TOKENS, HEADS, DIM = 16, 256, 2, 64
DSA_PAGE = 64  # SGLang's DSA indexer runs 64-token pages only


@pytest.fixture(autouse=True)
def cpu_server(monkeypatch):
    """What an SGLang server publishes before it builds its host pools, on the CPU: the HiCache
    settings its assembler reads, one rank; host memory is not pinned (no CUDA)."""
    memory = types.SimpleNamespace(
        hicache_ratio=2.0,
        hicache_size=0,
        hicache_mem_layout="page_first",
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=None,
    )
    monkeypatch.setattr(runtime_context._CONTEXT, "_config_bags", {"memory": memory})
    monkeypatch.setattr(common, "_cuda_host_register", lambda *args, **kwargs: None)
    ranks = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
    with get_parallel().override(dcp_enabled=False, **ranks):
        yield memory


# -- the host pool groups, as SGLang's assembler builds them -------------------------------------


def _mha(layers: int) -> MHATokenToKVPool:
    return MHATokenToKVPool(TOKENS, PAGE, torch.bfloat16, HEADS, DIM, layers, "cpu", False)


def _swa_group():
    """gpt-oss / Gemma: full-attention layers 0 and 2, sliding-window layers 1, 3, 4."""
    full, swa = _mha(2), _mha(3)
    group = assembler.build_hybrid_swa_group(
        page_size=PAGE,
        full_kv_pool=full,
        swa_kv_pool=swa,
        full_layer_mapping={0: 0, 2: 1},
        swa_layer_mapping={1: 0, 3: 1, 4: 2},
        use_mla=False,
    )
    return group, full


def _mamba_group(layout: str, mla: bool = False, side_state: bool = False):
    """Qwen3-Next / Nemotron-H: full attention (layers 1, 3) beside Mamba2 state (layers 0, 2),
    the two host pools ``build_hybrid_mamba_stack`` makes. ``mla``: an MLA latent for the full
    attention (Kimi Linear); ``side_state``: a per-slot side state registered on the state pool
    (a PLE short-conv window), which the host pool keeps in a buffer of its own."""
    full = MLATokenToKVPool(TOKENS, PAGE, torch.bfloat16, 64, 16, 2, "cpu", False) if mla else _mha(2)
    shape = Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=64,
        n_groups=1,
        num_heads=4,
        head_dim=16,
        state_size=8,
        conv_kernel=4,
    )
    dtypes = Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
    state = MambaPool(
        size=8,
        spec_state_size=0,
        cache_params=Mamba2CacheParams(shape=shape, layers=[0, 2], dtype=dtypes),
        mamba_layer_ids=[0, 2],
        device="cpu",
    )
    if side_state:
        state.register_slot_state(
            ShortConvPool(size=8, state_shape=(8, 3), layer_ids=[1], dtype=torch.bfloat16, device="cpu")
        )
    (info,) = state.get_device_pool_infos()
    kv_host = assembler.build_kv_host_pool(kv_pool=full, page_size=PAGE, use_mla=mla)
    state_host = assembler.build_mamba_host_pool(state, info, host_size=0, layout=layout)
    entry = assembler.build_pool_entry
    group = HostPoolGroup(
        [
            entry(
                name=PoolName.KV,
                host_pool=kv_host,
                device_pool=full,
                layer_mapping={1: 0, 3: 1},
                transfer_layer_id_max=4,
                is_anchor=True,
            ),
            entry(
                name=PoolName.MAMBA,
                host_pool=state_host,
                device_pool=state,
                layer_mapping={0: 0, 2: 1},
                transfer_layer_id_max=4,
            ),
        ]
    )
    return group, full


def _dsa_group():
    """DeepSeek V3.2: the MLA latent and its DSA indexer, from the pool's own declarations."""
    dsa = DSATokenToKVPool(
        size=TOKENS,
        page_size=DSA_PAGE,
        kv_lora_rank=64,
        dtype=torch.bfloat16,
        qk_rope_head_dim=16,
        layer_num=3,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=80,
    )
    config = prepare_host_pool_config(
        decls=dsa.host_pool_decls(),
        full_layer_mapping={i: i for i in range(3)},
        transfer_layer_id_max=3,
        transfer_page_size=DSA_PAGE,
        packed_draft_device_pools=(),
    )
    return assembler.build_host_pool_group(config=config), dsa


# -- SGLang's HybridCacheController over a group, its backend made by the dynamic factory ---------


class _Allocator:
    def __init__(self, device_pool) -> None:
        self.device_pool = device_pool

    def get_kvcache(self):
        return self.device_pool


def _extra(tmp_path, **settings) -> dict:
    return {
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KVTierHiCache",
        "interface_v1": 1,
        "tiers": ["disk"],
        "disk_path": str(tmp_path / "kv"),
        "gather_below_bytes": 4096,
    } | settings


def _controller(built, extra: dict, page: int = PAGE) -> HybridCacheController:
    group, device_pool = built
    return HybridCacheController(
        _Allocator(device_pool),
        group,
        page,
        None,
        threading.Event(),
        storage_backend="dynamic",
        model_name="org/hybrid",
        storage_backend_extra_config=dict(extra),
        enable_storage_metrics=True,
    )


def _buffers(pool) -> list[torch.Tensor]:
    """All of a host pool's memory (its pages and whatever lies between them)."""
    if hasattr(pool, "get_hybrid_pool_buffer"):
        return list(pool.get_hybrid_pool_buffer())
    return [pool.kv_buffer]


def _randomize(group) -> None:
    for entry in group.entries:
        for buf in _buffers(entry.host_pool):
            buf.view(torch.uint8).random_()


def _poison(group) -> None:
    for entry in group.entries:
        for buf in _buffers(entry.host_pool):
            buf.view(torch.uint8).fill_(0x5A)


def _page(pool, index: int) -> torch.Tensor:
    """One page's bytes (a state pool: one slot), from SGLang's own ``get_data_page``."""
    return pool.get_data_page(int(index), flat=True).contiguous().view(torch.uint8).clone()


def _pages(pool, indices: torch.Tensor) -> list[torch.Tensor]:
    return [_page(pool, i) for i in indices[:: pool.page_size]]


def _tokens(n_pages: int, page: int = PAGE, seed: int = 0) -> list[int]:
    return [(seed * 7919 + t) % 30000 + 1 for t in range(n_pages * page)]


def _keys(tokens: list[int], page: int = PAGE) -> list[str]:
    return get_storage_hash_str(tokens, None, page_size=page)


def _backup(cc, host_indices, tokens, keys, extra_pools=None):
    """One node's pages through the controller's backup thread: the acked operation."""
    cc.write_storage(host_indices, tokens, hash_value=keys, extra_pools=extra_pools)
    return cc.ack_backup_queue.get(timeout=60)  # bounded: a dead backup thread fails the test


def _prefetch(cc, tokens: list[int], extra_pools=None):
    """A request's prefetch, as the scheduler drives it: the hit query on the prefetch thread,
    then host staging for the hit (the KV pages and each side pool's share), then the reads.
    Returns (hit tokens, the operation, the pools' load counts, each transfer's host slots)."""
    op = cc.prefetch(CacheRequestHandle("req", 0), tokens, None, None, extra_pools=extra_pools)
    op = cc.prefetch_hit_queue.get(timeout=60)
    hit = op.storage_hit_count
    if hit == 0:
        return 0, op, {}, {}
    host, _ = cc.allocate_storage_hit(op, hit, allow_partial=False, min_tokens=PAGE, evict_host=lambda n: 0)
    assert host is not None
    staged = {}
    for t in extra_pools or []:
        if t.indices_from_pool is None:  # the scheduler stages what the hit needs of the pool
            pool = cc.mem_pool_host.get_pool(t.name)
            t.host_indices = pool.alloc(min(len(t.keys), hit // cc.page_size) * pool.page_size)
            staged[t.name] = t
    op.host_indices = host
    cc.prefetch_buffer.put(op)
    loaded, pool_hits = None, {}
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=60)
        if ack.completed_tokens is not None:
            loaded = ack.completed_tokens
        if ack.pool_hits:
            pool_hits = {k: v for k, v in ack.pool_hits.items() if v}
        if ack.completed_req:
            break
    assert loaded == hit, f"{loaded} of {hit} hit tokens loaded"
    return hit, op, pool_hits, staged


def _trailing(name: PoolName, n: int) -> PoolTransfer:
    """A prefetch's side pool as SGLang's components plan it: ``n`` trailing pages, keys
    filled in once the hit is known."""
    return PoolTransfer(name=name, keys=["__placeholder__"] * n, hit_policy=PoolHitPolicy.TRAILING_PAGES)


def _kv_derived(name: PoolName) -> PoolTransfer:
    return PoolTransfer(name=name, hit_policy=PoolHitPolicy.ALL_PAGES, indices_from_pool=PoolName.KV)


# -- sliding window (gpt-oss, Gemma) --------------------------------------------------------------

WINDOW = 3  # pages of the sliding window


def _swa_backup(cc, group, tokens, keys, *, swa_pages: int = WINDOW):
    """Back up a node as SGLang's SWA component does: every KV page, and the SWA pool's pages
    of the window before the node's end (``keys[-swa_pages:]``). Returns what was written."""
    kv, swa = group.get_pool(PoolName.KV), group.get_pool(PoolName.SWA)
    kv_idx = kv.alloc(len(keys) * PAGE)
    swa_idx = swa.alloc(swa_pages * PAGE)
    extra = [
        PoolTransfer(
            name=PoolName.SWA,
            host_indices=swa_idx,
            keys=keys[-swa_pages:],
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        )
    ]
    op = _backup(cc, kv_idx, tokens, keys, extra)
    assert op.completed_tokens == len(keys) * PAGE
    assert op.pool_storage_result.extra_pool_hit_pages.get(PoolName.SWA) == swa_pages
    return _pages(kv, kv_idx), _pages(swa, swa_idx)


def test_swa_window_hits_through_sglang_controller(tmp_path):
    built = _swa_group()
    group = built[0]
    cc = _controller(built, _extra(tmp_path))
    _randomize(group)
    tokens = _tokens(6)
    keys = _keys(tokens)
    want_kv, want_swa = _swa_backup(cc, group, tokens, keys)

    _poison(group)
    hit, op, pool_hits, staged = _prefetch(cc, tokens + _tokens(2, seed=9), [_trailing(PoolName.SWA, WINDOW)])
    assert hit == 6 * PAGE  # the 2 pages past the node were never stored
    assert op.pool_storage_result.restorable_prefix_pages == [6]  # the window ends only at page 6
    assert pool_hits == {"swa": WINDOW}
    kv, swa = group.get_pool(PoolName.KV), group.get_pool(PoolName.SWA)
    assert all(torch.equal(g, w) for g, w in zip(_pages(kv, op.host_indices), want_kv, strict=True))
    got_swa = _pages(swa, staged[PoolName.SWA].host_indices)
    assert all(torch.equal(g, w) for g, w in zip(got_swa, want_swa, strict=True))
    stats = cc.storage_backend.stats()["pools"]["swa"]
    assert stats["pages_set_ok"] == WINDOW and stats["pages_get_ok"] == WINDOW
    cc.detach_storage_backend()


def test_swa_window_missing_a_page_cuts_the_hit(tmp_path):
    """Two nodes: pages 0-3 (window 1-3 stored) and 4-7 whose SWA pages SGLang never handed over
    but one (page 7): a prefix ending at 8 lacks its window (5, 6 missing), the one ending at 4
    has it."""
    built = _swa_group()
    group = built[0]
    cc = _controller(built, _extra(tmp_path))
    _randomize(group)
    tokens = _tokens(8)
    keys = _keys(tokens)
    want_kv, want_swa = _swa_backup(cc, group, tokens[: 4 * PAGE], keys[:4])
    _swa_backup(cc, group, tokens[4 * PAGE :], keys[4:], swa_pages=1)  # SWA: page 7 only

    _poison(group)
    hit, op, pool_hits, staged = _prefetch(cc, tokens, [_trailing(PoolName.SWA, WINDOW)])
    assert hit == 4 * PAGE and op.pool_storage_result.restorable_prefix_pages == [4]
    kv, swa = group.get_pool(PoolName.KV), group.get_pool(PoolName.SWA)
    assert all(torch.equal(g, w) for g, w in zip(_pages(kv, op.host_indices), want_kv, strict=True))
    got_swa = _pages(swa, staged[PoolName.SWA].host_indices)
    assert all(torch.equal(g, w) for g, w in zip(got_swa, want_swa, strict=True))
    cc.detach_storage_backend()


def test_a_pool_never_loads_another_pools_pages(tmp_path):
    """Three pools of one page shape (3 layers each): KV, SWA and an MTP draft pool SGLang adds
    at runtime (``register_host_pool_entry``). A page stored for one is a miss for the others,
    and each loads its own bytes."""
    full, swa_dev, draft_dev = _mha(3), _mha(3), _mha(3)
    group = assembler.build_hybrid_swa_group(
        page_size=PAGE,
        full_kv_pool=full,
        swa_kv_pool=swa_dev,
        full_layer_mapping={0: 0, 2: 1, 4: 2},
        swa_layer_mapping={1: 0, 3: 1, 5: 2},
        use_mla=False,
    )
    cc = _controller((group, full), _extra(tmp_path))
    draft = assembler.build_kv_host_pool(kv_pool=draft_dev, page_size=PAGE, use_mla=False)
    cc.register_host_pool_entry(
        assembler.build_pool_entry(
            name=PoolName.DRAFT,
            host_pool=draft,
            device_pool=draft_dev,
            layer_mapping={0: 0, 1: 1, 2: 2},
            transfer_layer_id_max=6,
        )
    )
    be = cc.storage_backend
    pools = {name: group.get_pool(name) for name in (PoolName.KV, PoolName.SWA, PoolName.DRAFT)}
    _randomize(group)
    keys = _keys(_tokens(2))
    slots = {name: pool.alloc(2 * PAGE) for name, pool in pools.items()}
    wants = {name: _pages(pools[name], idx) for name, idx in slots.items()}
    swa_only = be.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=slots[PoolName.SWA], keys=keys)])
    assert swa_only == {PoolName.SWA: [True, True]}
    assert be.batch_exists(keys) == 0  # the KV pool holds none of them
    assert be.batch_exists_v2(keys, [_trailing(PoolName.DRAFT, 2)]).kv_hit_pages == 0
    draft_read = PoolTransfer(name=PoolName.DRAFT, host_indices=slots[PoolName.DRAFT], keys=keys)
    assert be.batch_get_v2([draft_read]) == {PoolName.DRAFT: [False, False]}
    assert be.batch_get_v1(keys, slots[PoolName.KV]) == [False, False]

    assert be.batch_set_v1(keys, slots[PoolName.KV]) == [True, True]
    written = be.batch_set_v2([draft_read])
    assert written == {PoolName.DRAFT: [True, True]}
    hit = be.batch_exists_v2(keys, [_trailing(PoolName.SWA, 2), _trailing(PoolName.DRAFT, 2)])
    assert hit.kv_hit_pages == 2
    _poison(group)
    reads = [
        PoolTransfer(name=name, host_indices=slots[name], keys=keys)
        for name in (PoolName.SWA, PoolName.DRAFT)
    ]
    assert be.batch_get_v2(reads) == {PoolName.SWA: [True, True], PoolName.DRAFT: [True, True]}
    assert be.batch_get_v1(keys, slots[PoolName.KV]) == [True, True]
    for name, pool in pools.items():
        assert all(torch.equal(g, w) for g, w in zip(_pages(pool, slots[name]), wants[name], strict=True)), (
            name
        )
    cc.detach_storage_backend()


# -- Mamba / linear-attention state (Qwen3-Next, Nemotron-H, Granite 4.0) ------------------------


def _mamba_backup(cc, group, tokens, keys):
    """A node as SGLang's Mamba component backs it up: its KV pages and the state at its end
    (one slot, keyed by the node's last page)."""
    kv, state = group.get_pool(PoolName.KV), group.get_pool(PoolName.MAMBA)
    kv_idx, slot = kv.alloc(len(keys) * PAGE), state.alloc(1)
    extra = [
        PoolTransfer(
            name=PoolName.MAMBA, host_indices=slot, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES
        )
    ]
    op = _backup(cc, kv_idx, tokens, keys, extra)
    assert op.completed_tokens == len(keys) * PAGE
    assert op.pool_storage_result.extra_pool_hit_pages.get(PoolName.MAMBA) == 1
    return _pages(kv, kv_idx), _page(state, slot[0])


@pytest.mark.parametrize(
    "layout, side_state", [("page_first", False), ("page_first_direct", False), ("page_first", True)]
)
def test_mamba_state_at_node_boundaries(tmp_path, layout, side_state):
    built = _mamba_group(layout, side_state=side_state)
    group = built[0]
    cc = _controller(built, _extra(tmp_path))
    _randomize(group)
    tokens = _tokens(8)
    keys = _keys(tokens)
    want_kv, _ = _mamba_backup(cc, group, tokens[: 4 * PAGE], keys[:4])
    more_kv, want_state = _mamba_backup(cc, group, tokens[4 * PAGE :], keys[4:])

    _poison(group)
    hit, op, pool_hits, staged = _prefetch(cc, tokens + _tokens(2, seed=5), [_trailing(PoolName.MAMBA, 1)])
    assert hit == 8 * PAGE
    assert op.pool_storage_result.restorable_prefix_pages == [4, 8]  # a state only at node ends
    assert pool_hits == {"mamba": 1}
    kv, state = group.get_pool(PoolName.KV), group.get_pool(PoolName.MAMBA)
    assert all(torch.equal(g, w) for g, w in zip(_pages(kv, op.host_indices), want_kv + more_kv, strict=True))
    assert torch.equal(_page(state, staged[PoolName.MAMBA].host_indices[0]), want_state)
    stats = cc.storage_backend.stats()["pools"]["mamba"]
    assert stats["pages_set_ok"] == 2 and stats["pages_get_ok"] == 1
    cc.detach_storage_backend()


def test_mamba_state_missing_falls_back_to_the_earlier_boundary(tmp_path):
    """The state at the second node's end never reached storage (SGLang had no host copy of
    it): the hit is the first node, loaded with its own state."""
    built = _mamba_group("page_first")
    group = built[0]
    cc = _controller(built, _extra(tmp_path))
    _randomize(group)
    tokens = _tokens(8)
    keys = _keys(tokens)
    want_kv, want_state = _mamba_backup(cc, group, tokens[: 4 * PAGE], keys[:4])
    kv = group.get_pool(PoolName.KV)
    kv_only = _backup(cc, kv.alloc(4 * PAGE), tokens[4 * PAGE :], keys[4:])  # no state handed over
    assert kv_only.completed_tokens == 4 * PAGE

    _poison(group)
    hit, op, pool_hits, staged = _prefetch(cc, tokens, [_trailing(PoolName.MAMBA, 1)])
    assert hit == 4 * PAGE and op.pool_storage_result.restorable_prefix_pages == [4]
    assert all(torch.equal(g, w) for g, w in zip(_pages(kv, op.host_indices), want_kv, strict=True))
    state = group.get_pool(PoolName.MAMBA)
    assert torch.equal(_page(state, staged[PoolName.MAMBA].host_indices[0]), want_state)
    cc.detach_storage_backend()


def test_mamba_state_is_kept_per_tp_rank_beside_a_shared_latent(tmp_path):
    """Kimi Linear (an MLA latent beside linear-attention state): every TP rank holds the
    latent alike (one writer) but its own shard of the state: rank 1 never loads rank 0's."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvtier.integrations.sglang import KVTierHiCache
    from kvtier.store.disk import DiskTier

    disk = DiskTier(tmp_path / "shared", 1 << 30, fsync=False)
    backends, groups = [], []
    for rank in (0, 1):
        group = _mamba_group("page_first", mla=True)[0]
        cfg = HiCacheStorageConfig(
            tp_rank=rank,
            tp_size=2,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=True,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name="org/hybrid",
            extra_config=_extra(tmp_path),
        )
        be = KVTierHiCache(cfg, {}, tiers=[disk])
        be.register_mem_pool_host(group.get_pool(PoolName.KV))
        for entry in group.entries:
            be.register_mem_host_pool_v2(entry.host_pool, entry.name)
        be.on_host_pools_registered()
        backends.append(be)
        groups.append(group)
    keys = _keys(_tokens(1))
    for be, group in zip(backends, groups, strict=True):
        _randomize(group)
        state = group.get_pool(PoolName.MAMBA)
        written = be.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=state.alloc(1), keys=keys)])
        assert written == {PoolName.MAMBA: [True]}  # every rank writes its own shard
    r0, r1 = backends
    assert r0.batch_set_v1(keys, groups[0].get_pool(PoolName.KV).alloc(PAGE)) == [True]  # the latent: rank 0
    assert r1.batch_exists(keys) == 1  # rank 1 sees rank 0's latent
    want = [_page(g.get_pool(PoolName.MAMBA), 0) for g in groups]
    assert not torch.equal(want[0], want[1])
    for be, group, w in zip(backends, groups, want, strict=True):
        state = group.get_pool(PoolName.MAMBA)
        _poison(group)
        read = PoolTransfer(name=PoolName.MAMBA, host_indices=state.alloc(1), keys=keys)
        assert be.batch_get_v2([read]) == {PoolName.MAMBA: [True]}
        assert torch.equal(_page(state, read.host_indices[0]), w)
    r0.close()


# -- MLA + DSA indexer (DeepSeek V3.2) ------------------------------------------------------------


def _dsa_backup(cc, group, tokens, keys, *, indexer: bool = True):
    kv = group.get_pool(PoolName.KV)
    kv_idx = kv.alloc(len(keys) * DSA_PAGE)
    extra = [_kv_derived(PoolName.INDEXER)] if indexer else None
    op = _backup(cc, kv_idx, tokens, keys, extra)
    assert op.completed_tokens == len(keys) * DSA_PAGE
    return _pages(kv, kv_idx), _pages(group.get_pool(PoolName.INDEXER), kv_idx)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mla_and_its_indexer_hit_together(tmp_path, cpu_server, layout):
    cpu_server.hicache_mem_layout = layout
    built = _dsa_group()
    group = built[0]
    cc = _controller(built, _extra(tmp_path), page=DSA_PAGE)
    _randomize(group)
    tokens = _tokens(3, DSA_PAGE)
    keys = _keys(tokens, DSA_PAGE)
    want_kv, want_index = _dsa_backup(cc, group, tokens, keys)

    _poison(group)
    hit, op, pool_hits, _ = _prefetch(cc, tokens, [_kv_derived(PoolName.INDEXER)])
    assert hit == 3 * DSA_PAGE
    kv, index = group.get_pool(PoolName.KV), group.get_pool(PoolName.INDEXER)
    assert all(torch.equal(g, w) for g, w in zip(_pages(kv, op.host_indices), want_kv, strict=True))
    assert all(torch.equal(g, w) for g, w in zip(_pages(index, op.host_indices), want_index, strict=True))
    stats = cc.storage_backend.stats()["pools"]["indexer"]
    assert stats["pages_set_ok"] == 3 and stats["pages_get_ok"] == 3
    cc.detach_storage_backend()


def test_mla_without_its_indexer_is_a_miss_from_there(tmp_path):
    """Pages 0-1 backed up with their index keys, page 2 with the latent only: the hit stops
    at 2, where the indexer (every page of the prefix) stops."""
    built = _dsa_group()
    group = built[0]
    cc = _controller(built, _extra(tmp_path), page=DSA_PAGE)
    _randomize(group)
    tokens = _tokens(3, DSA_PAGE)
    keys = _keys(tokens, DSA_PAGE)
    want_kv, want_index = _dsa_backup(cc, group, tokens[: 2 * DSA_PAGE], keys[:2])
    _dsa_backup(cc, group, tokens[2 * DSA_PAGE :], keys[2:], indexer=False)

    _poison(group)
    hit, op, _, _ = _prefetch(cc, tokens, [_kv_derived(PoolName.INDEXER)])
    assert hit == 2 * DSA_PAGE
    kv, index = group.get_pool(PoolName.KV), group.get_pool(PoolName.INDEXER)
    assert all(torch.equal(g, w) for g, w in zip(_pages(kv, op.host_indices), want_kv, strict=True))
    assert all(torch.equal(g, w) for g, w in zip(_pages(index, op.host_indices), want_index, strict=True))
    cc.detach_storage_backend()


# -- failures: a miss, counted, never an exception into SGLang's threads ------------------------


def _hybrid(kind: str):
    """(group and device pool, page size, a backup's side transfers, a prefetch's)."""
    if kind == "swa":
        built = _swa_group()
        swa = built[0].get_pool(PoolName.SWA)

        def sides(keys):
            return [PoolTransfer(name=PoolName.SWA, host_indices=swa.alloc(PAGE), keys=keys[-1:])]

        return built, PAGE, sides, [_trailing(PoolName.SWA, 1)]
    if kind == "mamba":
        built = _mamba_group("page_first")
        state = built[0].get_pool(PoolName.MAMBA)

        def sides(keys):
            return [PoolTransfer(name=PoolName.MAMBA, host_indices=state.alloc(1), keys=keys[-1:])]

        return built, PAGE, sides, [_trailing(PoolName.MAMBA, 1)]
    return (
        _dsa_group(),
        DSA_PAGE,
        lambda keys: [_kv_derived(PoolName.INDEXER)],
        [_kv_derived(PoolName.INDEXER)],
    )


@pytest.mark.parametrize("kind", ["swa", "mamba", "dsa"])
def test_a_tier_down_is_a_miss_per_pool(tmp_path, kind):
    """Redis does not answer: every pool's pages fail to store and to load, counted; SGLang's
    threads see misses only. With a disk tier beside it, the disk serves every pool."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    built, page, sides, wanted = _hybrid(kind)
    group = built[0]
    cc = _controller(built, _extra(tmp_path, tiers=["redis"], redis_url=url), page=page)
    _randomize(group)
    tokens = _tokens(2, page)
    keys = _keys(tokens, page)
    op = _backup(cc, group.get_pool(PoolName.KV).alloc(2 * page), tokens, keys, sides(keys))
    side = next(iter(op.pool_storage_result.extra_pool_hit_pages))
    assert op.completed_tokens == 0 and op.pool_storage_result.extra_pool_hit_pages[side] == 0
    assert _prefetch(cc, tokens, wanted)[0] == 0
    stats = cc.storage_backend.stats()
    assert stats["pools"][str(side)]["pages_set_failed"] >= 1 and stats["pages_set_failed"] >= 1
    cc.detach_storage_backend()

    both = _controller(built, _extra(tmp_path / "b", tiers=["disk", "redis"], redis_url=url), page=page)
    op = _backup(both, group.get_pool(PoolName.KV).alloc(2 * page), tokens, keys, sides(keys))
    assert op.completed_tokens == 2 * page and all(op.pool_storage_result.extra_pool_hit_pages.values())
    assert _prefetch(both, tokens, wanted)[0] == 2 * page
    both.detach_storage_backend()


def test_bad_transfers_are_misses_not_exceptions(tmp_path):
    built = _swa_group()
    group = built[0]
    cc = _controller(built, _extra(tmp_path))
    be = cc.storage_backend
    keys = _keys(_tokens(2))
    swa = group.get_pool(PoolName.SWA)
    short = PoolTransfer(name=PoolName.SWA, host_indices=swa.alloc(PAGE), keys=keys)  # 1 page for 2 keys
    unknown = PoolTransfer(name=PoolName.MAMBA, host_indices=swa.alloc(PAGE), keys=keys[:1])
    assert be.batch_set_v2([short, unknown]) == {PoolName.SWA: [False, False], PoolName.MAMBA: [False]}
    assert be.batch_get_v2([short]) == {PoolName.SWA: [False, False]}
    assert be.batch_set_v1(keys, group.get_pool(PoolName.KV).alloc(2 * PAGE)) == [True, True]
    assert be.batch_exists_v2(keys, [_trailing(PoolName.MAMBA, 1)]).kv_hit_pages == 0  # no such pool
    blocks = PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    assert be.batch_exists_v2(keys, [blocks]).kv_hit_pages == 0  # a policy kvtier does not serve
    stats = be.stats()
    assert stats["pools"]["swa"]["pages_set_failed"] == 2 and stats["pool_mamba_unregistered"] >= 1
    cc.detach_storage_backend()
