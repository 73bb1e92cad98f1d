"""WorkerSide: the connector's half in each vLLM worker — moves chunks through kvtier's store.

Per step, in vLLM's call order (`KVTierMetadata` bound first):

    handle_preemptions(meta)   later compute waits for the pending saves of preempted requests'
                               blocks: vLLM may hand them to another request
    start_load(meta)           prefetches start; each load: lower-tier reads, then the copies on
                               the copy stream, one event per layer; what no tier delivered is
                               reported as load errors (vLLM recomputes those blocks)
    wait_layer(name)           compute waits for that layer only (layerwise: the loads take the
                               engine's layer-major path, a true event per layer), no host blocking
    save(meta)                 after the forward: each new full chunk saved from its blocks, the
                               copy waiting for the compute stream's event; blocks held (the
                               request's free delayed) until the copy's event completed
    finished(ids)              (saved, loaded) request ids whose transfers completed
    report() / stats()         chunks held / lost for the scheduler; counters for vLLM's stats

Every tier failure is a miss (fewer tokens loaded, a save skipped), never an exception into
vLLM's forward. Block ids are vLLM's; chunk i of a run covers ``block_ids[i*bpc:(i+1)*bpc]``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from .hash_store import HashKeyedStore
from .metadata import ChunkRun, KVTierMetadata, KVTierWorkerMetadata
from .settings import VllmSettings

log = logging.getLogger(__name__)


class WorkerSide:
    """settings: `VllmSettings`. model: the identity keys are salted with. tp_rank / tp_size:
    this worker's rank (its keys are its own). order: vLLM's `KVCacheLayout` name of the cache.
    tiers / device: override what ``settings`` would build (tests: a `MemoryTier`, `SimDevice`)."""

    def __init__(
        self,
        settings: VllmSettings,
        model: str,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        order: str | None = None,
        block_size: int | None = None,
        tiers=None,
        device=None,
    ) -> None:
        self.settings, self.model, self.order = settings, model, order
        self.tp_rank, self.tp_size, self.block_size = tp_rank, tp_size, block_size
        self._tiers, self._device = tiers, device
        self.store: HashKeyedStore | None = None
        self._layer_index: dict[str, int] = {}
        self._loads: list = []  # (LoadHandle, ChunkRun, t0) of this step and earlier
        self._saves: dict[str, list] = {}  # req id -> [(SaveHandle, ChunkRun, t0)]
        self._finishing: set[str] = set()
        self._had_save: set[str] = set()  # requests the scheduler sent saves for: their free waits on us
        self._prefetches: list = []  # (req id, ChunkRun, Future)
        self._errors: set[int] = set()
        self._held: dict[bytes, int] = {}
        self._lost: dict[bytes, int] = {}
        self._prefetched: dict[str, int] = {}
        self._extra_sent = False
        self._counts: Counter = Counter()
        self._owned: list = []  # what register_kv_caches made, closed in reverse at shutdown

    # -- set-up ---------------------------------------------------------------------------------

    def register(self, kv_caches: dict) -> None:
        """Build the engine and store over vLLM's per-layer 4-D views (``{layer name: view}``)."""
        import torch

        from kvtier import layout
        from kvtier.engine import EngineConfig, TransferEngine
        from kvtier.pool import PinnedPool
        from kvtier.store import StoreConfig

        names = list(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(names)}
        kv = layout.vllm_paged(kv_caches, self.order or "LBHNC")
        ct = self.settings.chunk_tokens_for(self.block_size or kv.block_size)
        self.settings.check_host_bytes(kv.chunk_nbytes(ct // kv.block_size))  # before anything is allocated
        first = next(iter(kv_caches.values()))
        dev = self._device
        if dev is None:
            from kvtier.device import CudaDevice, SimDevice

            dev = CudaDevice(first.device.index or 0) if first.is_cuda else SimDevice()
            self._owned.append(dev)
        pool = PinnedPool(dev, self.settings.host_bytes)
        engine = TransferEngine(
            dev,
            kv,
            pool,
            config=EngineConfig(path=self.settings.engine_path, staging_bytes=self.settings.staging_bytes),
        )
        self._owned += [pool, engine]
        tiers = self._tiers if self._tiers is not None else self._make_tiers()
        s = self.settings
        cfg = StoreConfig(
            chunk_tokens=s.chunk_tokens_for(self.block_size or kv.block_size),
            write_policy=s.write_policy,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            salt=s.salt.encode(),
            hash_name=s.hash_name,
            auth_keys=s.auth_keys,
        )
        self.store = HashKeyedStore(engine, self.model, tiers=tiers, config=cfg)
        self.dev, self.kv, self.torch = dev, kv, torch

    def _make_tiers(self) -> list:
        s, tiers = self.settings, []
        if s.disk_path:
            from kvtier.store.disk import DiskTier

            tiers.append(DiskTier(s.disk_path, s.disk_bytes, space=f"tp{self.tp_rank}", label="disk_path"))
        if s.redis_url:
            from kvtier.store.redis_tier import RedisTier

            tiers.append(RedisTier(url=s.redis_url, cluster=s.redis_cluster))
        self._owned += tiers
        return tiers

    # -- per step -------------------------------------------------------------------------------

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        if self.store is None or not meta.preempted:
            return  # the common step: no device stream looked up
        stream = self.dev.current_stream()
        for rid in meta.preempted:
            for h, _, _ in self._saves.get(rid, ()):
                h.wait_on(stream)  # vLLM reuses these blocks: no overwrite before the copy read them

    def start_load(self, meta: KVTierMetadata) -> None:
        if self.store is None:
            return
        self._settle()
        for run in meta.prefetches:
            try:
                self._prefetches.append((run.req_id, run, self.store.prefetch(run.ids)))
            except Exception as exc:  # a prefetch is a hint: its failure is a later miss
                log.warning("kvtier: prefetch failed: %s", exc)
                self._prefetched[run.req_id] = 1 << self.tp_rank
        if meta.loads:
            # vLLM zeroes new blocks on the compute stream before the forward: a load must land after.
            zeroed = self.dev.current_stream().record()
        for run in meta.loads:
            self._load(run, zeroed)
        if not self.settings.layerwise:
            stream = self.dev.current_stream()
            for h, _, _ in self._loads:
                for layer in range(self.kv.num_layers):
                    h.wait_layer(layer, stream)  # the forward must not read a layer before it landed

    def _load(self, run: ChunkRun, zeroed) -> None:
        bpc, t0, got = self.store.fmt.blocks, time.perf_counter(), 0
        try:
            self.store.engine.compute_write(run.block_ids, zeroed)  # the copy waits for the zeroing
            h = self.store.load(run.ids, run.block_ids, path=self.load_path())
            got = h.tokens // self.store.fmt.tokens
            self._loads.append((h, run, t0))
            self._counts.update(f"hit_chunks_{t}" for t in h.tiers)
        except Exception as exc:  # a failing tier is a miss: vLLM recomputes what did not arrive
            log.warning("kvtier: load of %s failed: %s", run.req_id, exc)
            self._counts["load_errors"] += 1
        mask = 1 << self.tp_rank
        for cid in run.ids[:got]:
            self._held[cid] = mask
        for cid in run.ids[got:]:
            self._lost[cid] = mask
        if got < len(run.ids):
            self._counts["miss_chunks"] += len(run.ids) - got
            self._errors.update(run.block_ids[got * bpc :])

    def load_path(self) -> str | None:
        """Layerwise: the engine's layer-major path ("kernel": one launch per layer over every
        chunk, so layer l's event completes after l + 1 of L layers' bytes, not all of them);
        else the engine's whole-job path (staged / batch: DMA, closest to the link, every layer's
        event the job's last). A path the settings name wins."""
        if self.settings.engine_path != "auto":
            return self.settings.engine_path
        return "kernel" if self.settings.layerwise else None

    def wait_layer(self, layer_name: str) -> None:
        if not self._loads or not self.settings.layerwise:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        stream = self.dev.current_stream()
        for h, _, _ in self._loads:
            h.wait_layer(layer, stream)  # attention of this layer must not read blocks still landing

    def save(self, meta: KVTierMetadata) -> None:
        self._had_save.update(run.req_id for run in meta.saves)  # vLLM delays their frees until reported
        if self.store is None or not meta.saves:
            return
        after = self.dev.current_stream().record()  # the forward wrote the KV before this event
        for run in meta.saves:
            try:
                h = self.store.save(run.ids, run.block_ids, after=after)
            except Exception as exc:  # a failed save is only a later miss
                log.warning("kvtier: save of %s failed: %s", run.req_id, exc)
                self._counts["save_errors"] += 1
                continue
            if h.failed:  # the pool was full: those chunks are a later miss
                self._counts["save_errors"] += h.failed
            self._saves.setdefault(run.req_id, []).append((h, run, time.perf_counter()))

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finishing |= finished_req_ids & self._had_save  # only those vLLM waits for
        self._settle()
        done = {rid for rid in self._finishing if rid not in self._saves}
        self._finishing -= done
        self._had_save -= done
        return done or None, None

    def load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    def report(self) -> KVTierWorkerMetadata | None:
        self._settle()
        wm = KVTierWorkerMetadata(self._held, self._lost, self._prefetched)
        if self.store is not None and not self._extra_sent:
            x = self.store.extra
            wm.extra, self._extra_sent = (x.model, x.kv_dtype, x.layout, x.tp_size, x.salt), True
        self._held, self._lost, self._prefetched = {}, {}, {}
        return None if wm.is_empty() else wm

    def stats(self) -> dict:
        out, self._counts = dict(self._counts), Counter()
        return out

    def shutdown(self) -> None:
        if self.store is not None:
            try:
                self.store.close()  # every copy in flight lands before its slot goes back
            except Exception as exc:
                log.warning("kvtier: store close failed: %s", exc)
            self.store = None
        for thing in reversed(self._owned):
            try:
                thing.close()
            except Exception as exc:
                log.warning("kvtier: close of %s failed: %s", type(thing).__name__, exc)
        self._owned = []

    # -- internals ------------------------------------------------------------------------------

    def _settle(self) -> None:
        """Completed loads, saves and prefetches: counted, reported, their requests released."""
        mask, nbytes = 1 << self.tp_rank, self.store.fmt.nbytes if self.store else 0
        keep = []
        for h, run, t0 in self._loads:
            if h.done():  # event queries: the copies landed, the slots' pins drop
                self._account("load", len(h.jobs) * nbytes, t0)
            else:
                keep.append((h, run, t0))
        self._loads = keep
        for rid in list(self._saves):
            left = []
            for h, run, t0 in self._saves[rid]:
                if not h.done():  # the blocks stay the request's until the copy read them
                    left.append((h, run, t0))
                    continue
                self._account("save", h.saved * nbytes, t0)
                for cid in run.ids[: h.tokens // self.store.fmt.tokens]:
                    self._held[cid] = mask
            if left:
                self._saves[rid] = left
            else:
                del self._saves[rid]
        pending = []
        for rid, run, fut in self._prefetches:
            if not fut.done():
                pending.append((rid, run, fut))
                continue
            got = fut.result() // self.store.fmt.tokens if fut.exception() is None else 0
            for cid in run.ids[:got]:
                self._held[cid] = mask
            self._prefetched[rid] = mask
        self._prefetches = pending

    def _account(self, op: str, nbytes: int, t0: float) -> None:
        self._counts[f"{op}_bytes"] += nbytes
        self._counts[f"{op}_s"] += time.perf_counter() - t0
        self._counts[f"{op}s"] += 1
