"""KVStore: the API a serving engine calls — lookup / save / load / prefetch over the tiers.

Tiers, top down: the host (pinned pool slots, `HostTier`), then the lower `Tier`s given (e.g.
`DiskTier`, `RedisTier`). Chunk i of a request (``chunk_tokens`` tokens, whole blocks) covers
``block_ids[i*bpc:(i+1)*bpc]`` and is keyed by the hash chain of its whole prefix (`keys.py`):
KV of another model, dtype, layout or TP rank never matches.

- ``lookup``: the longest prefix of chunks some tier holds (chunks after a gap are useless).
- ``save``: one engine save job per chunk not held yet, into a pool slot that becomes a host
  entry once its event completed. Write-through pushes each saved chunk down from the writer
  thread; write-back pushes it only when the host evicts it.
- ``load``: chunk by chunk from ``first_chunk``: a host hit is pinned; a lower-tier hit is
  read into a pool slot (``get_into``), its header checked against this cache's
  shape/dtype/layout, and promoted into the host; then the copies: per layer across every
  chunk (`engine.load_slots`, one launch per layer) where loads take the kernel path, else an
  engine load job per chunk. The first chunk no tier delivers ends the load: ``handle.tokens``
  is what will arrive; the caller recomputes the rest. The walk and the copies: `load.py`.
- ``prefetch``: the same walk in the background, promoting without loading.

Failures of tiers (errors, timeouts, full, bad checksum or header) are misses, counted and
logged, never raised; bad arguments raise ValueError naming them. Pins keep every slot a
transfer or push touches out of eviction until the event that ends the transfer completed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.lifecycle import LifecycleError, SlotState
from kvtier.pool import PoolExhausted

from .chunking import ChunkFormat, as_block_ids
from .config import StoreConfig
from .fetch import Fetcher
from .handles import LoadHandle, Lookup, SaveHandle
from .host import HostEntry, HostTier
from .keys import KeyExtra, chunk_keys
from .metrics import StoreMetrics
from .reaper import Reaper
from .tier import Tier
from .writer import Push, Writer

log = logging.getLogger(__name__)


class KVStore:
    """engine: a `TransferEngine` (its cache, pool and trackers). model: the model identity
    (any string that changes when the weights do). tiers: the lower tiers, fastest first.
    config: a `StoreConfig`, or its fields as keyword arguments. metrics: where the host tier
    and the store count (pass the same `StoreMetrics` to the tiers for one registry)."""

    def __init__(
        self,
        engine,
        model: str,
        *,
        tiers: tuple[Tier, ...] | list[Tier] = (),
        config: StoreConfig | None = None,
        metrics: StoreMetrics | None = None,
        **options,
    ) -> None:
        if config is not None and options:
            raise ValueError(f"give config or options, not both (got {sorted(options)})")
        self.config = cfg = config if config is not None else StoreConfig(**options)
        kv, pool = engine.kv, engine.pool
        self.fmt = fmt = ChunkFormat.of(kv, cfg.chunk_tokens, pool.alignment)
        self.tiers = list(tiers)
        names = [getattr(t, "name", None) for t in self.tiers]
        if not all(isinstance(t, Tier) for t in self.tiers) or len({*names, "host"}) <= len(names):
            raise ValueError(f"tiers must be Tier objects with distinct names other than 'host', got {names}")
        self.engine, self.kv = engine, kv
        self.extra = KeyExtra(model, fmt.dtype, fmt.layout, cfg.tp_rank, cfg.tp_size, cfg.salt)
        self.write_back, self.promote = cfg.write_policy == "write_back", cfg.promote
        self.fetch_wait_s, self.alloc_timeout_s = float(cfg.fetch_wait_s), float(cfg.alloc_timeout_s)
        self.metrics = metrics if metrics is not None else StoreMetrics()
        self.host = HostTier(
            cfg.host_capacity(pool.capacity, fmt.span),
            cfg.host_policy,
            release=self._release_slot,
            spill=self._spill if self.write_back and self.tiers else None,
            metrics=self.metrics,
        )
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self._writer = Writer(fmt.header, self.host, self._release_slot, self._count)
        self._fetch = Fetcher(self)
        self._reaper = Reaper(self._completed, self._count)
        self._reap, self._track = self._reaper.reap, self._reaper.track
        for state in ("capacity", "used", "in_flight"):  # read at scrape time, never stale
            self.metrics.pool_bytes.labels(state).set_function(lambda s=state: getattr(pool.stats(), s))
        self._prefetcher = ThreadPoolExecutor(cfg.prefetch_workers, thread_name_prefix="kvtier-prefetch")
        self._closed = False

    # -- API ---------------------------------------------------------------------------------

    def lookup(self, tokens) -> Lookup:
        """The longest chunk prefix of ``tokens`` that some tier holds, and where each chunk is."""
        t0 = self._check_open()
        where = self._fetch.where(self._keys(tokens))  # stops at the first chunk no tier holds
        self._count(lookups=1, lookup_tokens=len(where) * self.fmt.tokens, _call=("lookup", t0))
        return Lookup(len(where) * self.fmt.tokens, tuple(where))

    def save(self, tokens, block_ids, *, after=None) -> SaveHandle:
        """Save the full chunks of ``tokens`` (shape [num_tokens]) from GPU blocks ``block_ids``
        (the request's blocks in order; at least bpc per full chunk). ``after``: an event on the
        compute stream recorded after these blocks' KV was written. Asynchronous: the handle's
        events complete when the blocks have been read (only then may they be overwritten)."""
        t0 = self._check_open()
        keys = self._keys(tokens)
        ids = self._ids(block_ids, need=len(keys) * self.fmt.blocks)
        self._reap()
        handle = SaveHandle(_on_done=self._reap)
        through = not self.write_back and bool(self.tiers)
        for i, key in enumerate(keys):
            entry, status = self.host.reserve(key, self.fmt.span, dirty=self.write_back and bool(self.tiers))
            if status == "present":  # held, or being saved or fetched by another request
                handle.skipped += 1
                handle.tokens += self.fmt.tokens
                continue
            try:
                if entry is None:
                    raise PoolExhausted("the host tier is full of pinned chunks")
                job = self.engine.save(self._chunk(ids, i), after=after, timeout=self.alloc_timeout_s)
            except PoolExhausted as exc:  # back-pressure: the rest is recomputed next time
                if entry is not None:
                    self.host.cancel(entry)  # no slot was allocated: nothing to wait for
                log.info("kvstore: save stops at chunk %d of %d: %s", i, len(keys), exc)
                handle.failed = len(keys) - i
                break
            except BaseException:
                self.host.cancel(entry)  # nothing was submitted into a slot of this entry
                raise
            self.host.attach(entry, job.slot, job)
            if through:
                self.host.add_pin(entry)  # the push reads the slot: it must not be evicted before
                handle.pushes.append(self._writer.submit(Push(entry, self.tiers, after=job)))
            self._track(job, entry, "save")
            handle.jobs.append(job)
            handle.saved += 1
            handle.tokens += self.fmt.tokens
        h = handle
        self._count(saves=1, save_chunks_saved=h.saved, save_chunks_skipped=h.skipped, _call=("save", t0))
        self._count(save_chunks_failed=h.failed)
        return handle

    def load(self, tokens, block_ids, *, per_layer: bool = True, first_chunk: int = 0) -> LoadHandle:
        """Load the longest available chunk prefix of ``tokens`` into ``block_ids`` (distinct
        GPU blocks of the request, in order; chunks beyond ``len(block_ids) // bpc`` are not
        loaded). Lower-tier reads happen here; the GPU copies are asynchronous: use
        ``handle.wait_layer(layer, stream)`` before attention reads a layer.

        first_chunk: start there (the caller recomputes the chunks before); chunk first_chunk + i
        goes into ``block_ids[i*bpc:(i+1)*bpc]`` and ``handle.tokens`` counts from there."""
        from .load import load

        return load(self, tokens, block_ids, per_layer=per_layer, first_chunk=first_chunk)

    def prefetch(self, tokens) -> Future:
        """Bring the chunks of ``tokens`` from lower tiers into the host, in the background.
        The future's result: tokens of the prefix then held (or being filled) by the host."""
        self._check_open()
        self._count("prefetches")
        return self._prefetcher.submit(self._fetch.prefetch, self._keys(tokens))

    def evict(self, tokens=None, *, lower: bool = False) -> int:
        """Evict from the host the chunks of ``tokens`` (None: every chunk) that no transfer
        uses, spilling dirty ones (write-back); ``lower``: also delete them from the lower
        tiers. Returns how many host chunks went."""
        self._check_open()
        keys = None if tokens is None else self._keys(tokens)
        self._reap()  # loads that completed first: their pins drop, their chunks may go
        n = self.host.evict(keys)
        if lower and keys:
            self._fetch.delete_lower(keys)
        self._count("evicted", n)
        return n

    def stats(self) -> dict[str, dict[str, int | float]]:
        """Per tier (hits, misses, bytes, latency sums, errors by kind, occupancy), the pool,
        and the store's own counters; also exported through ``self.metrics``."""
        self._reap()
        out: dict[str, dict] = {"host": self.host.stats()}
        for tier in self.tiers:
            try:
                out[tier.name] = tier.stats()
            except Exception as exc:
                log.warning("kvstore: stats of %s failed: %s", tier.name, exc)
        p = self.engine.pool.stats()
        out["pool"] = dict(capacity=p.capacity, used=p.used, in_flight=p.in_flight, slots=p.slots)
        with self._counts_lock:
            out["store"] = dict(self._counts, inflight=len(self._reaper), writer_backlog=self._writer.backlog)
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every push submitted so far (write-through, promotion, spill) finished."""
        return self._writer.flush(timeout)

    def close(self, *, flush: bool = True, timeout: float = 30.0) -> None:
        """Finish the transfers and pushes in flight, spill dirty chunks (write-back, ``flush``),
        and give every slot back. The engine and the tiers stay open (the caller owns them)."""
        if self._closed:
            return
        self._closed = True
        self._prefetcher.shutdown(wait=True)
        for job in self._reaper.jobs():
            job.wait(timeout)  # slots are given back below only once their copies landed
        self._reap()
        if flush and self.write_back and self.tiers:
            for e in self.host.entries():
                if e.dirty and self.host.pin(e):  # the push reads the slot: pinned until it is done
                    self._writer.submit(Push(e, self.tiers))
        self._writer.close(timeout)
        self._reaper.close(timeout)
        for e in self.host.drain():
            if e.slot is not None:
                self.engine.release(e.slot)  # retired: freed once no copy touches it

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # every transfer in flight lands before its slot goes back

    # -- internals ---------------------------------------------------------------------------

    def _keys(self, tokens) -> list[bytes]:
        bs, name = self.kv.block_size, self.config.hash_name
        return chunk_keys(tokens, self.fmt.tokens, bs, extra=self.extra, hash_name=name)

    def _ids(self, block_ids, need: int, unique: bool = False):
        return as_block_ids(
            block_ids, num_blocks=self.kv.num_blocks, need=need, bpc=self.fmt.blocks, unique=unique
        )

    def _chunk(self, ids, i: int):
        """Block ids of chunk ``i``: block_ids[i*bpc:(i+1)*bpc]."""
        return ids[i * self.fmt.blocks : (i + 1) * self.fmt.blocks]

    def _check_open(self) -> float:
        """The call's start time; a call after close() is a caller bug."""
        if self._closed:
            raise RuntimeError("KVStore is closed")
        return time.perf_counter()

    def _count(self, name: str | None = None, n: int = 1, _call=None, **counts: int) -> None:
        """Count events: ``_count("spills")``, ``_count("evicted", 3)`` or ``_count(a=1, b=2)``;
        ``_call=(op, t0)`` also records the call's latency."""
        if _call is not None:
            self.metrics.calls.labels(_call[0]).observe(time.perf_counter() - _call[1])
        if name is not None:
            counts[name] = n
        with self._counts_lock:
            self._counts.update({k: v for k, v in counts.items() if v})
        for k, v in counts.items():
            if v:
                self.metrics.events.labels(k).inc(v)

    def _completed(self, job, entry: HostEntry, kind: str) -> None:
        """A job's event has completed and the engine settled it (job None: a load that was never
        submitted): a saved entry turns READY, a load's pin drops, a temporary slot goes back."""
        if kind == "save":
            self.host.ready(entry)  # drops the fill's pin: the copy into the slot has landed
        elif kind == "temp":
            self._release_slot(entry.slot)  # a read-through slot no index holds; nothing reads it now
        else:
            self.host.unpin(entry)  # only once e_load completed (or nothing was submitted)

    def _release_slot(self, slot) -> None:
        """Give a slot back through the engine; with the sanitizer on, prove no copy uses it."""
        eng = self.engine
        if eng.sanitize and eng.slots.state(slot) not in (SlotState.READY, SlotState.ALLOCATED):
            why = "released from the store while a transfer still uses it (a pin was dropped early)"
            raise LifecycleError("evict", slot.name, eng.slots.state(slot).value, None, why)
        eng.release(slot)  # retire: the pool gets it back once no copy into/out of it is pending

    def _spill(self, entry: HostEntry) -> None:
        self._writer.spill(entry, self.tiers)  # the writer releases the slot once pushed
