"""kvtier's disk, Redis and Redis Cluster tiers as an SGLang HiCache storage backend (L3).

SGLang's cache controller builds it through its dynamic backend factory::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
        "class_name": "KVTierHiCache", "interface_v1": 1,
        "tiers": ["disk", "redis"], "disk_path": "/nvme/kv", "redis_url": "redis://cache:6379"}'

and then calls, from its prefetch and backup threads (settings: ``sglang_settings``):

    KVTierHiCache(storage_config, kwargs)         settings checked, tiers built; bad settings raise
                                                  here, a Redis that does not answer is a warning
    register_mem_pool_host(pool)                  the host pool whose pages move; its page shape and
                                                  the KV dtype the model runs
    batch_exists(keys, extra_info) -> int         pages present from the start: one round trip per tier
    batch_set_v1(keys, host_indices, extra_info)  pages written from the pool in place -> list[bool]
    batch_get_v1(keys, host_indices, extra_info)  pages read into the pool in place -> list[bool]
    get / set / batch_get / batch_set / exists    the copying interface, without ``interface_v1``
    register_mem_host_pool_v2 / batch_*_v2        a hybrid model's other host pools (sliding window,
                                                  Mamba state, DSA indexer): ``sglang_v2``
    get_stats() / stats() / close()               SGLang's StorageMetrics (+ ``.kvtier``); counters

A failure is a miss: every call answers False (or a shorter hit count) for the pages it could
not move, counts it, and never raises into SGLang, whose backup thread dies on an exception.
Keys carry the model, the TP/PP ranks (except MLA's latent, which every TP rank shares and only
the storage writer, TP rank 0, writes) and the KV dtype the model runs (``sglang_dtype``: fp8
formats share a uint8 pool). A page is atomic: it is read whole from one tier, and its pieces
must come from one write (``sglang_pages.page_group``); a page mixed from two writers is a miss,
and is dropped from that tier so the next backup stores it whole. With ``auth_keys`` every tier
seals each chunk it writes and loads only chunks a holder of the keys sealed (`kvtier.store.auth`):
a planted page is a miss, counted ``forged`` in the tier's stats. Importable without SGLang and
without a GPU; it subclasses SGLang's ``HiCacheStorage`` where that imports.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvtier.store.auth import note_unauthenticated
from kvtier.store.header import ChunkHeader, payload_checksum
from kvtier.store.stats import StatsLog, StoreStats
from kvtier.store.tier import contains_many, put_many

from .sglang_dtype import kv_dtype
from .sglang_pages import PageShape, chunk_key, page_group, page_views
from .sglang_settings import HiCacheSettings
from .sglang_v2 import HybridPools

log = logging.getLogger(__name__)

try:  # subclassing SGLang's class is what its dynamic factory checks; kvtier runs without it too
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except Exception:  # SGLang absent (or broken): a plain base, same methods
    _Base = object

GROUP_BYTES = 64 << 20  # pages per worker task: bounds a worker's staging buffer


@dataclass
class _Metrics:
    """SGLang's ``StorageMetrics`` fields, for when SGLang's class does not import (no slots:
    ``get_stats`` adds ``.kvtier``, as on SGLang's class)."""

    prefetch_pgs: list = field(default_factory=list)
    backup_pgs: list = field(default_factory=list)
    prefetch_bandwidth: list = field(default_factory=list)
    backup_bandwidth: list = field(default_factory=list)


def rank_suffix(cfg) -> str:
    """What names this rank's share of a page: model, TP (not for MLA's shared latent), PP, CP."""
    model = (getattr(cfg, "model_name", None) or "").replace("/", "-")
    out = model if getattr(cfg, "is_mla_model", False) else f"{model}_tp{cfg.tp_rank}of{cfg.tp_size}"
    if getattr(cfg, "pp_size", 1) > 1:
        out += f"_pp{cfg.pp_rank}of{cfg.pp_size}"
    if getattr(cfg, "attn_cp_size", 1) > 1:
        out += f"_cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}"
    if getattr(cfg, "dcp_size", 1) > 1:
        out += f"_dcp{cfg.dcp_rank}of{cfg.dcp_size}_tp{cfg.tp_size}"
    return out


def disk_space(cfg) -> str:
    """This rank's folder under ``disk_path``: named by its key suffix (one folder for MLA's TP
    ranks, which only the storage writer writes) and its attention-DP group, so no two writers
    of one server share a folder."""
    name = rank_suffix(cfg) + (f"_dp{cfg.dp_rank}" if getattr(cfg, "dp_rank", 0) else "")
    return "sglang-" + re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:190]


def is_writer(cfg) -> bool:
    """MLA: one writer per replica (SGLang's ``is_storage_writer``); MHA: every rank."""
    if hasattr(cfg, "is_storage_writer"):
        return bool(cfg.is_storage_writer)
    return not getattr(cfg, "is_mla_model", False) or cfg.tp_rank == 0


class KVTierHiCache(HybridPools, _Base):
    """storage_config: SGLang's ``HiCacheStorageConfig`` (or any object with its fields:
    tp_rank, tp_size, pp_rank, pp_size, is_mla_model, model_name, extra_config). kwargs: what
    SGLang's factory passes beside it (unused). tiers: prebuilt tiers instead of those the
    settings name (tests, benchmarks)."""

    def __init__(self, storage_config, kwargs: dict | None = None, *, tiers: list | None = None) -> None:
        if storage_config is None or not hasattr(storage_config, "tp_rank"):
            raise ValueError(
                f"storage_config must be a HiCacheStorageConfig, got {type(storage_config).__name__}"
            )
        # hits, bytes and time per tier, every KVTIER_STATS_LOG_S while SGLang moves pages (made
        # before the tiers: a bad KVTIER_STATS_LOG_S is refused before anything is opened)
        self._stats_log = StatsLog(log, self._stats_line)
        self.settings = HiCacheSettings.from_extra_config(getattr(storage_config, "extra_config", None))
        self.config = storage_config
        self.writer = is_writer(storage_config)
        self._suffix = rank_suffix(storage_config)
        if tiers is None:  # each rank its own disk folder; MLA's TP ranks > 0 read rank 0's
            tiers = self.settings.make_tiers(disk_space(storage_config), self.writer)
        self.tiers = list(tiers)
        if not self.tiers:
            raise ValueError("tiers must name at least one tier")
        note_unauthenticated(self.tiers)
        self.mem_pool_host = None
        self.shape: PageShape | None = None
        self._ns = ""
        self._layout = ""
        self._pools: dict = {}  # a hybrid model's host pools by name (``sglang_v2``)
        self._exec = ThreadPoolExecutor(self.settings.io_threads, thread_name_prefix="kvtier-hicache")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._metrics = _Metrics()
        self._closed = False

    # -- SGLang's calls -----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Take the pool and measure its page shape once (its first page's pieces); learn the
        KV dtype the model runs (ValueError where a uint8 pool leaves it unknown)."""
        import torch

        if not hasattr(mem_pool_host, "get_page_buffer_meta"):
            raise ValueError(
                f"mem_pool_host must have get_page_buffer_meta, got {type(mem_pool_host).__name__}"
            )
        dtype = kv_dtype(mem_pool_host, self.settings.kv_cache_dtype)
        page_size = int(mem_pool_host.page_size)
        _, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
        self.shape = PageShape.of(sizes, self.settings.gather_below_bytes)
        self.mem_pool_host = mem_pool_host
        layout = str(getattr(mem_pool_host, "layout", "unknown"))
        self._layout = f"sglang_{layout}_{'page' if self.shape.gathered else 'piece'}"
        self._ns = f"{self._suffix}\0{layout}\0{dtype}\0p{page_size}\0{self.settings.key_salt}"

    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        """How many of ``keys`` from the start are held, every chunk of each in some tier."""
        self._stats_log.tick()
        try:
            return self._exists(list(keys), flat=not self.settings.interface_v1)
        except Exception:  # a miss, never an exception into SGLang's prefetch thread
            log.exception("kvtier hicache: batch_exists of %d keys failed", len(keys))
            self._count("exists_errors")
            return 0

    def batch_set_v1(self, keys: list[str], host_indices, extra_info=None) -> list[bool]:
        """Write each page from the pool (in place, or gathered) to every tier; True where every
        chunk of the page is held by some tier. A non-writer MLA rank writes nothing: True."""
        n = len(keys)
        self._stats_log.tick()
        if not self.writer:
            self._count("pages_set_skipped_not_writer", n)
            return [True] * n
        t0 = time.perf_counter()
        try:
            views = self._views(keys, host_indices)
            ok = self._run(self._put_group, keys, views)
        except Exception:  # never into SGLang's backup thread (sglang#38428: it would die)
            log.exception("kvtier hicache: batch_set_v1 of %d pages failed", n)
            ok = [False] * n
        self._done("set", ok, time.perf_counter() - t0)
        return ok

    def batch_get_v1(self, keys: list[str], host_indices, extra_info=None) -> list[bool]:
        """Read each page into the pool from the first tier holding each chunk; False for a page
        with a chunk missing, corrupt or unreachable (its bytes in the pool are then undefined)."""
        n = len(keys)
        t0 = time.perf_counter()
        try:
            views = self._views(keys, host_indices)
            ok = self._run(self._get_group, keys, views)
        except Exception:  # a miss, never an exception into SGLang's prefetch thread
            log.exception("kvtier hicache: batch_get_v1 of %d pages failed", n)
            ok = [False] * n
        self._done("get", ok, time.perf_counter() - t0)
        return ok

    # The copying interface: one flat page tensor per key (SGLang's ``get_data_page(flat=True)``).

    def get(self, key: str, target_location=None, target_sizes=None):
        got = self.batch_get([key], [target_location])
        return got[0]

    def batch_get(self, keys: list[str], target_locations=None, target_sizes=None) -> list:
        out = []
        for key, dest in zip(keys, target_locations or [None] * len(keys), strict=True):
            try:
                view = _tensor_bytes(dest)
                ok = self._read(chunk_key(key, self._ns, "flat"), view, self._layout_flat)
            except Exception:  # a miss, never an exception into SGLang
                log.exception("kvtier hicache: get %s failed", key)
                ok = False
            self._count("pages_get_ok" if ok else "pages_get_failed")
            out.append(dest if ok else None)
        return out

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values=None, target_locations=None, target_sizes=None) -> bool:
        if not self.writer:
            self._count("pages_set_skipped_not_writer", len(keys))
            return True
        try:
            items = []
            for key, value in zip(keys, values, strict=True):
                ck = chunk_key(key, self._ns, "flat")
                view = _tensor_bytes(value)
                items.append(
                    (ck, ChunkHeader.for_payload(ck, view, (view.nbytes,), "uint8", self._layout_flat), view)
                )
            ok = self._put_items(items)
        except Exception:  # never into SGLang's backup thread
            log.exception("kvtier hicache: batch_set of %d pages failed", len(keys))
            ok = [False] * len(keys)
        self._count("pages_set_ok", sum(ok))
        self._count("pages_set_failed", len(ok) - sum(ok))
        return all(ok)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """Drop every chunk of the disk tiers (a Redis tier is shared: its server evicts)."""
        for tier in self.tiers:
            if hasattr(tier, "resident_keys"):
                for key in tier.resident_keys():
                    tier.delete(key)

    def get_stats(self):
        """SGLang's ``StorageMetrics`` of the calls since the last ``get_stats``, with kvtier's
        counters as ``.kvtier`` (``stats()``)."""
        with self._lock:
            m, self._metrics = self._metrics, _Metrics()
        out = _storage_metrics(m)
        out.kvtier = self.stats()
        return out

    def stats(self) -> dict:
        """Backend counters (pages, chunks, errors) and each tier's own (hits, misses, bytes)."""
        with self._lock:
            out: dict = dict(self._counts)
        out["tiers"] = {getattr(t, "name", str(i)): t.stats() for i, t in enumerate(self.tiers)}
        if pools := self._pool_stats():
            out["pools"] = pools
        return out

    def _stats_line(self) -> tuple[int, str]:
        """(pages moved so far, one line: pages got / set, then each tier's hits, bytes, time)."""
        s = self.stats()
        got, failed = s.get("pages_get_ok", 0), s.get("pages_get_failed", 0)
        rate = f" ({100 * got / (got + failed):.1f}% of pages asked)" if got + failed else ""
        tiers = StoreStats.of({name: t for name, t in s["tiers"].items()})
        line = f"kvtier hicache: {got} pages got{rate}, {s.get('pages_set_ok', 0)} set; " + tiers.tier_line()
        return got + failed + s.get("pages_set_ok", 0) + s.get("pages_set_failed", 0), line

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._exec.shutdown(wait=True)  # no worker may still read a pool page or use a tier
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as exc:  # closing a dead tier is not worth an exception
                log.debug("kvtier hicache: closing %s: %s", getattr(tier, "name", tier), exc)

    # -- internals ----------------------------------------------------------------------

    @property
    def _layout_flat(self) -> str:
        return self._layout.rsplit("_", 1)[0] + "_flat"

    def _views(self, keys: list[str], host_indices) -> list[tuple[memoryview, ...]]:
        if self.mem_pool_host is None:
            raise ValueError("no host pool: SGLang calls register_mem_pool_host first")
        for key in keys:
            if not isinstance(key, str) or not key:
                raise ValueError(f"keys must be non-empty str, got {key!r}")
        page_size = int(self.mem_pool_host.page_size)
        if len(host_indices) != len(keys) * page_size:
            raise ValueError(
                f"host_indices has {len(host_indices)} slots for {len(keys)} pages of {page_size}"
            )
        return page_views(self.mem_pool_host, host_indices, len(keys), self.shape) if keys else []

    def _run(self, fn, keys: list[str], views: list) -> list[bool]:
        """``fn(keys, views, indices, first_failed)`` over groups of pages on the worker threads."""
        if not views:
            return []
        per = max(1, GROUP_BYTES // self.shape.nbytes)
        n_groups = max(self.settings.io_threads, -(-len(views) // per))
        size = -(-len(views) // n_groups)
        groups = [list(range(s, min(s + size, len(views)))) for s in range(0, len(views), size)]
        first_failed = [len(views)]  # pages after a failed one are of no use to SGLang: skipped
        ok = [False] * len(views)
        futures = [self._exec.submit(fn, keys, views, g, first_failed) for g in groups]
        for g, fut in zip(groups, futures, strict=True):
            for i, good in zip(g, fut.result(), strict=True):
                ok[i] = good
        return ok

    def _chunks(self, key: str) -> list[bytes]:
        return [chunk_key(key, self._ns, part) for part in self.shape.parts()]

    def _staging(self, nbytes: int) -> memoryview:
        """This worker thread's gather buffer, grown as needed (never shared between threads)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    def _put_group(self, keys, views, group, first_failed) -> list[bool]:
        shape, items, owner = self.shape, [], []
        stage = self._staging(shape.nbytes * len(group)) if shape.gathered else None
        for n, i in enumerate(group):
            if shape.gathered:
                payloads, pos = [stage[n * shape.nbytes : (n + 1) * shape.nbytes]], n * shape.nbytes
                for piece in views[i]:
                    stage[pos : pos + piece.nbytes] = piece
                    pos += piece.nbytes
            else:
                payloads = views[i]
            sums = [payload_checksum(p) for p in payloads]
            tag = page_group(sums)
            for ck, payload, checksum in zip(self._chunks(keys[i]), payloads, sums, strict=True):
                nbytes = payload.nbytes
                header = ChunkHeader(ck, (nbytes,), "uint8", self._layout, nbytes, checksum, group=tag)
                items.append((ck, header, payload))
                owner.append(n)
        stored = self._put_items(items)
        ok = [True] * len(group)
        for n, good in zip(owner, stored, strict=True):
            ok[n] = ok[n] and good
        return ok

    def _put_items(self, items: list) -> list[bool]:
        """Each chunk to every tier (write-through: a local disk and a shared Redis both keep
        it); True where some tier holds it."""
        stored = [False] * len(items)
        for tier in self.tiers:
            for c, good in enumerate(put_many(tier, items)):
                stored[c] = stored[c] or good
        self._count("chunks_set_ok", sum(stored))
        self._count("chunks_set_failed", len(stored) - sum(stored))
        return stored

    def _get_group(self, keys, views, group, first_failed) -> list[bool]:
        shape, out = self.shape, []
        for i in group:
            if i > first_failed[0]:
                out.append(False)
                continue
            chunks = self._chunks(keys[i])
            if shape.gathered:
                stage = self._staging(shape.nbytes)
                ok = self._read(chunks[0], stage, self._layout)
                pos = 0
                for piece in views[i] if ok else ():
                    piece[:] = stage[pos : pos + piece.nbytes]
                    pos += piece.nbytes
            else:
                ok = self._read_pieces(chunks, views[i])
            if not ok:
                with self._lock:
                    first_failed[0] = min(first_failed[0], i)
            out.append(ok)
        return out

    def _read(self, key: bytes, dest: memoryview, layout: str) -> bool:
        """``key`` into ``dest`` from the first tier that holds it intact and of this shape."""
        for tier in self.tiers:
            if self._read_from(tier, key, dest, layout) is not None:
                return True
        self._count("chunks_missed")
        return False

    def _read_pieces(self, chunks: list[bytes], pieces) -> bool:
        """A page stored in place, into its ``pieces``: every chunk from one tier, and every one
        of the same write (``page_group``). A page of two writes is a miss, and is dropped from
        that tier: nobody could load it, and the next backup can then store it whole."""
        for tier in self.tiers:
            headers = []
            for ck, piece in zip(chunks, pieces, strict=True):
                header = self._read_from(tier, ck, piece, self._layout)
                if header is None:
                    break
                headers.append(header)
            else:
                tag = page_group([h.checksum for h in headers])
                if all(h.group == tag for h in headers):
                    return True
                name = getattr(tier, "name", "tier")
                log.warning("kvtier hicache: %s holds a page mixed from two writes; dropped", name)
                self._count(f"{name}_pages_mixed")
                for ck in chunks:
                    try:
                        tier.delete(ck)
                    except Exception as exc:  # the miss stands; the page stays unloadable until evicted
                        log.debug("kvtier hicache: dropping a mixed page from %s: %s", name, exc)
        self._count("chunks_missed")
        return False

    def _read_from(self, tier, key: bytes, dest: memoryview, layout: str) -> ChunkHeader | None:
        """``key`` into ``dest`` from ``tier``: its header, or None (a miss, an error, or a
        chunk of another shape)."""
        name = getattr(tier, "name", "tier")
        try:
            header = tier.get_into(key, dest)
        except Exception as exc:  # DestTooSmall or a tier bug: this tier misses
            log.warning("kvtier hicache: %s get_into failed: %s", name, exc)
            self._count(f"{name}_read_errors")
            return None
        if header is None:
            return None
        if header.layout != layout or header.payload_len != dest.nbytes:
            self._count(f"{name}_shape_mismatch")  # same key, other bytes: never loaded
            return None
        self._count(f"{name}_chunk_hits")
        return header

    def _exists(self, keys: list[str], flat: bool) -> int:
        """Pages from the start that some tier holds whole (every chunk of a page in one tier:
        a page is read from one tier). One round trip per tier asked."""
        if self.shape is None or not keys:
            return 0
        held = self._held(keys, flat)
        for p, h in enumerate(held):
            if not h:
                self._count("exists_pages_missed")
                return p
        return len(keys)

    def _held(self, keys: list[str], flat: bool) -> list[bool]:
        """For each of ``keys``, whether some tier holds the page whole. One round trip per tier
        asked (a tier is asked only for the pages the tiers before it miss)."""
        if self.shape is None or not keys:
            return [False] * len(keys)
        per = 1 if flat else len(self.shape.parts())
        names = (
            [chunk_key(k, self._ns, "flat") for k in keys]
            if flat
            else [c for k in keys for c in self._chunks(k)]
        )
        held = [False] * len(keys)
        for tier in self.tiers:
            todo = [p for p, h in enumerate(held) if not h]
            if not todo:
                break
            asked = [c for p in todo for c in names[p * per : (p + 1) * per]]
            try:
                found = contains_many(tier, asked)  # one pipelined round trip
            except Exception as exc:  # an unreachable tier holds nothing for this call
                log.warning("kvtier hicache: %s exists failed: %s", getattr(tier, "name", tier), exc)
                self._count("exists_errors")
                continue
            for n, p in enumerate(todo):
                held[p] = all(found[n * per : (n + 1) * per])
        return held

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def _done(self, op: str, ok: list[bool], seconds: float) -> None:
        good = sum(ok)
        nbytes = good * self.shape.nbytes if self.shape is not None else 0
        with self._lock:
            self._counts[f"pages_{op}_ok"] += good
            self._counts[f"pages_{op}_failed"] += len(ok) - good
            self._counts[f"bytes_{'read' if op == 'get' else 'written'}"] += nbytes
            if getattr(self.config, "enable_storage_metrics", False) and ok:
                pgs, bw = (
                    (self._metrics.prefetch_pgs, self._metrics.prefetch_bandwidth)
                    if op == "get"
                    else (self._metrics.backup_pgs, self._metrics.backup_bandwidth)
                )
                pgs.append(good)
                bw.append(nbytes / max(seconds, 1e-9) / 1e9)


def _tensor_bytes(tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor (no copy; a non-contiguous one is refused, since
    bytes read into a copy of it would be lost)."""
    import torch

    from kvtier.store.payload import as_view

    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
        raise ValueError(f"a page must be a contiguous tensor, got {type(tensor).__name__}")
    return as_view(tensor.view(-1).view(torch.uint8))


def _storage_metrics(m: _Metrics):
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except Exception:  # SGLang absent: the same fields in kvtier's own class
        return m
    return StorageMetrics(
        prefetch_pgs=m.prefetch_pgs,
        backup_pgs=m.backup_pgs,
        prefetch_bandwidth=m.prefetch_bandwidth,
        backup_bandwidth=m.backup_bandwidth,
    )
