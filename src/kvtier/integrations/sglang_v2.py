"""SGLang's hybrid host pools over kvtier's tiers: its ``*_v2`` storage calls.

A hybrid model keeps beside its KV pool (the anchor, whose pages move through the v1 calls) one
host pool per other kind of state, named by SGLang's ``PoolName``: ``swa`` (a sliding-window
model's window layers: gpt-oss, Gemma), ``mamba`` (Mamba / linear-attention state: Qwen3-Next,
Nemotron-H, Granite 4.0), ``indexer`` (DeepSeek-V3.2's DSA index keys, beside its MLA latent).
SGLang's ``HybridCacheController`` calls, from its prefetch and backup threads:

    register_mem_host_pool_v2(pool, name)     each pool once (the KV pool too); its page shape,
                                              KV dtype and keys fixed here; bad input raises
    on_host_pools_registered()                logs each pool and how its pages are kept
    batch_exists_v2(keys, transfers, info)    the longest prefix of ``keys`` that the KV pool and
        -> PoolTransferResult                 every pool of ``transfers`` can restore, per each
                                              pool's hit policy, and every such prefix length
    batch_set_v2(transfers, info)             each pool's pages written -> {name: [bool]}
    batch_get_v2(transfers, info)             each pool's pages read    -> {name: [bool]}

Each pool is kept as SGLang hands it over, one page per key: a sliding-window pool the pages of
the window before each backed-up node's end (not the whole prefix), a state pool its state at
the node boundaries SGLang backs up (one slot per key), the DSA indexer its index keys for every
page of the latent. The hit policies: ``all_pages`` (the indexer) needs the pool's page for every
page of the prefix; ``trailing_pages`` (window, state) needs only the pool's last
``len(transfer.keys)`` pages before the prefix's end, so the prefix lengths a request can restore
have holes (SGLang intersects them across ranks); ``block_groups`` (DeepSeek-V4's compressed
pools) is not served: such a request is a miss.

A pool's pages move through the v1 page path of a backend view for that pool (``_pool_view``): the
same tiers, settings and worker threads, keys apart (the pool's name and class are in them, so a
page of one pool never loads into another), pages atomic as v1 keeps them (a page's pieces from
one write, or a miss). Pages move in place where the pool gives their addresses
(``get_page_buffer_meta``: every page-first pool), else as the pool's own flat page copies (a
layer-first DSA indexer, a state pool with side states). A pool every TP rank holds alike (an MLA
model's latent and DSA indexer) is written once, by the storage writer; any other pool (Mamba
state, heads of a GQA model) is keyed by TP rank and written by every rank. A failure is a miss,
counted per pool, never an exception into SGLang.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

from .sglang_dtype import kv_dtype
from .sglang_pages import PageShape

log = logging.getLogger(__name__)

KV = "kv"
ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"

try:  # SGLang's result type where it imports; its fields otherwise
    from sglang.srt.mem_cache.hicache_storage import PoolTransferResult as _Result
except Exception:  # SGLang absent (or broken): a plain class with the same fields

    @dataclass
    class _Result:
        kv_hit_pages: int
        extra_pool_hit_pages: dict
        restorable_prefix_pages: list | None = field(default=None)


def pool_name(name) -> str:
    """SGLang's ``PoolName`` (a str enum) or its value, as a plain str."""
    return str(getattr(name, "value", name))


class HybridPools:
    """The ``*_v2`` calls of ``KVTierHiCache`` (a mixin: it reads the backend's own state,
    ``_pools`` included: pool name -> the backend moving that pool's pages)."""

    _flat_pages: bool | None = None  # a pool view's: pages as flat copies; None: interface_v1 decides
    _tp_shared = False  # a pool view's: one copy for all TP ranks (an MLA model's replicated pools)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Take one of SGLang's host pools. The KV pool is the one ``register_mem_pool_host``
        took (its pages keep their v1 keys); any other gets a backend view of its own."""
        name = pool_name(host_pool_name)
        if not name:
            raise ValueError(f"host_pool_name must name a pool, got {host_pool_name!r}")
        if name == KV:
            if host_pool is not self.mem_pool_host:
                log.warning("kvtier hicache: the v2 KV pool is not the pool register_mem_pool_host took")
            self._pools[KV] = self
            return
        self._pools[name] = self._pool_view(name, host_pool)

    def on_host_pools_registered(self) -> None:
        for name, view in sorted(self._pools.items()):
            shared = getattr(self.config, "is_mla_model", False) if view is self else view._tp_shared
            log.info(
                "kvtier hicache: pool %s (%s): %d-byte pages, %s, %s",
                name,
                type(view.mem_pool_host).__name__,
                view.shape.nbytes if view.shape else 0,
                "flat copies" if view._moves_flat() else "in place",
                "one copy for all TP ranks" if shared else "one per TP rank",
            )

    def batch_exists_v2(self, keys: list[str], pool_transfers=None, extra_info=None):
        """The longest prefix of ``keys`` (pages from the start) that the KV pool and every pool
        of ``pool_transfers`` can restore; one round trip per tier per pool."""
        try:
            return self._exists_v2(list(keys), list(pool_transfers or []))
        except Exception:  # a miss, never an exception into SGLang's prefetch thread
            log.exception("kvtier hicache: batch_exists_v2 of %d keys failed", len(keys))
            self._count("exists_errors")
            return _Result(0, {}, [])

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        """Each transfer's pages (``keys``, ``host_indices`` of its pool) to every tier; True
        where every chunk of the page is held."""
        return {t.name: self._pool_call(t, "set") for t in transfers}

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        """Each transfer's pages into its pool; False for a page missing, corrupt or
        unreachable (its bytes in the pool are then undefined), and for every page after it."""
        return {t.name: self._pool_call(t, "get") for t in transfers}

    # -- internals ----------------------------------------------------------------------

    def _pool_view(self, name: str, pool):
        """A backend for one more host pool of this server: this one's settings, tiers, worker
        threads and staging buffers; its own pool, page shape, keys and counters."""
        import torch

        if not all(hasattr(pool, a) for a in ("page_size", "get_data_page", "set_from_flat_data_page")):
            raise ValueError(f"host_pool {name!r} must be an SGLang host pool, got {type(pool).__name__}")
        shared = self._shared_by_tp_ranks(pool)
        view = copy.copy(self)
        view._pools = {}
        view._counts, view._lock = Counter(), threading.Lock()
        view.config = copy.copy(self.config)
        view.config.enable_storage_metrics = False  # SGLang's storage metrics count KV pages
        view._metrics = type(self._metrics)()
        view.writer = self.writer or not shared  # a pool held per TP rank: every rank writes its own
        view._tp_shared = shared and getattr(self.config, "is_mla_model", False)
        suffix = self._suffix  # an MHA model's names its TP rank already
        if not shared and getattr(self.config, "is_mla_model", False):
            suffix += f"_tp{self.config.tp_rank}of{self.config.tp_size}"
        state_dtype = getattr(pool, "temporal_dtype", None)  # a state pool's second dtype
        view._suffix = f"{suffix}\0pool={name}\0{type(pool).__name__}" + (
            f"\0{str(state_dtype).removeprefix('torch.')}" if state_dtype is not None else ""
        )
        view.mem_pool_host = view.shape = None
        try:
            pool.get_page_buffer_meta(torch.arange(int(pool.page_size), dtype=torch.int64))
        except (AttributeError, NotImplementedError, ValueError, AssertionError) as exc:  # no page address
            log.info("kvtier hicache: pool %s moves as flat page copies (%s)", name, exc)
            view._flat_pages = True
            view._bind_flat(pool)
        else:
            view._flat_pages = False
            view.register_mem_pool_host(pool)
        return view

    def _bind_flat(self, pool) -> None:
        """A pool whose pages are copied out and in by SGLang's own ``get_data_page`` /
        ``set_from_flat_data_page``: one chunk per page, keyed as v1's copying interface."""
        dtype = kv_dtype(pool, self.settings.kv_cache_dtype)
        page_size = int(pool.page_size)
        page = pool.get_data_page(0, flat=True)  # its size: every page's
        self.shape = PageShape.of([page.numel() * page.element_size()], self.settings.gather_below_bytes)
        self.mem_pool_host = pool
        layout = str(getattr(pool, "layout", "unknown"))
        self._layout = f"sglang_{layout}_flat"
        self._ns = f"{self._suffix}\0{layout}\0{dtype}\0p{page_size}\0{self.settings.key_salt}"

    @staticmethod
    def _shared_by_tp_ranks(pool) -> bool:
        """Whether every TP rank holds this pool alike: an MLA latent or a DSA indexer (both
        replicated across TP); only those are written once for all ranks."""
        try:
            from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
            from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
        except Exception:  # SGLang's classes absent: keyed per rank, the safe side
            return False
        return isinstance(pool, MLATokenToKVPoolHost | DSAIndexerPoolHost)

    def _pool_call(self, transfer, op: str) -> list[bool]:
        keys = list(transfer.keys or [])
        name = pool_name(transfer.name)
        view = self._pools.get(name)
        if view is None:
            self._count(f"pool_{name}_unregistered", max(1, len(keys)))
            return [False] * len(keys)
        try:
            if transfer.host_indices is None:
                raise ValueError(f"pool {name}: a transfer without host_indices")
            if view._moves_flat():
                return (
                    view._flat_set(keys, transfer.host_indices)
                    if op == "set"
                    else view._flat_get(keys, transfer.host_indices)
                )
            fn = view.batch_set_v1 if op == "set" else view.batch_get_v1
            return fn(keys, transfer.host_indices)
        except Exception:  # a miss, never an exception into SGLang's threads
            log.exception("kvtier hicache: batch_%s_v2 of pool %s failed", op, name)
            view._count(f"pages_{op}_failed", len(keys))
            return [False] * len(keys)

    def _moves_flat(self) -> bool:
        """Whether this backend's pages move as flat copies (v1's copying interface)."""
        return not self.settings.interface_v1 if self._flat_pages is None else self._flat_pages

    def _flat_indices(self, keys: list[str], host_indices) -> list[int]:
        page_size = int(self.mem_pool_host.page_size)
        if len(host_indices) != len(keys) * page_size:
            raise ValueError(
                f"host_indices has {len(host_indices)} slots for {len(keys)} pages of {page_size}"
            )
        return [int(host_indices[i * page_size]) for i in range(len(keys))]

    def _flat_set(self, keys: list[str], host_indices) -> list[bool]:
        pool = self.mem_pool_host
        return [
            self.batch_set([key], [pool.get_data_page(index, flat=True).contiguous()])
            for key, index in zip(keys, self._flat_indices(keys, host_indices), strict=True)
        ]

    def _flat_get(self, keys: list[str], host_indices) -> list[bool]:
        import torch

        pool, out = self.mem_pool_host, []
        like = pool.get_data_page(0, flat=True)  # a page's dtype and size (no pinned allocation)
        for key, index in zip(keys, self._flat_indices(keys, host_indices), strict=True):
            page = None if False in out else self.batch_get([key], [torch.empty_like(like)])[0]
            if page is not None:
                pool.set_from_flat_data_page(index, page)
            out.append(page is not None)
        return out

    def _exists_v2(self, keys: list[str], transfers: list):
        """``batch_exists_v2``'s answer: the KV pool's prefix, cut by each pool's policy."""
        held = self._held(keys, flat=self._moves_flat())
        kv_pages = held.index(False) if False in held else len(held)
        hits = {KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in transfers:
            if not restorable:
                break
            name, policy = pool_name(transfer.name), pool_name(transfer.hit_policy)
            view = self._pools.get(name)
            if view is None or policy not in (ALL_PAGES, TRAILING_PAGES):
                self._count(f"pool_{name}_unregistered" if view is None else f"pool_{name}_{policy}_unserved")
                restorable = set()
                break
            span = max(restorable)
            page_held = view._held(keys[:span], flat=view._moves_flat())
            if policy == ALL_PAGES:
                first_missing = page_held.index(False) if False in page_held else span
                ok = set(range(1, first_missing + 1))
            else:  # the pool's last n pages before the prefix's end: a run of n held pages
                n, run, ok = max(1, len(transfer.keys or ())), 0, set()
                for p, held_page in enumerate(page_held, start=1):
                    run = run + 1 if held_page else 0
                    if run >= min(n, p):
                        ok.add(p)
            if ok:
                hits[transfer.name] = max(ok)
            else:
                view._count("exists_pages_missed")
            restorable &= ok
        ordered = sorted(restorable)
        return _Result(ordered[-1] if ordered else 0, hits, ordered)

    def _pool_stats(self) -> dict:
        """Each non-KV pool's counters (pages, chunks, errors)."""
        out = {}
        for name, view in list(self._pools.items()):  # a pool may register meanwhile
            if view is not self:
                with view._lock:
                    out[name] = dict(view._counts)
        return out
